"""KV writes fail closed (issue 29): with prefill's NATS credentials, writes for a request
decode does not know, aimed at the blocks that hold another tenant's cached prefix, never
land, whatever epochs they name.

The attack as it was reproduced: a prefill worker sees every job's destination blocks
and epochs, and decode's epochs were one counter per pool, so a write for no request and
with no claim, trying the epochs just past the ones seen, overwrote the cached prefix
(27 of 27 blocks in 378 writes); the next request with that prefix answered garbage.
Here the attacker learns even more than a prefill would (the debug user's view of a real
write: its block ids, epochs, layers, dtype and shape), forges 64 epochs per block group
with a valid digest, and the mesh still answers the cached prompt exactly as the engine
alone does. Real nats-server, real services, real HTTP."""
from __future__ import annotations

import asyncio
import uuid

import aiohttp
import msgspec
import nats
import pytest

from pdmesh.local.cluster import Cluster
from shared import subjects as S
from shared.contracts.kv import KvWrite, KvWriteAck
from shared.contracts.sampling import SamplingParams
from shared.kv import wire
from shared.service import decode_reply

from .conftest import DET, det_overrides, reference_engine
from .helpers import complete

pytestmark = pytest.mark.timeout(300)
TRIES = 64          # epochs tried per captured write: past the ones seen, as with a counter


def forged(seen: KvWrite, shift: int) -> tuple[KvWrite, bytes]:
    """A write for no request into seen's blocks, epochs shifted, garbage bytes, a valid
    digest (anyone can compute it: it guards integrity, the grant guards who writes)."""
    payload = bytes([0x7F]) * wire.write_bytes(seen)
    meta = msgspec.structs.replace(seen, request_id=f"forged-{uuid.uuid4().hex[:8]}",
                                   attempt=uuid.uuid4().hex, done=None,
                                   epochs=[e + shift for e in seen.epochs])
    return wire.signed(meta, payload), payload


def test_forged_writes_never_land_in_a_cached_prefix(tiny_target, tiny_prompts):
    prompt = sum(tiny_prompts[:8], [])                 # several whole KV blocks
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (want,) = [o["token_ids"] for o in reference_engine(tiny_target).generate([prompt],
                                                                               params)]
    with Cluster(str(tiny_target), prefill=1, decode=1, **DET,
                 overrides=det_overrides(mode="pd"), echo=False) as c:
        async def run():
            writes: list[KvWrite] = []
            spy = await nats.connect(**c.client_options(S.DEBUG))

            async def on_write(msg) -> None:
                writes.append(KvWrite.from_headers(msg.headers))
            sub = await spy.subscribe(S.pattern("decode_kv", S.ANY), cb=on_write)
            await spy.flush()
            async with aiohttp.ClientSession() as http:
                first = (await complete(http, c.url, prompt, "pd", temperature=0.0,
                                        max_tokens=12, ignore_eos=True))[0]
                await asyncio.sleep(0.5)
                await sub.unsubscribe()           # the forged writes are not for it to see
                assert writes, "no KV write crossed NATS: the attack has nothing to aim at"
                attacker = await nats.connect(**c.client_options("prefill"))
                acks = []
                for seen in list(writes):
                    for shift in range(TRIES):
                        meta, payload = forged(seen, shift)
                        msg = await attacker.request(S.decode_kv("decode_0"), payload,
                                                     headers=meta.headers(), timeout=5)
                        acks.append(decode_reply(msg.data, msg.headers,
                                                 msgspec.json.Decoder(KvWriteAck)))
                again = (await complete(http, c.url, prompt, "pd", temperature=0.0,
                                        max_tokens=12, ignore_eos=True))[0]
                async with http.get(c.url + "/metrics") as r:
                    metrics = await r.text()
            for nc in (spy, attacker):
                await nc.close()
            return first, again, acks, metrics
        first, again, acks, metrics = asyncio.run(run())
        assert len(acks) >= TRIES and not any(a.applied for a in acks), \
            f"{sum(a.applied for a in acks)} of {len(acks)} forged writes landed"
        assert first == again == want
        assert c.unexpected_exits() == []
