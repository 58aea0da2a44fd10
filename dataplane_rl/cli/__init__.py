"""The `dataplane-rl` command line."""
