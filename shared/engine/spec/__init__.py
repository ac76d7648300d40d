"""Speculative decoding.

verify.py   target-side verification of drafted tokens: greedy prefix match or rejection
            sampling, on the same processed distribution normal sampling draws from
runner.py   the engine's speculative decode step: draft catch-up and proposals, one target
            forward over all k+1 rows, verification and appending (continuous batching)
"""
from .verify import VerifyInput, VerifyResult, processed_probs, spec_generator, verify

__all__ = ["VerifyInput", "VerifyResult", "processed_probs", "spec_generator", "verify"]
