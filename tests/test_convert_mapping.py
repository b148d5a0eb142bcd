"""The HF <-> canonical mapping tables, the pure transforms, HF file I/O and bad-input errors
(single process, no megatron)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.convert import mapping as M
from megarl.convert.hf_io import LazyHFTensors
from megarl.convert.hf_write import save_hf_dir
from megarl.convert.layout import split_tp
from megarl.models.hf_config import arch_from_hf
from tests.test_convert_common import CASES, make_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: make_hf_dir(cfg, str(root / name)) for name, cfg in CASES.items()}


def test_tables_match_what_transformers_writes(hf_dirs):
    """Names and shapes of every family's table == the safetensors transformers 5 saves."""
    for name, d in hf_dirs.items():
        arch = arch_from_hf(d)
        lazy = LazyHFTensors(d)
        assert sorted(lazy.names) == sorted(M.hf_names_for(arch)), name
        assert {n: lazy.shape(n) for n in lazy} == M.hf_shapes_for(arch), name


def test_roundtrip_in_memory_is_exact(hf_dirs):
    for name, d in hf_dirs.items():
        arch = arch_from_hf(d)
        sd = load_file(os.path.join(d, "model.safetensors"))
        lazy = LazyHFTensors(d)  # (gpt-oss: its stacked experts per expert)
        can = list(M.hf_to_canonical(arch, lazy.get, lazy.names))
        assert [n for n, _ in can] == M.canonical_names_for(arch), name
        shapes = M.canonical_shapes_for(arch)
        assert all(tuple(t.shape) == shapes[n] for n, t in can), name
        back = dict(M.to_files(arch, M.canonical_to_hf(arch, iter(can))))
        assert sorted(back) == sorted(sd), name
        assert all(torch.equal(back[k], sd[k]) for k in sd), name


def test_transformers5_config_spellings(hf_dirs):
    """Saved configs hold `rope_parameters` (and Qwen3-MoE `num_local_experts`)."""
    a = arch_from_hf(hf_dirs["llama3_gqa"])
    assert a.rope_theta == 500000.0 and a.rope_scaling["rope_type"] == "llama3"
    assert a.rope_scaling["original_max_position_embeddings"] == 64
    assert arch_from_hf(hf_dirs["llama2_mha_linear"]).rope_scaling["factor"] == 2.0
    assert arch_from_hf(hf_dirs["qwen3_moe"]).num_experts == 4
    assert arch_from_hf(hf_dirs["qwen3_tied_qknorm"]).tie_word_embeddings


def _labelled(rows: int, start: int, cols: int = 3) -> torch.Tensor:
    return torch.arange(start, start + rows, dtype=torch.float32)[:, None].expand(rows, cols)


