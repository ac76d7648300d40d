"""Whether a request can ever be served by an engine: checked before anything is built,
with the numbers in the error (a ValueError the services turn into a 400)."""
from __future__ import annotations

from .block_pool import BlockPool


def check_request(prompt_ids: list[int], params, vocab_size: int, max_model_len: int,
                  pool: BlockPool, window_tokens: int = 0) -> None:
    """window_tokens: when every layer slides, the most tokens a running sequence keeps
    KV for beyond its prompt's (scheduler.evict; 0: the whole context)."""
    params.check(vocab_size)
    if not prompt_ids:
        raise ValueError("prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    total = len(prompt_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the context window of {max_model_len} tokens")
    need = pool.blocks_for(total)
    if window_tokens:      # the prompt's blocks (a remote prefill fills them all), or a window
        need = min(need, max(pool.blocks_for(len(prompt_ids)),
                             pool.blocks_for(window_tokens) + 1))
    if need > pool.num_blocks:
        raise ValueError(f"request needs {need} KV blocks; the pool has {pool.num_blocks}")
