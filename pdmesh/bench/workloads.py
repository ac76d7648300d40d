"""Prompts and schemas that the benchmarks, the fault runs and the tests share (one copy:
a benchmark and the test that checks the same path run the same requests)."""
from __future__ import annotations

# short code and text prompts: the tiny models were trained on Python code
CODE_PROMPTS = [
    "def fibonacci(n):", "import os\n\ndef main():", "class Stack:\n    def __init__(self):",
    "for i in range(10):", "def read_file(path):\n    with open(path) as f:",
    "# Sort a list of numbers\n", "def is_prime(n):\n    if n < 2:", "try:\n    import json",
    "def __repr__(self):", "while True:\n    line = input()", "x = [i * i for i in",
    "def parse_args(argv):", "if __name__ == '__main__':", "from collections import",
    "def add(a, b):\n    return", "    raise ValueError(", "async def fetch(url):",
    "@property\ndef name(self):", "def test_addition():\n    assert", "lambda x:",
    "The capital of France is", "Hello, my name is",
]

# tools and a schema for constrained decoding (tool calls, json_schema)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "book_flight", "parameters": {
        "type": "object", "properties": {
            "passenger": {"type": "object", "properties": {
                "name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]},
            "legs": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "class": {"type": "string", "enum": ["economy", "business"]}},
        "required": ["passenger", "legs"]}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "minute": {"type": "integer", "minimum": 0, "maximum": 59},
            "label": {"type": "string"}},
        "required": ["hour", "minute"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"},
            "filters": {"type": "object", "properties": {
                "lang": {"type": "string", "enum": ["en", "de", "fr"]},
                "after": {"type": "string"}}}},
        "required": ["query"]}}},
]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "number"}, "kind": {"type": "string", "enum": ["a", "b"]}},
    "required": ["name", "kind"]}
CANON = dict(sort_keys=True, separators=(",", ":"))
