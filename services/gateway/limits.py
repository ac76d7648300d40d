"""Bounds on what one request may ask of the mesh, checked before anything is built or
cached (validate.py, structured.py), and the one bound the bus sets: a DecodeSubmit must
fit in one NATS message (`check_fits`).

    body            min(--max-body-bytes, the NATS connection's max_payload): a body
                    over it is refused (413) from its Content-Length, before it is read
    submission      the encoded DecodeSubmit <= max_payload - SUBMIT_HEADROOM, else 413
    tools           MAX_TOOLS tools, MAX_TOOLS_CHARS of canonical JSON together
    schema          MAX_SCHEMA_CHARS of canonical JSON (build.py's limit) and a budget
                    (check_schema, all of a request's schemas together): MAX_SCHEMA_DEPTH
                    levels of JSON, MAX_ENUM_VALUES enum/const values, MAX_PROPERTIES
                    properties, optional properties costing sum(n^2) over objects up to
                    MAX_OPTIONAL_COST (one object of 256, or 128 tools of 22), at most
                    MAX_UNION_BRANCHES anyOf/oneOf branches, patterns of MAX_PATTERN_CHARS
                    with counted repeats {m,n} up to MAX_PATTERN_REPEAT. Measured on
                    xgrammar 0.2.9 (tiny-target's vocabulary): one object of 1000 optional
                    properties compiles in 21 s (400: 1 s, 250: 0.4 s), `.{1,5000}` in 80 s,
                    500 anyOf branches in 4 s; the budget keeps a schema near 0.5 s. Then
                    compiling it must finish within --grammar-timeout-s (grammar_check.py)
    stop            MAX_STOP strings of at most MAX_STOP_CHARS characters
    stop_token_ids  MAX_STOP_TOKEN_IDS ids
    logit_bias      MAX_LOGIT_BIAS entries (OpenAI's limit)
    cache_salt      MAX_CACHE_SALT characters
    text            a prompt or chat of more characters than the window's tokens can hold
                    (max_model_len x the tokenizer's longest token) is refused before it is
                    tokenized (check_text_budget)
Sampling ranges that keep the logits finite live with the params (SamplingParams.check).
"""
from __future__ import annotations

import re

from .protocol import OpenAIError

SUBMIT_HEADROOM = 4096      # a message's headers and protocol line ride in max_payload too
MAX_TOOLS = 128             # OpenAI's limit
MAX_TOOLS_CHARS = 512 * 1024
MAX_SCHEMA_CHARS = 256 * 1024
MAX_STOP = 4
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_CACHE_SALT = 256
MAX_SCHEMA_DEPTH = 64        # JSON levels (~30 nested objects)
MAX_ENUM_VALUES = 1000       # OpenAI's structured-output limit
MAX_PROPERTIES = 5000        # OpenAI's
MAX_OPTIONAL_COST = 256 ** 2    # sum over objects of (optional properties)^2
MAX_UNION_BRANCHES = 128     # anyOf / oneOf branches, all together
MAX_PATTERN_CHARS = 1000
MAX_PATTERN_REPEAT = 256
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def check_fits(size: int, max_payload: int) -> None:
    """413 for a submission larger than one NATS message may be (the connection's
    max_payload, less room for headers): no instance could take it, and sending it would
    fail as a misleading 503."""
    limit = max_payload - SUBMIT_HEADROOM
    if max_payload and size > limit:
        raise OpenAIError(413, f"request too large: its prompt and constraint come to "
                               f"{size} bytes on the bus, over the {limit} a message may hold "
                               f"(NATS max_payload); shorten the prompt, tools or schema",
                          code="request_too_large")


def body_limit(max_body_bytes: int, max_payload: int) -> int:
    """The gateway's body limit: its own, and never more than one NATS message."""
    return min(max_body_bytes, max_payload) if max_payload else max_body_bytes


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(413, f"request body is larger than {limit} bytes (the gateway's limit: "
                            f"--max-body-bytes, at most the NATS max_payload)",
                       code="request_too_large")


def check_stop(stop, stop_token_ids) -> None:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > MAX_STOP:
        raise OpenAIError(400, f"'stop' may hold at most {MAX_STOP} sequences, got {len(stops)}",
                          "stop")
    for s in stops:
        if len(s) > MAX_STOP_CHARS:
            raise OpenAIError(400, f"'stop' sequences may be at most {MAX_STOP_CHARS} "
                                   f"characters, got one of {len(s)}", "stop")
    if stop_token_ids is not None and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise OpenAIError(400, f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, "
                               f"got {len(stop_token_ids)}", "stop_token_ids")


def check_logit_bias(bias) -> None:
    if bias is not None and len(bias) > MAX_LOGIT_BIAS:
        raise OpenAIError(400, f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got "
                               f"{len(bias)}", "logit_bias")


