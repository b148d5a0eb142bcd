"""GGUF in: a tiny Llama written by llama.cpp's own writer (`gguf`, F32 tensors, Q/K rows in
llama.cpp's order, a byte-level tokenizer with a chat template) dequantizes into exactly the
model it was made from, with everything an HF directory needs; `model.hf: FILE.gguf` is
converted once into the cache; files that are not GGUF or hold an architecture megarl cannot build
are one clear error. (The real 4-bit model: tests/test_real_model.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.convert.gguf import MARKER, GGUFError, gguf_hf_config, gguf_to_hf
from megarl.convert.hf_io import LazyHFTensors
from tests.gguf_files import CHAT_TEMPLATE, write_metadata_only, write_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    path = str(root / "tiny.gguf")
    return path, write_tiny_llama(path)


def test_gguf_to_hf_is_the_dequantized_model_with_tokenizer_and_configs(tiny, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    path, weights = tiny
    out = str(tmp_path / "hf")
    summary = gguf_to_hf(path, out, verify=True, seq_len=48)
    assert summary["family"] == "llama" and summary["tied_embeddings"]
    # transformers' own GGUF load gives the same logits as the written directory
    assert summary["verify"]["max_abs_delta"] == 0.0, summary
    assert summary["verify"]["tokens"] == 48
    lazy = LazyHFTensors(out)
    # tied embeddings stay tied: no lm_head.weight on disk
    assert sorted(lazy.names) == sorted(k for k in weights if k != "lm_head.weight")
    for name in lazy.names:  # F32 in, F32 out: bit-exact, Q/K rows back in HF order
        assert lazy.dtype(name) == torch.float32
        assert torch.equal(lazy.get(name), weights[name]), name
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"]
    assert "quantization_config" not in cfg and "_model_name_or_path" not in cfg
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 0)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    marker = json.load(open(os.path.join(out, MARKER)))
    assert marker["bytes"] == os.path.getsize(path) and len(marker["sha256"]) == 64


def test_model_hf_gguf_is_converted_once_into_the_cache(tiny, tmp_path, monkeypatch, caplog):
    from megarl.trainer.model_source import resolve_model
    from megarl.trainer.recipe import check_paths, load_arch

    path, _ = tiny
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(None, ["model.config=null", "model.tokenizer=null", f"model.hf={path}"])
    check_paths(cfg)  # a GGUF file is accepted where a directory is
    meta_arch = load_arch(cfg)  # dry run / plan: the metadata only, nothing converted
    assert not (tmp_path / "cache").exists()
    resolved = resolve_model(cfg)
    entry = resolved.model.hf
    assert entry.startswith(str(tmp_path / "cache" / "gguf"))
    assert os.path.exists(os.path.join(entry, MARKER))
    assert load_arch(resolved) == meta_arch
    stamp = os.stat(os.path.join(entry, "model.safetensors")).st_mtime_ns
    caplog.set_level("INFO")
    assert resolve_model(cfg).model.hf == entry  # the second run reuses it
    assert os.stat(os.path.join(entry, "model.safetensors")).st_mtime_ns == stamp
    assert "cached HF directory" in caplog.text
    os.remove(os.path.join(entry, MARKER))  # an incomplete entry is converted again
    assert resolve_model(cfg).model.hf == entry
    assert os.path.exists(os.path.join(entry, MARKER))


def resolve_worker(rank, world, path: str, cache: str):
    """Two ranks resolve `model.hf: FILE.gguf`: rank 0 converts, rank 1 waits for it."""
    os.environ["MEGARL_CACHE"] = cache
    from megarl.trainer.model_source import resolve_model

    cfg = load_config(None, ["model.config=null", "model.tokenizer=null", f"model.hf={path}"])
    return resolve_model(cfg).model.hf


def test_model_hf_gguf_is_converted_by_rank_0_while_the_others_wait(tiny, tmp_path):
    from megarl.distributed.launch import spawn

    dirs = spawn(resolve_worker, 2, tiny[0], str(tmp_path / "cache"))
    assert dirs[0] == dirs[1] and os.path.exists(os.path.join(dirs[0], MARKER))
    assert len(os.listdir(tmp_path / "cache" / "gguf")) == 1  # one entry, no leftovers


def test_a_file_that_is_not_gguf_is_one_clear_error(tmp_path):
    from megarl.trainer.recipe import check_paths

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    out = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert.py"), "gguf-to-hf"]
        + ["--gguf", str(bad), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megarl: error: "), proc.stderr
    assert str(bad) in lines[0] and "not a GGUF file" in lines[0] and "accepted" in lines[0]
    assert not out.exists() and os.listdir(tmp_path) == ["model.gguf"]  # nothing half-written
    cfg = load_config(None, ["model.config=null", "model.tokenizer=null", f"model.hf={bad}"])
    with pytest.raises(ConfigError, match="is not a directory or a GGUF file"):
        check_paths(cfg)


@pytest.mark.parametrize(
    "architecture,why",
    [
        ("phi3", "a GGUF file of a 'phi3' model, which megarl cannot build"),
        ("rwkv6", "transformers cannot read this GGUF file"),
    ],
)
def test_an_architecture_megarl_cannot_build_is_refused(tmp_path, architecture, why):
    path = str(tmp_path / f"{architecture}.gguf")
    write_metadata_only(path, architecture)
    for call in (gguf_hf_config, lambda p: gguf_to_hf(p, str(tmp_path / "out"))):
        with pytest.raises(GGUFError) as e:
            call(path)
        assert path in str(e.value) and why in str(e.value) and "llama, mistral" in str(e.value)
    assert not (tmp_path / "out").exists()
