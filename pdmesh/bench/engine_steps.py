"""An engine measured in-process (no mesh): the prefill of one long prompt, then decode
tokens/s with c streams, counted over the steps where every stream decodes."""
from __future__ import annotations

import time


def prefill_then_decode(eng, prefill: int, levels: tuple[int, ...], tokens: int) -> dict:
    """{"prefill_<prefill>_s": seconds, "<c>": decode tokens/s for each c in levels}."""
    from shared.contracts.sampling import SamplingParams

    t = time.perf_counter()
    eng.add_request("p", [200 + (i * 37) % 5000 for i in range(prefill)],
                    SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while eng.has_unfinished:
        eng.step()
    out: dict = {f"prefill_{prefill}_s": time.perf_counter() - t}
    for c in levels:
        out[str(c)] = decode_level(eng, c, tokens)[0]
    return out


def decode_level(eng, c: int, tokens: int) -> tuple[float | None, dict[str, list[int]]]:
    """c streams, `tokens` each: decode tokens/s over the steps where every stream decodes
    (a request's first token ends its prefill), and each request's tokens by id."""
    from shared.contracts.sampling import SamplingParams

    for i in range(c):
        eng.add_request(f"{c}-{i}", list(range(200 + 13 * i, 240 + 17 * i)),
                        SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    toks: dict[str, list[int]] = {}
    decode_s, decode_tokens = 0.0, 0
    while eng.has_unfinished:
        prefilling = len(toks) < c
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        if not prefilling:
            decode_s += dt
            decode_tokens += len(outs)
        for o in outs:
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
    return (decode_tokens / decode_s if decode_s else None), toks
