"""Train the two tiny bundled models from scratch on CPU: models/tiny-target and models/tiny-draft.

Both are ordinary Hugging Face Llama folders that share one byte-level BPE tokenizer and a
ChatML/Hermes chat template with tools. Phases, in order:

    data       Python stdlib sources (deterministic order, capped) + synthetic chat and
               tool-call dialogues (scripts/synth_chat.py), each with a held-out split
    tokenizer  byte-level BPE trained on the training text, special/added tokens first
    target     LlamaForCausalLM, cross-entropy on a mix of code and chat windows
    draft      1-layer Llama initialised from the target's embedding, layer 0 and norm, then
               trained on alpha * KL(target || draft) + (1 - alpha) * cross-entropy
    eval       held-out losses, greedy samples, draft/target greedy agreement; README.md + eval.json

    .venv/bin/python scripts/train_models.py            # full run, ~20-26 min on one busy CPU thread
    .venv/bin/python scripts/train_models.py --smoke    # seconds, into a temp dir
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import synth_chat

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="output dir (default models/, or a temp dir with --smoke)")
    p.add_argument("--threads", type=int, default=1, help="torch / tokenizers threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny everything, for tests")
    # data
    p.add_argument("--code-mb", type=float, default=16.0, help="cap on stdlib source read (MB of text)")
    p.add_argument("--held-every", type=int, default=25, help="every n-th stdlib file is held out")
    p.add_argument("--dialogues", type=int, default=4000, help="synthetic dialogues (train + held out)")
    p.add_argument("--chat-frac", type=float, default=0.3, help="share of training windows drawn from chat")
    p.add_argument("--vocab", type=int, default=8192)
    # model
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--draft-layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--max-pos", type=int, default=4096)
    # training
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="target batch (small batches learn more per token here)")
    p.add_argument("--draft-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=800, help="target optimizer steps")
    p.add_argument("--draft-steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--distill-alpha", type=float, default=0.8, help="weight of KL in the draft loss")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the loss")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--target-from", default=None,
                   help="reuse a saved tiny-target folder (and its tokenizer); train only the draft")
    args = p.parse_args(argv)
    if args.smoke:
        args.code_mb, args.held_every, args.dialogues, args.vocab = 0.4, 10, 200, 600
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 64, 2, 4, 2, 128
        args.seq, args.batch, args.draft_batch, args.steps, args.draft_steps, args.warmup = 64, 4, 4, 6, 4, 2
        args.compile, args.log_every = False, 2
    return args


# data

# installed packages, codec tables, docs held as one big string, and test suites (whose
# self.assertEqual(...) lines otherwise dominate what a model this small learns to write)
SKIP_DIRS = {"site-packages", "encodings", "pydoc_data", "test", "tests", "idle_test"}


def stdlib_sources(cap_mb: float, held_every: int) -> tuple[list[str], list[str]]:
    """(train, held-out) stdlib library-module texts (*.py, no tests) in sorted path order, up
    to cap_mb in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts))
    train, held, total = [], [], 0
    for i, path in enumerate(paths):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        (held if i % held_every == held_every - 1 else train).append(text)
        total += len(text)
        if total >= cap_mb * 1e6:
            break
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # GPT-2 split (runs of spaces kept together for indentation), then bytes -> printable chars
    split = Regex(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(split, behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[t for t, _ in synth_chat.ADDED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # the tool tags stay visible in decode(skip_special_tokens=True)
    spec = json.loads(tok.to_str())
    flags = dict(synth_chat.ADDED_TOKENS)
    for added in spec["added_tokens"]:
        added["special"] = flags[added["content"]]
    return Tokenizer.from_str(json.dumps(spec))


def hf_tokenizer(tok, max_len: int):
    from transformers import PreTrainedTokenizerFast

    eot = synth_chat.ENDOFTEXT
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=eot, eos_token=eot, pad_token=eot, model_max_length=max_len,
        chat_template=synth_chat.CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def token_stream(tok, texts: list[str], eot_id: int):
    """All texts encoded and joined, each followed by <|endoftext|>. -> int64 [N]"""
    import torch

    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.long)


class WindowSampler:
    """Random (seq + 1)-token windows from the code stream, or with probability chat_frac
    from the chat stream. Seeded, so the batch sequence is reproducible."""

    def __init__(self, code, chat, seq: int, chat_frac: float, seed: int):
        import torch

        self.code, self.chat, self.seq, self.chat_frac = code, chat, seq, chat_frac
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, n: int):
        import torch

        rows = []
        for _ in range(n):
            stream = self.chat if torch.rand((), generator=self.gen) < self.chat_frac else self.code
            start = int(torch.randint(0, len(stream) - self.seq - 1, (), generator=self.gen))
            rows.append(stream[start:start + self.seq + 1])
        return torch.stack(rows)  # [n, seq + 1]


def fixed_windows(stream, seq: int, n: int):
    """The first n disjoint windows of a held-out stream. -> [n', seq + 1]"""
    n = min(n, (len(stream) - 1) // (seq + 1))
    return stream[: n * (seq + 1)].view(n, seq + 1)


# models

def llama_config(args, layers: int, tok):
    from transformers import LlamaConfig

    ids = {t: tok.token_to_id(t) for t, _ in synth_chat.ADDED_TOKENS}
    eot, im_end = ids[synth_chat.ENDOFTEXT], ids["<|im_end|>"]
    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.max_pos, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
        bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot,
        architectures=["LlamaForCausalLM"])


def make_loss_fns(args):
    import torch
    import torch.nn.functional as F

    def ce_loss(model, batch):
        # batch: [B, T + 1]; logits: [B, T, V]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())

    def distill_loss(draft, target, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            with torch.no_grad():
                t_logits = target(input_ids=batch[:, :-1]).logits
            d_logits = draft(input_ids=batch[:, :-1]).logits
        d_logp = F.log_softmax(d_logits.float().flatten(0, 1), -1)  # [B*T, V]
        t_logp = F.log_softmax(t_logits.float().flatten(0, 1), -1)
        kl = F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean")
        ce = F.nll_loss(d_logp, batch[:, 1:].flatten())
        return args.distill_alpha * kl + (1 - args.distill_alpha) * ce

    if args.compile:
        return torch.compile(ce_loss), torch.compile(distill_loss)
    return ce_loss, distill_loss


def train(name: str, model, loss_fn, sampler, args, steps: int, lr: float, batch_size: int) -> dict:
    """AdamW with linear warmup then cosine decay to 10%; returns timing and the last losses."""
    import torch

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))

    def lr_at(step):
        if step < args.warmup:
            return lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, steps - args.warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    start, losses, tokens = time.time(), [], 0
    mark, mark_tokens, mark_step = start, 0, 0  # rate since the last log line (the first step includes compiling)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        batch = sampler.batch(batch_size)
        loss = loss_fn(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += batch[:, 1:].numel()
        if step == 0:
            first_step_s = time.time() - start
            mark, mark_tokens, mark_step = time.time(), tokens, step
        elif (step + 1) % args.log_every == 0 or step + 1 == steps:
            now = time.time()
            step_s = (now - mark) / (step - mark_step)
            recent = losses[-args.log_every:]
            print(f"[{name}] step {step + 1}/{steps} loss {sum(recent) / len(recent):.3f} lr {lr_at(step):.2e} "
                  f"{(tokens - mark_tokens) / (now - mark):.0f} tok/s elapsed {(now - start) / 60:.1f} min "
                  f"eta {(steps - step - 1) * step_s / 60:.1f} min", flush=True)
            mark, mark_tokens, mark_step = now, tokens, step
    model.eval()
    tail = losses[-max(1, steps // 10):]
    return {"steps": steps, "batch": batch_size, "tokens": tokens, "seconds": round(time.time() - start, 1),
            "first_step_seconds": round(first_step_s, 1), "final_train_loss": round(sum(tail) / len(tail), 4)}




def init_draft_from_target(draft, target) -> None:
    """Copy embedding, final norm and the first draft_layers layers: the draft starts out
    predicting what a truncated target would, which distillation then sharpens."""
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    for d_layer, t_layer in zip(draft.model.layers, target.model.layers):
        d_layer.load_state_dict(t_layer.state_dict())


def save(model, hf_tok, folder: Path, eos_ids: list[int], eot: int) -> None:
    import torch
    from transformers import GenerationConfig

    if folder.exists():
        shutil.rmtree(folder)
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eos_ids, pad_token_id=eot)
    model.to(torch.bfloat16).save_pretrained(folder)
    model.to(torch.float32)
    hf_tok.save_pretrained(folder)
    # keep the template inside tokenizer_config.json (one file for every loader to read)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = synth_chat.CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # the portable name (v5 maps it to TokenizersBackend)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    for f in folder.iterdir():
        f.chmod(0o644)  # safetensors are written 0600; containers may read as another user


def main(argv=None) -> Path:
    args = parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' pool, before first use
    import torch
    from transformers import LlamaForCausalLM

    import tiny_models_report as report_mod

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="tiny-models-")) if args.smoke else REPO / "models")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    # data
    code_train, code_held = stdlib_sources(args.code_mb, args.held_every)
    chats = synth_chat.dialogues(args.seed, args.dialogues)
    n_chat_held = max(10, args.dialogues // 20)
    chat_held, chat_train = chats[:n_chat_held], chats[n_chat_held:]
    print(f"data: {len(code_train)} code files {sum(map(len, code_train)) / 1e6:.1f} MB, "
          f"{len(chat_train)} dialogues {sum(map(len, chat_train)) / 1e6:.1f} MB ({time.time() - t0:.0f}s)", flush=True)

    # tokenizer
    if args.target_from:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.target_from) / "tokenizer.json"))
    else:
        tok = train_tokenizer(code_train + chat_train, args.vocab)
    eot = tok.token_to_id(synth_chat.ENDOFTEXT)
    eos_ids = [tok.token_to_id("<|im_end|>"), eot]
    hf_tok = hf_tokenizer(tok, args.max_pos)
    streams = {name: token_stream(tok, texts, eot) for name, texts in
               [("code", code_train), ("chat", chat_train), ("code_held", code_held), ("chat_held", chat_held)]}
    print("tokens: " + ", ".join(f"{k} {len(v):,}" for k, v in streams.items()) + f" ({time.time() - t0:.0f}s)", flush=True)
    n_eval = 48 if not args.smoke else 4
    held = {"code": fixed_windows(streams["code_held"], args.seq, n_eval),
            "chat": fixed_windows(streams["chat_held"], args.seq, n_eval)}

    ce_loss, distill_loss = make_loss_fns(args)

    # target
    if args.target_from:
        target = LlamaForCausalLM.from_pretrained(args.target_from, dtype=torch.float32)
        source_eval = Path(args.target_from).parent / "eval.json"
        t_stats = (json.loads(source_eval.read_text())["training"]["target"] if source_eval.is_file()
                   else {"steps": 0, "tokens": 0, "seconds": 0.0, "first_step_seconds": 0.0, "final_train_loss": None})
        t_stats = {**t_stats, "loaded_from": str(args.target_from)}
    else:
        target = LlamaForCausalLM(llama_config(args, args.layers, tok))
        sampler = WindowSampler(streams["code"], streams["chat"], args.seq, args.chat_frac, args.seed)
        t_stats = train("target", target, lambda b: ce_loss(target, b), sampler, args, args.steps, args.lr,
                        args.batch)
    target.requires_grad_(False)

    # draft
    draft = LlamaForCausalLM(llama_config(args, args.draft_layers, tok))
    init_draft_from_target(draft, target)
    draft.eval()
    d_init_agree = report_mod.greedy_agreement(draft, target, held["code"][:16])
    print(f"draft greedy agreement at init: {d_init_agree:.1%}", flush=True)
    sampler = WindowSampler(streams["code"], streams["chat"], args.seq, args.chat_frac, args.seed + 1)
    d_stats = train("draft", draft, lambda b: distill_loss(draft, target, b), sampler, args,
                    args.draft_steps, args.draft_lr, args.draft_batch)
    d_stats["agreement_at_init"] = d_init_agree

    save(target, hf_tok, out / "tiny-target", eos_ids, eot)
    save(draft, hf_tok, out / "tiny-draft", eos_ids, eot)
    train_seconds = time.time() - t0

    # eval + report
    ev = report_mod.evaluate(out, held, n_sample_tokens=48 if not args.smoke else 8)
    report = {
        "params": {"target": sum(p.numel() for p in target.parameters()),
                   "draft": sum(p.numel() for p in draft.parameters())},
        "tokenizer": {"vocab_size": tok.get_vocab_size(),
                      "added_tokens": {t: tok.token_to_id(t) for t, _ in synth_chat.ADDED_TOKENS}},
        "data": {"python": sys.version.split()[0], "code_mb_cap": args.code_mb, "held_every": args.held_every,
                 "code_train_files": len(code_train), "code_train_chars": sum(map(len, code_train)),
                 "code_train_tokens": len(streams["code"]), "code_held_files": len(code_held),
                 "code_held_tokens": len(streams["code_held"]), "seed": args.seed,
                 "dialogues_train": len(chat_train), "dialogues_held": len(chat_held),
                 "chat_train_tokens": len(streams["chat"]), "chat_held_tokens": len(streams["chat_held"])},
        "training": {"seq": args.seq, "chat_frac": args.chat_frac, "bf16": args.bf16,
                     "compile": args.compile, "warmup": args.warmup, "threads": args.threads,
                     "distill_alpha": args.distill_alpha,
                     "target": {**t_stats, "lr": args.lr}, "draft": {**d_stats, "lr": args.draft_lr},
                     "train_and_save_seconds": round(train_seconds, 1)},
        "eval": ev,
    }
    report["total_seconds"] = round(time.time() - t0, 1)
    report["sizes"] = report_mod.folder_sizes(out)
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    report_mod.write_readme(out, report)
    print(json.dumps({"held_out_loss": ev["held_out_loss"], "greedy_agreement": ev["greedy_agreement"],
                      "total_minutes": round(report["total_seconds"] / 60, 1),
                      "total_mb": round(report["sizes"]["total_bytes"] / 1e6, 1)}, indent=1), flush=True)
    print(f"wrote {out}", flush=True)
    return out


if __name__ == "__main__":
    main()
