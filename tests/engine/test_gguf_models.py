"""`--model file.gguf`: any GGUF of an architecture the engine serves, converted once from
the file alone (weights, tokenizer, chat template, special tokens and sampling defaults
from its metadata), serves what the Hugging Face folder it was written from serves. The
GGUFs are written in the test from tiny checkpoints (gguf_writer.py, the `gguf` package's
writer as llama.cpp's converter uses it)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from shared.contracts.sampling import SamplingParams
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.model_path import resolve

from .gguf_writer import write_gguf
from .test_archs import checkpoint


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDMESH_GGUF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def engine(model) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_blocks=128, block_size=8,
                                  dtype="float32"))


def answers(eng: LLMEngine, prompts: list[str], n: int = 24) -> list[str]:
    sp = SamplingParams(temperature=0.0, max_tokens=n)
    ids = [eng.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    return [o["text"] for o in eng.generate(ids, sp)]


def test_the_tiny_llama_as_a_gguf_serves_the_same_answers(tiny_target, tmp_path, gguf_cache):
    """A real tokenizer and chat template travel in the metadata; the folder and the GGUF
    give the same chat prompt ids and the same greedy answers, and the sampling defaults
    in the file reach generation_config.json."""
    g = write_gguf(tiny_target, tmp_path / "tiny.gguf",
                   sampling={"temp": 0.7, "top_p": 0.8, "top_k": 20})
    folder = resolve(str(g))
    assert folder.parent.parent == gguf_cache and folder.name == "tiny"   # served as "tiny"
    prompts = ["What is the capital of France?", "Name three colours.", "Count to five."]
    want, got = engine(tiny_target), engine(g)
    assert [want.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts] == \
        [got.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    assert answers(got, prompts) == answers(want, prompts)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert (gen["temperature"], gen["top_p"], gen["top_k"], gen["do_sample"]) == (0.7, 0.8, 20,
                                                                                 True)
    marker = (folder / "pdmesh_gguf_source.json").stat().st_mtime_ns
    assert resolve(str(g)) == folder                                  # converted once
    assert (folder / "pdmesh_gguf_source.json").stat().st_mtime_ns == marker


def test_a_qwen3_gguf_gives_the_folders_logits(tiny_target, tmp_path, gguf_cache):
    """Another architecture (q/k norms, no q/k permutation) through the same path: the
    converted weights are the folder's, bit for bit (F32 in the file), so the logits are."""
    src = checkpoint(tmp_path / "qwen3", "Qwen3Config", vocab_size=8192, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_target / f, src / f)
    g = write_gguf(src, tmp_path / "qwen3.gguf")
    want, got = engine(src), engine(g)
    ids = want.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert got.generate([ids], sp)[0]["token_ids"] == want.generate([ids], sp)[0]["token_ids"]
    a = want.model.forward(torch.tensor(ids), *_one(want, len(ids)))
    b = got.model.forward(torch.tensor(ids), *_one(got, len(ids)))
    assert torch.equal(a, b)


