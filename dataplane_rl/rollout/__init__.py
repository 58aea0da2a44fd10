"""Rollout: generation engines and the Ray actors that generate, score and write samples."""
