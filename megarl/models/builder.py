"""Build this rank's actor / reference / critic / reward chunks on megatron-core's `GPTModel`.

A "model" here is a list of chunks (one per virtual pipeline stage on this rank), the form
`get_forward_backward_func` takes. Trainable models are wrapped in megatron's
`DistributedDataParallel` (bucketed grad reduce; DistributedOptimizer-ready); frozen ones are
not. The critic and the reward model are the same kind of trunk whose output layer is a scalar
head (`ValueHead`, on the last pipeline stage); the reward model is frozen in an RL run
(`frozen=True`, like the reference) and trained by `algorithm.name: rm`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.models.hf_config import ModelArch, ModelConfigError, PrecisionConfig
from megarl.models.lora import LoraConfig, apply_lora, check_lora
from megarl.models.marks import mark_parameters
from megarl.models.mcore_config import transformer_config
from megarl.models.specs import block_spec, require_transformer_engine

ROLES = ("actor", "reference", "critic", "reward", "teacher")
SCALAR_ROLES = ("critic", "reward")
"""Roles whose output layer is a scalar head (`ValueHead`) instead of the LM head."""


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    make_vocab_size_divisible_by: int = 128
    """Embedding rows are padded to a multiple of this x TP (megatron convention)."""
    use_te: bool | None = None
    """Override of `precision.transformer_engine`; None = decided by `resolve_use_te`."""
    expert_bias_update_rate: float = 0.0
    """MoE routers with an expert bias: its aux-loss-free update per optimizer step (0: frozen;
    `model.expert_bias_update_rate`)."""
    routing_replay: bool = False
    """MoE: build the actor's and the reference's routers able to replay the rollout's routes
    (`megarl.models.routing`); the critic and the reward model route by themselves."""
    lora: LoraConfig = LoraConfig()
    """The actor's LoRA adapters (`megarl.models.lora`): its base frozen, only they train. Also
    those of a trained (not frozen) reward model: the one model of a reward-model run."""
    critic_lora: LoraConfig = LoraConfig()
    """The critic's LoRA adapters; its value head stays trainable."""
    lora_seed: int = 0
    """Seed of the adapters' init (the same adapters at every layout)."""


class ValueHead(torch.nn.Module):
    """Scalar head standing in for `GPTModel.output_layer` in the critic (values) and the reward
    model (scores; transformers' `score` of a one-label sequence classifier). Starts at zero.

    Replicated over TP (1 output column cannot be split). Under sequence parallelism the final
    hidden states are sequence-sharded, so they are gathered first. Every TP rank then computes
    the same values and the same loss, so the gather's backward only splits the gradient back
    (`tensor_parallel_output_grad=False`); a reduce-scatter would sum TP identical copies and
    scale the trunk's gradient by TP. The head's own grad is identical on every TP rank.
    """

    def __init__(self, config, hidden_size: int, tp_group):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=config.params_dtype))
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        from megatron.core import tensor_parallel

        if self.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return torch.nn.functional.linear(hidden, self.weight), None


def _apply_rope_scaling(model, arch: ModelArch) -> None:
    """megatron-core's llama3 scaling hard-codes low/high frequency factors and the original
    context; recompute inv_freq with the checkpoint's own values (linear scaling is handled by
    `seq_len_interpolation_factor`)."""
    rs = arch.rope_scaling
    if not rs or rs["rope_type"] != "llama3" or not hasattr(model, "rotary_pos_emb"):
        return
    rope = model.rotary_pos_emb
    dim = arch.head_dim
    base = 1.0 / (
        arch.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rope.inv_freq.device) / dim)
    )
    rope.inv_freq = rope._apply_scaling(
        base,
        factor=rs.get("factor", 8.0),
        low_freq_factor=rs.get("low_freq_factor", 1.0),
        high_freq_factor=rs.get("high_freq_factor", 4.0),
        original_max_position_embeddings=rs.get("original_max_position_embeddings", 8192),
    )


def resolve_use_te(precision: PrecisionConfig, build: BuildConfig, *, gpu: bool) -> bool:
    """Whether to build Transformer-Engine layers. On GPU they are the default and a missing TE
    is an error (never a silent fall-back to the slower local layers); the local spec on GPU
    only with `precision.transformer_engine: false`."""
    if build.use_te is not None:
        return build.use_te
    want = precision.transformer_engine
    if want is False:
        return False
    if not gpu:
        if want:
            raise ModelConfigError(
                "precision.transformer_engine=true needs a CUDA GPU; this process runs on CPU. "
                "Accepted on CPU: null or false"
            )
        return False
    require_transformer_engine(
        "training on GPU (the default layer spec there; set precision.transformer_engine: "
        "false to use megatron-core's local layers instead, slower and without FP8)"
    )
    return True


