"""Faults: detection, classification, retries and recovery, behind the Fleet's and the fault ledger's interfaces (docs/architecture.md §7)."""
