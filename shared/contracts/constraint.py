"""What constrains generation (tool calls, JSON): travels with every hand-off so the
grammar that shaped the first token (prefill) also shapes the rest (decode)."""
from __future__ import annotations

import enum

import msgspec


class ConstraintKind(str, enum.Enum):
    NONE = "none"
    JSON_OBJECT = "json_object"        # response_format {"type": "json_object"}
    JSON_SCHEMA = "json_schema"        # response_format {"type": "json_schema"}
    TOOLS_AUTO = "tools_auto"          # text, or tool calls once the call tag starts
    TOOLS_REQUIRED = "tools_required"  # one or more calls to any of the tools
    TOOL_NAMED = "tool_named"          # exactly the named tool


class Constraint(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    kind: ConstraintKind = ConstraintKind.NONE
    json_schema: str | None = None     # canonical JSON text of the schema
    tools: str | None = None           # canonical JSON text of the tools list
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    # the tool-call format the model speaks (shared/toolformats.py; "" is hermes): the
    # grammar a constrained call follows, so every engine must build the same one
    tool_format: str = ""
