"""Block-scaled FP8 checkpoints (DeepSeek-V3 / Kimi-K2 as published) are read as the bf16 model
transformers dequantizes them to, bit for bit, and convert to a megatron checkpoint of it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megarl.convert import fp8_blocks
from megarl.convert.hf_io import HFCheckpointError, LazyHFTensors
from megarl.convert.mapping import canonical_names_for, hf_to_canonical
from megarl.models.hf_config import arch_from_hf
from tests.test_convert_common import DEEPSEEK_V3, make_hf_dir

BLOCK = (16, 16)


def _fp8_dir(tmp_path) -> str:
    """A tiny DeepSeek-V3 saved as the published checkpoints are: 2-d projections in FP8 with
    16 x 16 block scales (rows and columns not multiples of 16: partial blocks), the rest bf16."""
    from safetensors.torch import load_file, save_file

    src = make_hf_dir(dict(DEEPSEEK_V3, num_hidden_layers=2), str(tmp_path / "src"))
    out, quantized = {}, 0
    for k, v in load_file(os.path.join(src, "model.safetensors")).items():
        if v.dim() == 2 and not k.startswith(("model.embed", "lm_head")) and ".gate." not in k:
            out[k], out[k + "_scale_inv"] = fp8_blocks.quantize(v, BLOCK)
            quantized += 1
        else:
            out[k] = v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
    dst = tmp_path / "fp8"
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    assert quantized > 20
    return str(dst)


def test_fp8_blocks_read_as_transformers_dequantizes_them(tmp_path):
    from transformers import AutoModelForCausalLM

    fp8 = _fp8_dir(tmp_path)
    lazy = LazyHFTensors(fp8)
    assert lazy.fp8_blocks > 20 and not any(n.endswith("_scale_inv") for n in lazy.names)
    # transformers' own dequantisation (on CPU: to bf16); its experts are fused in memory
    state = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.bfloat16).state_dict()
    for name in lazy.names:
        experts, _, rest = name.partition(".mlp.experts.")
        if rest:
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = state[
                f"{experts}.mlp.experts.{'down' if proj == 'down_proj' else 'gate_up'}_proj"
            ]
            half = fused.shape[1] // 2
            want = {"gate_proj": fused[e, :half], "up_proj": fused[e, half:]}.get(proj, fused[e])
        else:
            want = state[name]
        assert torch.equal(lazy.get(name).to(want.dtype), want), name
    arch = arch_from_hf(fp8)
    assert "quantization_config" not in arch.hf_config  # megarl writes the bf16 model
    assert len(dict(hf_to_canonical(arch, lazy.get, lazy.names))) == len(canonical_names_for(arch))
    # rows read alone are the rows of the whole (a partial block at both ends)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert torch.equal(lazy.get_rows(name, 5, 29), lazy.get(name)[5:29])


def test_scales_without_a_block_fp8_config_are_refused(tmp_path):
    fp8 = _fp8_dir(tmp_path)
    cfg = json.load(open(os.path.join(fp8, "config.json")))
    del cfg["quantization_config"]
    json.dump(cfg, open(os.path.join(fp8, "config.json"), "w"))
    with pytest.raises(HFCheckpointError, match="no quantization_config with quant_method 'fp8'"):
        LazyHFTensors(fp8)


def test_dequantize_is_the_block_scale_times_the_value():
    w = torch.randn(40, 24)
    q, s = fp8_blocks.quantize(w, BLOCK)
    assert s.shape == (3, 2)
    back = fp8_blocks.dequantize(q, s, BLOCK)
    expect = q.float() * s[torch.arange(40) // 16][:, torch.arange(24) // 16]
    assert torch.equal(back, expect.to(torch.bfloat16))
    assert (back.float() - w).abs().max() <= 0.07 * w.abs().max()  # e4m3: 3 mantissa bits


@pytest.mark.slow
def test_a_block_fp8_checkpoint_converts_to_the_model_it_stands_for(tmp_path):
    """`megarl convert hf-to-mcore` of the FP8 files: megatron's logits == transformers' over
    the dequantized weights in fp32 (what `--verify` compares; transformers itself computes an
    FP8 checkpoint in bf16 on CPU)."""
    from megarl.convert.verify import compare_logits, hf_logits, sample_tokens
    from megarl.distributed.launch import spawn
    from tests.test_convert_common import convert_worker

    fp8 = _fp8_dir(tmp_path)
    tokens = sample_tokens(250, batch=2, seq_len=16)
    logits = spawn(convert_worker, 1, {"fp8": fp8}, str(tmp_path / "out"), tokens)[0]
    d = compare_logits(hf_logits(fp8, tokens), logits["fp8"])
    print("fp8 checkpoint", d)
    assert d["max_abs_delta"] <= 1e-5 and d["argmax_agreement"] == 1.0, d
