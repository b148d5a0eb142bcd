"""vLLM's LoRA, driven in memory: the functions `RolloutEngine.call` runs on its worker.

vLLM loads adapters from directories (`LoRARequest.lora_path`); a trainer has them as tensors.
`load` builds vLLM's own `LoRAModel` from PEFT-named tensors (`LoRAModel.from_lora_tensors`,
the constructor vLLM's directory loader ends in) and swaps it into the worker's adapter manager
under one id: removed, added (vLLM packs q/k/v and gate/up, folds alpha / rank into B), then
activated (copied into every LoRA layer's stacked buffers, which the forward reads). Requests
name the id with a `LoRARequest` whose path is never read: the id is already loaded.

`sums` reads those stacked buffers back: what the forward will use, not what was sent.
"""

from __future__ import annotations

import torch

ADAPTER_ID = 1
"""The one adapter slot the policy's adapters occupy (vLLM ids start at 1)."""
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM accepts (`vllm.config.lora.MaxLoRARanks`)."""


def max_lora_rank(rank: int) -> int:
    """vLLM's slot rank for adapters of `rank`: the smallest it accepts that holds them (the
    rest of the slot is zero)."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank}: vLLM accepts at most {VLLM_RANKS[-1]}")


def request():
    """The `LoRARequest` generation passes while the policy's adapters are loaded."""
    from vllm.lora.request import LoRARequest

    return LoRARequest("megarl-policy", ADAPTER_ID, lora_path="<in memory: megarl sync>")


def _manager(worker):
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("the vLLM engine was started without LoRA (enable_lora=False)")
    return manager


@torch.no_grad()
def load(worker, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Make `tensors` ({PEFT key: whole tensor}) the adapter under `ADAPTER_ID`."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = _manager(worker)
    lora = LoRAModel.from_lora_tensors(
        ADAPTER_ID,
        tensors,
        PEFTHelper.from_dict(config),
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
    )
    adapters = manager._adapter_manager
    adapters.remove_adapter(ADAPTER_ID)  # deactivates and frees the slot
    adapters.add_adapter(lora)
    adapters.activate_adapter(ADAPTER_ID)


@torch.no_grad()
def sums(worker) -> dict[str, tuple[float, ...]] | None:
    """{HF module ("model.layers.0.self_attn.q_proj"): `adapter_sums`} of the adapter in the
    LoRA layers' stacked buffers, as this vLLM rank's share (`layer_sums`): summed over the
    instance's TP group they are the whole adapter's. B has alpha / rank folded in. None when no
    adapter is active."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    adapters = _manager(worker)._adapter_manager
    if ADAPTER_ID not in adapters.lora_index_to_id:
        return None
    slot = adapters.lora_index_to_id.index(ADAPTER_ID)
    out = {}
    for module_name, module in adapters.modules.items():
        if not isinstance(module, BaseLinearLayerWithLoRA):  # megarl adapts linears only
            continue
        prefix, _, last = module_name.rpartition(".")
        names = adapters.packed_modules_mapping.get(last, [last])
        for name, pair in zip(names, layer_sums(module, slot), strict=True):
            out[f"{prefix}.{name}" if prefix else name] = pair
    return out


def layer_sums(module, slot: int) -> list[tuple[float, ...]]:
    """`adapter_sums` (A², B², A² by column, B² by row) of each slice of a vLLM LoRA linear
    layer's adapter in `slot`, as this TP rank's share, rows and columns at their index in the
    whole tensor. vLLM (`vllm/lora/layers`) keeps a factor whole on every rank (A of a
    column-parallel layer, B of a row-parallel one: counted 1 / tp here) or splits it (counted
    once), except the K and V rows of B, which every one of `num_kv_head_replicas` ranks holds
    when vLLM TP exceeds the KV heads (`column_parallel_linear.py:417,474`)."""
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear

    base, tp, n = module.base_layer, module.tp_size, len(module.lora_a_stacked)
    out = []
    for i in range(n):
        a = module.lora_a_stacked[i][slot][0].double()  # [rank, inputs on this rank]
        b = module.lora_b_stacked[i][slot][0].double()  # [outputs on this rank, rank]
        if isinstance(base, RowParallelLinear):  # A split by inputs, B whole
            out.append(adapter_sums(a, b, a_start=module.tp_rank * a.shape[1], b_copies=tp))
            continue
        if isinstance(base, QKVParallelLinear) and n == 1:
            raise NotImplementedError(
                f"{base.prefix}: one adapter over a fused q/k/v projection; its K/V rows repeat "
                "on vLLM ranks past the KV heads and its sums are not split here"
            )
        kv = isinstance(base, QKVParallelLinear) and i > 0
        shard = module.output_ids[i] if hasattr(module, "output_ids") else module.tp_rank
        out.append(
            adapter_sums(
                a, b, a_copies=tp, b_start=shard * b.shape[0],
                b_copies=base.num_kv_head_replicas if kv else 1,
            )
        )  # fmt: skip
    return out


def adapter_sums(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    a_start: int = 0,
    b_start: int = 0,
    a_copies: int = 1,
    b_copies: int = 1,
) -> tuple[float, float, float, float]:
    """(sum of A², sum of B², sum over A's columns of (column + 1) x its sum of squares, the
    same over B's rows) of a slice of an adapter: A [rank, inputs] whose first column is column
    `a_start` of the whole A, B [outputs, rank] whose first row is row `b_start` of the whole B;
    each factor's sums divided by the ranks that hold the same slice (`*_copies`), so that the
    shares of all ranks add up to the whole adapter's. The weighted sums see a slice put back
    in the wrong place, which plain sums of squares cannot."""
    a, b = a.double(), b.double()
    cols = a.square().sum(0)
    rows = b.square().sum(1)
    at_a = torch.arange(a_start + 1, a_start + 1 + cols.numel(), dtype=torch.float64)
    at_b = torch.arange(b_start + 1, b_start + 1 + rows.numel(), dtype=torch.float64)
    return (
        float(cols.sum()) / a_copies,
        float(rows.sum()) / b_copies,
        float((cols * at_a).sum()) / a_copies,
        float((rows * at_b).sum()) / b_copies,
    )
