"""The adapter check's engine side at vLLM TP > 1 (`megarl.rollout.engine.vllm_lora.layer_sums`),
on vLLM's own LoRA layers: each TP rank's layer is built by vLLM at its rank (the rank and world
size vLLM's linear layers read, set per rank), loaded with vLLM's `set_lora` (its slicing), and
the ranks' shares add up to the whole adapter's sums, plain and weighted by row / column
index (which see a slice in the wrong place). At TP 4 over 2 KV heads each K/V row of B
is on two ranks: the case an H100 engine at TP 8 over a 70B model's 8 KV heads does not reach,
and a GQA model with fewer KV heads than GPUs does."""

from __future__ import annotations

import pytest
import torch

HIDDEN, HEAD, HEADS, R = 64, 8, 8, 4


def _config():
    from vllm.config.lora import LoRAConfig

    return LoRAConfig(max_lora_rank=8, max_loras=1, lora_dtype=torch.float32)


def _layers(monkeypatch, tp: int, rank: int, kv_heads: int) -> dict:
    """vLLM's q/k/v, gate/up and o LoRA layers of TP rank `rank` of `tp`."""
    from vllm.distributed import parallel_state
    from vllm.lora.layers import (
        MergedColumnParallelLinearWithLoRA,
        MergedQKVParallelLinearWithLoRA,
        RowParallelLinearWithLoRA,
    )
    from vllm.model_executor import parameter
    from vllm.model_executor.layers import linear

    for module in (parallel_state, linear, parameter):  # where vLLM's layers look them up
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp)
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
    qkv = linear.QKVParallelLinear(HIDDEN, HEAD, HEADS, kv_heads, bias=False, prefix="qkv")
    gate_up = linear.MergedColumnParallelLinear(HIDDEN, [2 * HIDDEN] * 2, bias=False)
    o = linear.RowParallelLinear(HEADS * HEAD, HIDDEN, bias=False, prefix="o")
    layers = {
        "qkv": MergedQKVParallelLinearWithLoRA(qkv),
        "gate_up": MergedColumnParallelLinearWithLoRA(gate_up),
        "o": RowParallelLinearWithLoRA(o),
    }
    for layer in layers.values():
        layer.create_lora_weights(1, _config())
    return layers


def _adapters(kv_heads: int, seed: int) -> dict:
    """{layer: ([A of each slice], [B of each slice])}, whole (HF shapes, B rows = outputs)."""
    g = torch.Generator().manual_seed(seed)

    def pair(n_in: int, n_out: int):
        return torch.randn(R, n_in, generator=g), torch.randn(n_out, R, generator=g)

    slices = {
        "qkv": [pair(HIDDEN, HEADS * HEAD)] + [pair(HIDDEN, kv_heads * HEAD) for _ in "kv"],
        "gate_up": [pair(HIDDEN, 2 * HIDDEN) for _ in "gu"],
        "o": [pair(HEADS * HEAD, HIDDEN)],
    }
    return {k: ([a for a, _ in v], [b for _, b in v]) for k, v in slices.items()}


@pytest.mark.parametrize("tp, kv_heads", [(1, 2), (2, 2), (4, 2), (8, 2), (4, 1)])
def test_tp_ranks_shares_add_up_to_the_whole_adapter(monkeypatch, tp, kv_heads):
    from megarl.rollout.engine.vllm_lora import adapter_sums, layer_sums

    whole = _adapters(kv_heads, seed=tp)
    want = {
        name: [adapter_sums(a, b) for a, b in zip(a_s, b_s, strict=True)]
        for name, (a_s, b_s) in whole.items()
    }
    have = {name: [(0.0,) * 4] * len(v) for name, v in want.items()}
    for rank in range(tp):
        for name, layer in _layers(monkeypatch, tp, rank, kv_heads).items():
            a_s, b_s = whole[name]
            if name == "o":
                layer.set_lora(0, a_s[0].clone(), b_s[0].clone())
            else:
                layer.set_lora(0, [a.clone() for a in a_s], [b.clone() for b in b_s])
            shares = layer_sums(layer, 0)
            have[name] = [
                tuple(x + y for x, y in zip(h, share, strict=True))
                for h, share in zip(have[name], shares, strict=True)
            ]
    for name in want:
        for i, (w, h) in enumerate(zip(want[name], have[name], strict=True)):
            assert h == pytest.approx(w, rel=1e-9), (name, i, tp, kv_heads)
