"""Model output text -> tool calls, whole (`parse_tool_calls`: OpenAI's message fields) or
as a stream (`ToolCallStreamParser`: typed events, `Text` and `Call`, that every API's
renderer writes in its own shape; `openai_deltas` is chat.completion.chunk's), in the
format the model speaks (toolformats.py; Hermes unless told), e.g. Hermes:

    some text
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>...</tool_call>

Rules, the same for both (the whole parse is the stream fed the whole text at once, so the
stream's concatenated content and its calls equal it by construction):
- a block (the format's open marker to its close marker, or to the end of the output) is
  its calls when the format reads its body (Hermes: a JSON object with a non-empty string
  "name" and an object "arguments", missing -> {}, a JSON string holding an object
  accepted); anything else — bad JSON, no name, an unclosed tag — stays in the content as text;
- whitespace touching a call (before its tag, after its close tag) is dropped; other text
  outside calls is content, in order;
- content is None when there are calls and no other text;
- arguments are re-serialised with json.dumps (", " / ": " separators, non-ASCII kept), which
  is also how the templates render them back into history, so a multi-turn prompt repeats the
  generated tokens.

Call ids are `call_<24 hex>`, derived from (request id, call index) when a request id is given.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from .toolformats import ToolFormat, get


@dataclass(frozen=True, slots=True)
class Text:
    """Output text that is content (no part of a call)."""
    text: str


@dataclass(frozen=True, slots=True)
class Call:
    """One whole tool call, in output order (index: among the output's calls)."""
    index: int
    id: str                  # call_<24 hex>
    name: str
    arguments: str           # JSON text of an object


def openai_deltas(events: list[Text | Call]) -> list[dict]:
    """Events -> OpenAI chat.completion.chunk `delta` dicts: `{"content": str}` for text;
    per call two deltas, `{"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments": ""}}]}` then `{"tool_calls": [{"index", "function": {"arguments":
    <whole JSON>}}]}`."""
    out: list[dict] = []
    for e in events:
        if isinstance(e, Text):
            out.append({"content": e.text})
            continue
        out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                    "function": {"name": e.name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.arguments}}]})
    return out


def call_id(request_id: str | None, index: int) -> str:
    if request_id is None:
        return "call_" + uuid.uuid4().hex[:24]
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def parse_tool_calls(text: str, request_id: str | None = None, fmt: str | None = None,
                     tools: Mapping[str, dict] | None = None) -> tuple[str | None, list[dict]]:
    """Whole output -> (message content, OpenAI tool_calls). fmt: a toolformats name;
    tools: each tool's parameters schema by name (GLM's raw string values)."""
    parser = ToolCallStreamParser(request_id, fmt, tools)
    events = parser.feed(text) + parser.finish()
    joined = "".join(e.text for e in events if isinstance(e, Text))
    calls = [{"id": e.id, "type": "function",
              "function": {"name": e.name, "arguments": e.arguments}}
             for e in events if isinstance(e, Call)]
    return (joined or None) if calls else joined, calls


def tool_schemas(tools_json: str | None) -> dict[str, dict]:
    """A constraint's tools (canonical JSON of the OpenAI list) -> parameters by name."""
    out: dict[str, dict] = {}
    for t in json.loads(tools_json) if tools_json else ():
        fn = t.get("function") or {}
        if isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {}
    return out


def parse_for(constraint, text: str, request_id: str | None = None):
    """parse_tool_calls in the format and with the tools a request's Constraint names."""
    return parse_tool_calls(text, request_id, constraint.tool_format,
                            tool_schemas(constraint.tools))


def stream_for(constraint, request_id: str | None = None) -> "ToolCallStreamParser":
    """A ToolCallStreamParser in the format and with the tools a Constraint names."""
    return ToolCallStreamParser(request_id, constraint.tool_format,
                                tool_schemas(constraint.tools))


