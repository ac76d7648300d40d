"""Model-free drafting (vLLM's `ngram` method, "prompt lookup decoding"): the tokens that
followed the latest earlier occurrence of the sequence's last n tokens, for the largest
n in [min_n, max_n] that occurs. Text that repeats what it has read or written (code
edits, quotes, a list's structure, and a repetition loop) drafts itself; other text
proposes nothing and decodes plainly. Pure: tokens in, drafts out."""
from __future__ import annotations

from collections.abc import Sequence

MIN_N, MAX_N = 2, 4


def propose(tokens: Sequence[int], k: int, min_n: int = MIN_N, max_n: int = MAX_N,
            window: int = 2048) -> list[int]:
    """Up to k drafts continuing tokens; [] when its last min_n tokens never occurred
    before (within the last `window` tokens)."""
    if k <= 0 or len(tokens) <= min_n:
        return []
    hay = list(tokens[-window:])
    L = len(hay)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = hay[L - n:]
        # latest earlier start i of tail (i + n <= L - 1: a continuation exists)
        for i in range(L - n - 1, -1, -1):
            if hay[i:i + n] == tail:
                return hay[i + n:i + n + k]
    return []
