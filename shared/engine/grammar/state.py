"""One request's position in its grammar: which tokens may come next.

    state = compiled.new_state()
    state.replay(output_ids)          # decode: catch up with what prefill already sampled
    mask = state.mask()               # [V] bool -> SampleInput.allowed_mask
    state.accept(token)               # after sampling; False = the token breaks the grammar
    masks = state.masks_for(drafts)   # speculative verification: [k+1, V], state unchanged
    state.accept_many(drafts[:n]); state.accept(bonus)

Once the grammar is complete only stop tokens are allowed; once a stop token is accepted the
state is terminated and its mask allows only stop tokens. Rollback is unlimited (xgrammar's
Earley matcher keeps the history), so speculative steps advance, measure and undo freely.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
import xgrammar as xgr


class ReplayError(RuntimeError):
    """Tokens sampled elsewhere do not fit this grammar: the constraint or the tokenizer differs
    between the two sides of a hand-off. Never a client error."""

    def __init__(self, index: int, token: int):
        super().__init__(f"token {token} at output position {index} is not allowed by the grammar")
        self.index, self.token = index, token


class ConstraintState:
    def __init__(self, grammar: xgr.CompiledGrammar, vocab_size: int,
                 stop_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._matcher = xgr.GrammarMatcher(grammar)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)   # [1, ceil(V/32)] int32
        self._stop_mask = np.zeros(vocab_size, dtype=np.bool_)
        self._stop_mask[list(self.stop_token_ids)] = True
        self.num_accepted = 0

    # state

    @property
    def is_terminated(self) -> bool:
        """A stop token has been accepted."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The output so far is a whole match (a stop token may come next)."""
        return self._matcher.is_completed()

    def fork(self) -> "ConstraintState":
        twin = object.__new__(ConstraintState)
        twin.vocab_size, twin.stop_token_ids = self.vocab_size, self.stop_token_ids
        twin._matcher = self._matcher.fork()
        twin._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        twin._stop_mask, twin.num_accepted = self._stop_mask, self.num_accepted
        return twin

    # masks

    def mask(self, vocab_size: int | None = None) -> torch.Tensor:
        """Allowed next tokens: [vocab_size] bool on CPU (columns past the grammar's vocabulary,
        if any, are False)."""
        allowed = self._allowed()
        width = vocab_size or self.vocab_size
        if width != self.vocab_size:
            fitted = np.zeros(width, dtype=np.bool_)
            n = min(width, self.vocab_size)
            fitted[:n] = allowed[:n]
            allowed = fitted
        return torch.from_numpy(allowed)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the packed mask into row `index` of a batch bitmask [B, ceil(V/32)] int32 (CPU),
        for xgr.apply_token_bitmask_inplace on the logits' device."""
        if self.is_terminated:
            bitmask[index] = pack_mask(torch.from_numpy(self._stop_mask))
        else:
            self._matcher.fill_next_token_bitmask(bitmask, index)

    def masks_for(self, draft_tokens: Sequence[int]) -> torch.Tensor:
        """Masks for verifying k draft tokens: [k+1, V] bool, row i = allowed tokens after
        drafts[:i]. If the grammar rejects drafts[j], rows j+1.. repeat row j — verification
        stops at j (the target gives drafts[j] probability 0), so they are never used. The
        state is the same afterwards."""
        rows = np.empty((len(draft_tokens) + 1, self.vocab_size), dtype=np.bool_)  # [k+1, V]
        rows[0] = self._allowed()
        advanced = 0
        for token in draft_tokens:
            if not self._accept_raw(token):
                break
            advanced += 1
            rows[advanced] = self._allowed()
        if advanced:
            self._matcher.rollback(advanced)
        rows[advanced + 1:] = rows[advanced]
        return torch.from_numpy(rows)

    # advancing

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""
        if not self._accept_raw(token):
            return False
        self.num_accepted += 1
        return True

    def accept_many(self, tokens: Iterable[int]) -> int:
        """Accept tokens in order up to the first the grammar forbids; returns how many."""
        n = 0
        for token in tokens:
            if not self.accept(token):
                break
            n += 1
        return n

    def replay(self, tokens: Iterable[int]) -> None:
        """Catch up with tokens already sampled under this constraint (decode after prefill).
        All or nothing: raises ReplayError and leaves the state as it was."""
        start = self.num_accepted
        for i, token in enumerate(tokens):
            if not self.accept(token):
                self.rollback(self.num_accepted - start)
                raise ReplayError(start + i, int(token))

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (speculative tokens the target rejected)."""
        if n < 0 or n > self.num_accepted:
            raise ValueError(f"cannot roll back {n} of {self.num_accepted} accepted tokens")
        if n:
            self._matcher.rollback(n)
            self.num_accepted -= n

    def _allowed(self) -> np.ndarray:
        """[V] bool, a fresh array (callers may keep or write it)."""
        if self.is_terminated:
            return self._stop_mask.copy()
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return _unpack(self._bitmask[0].numpy(), self.vocab_size)

    def _accept_raw(self, token: int) -> bool:
        token = int(token)
        if not 0 <= token < self.vocab_size or self.is_terminated:
            return False
        return self._matcher.accept_token(token)


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[ceil(V/32)] int32 -> [V] bool (bit j of word i is token 32*i + j). numpy: a tiny
    torch op pays for waking its thread pool, which costs milliseconds on a busy host."""
    return torch.from_numpy(_unpack(bits.numpy(), vocab_size))


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """[V] bool -> [ceil(V/32)] int32, the inverse of unpack_bitmask."""
    words = -(-mask.shape[0] // 32)
    packed = np.zeros(words * 4, dtype=np.uint8)
    raw = np.packbits(mask.numpy(), bitorder="little")
    packed[: raw.shape[0]] = raw
    return torch.from_numpy(packed.view(np.int32))


def _unpack(words: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].view(np.bool_)