class ToolCallStreamParser:
    """Text deltas -> events.

    `feed(text)` and `finish()` return lists of events: `Text` for content, and a `Call`
    once its block closes (`openai_deltas` turns them into chat chunk deltas). Arguments
    go out whole when the block closes: the simplest choice that is always well-formed
    (a block that turns out bad must fall back to text, which a half-sent call could not).
    Text that may still become a marker (a trailing "<", "<to", ...) and whitespace that
    may precede one are held back, so no marker text leaks as content. A block that runs
    to the end of the output (Mistral, Llama 3) is held until finish().
    """

    def __init__(self, request_id: str | None = None, fmt: str | ToolFormat | None = None,
                 tools: Mapping[str, dict] | None = None):
        self.request_id = request_id
        self.fmt = fmt if isinstance(fmt, ToolFormat) else get(fmt)
        self.tools = tools or {}
        self.num_calls = 0
        self._buf = ""             # unparsed text
        self._marker = None        # the open marker when _buf is inside a block
        self._ws_before = ""       # whitespace held before the marker (kept if the block is text)
        self._after_call = False   # drop leading whitespace of the text that follows a call
        self._text_seen = False    # content went out (a leading format opens no block after)

    @property
    def has_tool_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[Text | Call]:
        self._buf += text
        out: list[Text | Call] = []
        f = self.fmt
        while True:
            if self._marker is not None:
                end = self._buf.find(f.end) if f.end else -1
                if end == -1:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(f.end):]
                self._close_block(body, out)
                continue
            if self._after_call:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._after_call = False
            if f.leading and self._text_seen:
                self._emit(self._buf, out)
                self._buf = ""
                return out
            start, marker = self._find_start()
            if marker is not None:
                before = self._buf[:start]
                text_part = before.rstrip()
                self._emit(text_part, out)
                self._ws_before = before[len(text_part):]
                self._buf = self._buf[start + (0 if f.keep_start else len(marker)):]
                self._marker = marker
                continue
            keep = self._held_suffix()
            self._emit(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[Text | Call]:
        """End of output: a block that runs to the end closes; whatever else was held back
        is content (an unclosed tag is text)."""
        out: list[Text | Call] = []
        if self._marker is not None and self.fmt.end is None:
            self._close_block(self._buf, out)
        elif self._marker is not None:
            self._emit(self._ws_before + self._opened() + self._buf, out)
        elif not self._after_call:
            self._emit(self._buf, out)
        self._buf, self._marker, self._ws_before = "", None, ""
        return out

    def _find_start(self) -> tuple[int, str | None]:
        """Where the first open marker is in _buf; a leading format's only where the
        output's first non-whitespace text begins."""
        if self.fmt.leading:
            i = len(self._buf) - len(self._buf.lstrip())
            hit = next((m for m in self.fmt.starts if self._buf.startswith(m, i)), None)
            return i, hit
        found = [(i, m) for m in self.fmt.starts if (i := self._buf.find(m)) != -1]
        return min(found) if found else (-1, None)

    def _held_suffix(self) -> int:
        """Length of the tail to hold: a proper prefix of an open marker, plus the
        whitespace before it (dropped if a call follows); a leading format holds all
        while the output is whitespace or a marker's prefix."""
        buf = self._buf
        if self.fmt.leading:
            rest = buf.lstrip()
            return len(buf) if any(m.startswith(rest) for m in self.fmt.starts) else 0
        tag = 0
        for m in self.fmt.starts:
            for k in range(min(len(buf), len(m) - 1), tag, -1):
                if m.startswith(buf[-k:]):
                    tag = k
                    break
        head = buf[:len(buf) - tag]
        return tag + len(head) - len(head.rstrip())

    def _opened(self) -> str:
        return "" if self.fmt.keep_start else self._marker

    def _close_block(self, body: str, out: list[Text | Call]) -> None:
        calls = self.fmt.parse(body, self.tools)
        if calls is None:
            self._emit(self._ws_before + self._opened() + body + (self.fmt.end or ""), out)
        else:
            for name, arguments in calls:
                out.append(Call(self.num_calls, call_id(self.request_id, self.num_calls), name,
                                arguments))
                self.num_calls += 1
            self._after_call = True
        self._ws_before, self._marker = "", None

    def _emit(self, text: str, out: list[Text | Call]) -> None:
        if text:
            self._text_seen = True
            out.append(Text(text))