def check_cache_salt(salt) -> None:
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT:
        raise OpenAIError(400, f"'cache_salt' must be 1 to {MAX_CACHE_SALT} characters",
                          "cache_salt")


def unreadable(e: Exception) -> OpenAIError:
    """400 for a body aiohttp could not read: a Content-Encoding (gzip, deflate) that does
    not decode, a body cut short."""
    why = getattr(e.__cause__, "message", None) or str(e)
    return OpenAIError(400, f"request body could not be read: {why}", code="invalid_body",
                       headers={"Connection": "close"})


def body_middleware(limit_of):
    """aiohttp middleware: a body whose Content-Length is over limit_of() is refused (413)
    before a byte of it is read; a chunked one is cut off at the limit while read; one that
    cannot be read (bad Content-Encoding) is a 400, not an unhandled RequestPayloadError."""
    from aiohttp import web

    @web.middleware
    async def limit_body(request: web.Request, handler):
        limit = limit_of()
        if request.content_length is not None and request.content_length > limit:
            raise too_large(limit)
        if request.can_read_body:
            request = request.clone(client_max_size=limit)
        try:
            return await handler(request)
        except web.RequestPayloadError as e:
            # the rest cannot be read either: end the payload, or aiohttp reads it again after
            # the answer (and fails); the answer closes the connection (Connection: close)
            request.content.feed_eof()
            raise unreadable(e) from None

    return limit_body


class SchemaBudget:
    """What a request's schemas may hold together; check() walks one (no recursion)."""

    def __init__(self):
        self.enums = self.props = self.optional_cost = self.branches = 0

    def check(self, schema, param: str) -> None:
        stack = [(schema, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > MAX_SCHEMA_DEPTH:
                raise OpenAIError(400, f"'{param}' is nested too deeply: more than "
                                       f"{MAX_SCHEMA_DEPTH} levels of JSON", param)
            if isinstance(node, dict):
                self._node(node, param)
                stack.extend((v, depth + 1) for v in node.values())
            elif isinstance(node, list):
                stack.extend((v, depth + 1) for v in node)

    def _node(self, node: dict, param: str) -> None:
        enum, props, pattern = node.get("enum"), node.get("properties"), node.get("pattern")
        self.enums += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
        if isinstance(props, dict):
            self.props += len(props)
            required = node.get("required")     # its items may be anything: only names count
            required = ({r for r in required if isinstance(r, str)}
                        if isinstance(required, list) else set())
            self.optional_cost += sum(1 for k in props if k not in required) ** 2
            if self.optional_cost > MAX_OPTIONAL_COST:
                raise _complex(param, "too many optional properties (the sum over objects of "
                                      f"their count squared is over {MAX_OPTIONAL_COST})")
        for key in ("anyOf", "oneOf"):
            self.branches += len(node[key]) if isinstance(node.get(key), list) else 0
        if self.branches > MAX_UNION_BRANCHES:
            raise _complex(param, f"more than {MAX_UNION_BRANCHES} anyOf/oneOf branches")
        if self.enums > MAX_ENUM_VALUES:
            raise _complex(param, f"more than {MAX_ENUM_VALUES} enum/const values")
        if self.props > MAX_PROPERTIES:
            raise _complex(param, f"more than {MAX_PROPERTIES} properties")
        if isinstance(pattern, str):
            # length first: int() refuses a run of over 4300 digits (ValueError)
            if len(pattern) > MAX_PATTERN_CHARS or max(
                    (int(n) for m in _REPEAT.finditer(pattern) for n in m.groups() if n),
                    default=0) > MAX_PATTERN_REPEAT:
                raise _complex(param, f"a pattern over {MAX_PATTERN_CHARS} characters or with "
                                      f"a counted repeat over {MAX_PATTERN_REPEAT}")


def _complex(param: str, what: str) -> OpenAIError:
    return OpenAIError(400, f"'{param}' is too complex for constrained decoding: {what}",
                       param, code="schema_too_complex")


def text_chars(obj) -> int:
    """Characters of every string in a JSON-like value (what a template renders)."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return sum(text_chars(k) + text_chars(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(text_chars(v) for v in obj)
    return 0


def check_text_budget(chars: int, spec, param: str) -> None:
    """400 before tokenizing a text that cannot fit the context window whatever it
    tokenizes to: at least chars / max_token_chars tokens (issue 29: an 8 MiB body cost ~5 s
    of the one tokenizer thread before its 400, and every other tenant waited)."""
    per = getattr(spec.tokenizer, "max_token_chars", None)
    if isinstance(per, int) and per > 0 and chars > spec.max_model_len * per:
        raise OpenAIError(400, f"This model's maximum context length is {spec.max_model_len} "
                               f"tokens. However, your {param} has {chars} characters, more "
                               f"than any text of {spec.max_model_len} tokens can have "
                               f"({per} characters a token at most). Please reduce the "
                               f"length of the {param}.", param, code="context_length_exceeded")
