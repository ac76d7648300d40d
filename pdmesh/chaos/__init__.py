"""Faults on purpose: the chaos harness (scripts/chaos.py), load under faults, and the network
lab (namespaces, links cut)."""
