"""One step's flat batch: token rows, positions, KV slots and attention metadata.

Rows come in two kinds:
  decode rows  one pending token (or a speculative step's token and its drafts, each a
               row at its own position), attended together in one batched paged-attention
               call; they come first;
  chunks       prompt chunks (and, in deterministic mode, every step), attended per
               sequence over exactly that sequence's context (SeqSpan); in deterministic
               mode each row as its own decode step attends it (SeqSpan.rowwise).
On CPU, single-token decode rows go through the chunk path too (one small attention per
sequence on its exact context) when their contexts average PER_SEQUENCE_CTX tokens or
more: the batched call pads every sequence to the longest context and copies it all to
float32, which costs more from there on.
Deterministic mode runs every GEMM in tiles of DET_TILE rows (model.linear), so no
request's logits depend on its neighbours or on how many there are.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import EngineConfig
from .scheduler import Scheduled


@dataclass(slots=True)
class SeqSpan:
    """Rows [start, start + n) of the flat batch belong to one sequence whose context
    (after this step) is positions [0, context_len)."""
    start: int
    n: int
    context_len: int
    ctx_slots: torch.Tensor  # [context_len] int64 flat slots of positions 0..context_len-1
    request_id: str = ""     # whose rows (layer listeners stream a request's KV by it)
    rowwise: bool = False    # deterministic mode: each row as its own decode step attends


@dataclass(slots=True)
class BatchMeta:
    positions: torch.Tensor      # [T] int64
    slot_mapping: torch.Tensor   # [T] int64, -1 for padding rows
    # leading decode rows attended in one batched paged-attention call
    num_decode: int = 0
    block_tables: torch.Tensor | None = None   # [num_decode, max_blocks] int32
    context_lens: torch.Tensor | None = None   # [num_decode] int32
    spans: list[SeqSpan] = field(default_factory=list)  # everything else, per sequence
    logits_rows: torch.Tensor | None = None    # [S] rows whose logits are wanted
    det_tile: int = 0        # deterministic mode: every GEMM in tiles of this many rows
    loads: list = field(default_factory=list)   # layer_load.LayerLoad: wait per layer
    load_timeout_s: float = 30.0


# CPU, SmolLM2's heads, bf16 KV, one thread, us per layer (batched call / per sequence),
# contexts within +-10 tokens of each other: 2 rows at 20 / 100 / 300 tokens 53/68,
# 77/86, 172/157; 8 rows at 64 / 150 / 200 / 300 171/312, 375/420, 516/496, 748/670;
# 16 rows 380/626, 767/862, 990/973, 1460/1338; 32 rows 764/1244, 1489/1620, 2044/1906,
# 2933/2628. The batched call pads to the longest context: more spread, more waste.
PER_SEQUENCE_CTX = 192
# deterministic mode's GEMM tile: every matmul of a forward runs on pieces of exactly this
# many rows (model.linear). A GEMM row's result depends on M on this CPU; at a fixed M it
# does not depend on the other rows. Before, every forward was padded to
# max_num_batched_tokens rows: a one-token decode step computed 128 rows.
DET_TILE = 16


@dataclass(slots=True)
class _Rows:
    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    spans: list[SeqSpan] = field(default_factory=list)
    logits: list[int] = field(default_factory=list)
    sampled: list[Scheduled] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.pos)


def build_batch(batch: list[Scheduled], cfg: EngineConfig
                ) -> tuple[torch.Tensor, BatchMeta, list[Scheduled]]:
    """(input ids, metadata, the scheduled entries whose last rows are sampled)."""
    decode = _decode_rows(batch, cfg)
    rows = _Rows()
    for s in decode:
        _add(rows, s, cfg, chunk=False)
    for s in batch:
        if s not in decode:
            _add(rows, s, cfg, chunk=True)
    meta = BatchMeta(positions=torch.tensor(rows.pos), slot_mapping=torch.tensor(rows.slots),
                     spans=rows.spans, logits_rows=torch.tensor(rows.logits, dtype=torch.long))
    if cfg.load_guard:   # compute on layer i waits for layer i of these loads
        meta.loads = [s.seq.load for s in batch if s.seq.load is not None]
        meta.load_timeout_s = cfg.load_timeout_s
    if decode:
        _decode_meta(meta, decode)
    if cfg.deterministic:  # fixed GEMM shapes: tiles of DET_TILE rows
        meta.det_tile = DET_TILE
    return torch.tensor(rows.ids, dtype=torch.long), meta, rows.sampled


def _decode_rows(batch: list[Scheduled], cfg: EngineConfig) -> list[Scheduled]:
    if cfg.deterministic:
        return []
    decode = [s for s in batch if s.rows == 1 or s.drafts]
    if cfg.device.startswith("cuda"):      # the paged kernel
        return decode
    single = [s for s in decode if not s.drafts]
    if sum(s.start + 1 for s in single) >= PER_SEQUENCE_CTX * len(single):
        decode = [s for s in decode if s.drafts]
    return [] if sum(s.rows for s in decode) == 1 else decode


def _add(rows: _Rows, s: Scheduled, cfg: EngineConfig, chunk: bool) -> None:
    """Append one scheduled entry's rows: its tokens, then the drafts they verify."""
    bs, seq, row = cfg.block_size, s.seq, rows.n
    p = list(range(s.start, s.start + s.rows))
    rows.ids += [seq.token_at(i) for i in p[:s.n]] + s.drafts
    rows.pos += p
    rows.slots += [seq.block_table[i // bs] * bs + i % bs for i in p]
    if chunk:
        ctx = s.start + s.rows
        bt = torch.tensor(seq.block_table, dtype=torch.long)
        ctx_slots = (bt.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:ctx]
        # deterministic mode: each row (prompt, token or draft) exactly as its own decode
        # step computes it, so no position's KV depends on how it was computed
        rows.spans.append(SeqSpan(row, s.rows, ctx, ctx_slots, seq.request_id,
                                  rowwise=cfg.deterministic))
    if s.samples:
        end = row + s.rows
        rows.logits += range(end - 1 - len(s.drafts), end)
        rows.sampled.append(s)


def _decode_meta(meta: BatchMeta, decode: list[Scheduled]) -> None:
    nb = max(len(s.seq.block_table) for s in decode)
    meta.num_decode = sum(s.rows for s in decode)
    meta.block_tables = torch.tensor(
        [s.seq.block_table + [0] * (nb - len(s.seq.block_table))
         for s in decode for _ in range(s.rows)], dtype=torch.int32)
    meta.context_lens = torch.tensor(
        [i + 1 for s in decode for i in range(s.start, s.start + s.rows)], dtype=torch.int32)
