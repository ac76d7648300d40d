"""Gateway settings: one dataclass, filled by shared.settings from flags, PDMESH_* env, defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shared import subjects
from shared.natsconn import NatsAuth
from shared.service import new_instance_id

from .auth import parse_keys


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(slots=True)
class GatewayConfig:
    """pdmesh gateway: OpenAI-compatible REST in front of the decode instances."""
    model: str = field(default="", metadata=_help(
        "HF model folder: tokenizer, chat template, config.json (context window)"))
    served_model_name: str = field(default="", metadata=_help(
        "model id clients send and /v1/models lists (default: the folder name)"))
    max_model_len: int = field(default=0, metadata=_help(
        "context window requests are checked against, prompt + completion tokens, and "
        "/v1/models lists (0: the model's max_position_embeddings); set it as decode's"))
    chat_template: str = field(default="", metadata=_help(
        "a Jinja chat template file that replaces the model's ('': the model's)"))
    tool_call_parser: str = field(default="auto", metadata=_help(
        "the format tool calls are parsed and constrained in: auto (from the chat template) "
        "| hermes | llama3_json | mistral | glm45"))
    nats_url: str = field(default="nats://127.0.0.1:4222", metadata=_help("NATS server URL"))
    nats: NatsAuth = field(default_factory=NatsAuth, metadata={"prefix": "nats_"})   # identity, TLS
    otlp_endpoint: str = field(default="", metadata=_help(
        "OpenTelemetry: export spans over OTLP/HTTP to this collector (http://host:4318); "
        "off when empty (PDMESH_OTLP_ENDPOINT sets it for every service)"))
    host: str = field(default="127.0.0.1", metadata=_help("HTTP listen address"))
    port: int = field(default=8000, metadata=_help("HTTP listen port"))
    listen_fd: int = field(default=-1, metadata=_help(
        "serve on this inherited listening socket instead of binding host:port (pdmesh up "
        "owns the socket: connections wait in its backlog while a gateway restarts, and a "
        "successor takes them over with none lost; -1: bind host:port)"))
    instance_id: str = field(default="", metadata=_help(
        "this gateway's id in subjects (default: generated)"))
    request_timeout_s: float = field(default=600.0, metadata=_help(
        "a request that has not finished by then gets a timeout error"))
    decode_dead_after_s: float = field(default=5.0, metadata=_help(
        "a decode instance silent for this long is dead; its requests fail"))
    submit_timeout_s: float = field(default=5.0, metadata=_help(
        "wait this long for a decode instance to accept a request, then try the next"))
    drain_grace_s: float = field(default=10.0, metadata=_help(
        "on SIGTERM, let in-flight requests finish for this long"))
    metrics_refresh_s: float = field(default=2.0, metadata=_help(
        "how often the gateway asks kvstore and the prefill ranks for their STATS, which "
        "/metrics shows (a scrape itself asks nobody)"))
    access_log: bool = field(default=True, metadata=_help(
        "one log line per HTTP request (logger pdmesh.access: status, latency, tokens, TTFT, "
        "pd or colocated, a tenant digest); --no-access-log turns it off"))
    max_body_bytes: int = field(default=32 << 20, metadata=_help(
        "larger request bodies get 413"))
    generation_config: bool = field(default=True, metadata=_help(
        "apply the model folder's generation_config.json sampling defaults (temperature, "
        "top_p, top_k, min_p, repetition_penalty, max_new_tokens) to fields a request omits, "
        "like vLLM's --generation-config auto; --no-generation-config: OpenAI's defaults"))
    default_max_tokens: int = field(default=512, metadata=_help(
        "generated-token cap for chat, responses and messages requests that set no "
        "max_tokens (a generation_config.json max_new_tokens wins; 0: no cap, only the "
        "context window)"))
    responses_store_size: int = field(default=1024, metadata=_help(
        "/v1/responses kept for previous_response_id and GET (store: true): an in-memory "
        "LRU of this many responses per gateway (0: store nothing)"))
    max_redispatch: int = field(default=2, metadata=_help(
        "a request decode aborted for an acceptance anomaly goes to another decode instance "
        "at most this many times (only while nothing of it reached the client)"))

    max_migrations: int = field(default=3, metadata=_help(
        "a request whose decode instance is lost (dead, silent, a lost chunk) moves to "
        "another instance with its tokens so far at most this many times"))
    progress_timeout_s: float = field(default=60.0, metadata=_help(
        "a request that gets no chunk for this long is treated like one whose decode "
        "instance was lost (migrated)"))
    first_chunk_timeout_s: float = field(default=600.0, metadata=_help(
        "the same before a request's first token: its prompt's prefill, which takes a "
        "minute for 8,000 tokens on a 2-core CPU (a dead instance is found by its "
        "heartbeat within seconds either way)"))
    api_key: str = field(default="", metadata={"repeat": True, "help": (
        "API key clients must send (Authorization: Bearer KEY, or x-api-key: KEY) on /v1/*, "
        "/tokenize, /detokenize and /metrics; repeat the flag or comma-separate for several "
        "keys (each key is its own tenant of the prefix cache). No key at all (here or in "
        "api_key_file): the gateway is OPEN to anyone who reaches its port")})
    api_key_file: str = field(default="", metadata=_help(
        "file with API keys, one per line (# comments), added to api_key; keeps keys out "
        "of the process list"))
    shared_prefix_cache: bool = field(default=False, metadata=_help(
        "let every API key share prefix-cache blocks (default: each key's prompts are "
        "cached apart: one tenant never hits, nor times, another's prefix)"))
    open_metrics: bool = field(default=False, metadata=_help(
        "serve /metrics without an API key (for a scraper on a private network); by "
        "default it needs one whenever keys are configured"))
    grammar_timeout_s: float = field(default=5.0, metadata=_help(
        "a tools / response_format schema that takes longer to compile for constrained "
        "decoding is refused (400 schema_too_complex); compiled on the gateway's grammar "
        "threads, off the event loop and the tokenizer thread"))
    max_in_flight: int = field(default=0, metadata=_help(
        "requests in flight beyond this get 429 with Retry-After (0: 4 times what the "
        "live decode instances batch at once, from their heartbeats; lower it to bound "
        "latency under overload, e.g. 1.5x). A request counts once its body is read and "
        "parsed"))
    max_in_flight_per_key: int = field(default=0, metadata=_help(
        "requests one API key may have in flight (0: half of --max-in-flight's cap): one "
        "tenant cannot take every slot. Without API keys only the global cap applies"))
    body_timeout_s: float = field(default=30.0, metadata=_help(
        "a request body not received within this gets 408 (a client that sends a byte "
        "at a time holds nothing else meanwhile)"))
    write_timeout_s: float = field(default=30.0, metadata=_help(
        "a streamed response the client does not read for this long is cut off and its "
        "request aborted at decode (a client that stopped reading holds no slot)"))

    def __post_init__(self):
        if not self.model:
            raise ValueError("model is required: --model PATH or PDMESH_MODEL")
        if not self.served_model_name:
            self.served_model_name = Path(self.model).name
        self.instance_id = (subjects.instance_token(self.instance_id) if self.instance_id
                            else new_instance_id("gateway"))
        for name in ("request_timeout_s", "decode_dead_after_s", "submit_timeout_s",
                     "body_timeout_s", "write_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_redispatch < 0:
            raise ValueError(f"max_redispatch must be >= 0, got {self.max_redispatch}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got "
                             f"{self.responses_store_size}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.tool_call_parser != "auto":
            from shared.toolformats import get
            get(self.tool_call_parser)          # ValueError names the known ones
        if self.chat_template and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template {self.chat_template}: no such file")
        if self.default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be >= 0, got {self.default_max_tokens}")
        parse_keys(self.api_key, self.api_key_file)     # a key file that cannot be read: now
        if self.grammar_timeout_s <= 0:
            raise ValueError(f"grammar_timeout_s must be > 0, got {self.grammar_timeout_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
