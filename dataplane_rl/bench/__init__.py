"""Benchmarks reachable as `dataplane-rl bench ...`; the scripts in benchmarks/ call these."""