def _one(eng, n):
    from shared.engine.model import one_prompt
    return one_prompt(eng.model_cfg, n, torch.float32)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_quantized_gguf_is_dequantized_and_serves_close(tiny_target, tmp_path, gguf_cache,
                                                         qtype):
    """llama.cpp's block types (Q8_0, Q4_0) come back as float weights within their own
    rounding (bfloat16 in the folder); the engine then quantizes as its settings say."""
    import gguf
    from safetensors.torch import load_file

    g = write_gguf(tiny_target, tmp_path / f"tiny-{qtype}.gguf",
                   quant=getattr(gguf.GGMLQuantizationType, qtype))
    folder = resolve(str(g))
    want = load_file(tiny_target / "model.safetensors")
    got = load_file(folder / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    for name, t in want.items():
        err = (got[name].float() - t.float()).abs().max() / t.float().abs().max()
        assert err < (0.01 if qtype == "Q8_0" else 0.15), (name, float(err))
    ids = engine(tiny_target).tokenizer.encode("Once upon a time")
    a = engine(tiny_target).model.forward(torch.tensor(ids), *_one(engine(tiny_target), len(ids)))
    b = engine(g).model.forward(torch.tensor(ids), *_one(engine(g), len(ids)))
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > (
        0.999 if qtype == "Q8_0" else 0.97)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_a_q4_gguf_keeps_its_own_int4_grid(tiny_target, tmp_path, gguf_cache, qtype):
    """int4 re-finds the codes a Q4_0 / Q4_1 file stores (its own groups of 32): every
    served weight is the file's within the bfloat16 rounding of the scales, far inside one
    grid step (re-quantizing a Q4_0 group from its min to its max moves weights by up
    to half a step)."""
    import gguf
    from safetensors.torch import load_file

    from shared.engine.quant import INT4_GROUP, Int4Weight

    g = write_gguf(tiny_target, tmp_path / f"tiny-{qtype}.gguf",
                   quant=getattr(gguf.GGMLQuantizationType, qtype))
    checked = 0
    for name, t in load_file(resolve(str(g)) / "model.safetensors").items():
        if t.dim() != 2 or "layers" not in name:
            continue
        w = t.float()
        got = Int4Weight(w).dequantize().float()
        groups = w.reshape(w.shape[0], -1, INT4_GROUP)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(INT4_GROUP, 1)
        assert ((got - w).abs() <= step / 8).all(), (name, float(((got - w).abs() / step).max()))
        checked += 1
    assert checked >= 7


@pytest.mark.parametrize("qtype, mode", [(None, ""), ("Q8_0", "int8"), ("Q4_0", "int4")])
def test_auto_quantization_serves_a_gguf_at_its_own_precision(tiny_target, tmp_path,
                                                              gguf_cache, qtype, mode):
    """`pdmesh up`'s default (--quantization auto): a Q4 file serves int4, a Q8_0 file int8
    (not re-quantized to 4 bits), an F32 file unquantized (what needs quantization, W8A8
    and the split head, falls away); a plain folder serves the project's int4."""
    import gguf

    g = write_gguf(tiny_target, tmp_path / f"tiny-{qtype}.gguf",
                   quant=qtype and getattr(gguf.GGMLQuantizationType, qtype))
    cfg = dict(num_blocks=64, block_size=8, quantize="auto", act_int8=True, head_split=True)
    eng = LLMEngine(EngineConfig(model=str(g), **cfg))
    assert (eng.cfg.quantize, eng.cfg.act_int8, eng.cfg.head_split) == (mode, bool(mode),
                                                                         bool(mode))
    assert type(eng.model.layers[0].down_w).__name__ == {"": "Tensor", "int8": "Int8Weight",
                                                        "int4": "Int4Weight"}[mode]
    assert LLMEngine(EngineConfig(model=str(tiny_target), **cfg)).cfg.quantize == "int4"


def _glm4(tmp_path, tiny_target):
    """A tiny GLM-4 (partial interleaved rope, q/k/v biases, post-norms, fused gate|up)
    with the tiny tokenizer; eos is that tokenizer's (GLM's own ids are past 8192)."""
    eos = engine(tiny_target).tokenizer.hf.eos_token_id
    src = checkpoint(tmp_path / "glm4", "Glm4Config", vocab_size=8192, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, attention_bias=True, pad_token_id=0,
                     eos_token_id=eos)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_target / f, src / f)
    return src


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_a_glm4_gguf_serves_the_folders_answers(tiny_target, tmp_path, gguf_cache, qtype):
    """GLM-4, which transformers' GGUF reader refuses, through gguf_native: an F32 file
    gives the folder's logits bit for bit and its greedy tokens; a Q8_0 file (served int8
    under auto) stays within Q8_0's rounding of them."""
    import gguf

    src = _glm4(tmp_path, tiny_target)
    g = write_gguf(src, tmp_path / "glm4.gguf",
                   quant=qtype and getattr(gguf.GGMLQuantizationType, qtype))
    want, got = engine(src), engine(g)
    assert json.loads((resolve(str(g)) / "config.json").read_text())["architectures"] == [
        "Glm4ForCausalLM"]
    ids = want.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    a = want.model.forward(torch.tensor(ids), *_one(want, len(ids)))
    b = got.model.forward(torch.tensor(ids), *_one(got, len(ids)))
    if qtype is None:
        assert torch.equal(a, b)
        sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        assert got.generate([ids], sp)[0]["token_ids"] == want.generate([ids], sp)[0]["token_ids"]
    else:
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.999
        auto = LLMEngine(EngineConfig(model=str(g), num_blocks=64, block_size=8,
                                      quantize="auto"))
        assert auto.cfg.quantize == "int8"