def build_gpt_chunk(
    arch: ModelArch, config, *, vp_stage, role: str, build: BuildConfig, use_te: bool
):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    has_vpp = ps.get_virtual_pipeline_model_parallel_world_size() is not None
    pre = ps.is_pipeline_first_stage(ignore_virtual=not has_vpp, vp_stage=vp_stage)
    post = ps.is_pipeline_last_stage(ignore_virtual=not has_vpp, vp_stage=vp_stage)
    tp = ps.get_tensor_model_parallel_world_size()
    rs = arch.rope_scaling or {}
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(arch, config, use_te=use_te, vp_stage=vp_stage),
        vocab_size=arch.padded_vocab_size(build.make_vocab_size_divisible_by, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and role not in SCALAR_ROLES,
        # (MLA layers embed their own rotary keys, yarn or not)
        position_embedding_type=(
            "yarn" if rs.get("rope_type") == "yarn" and arch.mla is None else "rope"
        ),
        rotary_percent=arch.rotary_fraction,
        rotary_base=int(arch.rope_theta),
        seq_len_interpolation_factor=rs.get("factor") if rs.get("rope_type") == "linear" else None,
        vp_stage=vp_stage,
    )
    _apply_rope_scaling(model, arch)
    mark_parameters(model, arch)
    model.megarl_vocab_size = arch.vocab_size  # logits and exports are cut to the real vocab
    model.megarl_role = role  # which model a forward belongs to (MoE router statistics)
    if role in SCALAR_ROLES and post:
        model.output_layer = ValueHead(
            config, arch.hidden_size, ps.get_tensor_model_parallel_group()
        )
    return model


def build_model(
    arch: ModelArch,
    parallel,
    precision: PrecisionConfig,
    *,
    role: str,
    build: BuildConfig = BuildConfig(),
    gpu: bool = False,
    ddp_config=None,
    frozen: bool | None = None,
) -> list[torch.nn.Module]:
    """Build this rank's chunks of `role` (actor, reference, critic, reward or teacher).

    Requires megatron's parallel state (see `Topology.initialize`). Trainable roles are wrapped in
    megatron `DistributedDataParallel` with `ddp_config` (default: distributed-optimizer buckets,
    fp32 grad reduce). `frozen` (default: the reference only) builds no grads and no DDP."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    if role not in ROLES:
        raise ValueError(f"role={role!r}; accepted: {ROLES}")
    use_te = resolve_use_te(precision, build, gpu=gpu)
    if use_te and precision.fp32_residual:
        raise ModelConfigError(
            "precision.fp32_residual=true builds megatron's local layers only (TE's assert that "
            "their input's dtype is their weights' outside autocast: transformer_engine/pytorch/"
            "module/base.py, set_activation_dtype); accepted on GPU: precision.transformer_engine:"
            " false, or fp32_residual: false"
        )
    # the sampler's routes are the policy's: the actor and its initial copy replay them, not a
    # scalar-head model or a teacher of another architecture
    replay = build.routing_replay and role in ("actor", "reference")
    if frozen is None:
        frozen = role == "reference"
    rate = 0.0 if frozen or role not in ("actor", "critic") else build.expert_bias_update_rate
    config = transformer_config(
        arch, parallel, precision, gpu=gpu, routing_replay=replay, expert_bias_rate=rate
    )
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    lora = role_lora(build, role, frozen)
    tp = ps.get_tensor_model_parallel_world_size()
    check_lora(lora, arch, tp=tp, use_te=use_te, precision=precision)
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        chunk = build_gpt_chunk(
            arch, config, vp_stage=vp_stage, role=role, build=build, use_te=use_te
        )
        if lora.enabled:
            apply_lora(chunk, lora, arch, build.lora_seed)
            if isinstance(getattr(chunk, "output_layer", None), ValueHead):
                chunk.output_layer.requires_grad_(True)  # a new head: trained in full
        if gpu:
            chunk.cuda(torch.cuda.current_device())
        if precision.dtype != "fp32":
            chunk = Float16Module(config, chunk)
        chunks.append(chunk)
    if precision.dtype != "fp32" and arch.moe_expert_bias:
        round_expert_bias(chunks, precision.torch_dtype)
    if frozen:
        for c in chunks:
            c.requires_grad_(False)
            c.eval()
        drop_preserved_init(chunks)  # no optimizer will read it
        return chunks
    ddp_config = ddp_config or default_ddp_config(precision)
    return [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0
        )
        for i, c in enumerate(chunks)
    ]


def round_expert_bias(chunks: list[torch.nn.Module], dtype: torch.dtype) -> None:
    """In a 16-bit model, keep every router's expert bias (an fp32 buffer megatron-core
    maintains, router.py:209-218) on `dtype`'s grid before each forward: the weight sync carries
    it in the model's dtype, so the trainer and vLLM route with the same values."""

    def hook(router, args):
        b = router.expert_bias
        b.copy_(b.to(dtype).float())

    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, "expert_bias", None) is not None:
                module.register_forward_pre_hook(hook)


