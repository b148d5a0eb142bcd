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
def sums(worker) -> dict[str, tuple[float, float]] | None:
    """{HF module ("model.layers.0.self_attn.q_proj"): (sum of A², sum of B²)} of the adapter in
    the LoRA layers' stacked buffers on this vLLM rank (B with alpha / rank folded in); None when
    no adapter is active."""
    adapters = _manager(worker)._adapter_manager
    if ADAPTER_ID not in adapters.lora_index_to_id:
        return None
    slot = adapters.lora_index_to_id.index(ADAPTER_ID)
    out = {}
    for module_name, module in adapters.modules.items():
        if not hasattr(module, "lora_a_stacked"):
            continue
        prefix, _, last = module_name.rpartition(".")
        names = adapters.packed_modules_mapping.get(last, [last])
        for i, name in enumerate(names):
            a = module.lora_a_stacked[i][slot].double()
            b = module.lora_b_stacked[i][slot].double()
            key = f"{prefix}.{name}" if prefix else name
            out[key] = (float(a.square().sum()), float(b.square().sum()))
    return out
