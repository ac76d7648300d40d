"""Speculative decoding.

verify.py   target-side verification of drafted tokens: greedy prefix match or rejection
            sampling, on the same processed distribution normal sampling draws from
"""
from .verify import VerifyInput, VerifyResult, processed_probs, spec_generator, verify

__all__ = ["VerifyInput", "VerifyResult", "processed_probs", "spec_generator", "verify"]
