"""Model output text -> OpenAI tool calls, whole (`parse_tool_calls`) or as a stream
(`ToolCallStreamParser`), for the Hermes format the chat templates render:

    some text
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>...</tool_call>

Rules, the same for both (the stream's concatenated content and its calls equal the whole
parse of the same text):
- a block `<tool_call>JSON</tool_call>` is a call when JSON is an object with a non-empty
  string "name" and an object "arguments" (missing -> {}; a JSON string holding an object is
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
from typing import Any

START = "<tool_call>"
END = "</tool_call>"


def call_id(request_id: str | None, index: int) -> str:
    if request_id is None:
        return "call_" + uuid.uuid4().hex[:24]
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def parse_call(body: str) -> tuple[str, str] | None:
    """Inside of one tag -> (name, arguments JSON text), or None if it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def tool_call(request_id: str | None, index: int, name: str, arguments: str) -> dict:
    return {"id": call_id(request_id, index), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, request_id: str | None = None) -> tuple[str | None, list[dict]]:
    """Whole output -> (message content, OpenAI tool_calls)."""
    content: list[str] = []
    calls: list[dict] = []
    pos = 0
    after_call = False
    while True:
        start = text.find(START, pos)
        end = text.find(END, start + len(START)) if start != -1 else -1
        if end == -1:                                   # no more (closed) blocks
            rest = text[pos:]
            content.append(rest.lstrip() if after_call else rest)
            break
        parsed = parse_call(text[start + len(START):end])
        if parsed is None:                              # the block stays text
            before = text[pos:end + len(END)]
            content.append(before.lstrip() if after_call else before)
            after_call = False
        else:
            before = text[pos:start]
            content.append((before.lstrip() if after_call else before).rstrip())
            calls.append(tool_call(request_id, len(calls), *parsed))
            after_call = True
        pos = end + len(END)
    joined = "".join(content)
    return (joined or None) if calls else joined, calls


class ToolCallStreamParser:
    """Text deltas -> OpenAI chat.completion.chunk `delta` dicts.

    `feed(text)` and `finish()` return lists of deltas: `{"content": str}` for text, and per
    call two deltas once its close tag arrives — `{"tool_calls": [{"index", "id", "type",
    "function": {"name", "arguments": ""}}]}` then `{"tool_calls": [{"index", "function":
    {"arguments": <whole JSON>}}]}`. Arguments go out whole when the call closes: the simplest
    choice that is always well-formed (a call whose JSON turns out bad must fall back to text,
    which a half-sent call could not). Text that may still become a tag (a trailing "<", "<to",
    ...) and whitespace that may precede one are held back, so no tag text leaks as content.
    """

    def __init__(self, request_id: str | None = None):
        self.request_id = request_id
        self.num_calls = 0
        self._buf = ""             # unparsed text
        self._in_call = False      # _buf starts inside a <tool_call> (tag itself consumed)
        self._ws_before = ""       # whitespace held before the open tag (kept if the block is text)
        self._after_call = False   # drop leading whitespace of the text that follows a call

    @property
    def has_tool_calls(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        out: list[dict] = []
        while True:
            if self._in_call:
                end = self._buf.find(END)
                if end == -1:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(END):]
                self._in_call = False
                self._close_block(body, out)
                continue
            if self._after_call:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._after_call = False
            start = self._buf.find(START)
            if start != -1:
                before = self._buf[:start]
                text_part = before.rstrip()
                self._emit(text_part, out)
                self._ws_before = before[len(text_part):]
                self._buf = self._buf[start + len(START):]
                self._in_call = True
                continue
            keep = _held_suffix(self._buf)
            self._emit(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return out

    def finish(self) -> list[dict]:
        """End of output: whatever was held back is content (an unclosed tag is text)."""
        out: list[dict] = []
        if self._in_call:
            self._emit(self._ws_before + START + self._buf, out)
        elif not self._after_call:
            self._emit(self._buf, out)
        self._buf, self._in_call, self._ws_before = "", False, ""
        return out

    def _close_block(self, body: str, out: list[dict]) -> None:
        parsed = parse_call(body)
        if parsed is None:
            self._emit(self._ws_before + START + body + END, out)
        else:
            name, arguments = parsed
            call = tool_call(self.request_id, self.num_calls, name, "")
            out.append({"tool_calls": [{"index": self.num_calls, **call}]})
            out.append({"tool_calls": [{"index": self.num_calls,
                                        "function": {"arguments": arguments}}]})
            self.num_calls += 1
            self._after_call = True
        self._ws_before = ""

    @staticmethod
    def _emit(text: str, out: list[dict]) -> None:
        if text:
            out.append({"content": text})


def _held_suffix(buf: str) -> int:
    """Length of the tail to hold: a proper prefix of the open tag, plus the whitespace before
    it (it is dropped if a call follows)."""
    tag = 0
    for k in range(min(len(buf), len(START) - 1), 0, -1):
        if START.startswith(buf[-k:]):
            tag = k
            break
    head = buf[:len(buf) - tag]
    return tag + len(head) - len(head.rstrip())
