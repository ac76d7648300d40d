"""One request inside the engine: its tokens, its KV blocks and how far it is computed.

Prefill and decode are the same thing here (as in vLLM v1): a sequence has
`num_computed` tokens whose K/V are in its blocks; a step computes some of the rest, and
when a step reaches the last token a new token is sampled. A sequence whose prompt KV
was written by a remote prefill is HELD (not scheduled) until it enters with
num_computed = len(prompt).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.contracts.sampling import SamplingParams

EVICTED = 0    # an evicted entry: a block id any gather may read, every read of it masked


class SeqStatus(enum.Enum):
    HELD = "held"            # blocks allocated, not scheduled: its KV is filled from outside
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # leading blocks given back once no future token can see them (every layer slides):
    # their entries hold EVICTED, and only block_table[num_evicted:] is this sequence's
    num_evicted: int = 0
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_after_prefill: bool = False   # prefill-only: finish after the first token
    # prefix cache: keys of the prompt's cacheable blocks, how many are registered in the
    # pool's index, prompt tokens served from L1 / from any cache, and a load in progress
    keys: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    tail_registered: bool = False      # its last, partial prompt block too (tail_key)
    want_tail: bool = False            # to copy a cached partial block as it is admitted
    num_l1: int = 0
    num_cached: int = 0
    load: object = None                # layer_load.LayerLoad while lower-tier KV arrives
    cache_salt: str = ""               # tenant: starts the chain of its prefix keys
    # speculative decoding: positions whose draft KV this sequence computed (it never
    # trusts draft KV it did not compute: cached, loaded and remote blocks hold target KV
    # only), and cumulative counts of verification steps, drafts proposed and accepted
    draft_computed: int = 0
    spec_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    scheduled_at: float = 0.0          # time.monotonic() of its first step (queue time ends)

    @property
    def live_blocks(self) -> list[int]:
        """The blocks this sequence holds (its table less the evicted lead)."""
        return self.block_table[self.num_evicted:]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def remaining(self) -> int:
        """Tokens not yet in the KV cache."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
