"""TEST ONLY fault injection in decode: corrupt a request's prompt KV the way a broken
transfer would, or push it into a repetition loop (the anomaly monitor's faults,
invariant 5); drop the constraint from prefill jobs (invariant 2); switch off the
reclaim-ack or the epoch fence (invariant 3's guards). Off unless a --fault-* setting is
set (and PDMESH_ALLOW_FAULTS=1, shared/faults.py); applied by install(), which wraps the
service's KV slots, peers and submit handler. Benchmarks (scripts/bench_monitor.py) call
the same corrupting functions on an engine's pool.

Pure functions on tensors: `kv` is an engine KV pool, [layers, 2, blocks, block_size,
Hkv, D]; `blocks` are the block ids of the request's received prompt KV. Every kind
changes only those blocks, so only the selected request is corrupted.

    zero_layer  one middle layer's K and V of the blocks set to 0 (a layer never written)
    swap        the blocks get the KV of other blocks (another live request's when given,
                else a random other region of the pool): a block table pointing at the
                wrong blocks. One-way: the other blocks are left as they are.
    noise       Gaussian noise with the std of the blocks' KV (times `scale`) added
    repeat_loop not KV: a logit_bias of +100 on one token, so draft and target both keep
                emitting it (acceptance ~1)

Requests are selected deterministically from the sampling seed the client sent:
seed % mod == 0 selects, and kinds[(seed // mod) % len(kinds)] says which fault.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from shared.contracts.constraint import Constraint
from shared.contracts.sampling import SamplingParams

KV_KINDS = ("zero_layer", "swap", "noise")
REPEAT_LOOP = "repeat_loop"
KINDS = (*KV_KINDS, REPEAT_LOOP)
REPEAT_BIAS = 100.0


@dataclass
class DecodeFaults:
    """TEST ONLY (flags --fault-*)."""
    corrupt_kv: str = field(default="", metadata={
        "help": "TEST ONLY: corrupt selected PD requests' received prompt KV before they "
                "decode: zero_layer, swap, noise (comma-separated; see faults.py)"})
    noise_scale: float = field(default=1.0, metadata={
        "help": "TEST ONLY: noise fault: Gaussian noise of this many times the KV's std"})
    repeat_loop: bool = field(default=False, metadata={
        "help": "TEST ONLY: push selected requests into a repetition loop (logit bias)"})
    select_seed_mod: int = field(default=0, metadata={
        "help": "TEST ONLY: a request whose sampling seed is a multiple of N gets a fault: "
                "kind number (seed / N) mod (number of kinds), kinds as listed above, "
                "repeat_loop last (0: none)"})
    drop_constraint_in_job: bool = field(default=False, metadata={
        "help": "TEST ONLY: send prefill jobs without their constraint"})
    no_reclaim_ack: bool = field(default=False, metadata={
        "help": "TEST ONLY: grant every claim, free aborted blocks at once, send no Reclaim"})
    no_epoch_fence: bool = field(default=False, metadata={
        "help": "TEST ONLY: KV writes land in the blocks they name, whatever their epoch"})
    drop_chunk_seq: int = field(default=-1, metadata={
        "help": "TEST ONLY: the TokenChunk with this seq of every request is never sent "
                "(a lost message; -1: none)"})
    drop_last_chunk: bool = field(default=False, metadata={
        "help": "TEST ONLY: the final TokenChunk of every request is never sent"})

    def __post_init__(self):
        parse_kinds(self.corrupt_kv)
        if self.select_seed_mod < 0:
            raise ValueError("fault_select_seed_mod must be >= 0")

    def kinds(self) -> tuple[str, ...]:
        return parse_kinds(self.corrupt_kv) + ((REPEAT_LOOP,) if self.repeat_loop else ())

    def select(self, seed: int | None) -> str | None:
        return select(seed, self.select_seed_mod, self.kinds())


def parse_kinds(spec: str) -> tuple[str, ...]:
    """"zero_layer,noise" -> ("zero_layer", "noise"); ValueError on an unknown kind."""
    kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
    bad = [k for k in kinds if k not in KV_KINDS]
    if bad:
        raise ValueError(f"unknown KV fault(s) {bad}; known: {', '.join(KV_KINDS)}")
    return kinds


def select(seed: int | None, mod: int, kinds: tuple[str, ...]) -> str | None:
    """The fault a request with this sampling seed gets, or None."""
    if not kinds or mod <= 0 or seed is None or seed % mod:
        return None
    return kinds[(seed // mod) % len(kinds)]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)


def zero_layer(kv: torch.Tensor, blocks: list[int], layer: int | None = None) -> None:
    layer = kv.shape[0] // 2 if layer is None else layer
    kv[layer, :, blocks] = 0


def swap(kv: torch.Tensor, blocks: list[int], gen: torch.Generator,
         others: list[int] | None = None) -> None:
    """blocks <- the KV of `others` (drawn with replacement if there are fewer), or of
    random blocks of the pool outside `blocks`."""
    mine = set(blocks)
    cands = [b for b in (others or []) if b not in mine]
    if not cands:
        cands = [b for b in range(kv.shape[2]) if b not in mine]
    idx = (torch.randperm(len(cands), generator=gen)[:len(blocks)] if len(cands) >= len(blocks)
           else torch.randint(len(cands), (len(blocks),), generator=gen))
    src = [cands[i] for i in idx.tolist()]
    kv[:, :, blocks] = kv[:, :, src].clone()


def add_noise(kv: torch.Tensor, blocks: list[int], gen: torch.Generator,
              scale: float = 1.0) -> None:
    x = kv[:, :, blocks].float()                       # [L, 2, n, bs, Hkv, D]
    std = float(x.std()) or 1.0
    noise = torch.randn(x.shape, generator=gen) * (std * scale)
    kv[:, :, blocks] = (x + noise).to(kv.dtype)


def corrupt(kind: str, kv: torch.Tensor, blocks: list[int], seed: int,
            others: list[int] | None = None, noise_scale: float = 1.0) -> None:
    """Apply one KV fault to `blocks` (in place); `seed` makes it repeatable."""
    if not blocks:
        return
    if kind == "zero_layer":
        zero_layer(kv, blocks)
    elif kind == "swap":
        swap(kv, blocks, generator(seed), others)
    elif kind == "noise":
        add_noise(kv, blocks, generator(seed), noise_scale)
    else:
        raise ValueError(f"unknown KV fault {kind!r}")


def repeat_loop(params: SamplingParams, token: int) -> SamplingParams:
    """params with a +100 logit bias on `token`: every sampler, draft and target alike,
    picks it from now on."""
    bias = dict(params.logit_bias or {}) | {token: REPEAT_BIAS}
    return msgspec.structs.replace(params, logit_bias=bias)


def drop_constraint(job):
    """A PrefillJob without its constraint (the production bug invariant 2 prevents)."""
    return msgspec.structs.replace(job, constraint=Constraint())
