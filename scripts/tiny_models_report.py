"""Evaluate the tiny bundled models and write models/README.md and models/eval.json.

Run by scripts/train_models.py after training; works on the saved folders (bf16 weights
loaded as float32), so the numbers describe exactly what ships:

    held-out loss       target and draft, on held-out stdlib files and held-out dialogues
    greedy agreement    share of positions where draft argmax == target argmax (what
                        speculative decoding accepts, one token at a time)
    samples             greedy continuations of a code prompt, chat prompts and a tool prompt
"""

from __future__ import annotations

import json
from pathlib import Path


def held_loss(model, windows, bs: int = 8) -> float:
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), bs):
            w = windows[i:i + bs]
            logits = model(input_ids=w[:, :-1]).logits.float()
            total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
            count += w[:, 1:].numel()
    return round(total / max(1, count), 4)


def greedy_agreement(draft, target, windows, bs: int = 8) -> float:
    """Share of positions where the draft's argmax next token equals the target's."""
    import torch

    same, count = 0, 0
    with torch.no_grad():
        for i in range(0, len(windows), bs):
            w = windows[i:i + bs, :-1]
            same += (draft(input_ids=w).logits.argmax(-1) == target(input_ids=w).logits.argmax(-1)).sum().item()
            count += w.numel()
    return round(same / max(1, count), 4)


def generate(model, tok, prompt_ids: list[int], n: int) -> list[int]:
    import torch

    eos = model.generation_config.eos_token_id
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


SAMPLE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city."},
        "units": {"type": "string", "enum": ["metric", "imperial"], "description": "The units."}},
        "required": ["city"]}}}


