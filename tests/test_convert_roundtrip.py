"""HF -> megatron -> HF is bit-exact, and the converted checkpoint gives transformers' logits at
TP=1, TP=2, PP=2 (EP=2 for MoE), including after a re-save from a multi-rank layout."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from megarl.convert.hf_io import LazyHFTensors
from megarl.convert.mapping import hf_to_canonical
from megarl.convert.verify import compare_logits, hf_logits, sample_tokens
from megarl.distributed.launch import spawn
from megarl.models.hf_config import arch_from_hf
from tests.test_convert_common import CASES, convert_worker, layouts_worker, make_hf_dir

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    hf_dirs = {name: make_hf_dir(cfg, str(root / name / "src")) for name, cfg in CASES.items()}
    # one bf16 model: bf16 stays bf16 end to end, bit-exact
    bf16 = str(root / "qwen2_bf16" / "src")
    make_hf_dir(CASES["qwen2_tied_bias"], bf16, dtype=torch.bfloat16)
    hf_dirs["qwen2_bf16"] = bf16
    tokens = sample_tokens(250, batch=2, seq_len=16)
    logits = spawn(convert_worker, 1, hf_dirs, str(root), tokens)[0]
    ref = {name: hf_logits(d, tokens) for name, d in hf_dirs.items()}
    return root, hf_dirs, tokens, logits, ref


def _tensors(d: str) -> dict[str, torch.Tensor]:
    lazy = LazyHFTensors(d)
    return {n: lazy.get(n) for n in lazy.names}


def test_roundtrip_bit_exact(converted):
    root, hf_dirs, *_ = converted
    for name, src in hf_dirs.items():
        back = str(root / name / "hf")
        a, b = _tensors(src), _tensors(back)
        assert sorted(a) == sorted(b), name
        for k in a:
            assert a[k].dtype == b[k].dtype, (name, k)
            assert torch.equal(a[k], b[k]), (name, k)
        # small shards: an index that transformers reads, and the files it names
        index = json.load(open(os.path.join(back, "model.safetensors.index.json")))
        with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
            assert set(index["weight_map"]) == set(f.keys())
        cfg_a = json.load(open(os.path.join(src, "config.json")))
        cfg_b = json.load(open(os.path.join(back, "config.json")))
        assert cfg_a == cfg_b, name
        for f in ("tokenizer_config.json", "generation_config.json"):
            assert os.path.exists(os.path.join(back, f)), (name, f)
            assert os.path.exists(os.path.join(root / name / "mcore", f)), (name, f)
    # dense checkpoints carry megatron's TE names for the fused norms; MoE ones the TE spec's
    # standalone pre-MLP norm (local and TE specs then load the same files)
    keys = converted[3]
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys["llama3_gqa/keys"]
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys["llama3_gqa/keys"]
    assert "decoder.layers.pre_mlp_layernorm.weight" in keys["mixtral/keys"]
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" not in keys["qwen3_moe/keys"]
    # multi-latent attention: the latent norms under the TE spec's fused names, which the local
    # layers read back (the logits tests below); the dense first layer's pre-MLP norm a row of
    # the stacked standalone norm, which a TE model's fused fc1 norm reads by name match
    # (dense first layers make megatron name each layer: decoder.layers.{i}.*)
    mla = keys["deepseek_v3/keys"]
    assert "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight" in mla
    assert "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight" in mla
    assert not any("q_layernorm" in k for k in mla)
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in mla  # MoE layers: standalone
    glm = keys["glm4_moe/keys"]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in glm  # dense: fused in TE
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in glm
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" not in glm
    # transformers loads the sharded output (no missing / unexpected keys)
    got = hf_logits(str(root / "mixtral" / "hf"), converted[2])
    assert torch.equal(got, converted[4]["mixtral"])
    # gpt-oss: the experts written stacked, as transformers stores them, and loaded by it
    index = json.load(open(root / "gpt_oss" / "hf" / "model.safetensors.index.json"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in index["weight_map"]
    assert not any(".experts.0." in k for k in index["weight_map"])
    got = hf_logits(str(root / "gpt_oss" / "hf"), converted[2])
    assert torch.equal(got, converted[4]["gpt_oss"])


def test_logits_tp1(converted):
    *_, logits, ref = converted
    for name in ref:
        assert name + "/keys" in logits
        d = compare_logits(ref[name], logits[name])
        print(name, "TP=1", d)
        assert d["max_abs_delta"] <= TOL, (name, d)
        assert d["argmax_agreement"] == 1.0, (name, d)


def test_logits_tp2_pp2_ep2_and_resave(converted):
    root, hf_dirs, tokens, _, ref = converted
    names = [n for n in CASES]
    ckpts = {n: str(root / n / "mcore") for n in names}
    res = spawn(layouts_worker, 2, ckpts, str(root), tokens)[0]
    seen = set()
    for (name, tag), val in res.items():
        if tag == "critic_tp2":  # everything but the value head comes from the checkpoint
            assert val["output_layer.weight"].shape == (1, 64)
            val = {k: v for k, v in val.items() if k != "output_layer.weight"}
            val["output_layer.weight"] = res[(name, "actor_tp2")]["output_layer.weight"]
        if tag.startswith(("resaved_", "actor_", "critic_")):
            lazy = LazyHFTensors(hf_dirs[name])
            want = dict(hf_to_canonical(arch_from_hf(hf_dirs[name]), lazy.get, lazy.names))
            assert sorted(val) == sorted(want), name
            for k in want:
                assert torch.equal(val[k], want[k]), (name, tag, k)
            continue
        d = compare_logits(ref[name], val)
        print(name, tag, d)
        assert d["max_abs_delta"] <= TOL, (name, tag, d)
        seen.add(tag)
    assert seen == {"tp2", "pp2", "ep2"}
