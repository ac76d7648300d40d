"""Continuous batching: which sequences compute how many tokens in the next step.

Pure bookkeeping (no tensors, no I/O). Each step:
  1. running sequences first, oldest first: decodes take one row, unfinished prompts a
     chunk; blocks are grown as needed, preempting the newest sequence (its blocks are
     freed and it recomputes later) when the pool is short;
  2. then waiting sequences, FIFO, while rows, sequence slots and blocks allow.
Requests join and leave between steps.

Deterministic mode keeps every shape a sequence sees independent of its neighbours:
prefill chunks are aligned to multiples of chunk_size and never split by the row
budget, and a sequence is admitted only with blocks for its whole budget
(prompt + max_tokens) so it is never preempted and recomputed.

Sliding windows (`window`, set by the engine when every layer of the model slides): a
running sequence gives back its leading blocks once no token still to be computed can see
them (a row at position p attends p - window + 1 .. p), so its KV holds about a window,
not the whole context, as vLLM's sliding-window manager does. Not while its KV is still
going somewhere (a prefill-only sequence, a lower-tier load in progress, a prompt not yet
complete: the kvstore write-back copies the whole prompt at its first token), and a
prompt block only once the prefix index holds it (an evicted entry is never registered).

Speculative decoding: a decode step may carry k extra rows for draft tokens (`lookahead`,
set by the engine, says how many the sequence may take). Rows and blocks are reserved for
them here; they shrink to what fits rather than preempt anyone (deterministic mode: the
step waits instead, so k never depends on the neighbours).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .config import EngineConfig
from .sequence import EVICTED, SeqStatus, Sequence


@dataclass(slots=True)
class Scheduled:
    seq: Sequence
    start: int      # first position computed this step (== seq.num_computed)
    n: int          # tokens computed this step
    k: int = 0      # rows reserved for draft tokens (speculative decode step)
    drafts: list[int] = field(default_factory=list)   # proposed, len <= k (spec.runner)
    draft_probs: object = None     # [len(drafts), V] draft distribution (sampled requests)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token (so a token is sampled)."""
        return self.start + self.n == self.seq.num_tokens

    @property
    def rows(self) -> int:
        """Rows of the target forward: the tokens, then the drafts they verify."""
        return self.n + len(self.drafts)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: BlockPool):
        self.cfg = cfg
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.lookahead: Callable[[Sequence], int] | None = None   # drafts a decode may take
        # PrefixCache.attach_tail: a sequence's partial-block copy, taken as it is admitted
        self.attach_tail: Callable[[Sequence], None] | None = None
        self.window = 0              # every layer's window (0: some layer sees everything)
        self.evicted_blocks = 0      # given back by sliding windows, in all

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already owns blocks with its prompt KV (remote prefill)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        C = self.cfg.chunk_size
        if self.cfg.deterministic:
            n = min(seq.remaining, C - seq.num_computed % C)
            return n if n <= budget else 0
        return min(seq.remaining, C, budget)

    def _blocks_needed(self, seq: Sequence, upto: int) -> int:
        return max(0, self.pool.blocks_for(upto) - len(seq.block_table))

    def evict(self, seq: Sequence) -> None:
        """Give back the leading blocks no future row of seq can attend (window)."""
        if (not self.window or seq.stop_after_prefill or seq.load is not None
                or seq.num_computed < len(seq.prompt_ids)):
            return      # the whole prompt stays until its first token (kvstore write-back)
        bs = self.pool.block_size
        dead = min(max(0, (seq.num_computed - self.window) // bs), len(seq.block_table))
        if self.cfg.prefix_cache and seq.num_registered < len(seq.keys):
            dead = min(dead, seq.num_registered)     # registered first, then given back
        if dead > seq.num_evicted:
            self.pool.free(seq.block_table[seq.num_evicted:dead])
            self.evicted_blocks += dead - seq.num_evicted
            seq.block_table[seq.num_evicted:dead] = [EVICTED] * (dead - seq.num_evicted)
            seq.num_evicted = dead

    def _drafts(self, seq: Sequence, n: int, budget: int) -> int:
        """Draft rows for a decode step: what lookahead allows, shrunk to the free rows
        and blocks (never a preemption); -1: deterministic mode, wait for a whole step."""
        if self.lookahead is None or seq.remaining != 1 or not seq.output_ids:
            return 0
        k = self.lookahead(seq)
        if self.cfg.deterministic and n + k > budget:
            return -1
        k = min(k, budget - n)
        while k and self._blocks_needed(seq, seq.num_computed + n + k) > self.pool.num_free:
            k -= 1
        return k

    def _reserve_tokens(self, seq: Sequence, n: int) -> int:
        if self.cfg.deterministic:  # whole budget up front: never preempted
            return len(seq.prompt_ids) + seq.params.max_tokens
        return seq.num_computed + n

    def schedule(self) -> list[Scheduled]:
        budget = self.cfg.max_num_batched_tokens
        out: list[Scheduled] = []
        for seq in list(self.running):
            if seq not in self.running:   # preempted below by an older sequence
                continue
            self.evict(seq)
            n = self._chunk(seq, budget)
            k = self._drafts(seq, n, budget) if n else 0
            if n == 0 or k < 0:
                continue
            need = self._blocks_needed(seq, seq.num_computed + n + k)
            while need > self.pool.num_free:
                victim = self.running[-1]
                self.preempt(victim)
                out = [s for s in out if s.seq is not victim]
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.block_table += self.pool.allocate(need)
            out.append(Scheduled(seq, seq.num_computed, n, k))
            budget -= n + k
        budget = self.cfg.max_num_batched_tokens - sum(s.n + s.k for s in out)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.want_tail and self.attach_tail:    # a block of its own: taken as it joins,
                seq.want_tail = False                 # with room for its whole prompt
                if self._blocks_needed(seq, len(seq.prompt_ids)) <= self.pool.num_free:
                    self.attach_tail(seq)
            n = self._chunk(seq, budget)
            if n == 0:
                break
            need = self._blocks_needed(seq, self._reserve_tokens(seq, n))
            if need > self.pool.num_free:
                break
            self.waiting.popleft()
            seq.block_table += self.pool.allocate(need)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(Scheduled(seq, seq.num_computed, n))
            budget -= n
        return out

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks; it recomputes from scratch when readmitted."""
        self.running.remove(seq)
        cancel_load(seq)
        self.pool.free(seq.live_blocks)
        seq.block_table = []
        seq.num_computed = seq.num_registered = seq.num_l1 = seq.num_cached = 0
        seq.num_evicted = 0
        seq.draft_computed = 0
        seq.tail_registered = seq.want_tail = False
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, keep_blocks: bool = False) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        cancel_load(seq)
        if not keep_blocks and seq.block_table:
            self.pool.free(seq.live_blocks)
            seq.block_table, seq.num_evicted = [], 0
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason


def cancel_load(seq: Sequence) -> None:
    """The sequence's blocks are going away: its loader must not write any more
    (LayerLoad.cancel waits for a copy in progress)."""
    if seq.load is not None:
        seq.load.cancel()
        seq.load = None