def samples(folder: Path, n: int) -> list[dict]:
    """Greedy continuations from the saved target folder (loaded as float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [
        # no trailing newline: "\n" + indent is one pre-token, so a prompt ending in "\n" splits it
        ("code", "def fibonacci(n):", None),
        ("code", "class Stack:\n    def __init__(self):", None),
        ("chat", [{"role": "user", "content": "What is the capital of France?"}], None),
        ("chat", [{"role": "user", "content": "What is 12 + 30?"}], None),
        ("tool_call", [{"role": "user", "content": "Please get weather with city Paris and units metric."}],
         [SAMPLE_TOOL]),
    ]
    out = []
    for kind, prompt, tools in prompts:
        if kind == "code":
            ids = tok.encode(prompt, add_special_tokens=False)
            shown = prompt
        else:
            shown = tok.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
            ids = tok.encode(shown, add_special_tokens=False)
        text = tok.decode(generate(model, tok, ids, n), skip_special_tokens=False)
        entry = {"kind": kind, "prompt": prompt if kind == "code" else prompt[-1]["content"], "output": text}
        if kind == "tool_call":
            entry["parsed_call"] = parse_tool_call(text)
        out.append(entry)
    return out


def parse_tool_call(text: str):
    start, end = text.find("<tool_call>"), text.find("</tool_call>")
    if start < 0 or end < start:
        return None
    try:
        return json.loads(text[start + len("<tool_call>"):end])
    except ValueError:
        return None


def evaluate(out: Path, held: dict, n_sample_tokens: int) -> dict:
    """held: {"code": [N, T+1] windows, "chat": [M, T+1] windows} of held-out token ids."""
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(out / "tiny-target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(out / "tiny-draft", dtype=torch.float32).eval()
    result = {"held_out_loss": {}, "greedy_agreement": {}}
    for split, windows in held.items():
        result["held_out_loss"][split] = {"target": held_loss(target, windows), "draft": held_loss(draft, windows)}
        result["greedy_agreement"][split] = greedy_agreement(draft, target, windows)
    result["samples"] = samples(out / "tiny-target", n_sample_tokens)
    return result


def folder_sizes(out: Path) -> dict:
    sizes = {}
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        sizes[folder.name] = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file()}
    sizes["total_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return sizes


def _arch_line(config: dict) -> str:
    return (f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
            f"{config['num_attention_heads']} heads / {config['num_key_value_heads']} KV heads "
            f"(head_dim {config['head_dim']}), intermediate {config['intermediate_size']}, "
            f"vocab {config['vocab_size']}, max_position_embeddings {config['max_position_embeddings']}, "
            f"rope_theta {config.get('rope_theta', (config.get('rope_parameters') or {}).get('rope_theta'))}, "
            f"tied embeddings {config['tie_word_embeddings']}, rms_norm_eps {config['rms_norm_eps']}")


def write_readme(out: Path, report: dict) -> None:
    """models/README.md from the report dict (the same dict goes to eval.json)."""
    cfg = {n: json.loads((out / n / "config.json").read_text()) for n in ("tiny-target", "tiny-draft")}
    data, ev, tr = report["data"], report["eval"], report["training"]
    lines = [
        "# Tiny bundled models",
        "",
        "`tiny-target` and `tiny-draft` are Llama-architecture models trained from scratch on CPU by",
        "`scripts/train_models.py` (seeded; rerun with `make train-models`). They share one tokenizer",
        "and exist so the serving stack, speculative decoding and tool calling can be exercised without",
        "downloads. They are far too small to be useful assistants: expect Python-shaped text and",
        "templated chat/tool-call answers, not correctness.",
        "",
        "## Architecture",
        "",
        f"- **tiny-target**: {_arch_line(cfg['tiny-target'])}; {report['params']['target']:,} parameters",
        f"- **tiny-draft**: {_arch_line(cfg['tiny-draft'])}; {report['params']['draft']:,} parameters",
        "- weights stored as bfloat16 safetensors (load with `dtype=torch.float32` for exact reference maths)",
        "",
        "## Tokenizer and chat template",
        "",
        f"Byte-level BPE (`tokenizers`), vocab {report['tokenizer']['vocab_size']}, GPT-2 pre-split, trained on the training text.",
        "Added tokens, ids 0-6: " + ", ".join(f"`{t}` ({i})" for t, i in report["tokenizer"]["added_tokens"].items()) + ".",
        "`<|endoftext|>` is bos/eos/pad and separates documents; `<|im_end|>` ends a chat turn; both are in",
        "`generation_config.eos_token_id`. The tool tags are added but not *special*, so",
        "`decode(skip_special_tokens=True)` keeps them. The chat template is ChatML/Hermes (same output as",
        "`shared/engine/templates/hermes_tools.jinja`, default system prompt \"You are a helpful assistant.\"):",
        "tools are listed as JSON lines inside `<tools></tools>` in the system turn, an assistant call is",
        "`<tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call>`, and tool results come back as a",
        "user turn of `<tool_response>\\n...\\n</tool_response>` blocks.",
        "",
        "## Data",
        "",
        f"- Python {data['python']} standard library `*.py` library modules (sorted paths; no test suites, "
        f"site-packages, encodings or pydoc_data; capped at {data['code_mb_cap']} MB): "
        f"{data['code_train_files']} files / {data['code_train_chars'] / 1e6:.1f} MB / {data['code_train_tokens']:,} tokens for training; "
        f"every {data['held_every']}th file held out ({data['code_held_files']} files, {data['code_held_tokens']:,} tokens).",
        f"- Synthetic dialogues (`scripts/synth_chat.py`, seed {data['seed']}): {data['dialogues_train']} train / "
        f"{data['dialogues_held']} held out, {data['chat_train_tokens']:,} train tokens; ~60% with random tools "
        "(JSON-schema params with enums, arrays, nested objects; calls whose arguments satisfy the schema, "
        "sometimes two in parallel, arguments given as object or JSON string; tool results; short answers), "
        "the rest plain Q&A (arithmetic, capitals, spelling, sorting, tiny Python functions).",
        f"- Training windows of {tr['seq']} tokens drawn at random offsets, {tr['chat_frac']:.0%} from the chat stream.",
        "",
        "## Training",
        "",
        f"One CPU thread, bf16 autocast {tr['bf16']}, torch.compile {tr['compile']}, AdamW (wd 0.1, betas 0.9/0.95), "
        f"warmup {tr['warmup']} steps then cosine to 10%, sequences of {tr['seq']} tokens.",
        "",
        "| model | steps | batch | tokens | lr | time | final train loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("target", "draft"):
        s = tr[name]
        lines.append(f"| tiny-{name} | {s['steps']} | {s.get('batch', '')} | {s['tokens']:,} | {s['lr']} | {s['seconds'] / 60:.1f} min | {s['final_train_loss']} |")
    lines += [
        "",
        f"The draft starts as a copy of the target's embedding, layer 0 and final norm, then trains on "
        f"{tr['distill_alpha']} x KL(target || draft) + {1 - tr['distill_alpha']:.2f} x cross-entropy. "
        f"Greedy agreement on held-out code at initialisation: {tr['draft']['agreement_at_init']:.1%}.",
        "",
        f"Whole script: {report['total_seconds'] / 60:.1f} min wall.",
        "",
        "## Evaluation (held out)",
        "",
        "| split | target loss | draft loss | draft/target greedy agreement |",
        "|---|---|---|---|",
    ]
    for split, losses in ev["held_out_loss"].items():
        lines.append(f"| {split} | {losses['target']} | {losses['draft']} | {ev['greedy_agreement'][split]:.1%} |")
    lines += ["", "Agreement: share of positions where the draft's argmax next token equals the target's,",
              "teacher-forced on held-out text (float32).", ""]
    lines += _ablation_lines(report.get("distill_ablation"))
    lines += [
        "## Caveats",
        "",
        "- About 1.6M training tokens for the target: greedy text is Python-shaped but loops, chat answers",
        "  follow the templates with wrong facts, and tool calls have the right shape but often the wrong",
        "  tool or arguments (use constrained decoding when a test needs a valid call).",
        "- Greedy loops are easy for the draft to predict: acceptance on such output can exceed the",
        "  anomaly monitor's 0.96 `spec_accept_rate` threshold; tests should account for that.",
        "- Trained on 512-token windows; positions past 512 work but are out of distribution.",
        "",
        "## Greedy samples (tiny-target)",
        "",
    ]
    for s in ev["samples"]:
        lines += [f"**{s['kind']}** — prompt: `{json.dumps(s['prompt'])}`", "", "```", s["output"], "```", ""]
        if "parsed_call" in s:
            lines += [f"parsed tool call: `{json.dumps(s['parsed_call'])}`", ""]
    lines += ["## Files", "", "| file | bytes |", "|---|---|"]
    for folder, files in report["sizes"].items():
        if isinstance(files, dict):
            lines += [f"| {folder}/{name} | {size:,} |" for name, size in files.items()]
    lines += [f"| total (models/) | {report['sizes']['total_bytes']:,} |", ""]
    (out / "README.md").write_text("\n".join(lines))


def _ablation_lines(ablation: dict | None) -> list[str]:
    """README section for a distillation ablation recorded in eval.json (run separately with
    --target-from ... --distill-alpha 0 and added by hand)."""
    if not ablation:
        return []
    a0, a8 = ablation["alpha_0"], ablation["alpha_0.8"]
    return [
        "## Does distillation help? (separate run)",
        "",
        f"The same draft recipe trained on cross-entropy alone (`{ablation['command']}`) reaches "
        f"{a0['greedy_agreement']['code']:.1%} greedy agreement on held-out code and "
        f"{a0['greedy_agreement']['chat']:.1%} on chat, against {a8['greedy_agreement']['code']:.1%} / "
        f"{a8['greedy_agreement']['chat']:.1%} with alpha 0.8, at about the same held-out draft loss "
        f"({a0['held_out_loss_draft']['code']} vs {a8['held_out_loss_draft']['code']} on code). "
        "Distillation is kept. This comparison lives in eval.json `distill_ablation`; a rerun of the "
        "training script does not repeat it.",
        "",
    ]