def test_qkv_layout_per_query_group():
    heads, kv, hd = 4, 2, 2
    q, k, v = _labelled(heads * hd, 0), _labelled(kv * hd, 100), _labelled(kv * hd, 200)
    qkv = M.qkv_to_megatron(q, k, v, heads, kv, hd)
    # group g: [q heads 2g, 2g+1 (2 x hd rows); k_g; v_g]
    want = [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert qkv[:, 0].tolist() == want
    assert all(
        torch.equal(a, b)
        for a, b in zip(M.qkv_from_megatron(qkv, heads, kv, hd), (q, k, v), strict=True)
    )
    # a TP=2 shard holds one whole group: the transforms apply to it with per-shard counts
    shard = split_tp("x.linear_qkv.weight", qkv, 0, 2, 1)
    sq, sk, sv = M.qkv_from_megatron(shard, heads // 2, kv // 2, hd)
    assert torch.equal(sq, q[4:]) and torch.equal(sk, k[2:]) and torch.equal(sv, v[2:])
    # biases (1-D), MHA and MQA
    for h, g in ((4, 4), (4, 1)):
        qb, kb, vb = torch.randn(h * hd), torch.randn(g * hd), torch.randn(g * hd)
        out = M.qkv_from_megatron(M.qkv_to_megatron(qb, kb, vb, h, g, hd), h, g, hd)
        assert all(torch.equal(a, b) for a, b in zip(out, (qb, kb, vb), strict=True))


def test_gate_up_and_its_tp_split():
    gate, up = _labelled(4, 0), _labelled(4, 100)
    fc1 = M.gate_up_to_megatron(gate, up)
    assert fc1[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    shard = split_tp("decoder.layers.0.mlp.linear_fc1.weight", fc1, 0, 2, 1)
    g1, u1 = M.gate_up_from_megatron(shard)
    assert torch.equal(g1, gate[2:]) and torch.equal(u1, up[2:])


def _sd(name: str):
    arch = arch_from_hf(CASES[name])
    return arch, {n: torch.zeros(s) for n, s in M.hf_shapes_for(arch).items()}


def test_mapping_errors_name_the_key():
    arch, sd = _sd("qwen2_tied_bias")
    # a tied model's duplicate lm_head and old rotary buffers are accepted and dropped
    extra = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    assert len(list(M.hf_to_canonical(arch, extra.__getitem__, extra))) == len(
        M.canonical_names_for(arch)
    )
    bad = {**sd, "model.layers.0.mlp.shared_expert.weight": torch.zeros(1)}
    with pytest.raises(M.MappingError, match="model.layers.0.mlp.shared_expert.weight"):
        list(M.hf_to_canonical(arch, bad.__getitem__, bad))
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(M.MappingError, match=r"missing: 'model.layers.1.self_attn.k_proj.bias'"):
        list(M.hf_to_canonical(arch, missing.__getitem__, missing))
    wrong = {**sd, "model.layers.1.mlp.up_proj.weight": torch.zeros(95, 64)}
    with pytest.raises(M.MappingError, match=r"up_proj.weight' has shape \(95, 64\)"):
        list(M.hf_to_canonical(arch, wrong.__getitem__, wrong))
    with pytest.raises(M.MappingError, match="decoder.layers.7.mlp.linear_fc2.weight"):
        list(M.canonical_to_hf(arch, [("decoder.layers.7.mlp.linear_fc2.weight", torch.zeros(1))]))
    # tied: no lm_head is written even if an output layer is passed
    arch, _ = _sd("qwen3_tied_qknorm")
    assert list(M.canonical_to_hf(arch, [("output_layer.weight", torch.zeros(250, 64))])) == []


def test_lazy_reader_and_atomic_sharded_writer(tmp_path):
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(200, 16),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"))
    lazy = LazyHFTensors(tmp_path)
    assert lazy.shape("c") == (200, 16) and lazy.dtype("a") == torch.bfloat16
    assert all(torch.equal(lazy.get(k), v) for k, v in tensors.items())
    with pytest.raises(KeyError, match="no tensor named 'd'"):
        lazy.get("d")

    out = tmp_path / "out"
    save_hf_dir(out, {"x": 1}, iter(tensors.items()), max_shard_bytes=1024)
    index = json.load(open(out / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) >= 2  # sharded
    back = LazyHFTensors(out)
    assert all(torch.equal(back.get(k), v) for k, v in tensors.items())
    with pytest.raises(FileExistsError, match=str(out)):
        save_hf_dir(out, {}, iter([]))

    def interrupted():
        yield "a", tensors["a"]
        raise KeyboardInterrupt

    target = tmp_path / "never"
    with pytest.raises(KeyboardInterrupt):
        save_hf_dir(target, {}, interrupted(), max_shard_bytes=1)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    save_hf_dir(out, {"y": 2}, iter([("z", torch.ones(2))]), overwrite=True)
    assert LazyHFTensors(out).names == ["z"]


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert.py"), *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_bad_input_is_a_clear_error(tmp_path, hf_dirs):
    # unknown architecture, a key no mapping consumes, an output that already holds a checkpoint
    bad_arch = tmp_path / "gpt2"
    bad_arch.mkdir()
    (bad_arch / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    extra = tmp_path / "extra"
    extra.mkdir()
    sd = load_file(os.path.join(hf_dirs["mixtral"], "model.safetensors"))
    sd["model.layers.0.block_sparse_moe.experts.9.w1.weight"] = torch.zeros(1)
    save_file(sd, str(extra / "model.safetensors"))
    (extra / "config.json").write_text(open(os.path.join(hf_dirs["mixtral"], "config.json")).read())
    out = tmp_path / "taken"
    out.mkdir()
    (out / "metadata.json").write_text("{}")
    cases = [
        (["--hf", str(bad_arch)], "GPT2LMHeadModel"),
        (["--hf", str(extra)], "experts.9.w1.weight"),
        (["--hf", hf_dirs["llama3_gqa"]], "already holds a checkpoint"),
    ]
    for args, msg in cases:
        target = str(out) if "already" in msg else str(tmp_path / "o")
        r = _cli("hf-to-mcore", *args, "--out", target)
        assert r.returncode == 2, r.stderr[-2000:]
        assert msg in r.stderr, r.stderr[-2000:]
        assert not os.path.exists(tmp_path / "o")