def test_a_glm4_gguf_with_what_the_converter_does_not_know_is_refused(tiny_target, tmp_path,
                                                                      gguf_cache):
    """A tensor no GLM-4 parameter takes, or rope scaling: refused by name, not dropped."""
    import gguf

    from shared.engine.loader import CheckpointError

    src = _glm4(tmp_path, tiny_target)
    g = write_gguf(src, tmp_path / "extra.gguf",
                   extra=lambda w: w.add_tensor("blk.0.attn_gate.weight",
                                                np.zeros((64, 64), np.float32)))
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_gate\.weight"):
        resolve(str(g))
    g = write_gguf(src, tmp_path / "yarn.gguf",
                   extra=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN))
    with pytest.raises(CheckpointError, match="rope.scaling.type 'yarn'"):
        resolve(str(g))


def test_a_conversion_from_before_learns_its_precision_without_converting_again(
        tiny_target, tmp_path, gguf_cache):
    """A marker written before it recorded the file's precision gets it from the GGUF's
    header on the next start; the weights are not converted again."""
    import gguf

    g = write_gguf(tiny_target, tmp_path / "old.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
    folder = resolve(str(g))
    marker = folder / "pdmesh_gguf_source.json"
    old = json.loads(marker.read_text())
    marker.write_text(json.dumps({k: v for k, v in old.items() if k != "quantization"}))
    weights = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve(str(g)) == folder
    assert json.loads(marker.read_text())["quantization"] == "int8"
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights


def test_a_glm4_gguf_splits_and_stops_as_llama_cpp_reads_it(tiny_target, tmp_path,
                                                           gguf_cache):
    """GLM-4's pre-tokenizer ("chatglm-bpe"), which transformers' GGUF reader does not
    know, splits digits in groups of three as llama.cpp does (not GPT-2's way), and the
    file's end-of-turn token (eot) stops generation besides eos."""
    src = _glm4(tmp_path, tiny_target)
    eot = 5
    g = write_gguf(src, tmp_path / "glm4.gguf", pre="chatglm-bpe",
                   extra=lambda w: w.add_eot_token_id(eot))
    folder = resolve(str(g))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 1234567")]
    assert pieces[-3:] == ["123", "456", "7"], pieces
    gen = json.loads((folder / "generation_config.json").read_text())
    assert eot in gen["eos_token_id"]
    assert eot in engine(g).tokenizer.eos_token_ids


def test_processes_converting_the_same_gguf_together_convert_it_once(tiny_target, tmp_path,
                                                                     capsys):
    """Services (or make test's workers) that start together on a GGUF not yet converted:
    one converts, the others wait on the lock beside the folder and find it done."""
    import threading

    from shared.engine.gguf_convert import convert

    g = write_gguf(tiny_target, tmp_path / "tiny.gguf")
    out = tmp_path / "models" / "tiny"
    start = threading.Barrier(3)

    def run():
        start.wait()
        convert(out, g)
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    printed = capsys.readouterr().out
    assert printed.count("[gguf_convert] converting") == 1, printed
    assert printed.count(" already holds ") == 2, printed
    assert (resolve(str(out)) / "model.safetensors").is_file()


def test_a_conversion_parses_the_gguf_once(tiny_target, tmp_path, monkeypatch):
    """transformers reads the file anew for the config, the tokenizer and the weights; the
    conversion hands each the one parse (SmolLM2's took ~4.5 s each: 26 s -> 10 s)."""
    import gguf

    from shared.engine.gguf_convert import convert

    g = write_gguf(tiny_target, tmp_path / "tiny.gguf")
    parsed: list[str] = []

    class Counted(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            parsed.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    out = convert(tmp_path / "models" / "tiny", g)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert parsed == [str(g)]