def default_ddp_config(precision: PrecisionConfig):
    """megatron's `DistributedDataParallelConfig` of a trained model: distributed-optimizer
    buckets, fp32 grad reduce, and FP8 parameters gathered in FP8 with `precision.fp8_param` (as
    Megatron-LM's `--fp8-param-gather` sets `fp8_param` in the model's config and
    `fp8_param_gather` in this one)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        bucket_size=None,
        fp8_param_gather=precision.fp8_param,
    )


def drop_preserved_init(chunks: list[torch.nn.Module]) -> None:
    """Free the host copy of the random initial value that Transformer-Engine keeps on each FP8
    parameter built under `preserve_high_precision_init_val` (TE 2.9
    `pytorch/module/base.py:1280-1325`): nothing reads it once the masters are set, and a frozen
    model would hold it for the whole run (~4.4 GB of host memory per rank for a 70B model at
    TP 8 x PP 4). No-op for parameters without one."""
    for chunk in chunks:
        for p in chunk.parameters():
            clear = getattr(p, "clear_high_precision_init_val", None)
            if clear is not None:
                clear()


def role_lora(build: BuildConfig, role: str, frozen: bool) -> LoraConfig:
    """The adapters `role` is built with: the actor's (also when frozen: `megarl eval` of a
    PEFT adapter), a trained reward model's (a frozen one scores as it was exported), the
    critic's own; none on the reference (a LoRA run's reference is the actor, adapters off)."""
    if role == "actor" or (role == "reward" and not frozen):
        return build.lora
    return build.critic_lora if role == "critic" else LoraConfig()


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The `GPTModel` inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def num_params(arch: ModelArch) -> int:
    """Parameter count of the HF model (unpadded vocab; a reward model's scalar head; routers'
    expert biases), for MFU and memory estimates; equal to the sum over the HF mapping's shapes
    (tests/test_model_config.py)."""
    h, L, v = arch.hidden_size, arch.num_layers, arch.vocab_size
    heads, m = arch.num_attention_heads, arch.mla
    if m is None:
        q, kv = heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if arch.qkv_bias else 0)
        attn += 2 * arch.head_dim if arch.qk_norm else 0
        attn += (h if arch.linear_bias else 0) + (heads if arch.attention_sinks else 0)
        attn += q * h if arch.attention_output_gate else 0
    else:
        q_out = heads * m.qk_head_dim
        q = h * q_out if m.q_lora_rank is None else m.q_lora_rank * (h + 1 + q_out)
        kv_up = heads * (m.qk_nope_head_dim + m.v_head_dim)
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * (1 + kv_up)
        attn = q + kv + heads * m.v_head_dim * h
    dense = 3 * h * arch.intermediate_size
    moe = 0
    if arch.is_moe:
        e = arch.num_experts
        moe = e * 3 * h * arch.moe_intermediate_size + h * e + (e if arch.moe_expert_bias else 0)
        if arch.linear_bias:  # gpt-oss: the router's and each expert's [gate; up] and down
            moe += e + e * (2 * arch.moe_intermediate_size + h)
        moe += 3 * h * (arch.moe_shared_intermediate_size or 0)
        moe += h if arch.moe_shared_gate else 0
    moe_layers = L - arch.dense_layers if arch.is_moe else 0
    head = h if arch.score_head else (0 if arch.tie_word_embeddings else v * h)
    linear = sum(arch.linear_layers or ())
    mixers = (L - linear) * attn + (linear * _gdn_params(arch) if linear else 0)
    return mixers + 2 * h * L + (L - moe_layers) * dense + moe_layers * moe + v * h + head + h


def _gdn_params(arch: ModelArch) -> int:
    """One Gated DeltaNet layer's parameters: in_proj, conv1d, dt_bias, A_log, out_norm,
    out_proj."""
    g, h = arch.gdn, arch.hidden_size
    qk, v = g.key_heads * g.key_dim, g.value_heads * g.value_dim
    in_proj = h * (2 * qk + 2 * v + 2 * g.value_heads)
    return in_proj + (2 * qk + v) * g.conv_kernel + 2 * g.value_heads + g.value_dim + v * h
