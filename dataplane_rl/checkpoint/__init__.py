"""Checkpoints: the manager, the files on disk and their manifest, async saved partitions, resume and export."""
