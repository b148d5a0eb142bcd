"""gpt-oss checkpoints as published: the experts' weights in MXFP4, stacked per layer. megarl reads
each expert as the bf16 [in, out] weight transformers dequantizes it to, bit for bit, and the
mapping consumes every tensor of such a directory."""

from __future__ import annotations

import json
import os

import torch

from megarl.convert.hf_io import LazyHFTensors
from megarl.convert.mapping import hf_to_canonical
from megarl.convert.stacked import dequantize_mxfp4
from megarl.models.hf_config import arch_from_hf
from tests.test_convert_common import GPT_OSS, make_hf_dir


def _mxfp4_dir(tmp_path) -> tuple[str, dict]:
    """The tiny gpt-oss with its experts' weights replaced by random MXFP4 blocks and scales
    (exponents 2^-8 .. 2^0), stored as the released checkpoints name them."""
    from safetensors.torch import load_file, save_file

    src = make_hf_dir(dict(GPT_OSS, num_hidden_layers=2), str(tmp_path / "src"))
    g = torch.Generator().manual_seed(0)
    out, packed = {}, {}
    for k, v in load_file(os.path.join(src, "model.safetensors")).items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, n_in, n_out = v.shape
            blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=g)
            scales = torch.randint(119, 128, (e, n_out, n_in // 32), generator=g)
            out[k + "_blocks"], out[k + "_scales"] = blocks.to(torch.uint8), scales.to(torch.uint8)
            packed[k] = (out[k + "_blocks"], out[k + "_scales"])
        else:
            out[k] = v.to(torch.bfloat16)
    dst = tmp_path / "mxfp4"
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    json.dump(cfg, open(dst / "config.json", "w"))
    return str(dst), packed


def test_mxfp4_experts_read_as_transformers_dequantizes_them(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    d, packed = _mxfp4_dir(tmp_path)
    lazy = LazyHFTensors(d)
    assert not any(n.endswith(("_blocks", "_scales")) for n in lazy.names)
    for stacked, (blocks, scales) in packed.items():
        want = convert_moe_packed_tensors(blocks, scales)  # [experts, in, out] bf16
        assert want.abs().max() > 0
        for e in range(want.shape[0]):
            name = stacked.replace(".experts.", f".experts.{e}.")
            assert lazy.shape(name) == tuple(want.shape[1:]) and lazy.dtype(name) == torch.bfloat16
            assert torch.equal(lazy.get(name), want[e]), name
            assert torch.equal(lazy.get_rows(name, 3, 7), want[e][3:7]), name
    arch = arch_from_hf(d)
    assert "quantization_config" not in arch.hf_config  # what megarl writes is the bf16 model
    got = dict(hf_to_canonical(arch, lazy.get, lazy.names, shape_of=lazy.shape))
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight" in got


def test_dequantize_is_the_fp4_value_times_the_power_of_two():
    # byte 0x71: low nibble 1 (+0.5), high nibble 7 (+6.0); 0x9F: 15 (-6.0), 9 (-0.5)
    blocks = torch.tensor([[[0x71] * 8 + [0x9F] * 8]], dtype=torch.uint8)
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^(128 - 127)
    w = dequantize_mxfp4(blocks, scales)  # [32, 1]
    assert w.shape == (32, 1)
    assert w[:4, 0].tolist() == [1.0, 12.0, 1.0, 12.0]
    assert w[16:18, 0].tolist() == [-12.0, -1.0]


def test_an_mxfp4_checkpoint_converts_to_the_model_it_stands_for(tmp_path):
    """`convert --verify`'s reference for an MXFP4 checkpoint is transformers over the
    dequantized weights in fp32 (transformers computes the dequantized model in bf16: 0.6 off);
    the converted checkpoint gives its logits."""
    from megarl.convert.verify import compare_logits, hf_logits, sample_tokens
    from megarl.distributed.launch import spawn
    from tests.test_convert_common import convert_worker

    d, _ = _mxfp4_dir(tmp_path)
    tokens = sample_tokens(250, batch=2, seq_len=16)
    got = spawn(convert_worker, 1, {"mx": d}, str(tmp_path / "out"), tokens)[0]["mx"]
    err = compare_logits(hf_logits(d, tokens), got)
    assert err["max_abs_delta"] <= 1e-5 and err["argmax_agreement"] == 1.0, err
