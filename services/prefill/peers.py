"""Everything prefill asks of a decode instance, behind one small interface: claim a job's
blocks, and report the attempt's end (PrefillDone). NatsPrefillPeers is the real one;
in-process tests (tests/decode/local_mesh.py) call decode's handlers directly."""
from __future__ import annotations

from typing import Protocol

from shared import subjects
from shared.contracts.common import Codec, encode
from shared.contracts.messages import PrefillDone
from shared.contracts.reclaim import ClaimReply, PrefillClaim
from shared.service import decode_reply

CLAIM_REPLY = Codec(ClaimReply)


class PrefillPeers(Protocol):
    async def claim(self, decode: str, c: PrefillClaim, timeout: float) -> ClaimReply: ...

    async def prefill_done(self, decode: str, done: PrefillDone, timeout: float) -> None: ...


class NatsPrefillPeers:
    def __init__(self, nc):
        self.nc = nc

    async def claim(self, decode: str, c: PrefillClaim, timeout: float) -> ClaimReply:
        msg = await self.nc.request(subjects.decode_claim(decode), encode(c), timeout=timeout)
        return decode_reply(msg.data, msg.headers, CLAIM_REPLY)

    async def prefill_done(self, decode: str, done: PrefillDone, timeout: float) -> None:
        await self.nc.request(subjects.decode_prefill_done(decode), encode(done),
                              timeout=timeout)
