"""Per-family readers of the HF config fields beyond a Llama's: MoE routing, shared experts,
dense first layers, multi-latent attention, partial rotary, gpt-oss's sinks, windows and biases,
Qwen3-Next's Gated DeltaNet layers.

Each reader takes the resolved HF config dict and returns `ModelArch` keyword arguments, refusing
what megarl cannot express with an error that names the field. `FAMILIES` is the one list of what
megarl reads (the errors of `megarl convert` and `megarl plan` name it; docs/models.md says what
has run where).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GDNShape:
    """Gated DeltaNet layers (Qwen3-Next): `key_heads` query / key heads of `key_dim`, `value_heads`
    value heads of `value_dim` (a multiple of the key heads), a causal depthwise convolution of
    `conv_kernel` taps over q, k and v."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention (DeepSeek-V2/V3, Kimi-K2): queries through a LoRA of rank
    `q_lora_rank` (None: one full projection), keys and values from one compressed vector of
    `kv_lora_rank` plus a rotary key of `qk_rope_head_dim` shared by all heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
}
"""HF `architectures[0]` -> family (DeepSeek-V3, V3.1 and Kimi-K2 share `DeepseekV3ForCausalLM`)."""

NOT_YET = {
    "Qwen3_5MoeForCausalLM": "its routed experts beside Qwen3.5's Gated DeltaNet layers are not "
    "mapped yet (the dense Qwen3_5ForCausalLM and Qwen3-Next's MoE are)",
    "Qwen3_5ForConditionalGeneration": "the published Qwen3.5 checkpoints are vision-language "
    "models (`model.language_model.*` beside a vision tower); megarl reads the text model "
    "(Qwen3_5ForCausalLM, `model.*`) only",
    "Gemma3ForCausalLM": "local / global attention with 1024-token windows, four norms per "
    "layer and a scaled embedding: megarl's layers do not build them yet",
}
"""Architectures of 2026 families megarl does not build, with why (named in the refusal)."""

GDN_HYBRID = ("qwen3_next", "qwen3_5")
"""Families of Gated DeltaNet layers between gated full-attention ones."""

SIGMOID_MOE = ("glm4_moe", "deepseek_v3")
"""Families routed DeepSeek-V3's way: sigmoid scores, an expert bias used only to choose,
group-limited top-k, a routed scaling factor, shared experts, dense first layers."""


def _int(cfg: dict, key: str, where: str, error) -> int:
    if cfg.get(key) is None:
        raise error(f"{where}: required field {key!r} is missing")
    return int(cfg[key])


def moe_fields(cfg: dict, family: str, where: str, error) -> dict:
    """`ModelArch` MoE keywords of `family` (empty for a dense family)."""
    if family == "mixtral":
        return dict(
            num_experts=_int(cfg, "num_local_experts", where, error),
            moe_topk=_int(cfg, "num_experts_per_tok", where, error),
            moe_intermediate_size=_int(cfg, "intermediate_size", where, error),
        )
    if family == "qwen3_moe":
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise error(
                f"{where}: mixed dense/MoE layers (mlp_only_layers, decoder_sparse_step != 1) "
                "are not supported"
            )
        return dict(
            num_experts=_int(cfg, "num_experts", where, error),
            moe_topk=_int(cfg, "num_experts_per_tok", where, error),
            moe_intermediate_size=_int(cfg, "moe_intermediate_size", where, error),
            moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        )
    if family not in SIGMOID_MOE:
        return {}
    experts = _int(cfg, "n_routed_experts", where, error)
    layers = _int(cfg, "num_hidden_layers", where, error)
    dense = int(cfg.get("first_k_dense_replace") or 0)
    if not 0 <= dense < layers:
        raise error(
            f"{where}: first_k_dense_replace={dense} with num_hidden_layers={layers}; accepted: "
            f"0 to {layers - 1} (at least one MoE layer)"
        )
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    topk = _int(cfg, "num_experts_per_tok", where, error)
    if experts % groups or not 1 <= group_topk <= groups:
        raise error(
            f"{where}: n_group={groups}, topk_group={group_topk} with n_routed_experts="
            f"{experts}; accepted: n_group dividing n_routed_experts, 1 <= topk_group <= n_group"
        )
    if groups > 1 and topk > group_topk * (experts // groups):
        raise error(
            f"{where}: num_experts_per_tok={topk} exceeds the experts of the topk_group="
            f"{group_topk} groups chosen ({group_topk} x {experts // groups})"
        )
    if groups > 1 and topk != 2 * group_topk:
        # HF scores a group by the sum of its top two experts, megatron-core 0.16.1 by its top
        # topk / group_topk (moe_utils.group_limited_topk); DeepSeek-V3 has 8 = 2 x 4
        raise error(
            f"{where}: n_group={groups} with num_experts_per_tok={topk}, topk_group={group_topk}: "
            "megatron-core scores a group by its top num_experts_per_tok / topk_group experts, "
            "transformers by its top two; accepted: num_experts_per_tok = 2 x topk_group, or "
            "n_group=1"
        )
    if not cfg.get("norm_topk_prob", True) and topk > 1:
        raise error(
            f"{where}: norm_topk_prob=false: megatron-core renormalises sigmoid top-k weights "
            "always; accepted: norm_topk_prob=true (every released GLM-4.5 and DeepSeek-V3)"
        )
    width = _int(cfg, "moe_intermediate_size", where, error)
    shared = int(cfg.get("n_shared_experts") or 0)
    return dict(
        num_experts=experts,
        moe_topk=topk,
        moe_intermediate_size=width,
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        moe_score="sigmoid",
        moe_expert_bias=True,
        moe_groups=groups,
        moe_group_topk=group_topk,
        moe_scaling=float(cfg.get("routed_scaling_factor") or 1.0),
        moe_shared_intermediate_size=shared * width or None,
        dense_layers=dense,
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )


def gpt_oss_fields(cfg: dict, where: str, error) -> dict:
    """gpt-oss: attention sinks, sliding-window layers, biases on every linear, clamped SwiGLU
    experts (`ModelArch` keywords beside the MoE ones)."""
    alpha = float(cfg.get("swiglu_alpha", 1.702))
    if alpha != 1.702:
        # megatron's clamped GLU is quick_gelu(gate) x (up + 1), quick_gelu's gain fixed at 1.702
        raise error(f"{where}: swiglu_alpha={alpha}; accepted: 1.702 (every gpt-oss release)")
    if cfg.get("attention_bias") is False:
        # megatron's add_bias_linear puts biases on every linear, the experts' too
        raise error(f"{where}: attention_bias=false; accepted for gpt-oss: true (its default)")
    layers = _int(cfg, "num_hidden_layers", where, error)
    kinds = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    if len(kinds) != layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise error(
            f"{where}: layer_types={kinds}; accepted: {layers} entries of 'sliding_attention' / "
            "'full_attention'"
        )
    window = cfg.get("sliding_window")
    windowed = tuple(k == "sliding_attention" for k in kinds)
    if any(windowed) and not window:
        raise error(f"{where}: sliding_attention layers without a sliding_window")
    return dict(
        num_experts=_int(cfg, "num_local_experts", where, error),
        moe_topk=_int(cfg, "num_experts_per_tok", where, error),
        moe_intermediate_size=_int(cfg, "intermediate_size", where, error),
        moe_router_bias=True,
        linear_bias=True,
        attention_sinks=True,
        sliding_window=int(window) if any(windowed) else None,
        window_layers=windowed if any(windowed) else None,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        stacked_experts=True,
    )


def gdn_hybrid_fields(cfg: dict, family: str, where: str, error) -> dict:
    """Qwen3-Next / Qwen3.5: Gated DeltaNet layers between gated full-attention ones,
    zero-centred norms (weight + 1); Qwen3-Next routes every layer with a sigmoid-gated shared
    expert, Qwen3.5 (dense) has plain MLPs (`ModelArch` keywords, the MoE ones included)."""
    layers = _int(cfg, "num_hidden_layers", where, error)
    interval = int(cfg.get("full_attention_interval") or 4)
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    ]
    if len(kinds) != layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise error(
            f"{where}: layer_types={kinds}; accepted: {layers} entries of 'linear_attention' / "
            "'full_attention'"
        )
    moe = family == "qwen3_next"
    if moe and (cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1):
        raise error(
            f"{where}: dense layers (mlp_only_layers, decoder_sparse_step != 1) in Qwen3-Next "
            "are not supported; accepted: every layer routed (every released checkpoint)"
        )
    if cfg.get("attention_bias"):
        raise error(f"{where}: attention_bias=true; accepted for {family}: false")
    gdn = GDNShape(
        key_heads=_int(cfg, "linear_num_key_heads", where, error),
        value_heads=_int(cfg, "linear_num_value_heads", where, error),
        key_dim=_int(cfg, "linear_key_head_dim", where, error),
        value_dim=_int(cfg, "linear_value_head_dim", where, error),
        conv_kernel=_int(cfg, "linear_conv_kernel_dim", where, error),
    )
    if gdn.value_heads % gdn.key_heads:
        raise error(
            f"{where}: linear_num_value_heads={gdn.value_heads} is not a multiple of "
            f"linear_num_key_heads={gdn.key_heads}"
        )
    routed = {}
    if moe:
        routed = dict(
            num_experts=_int(cfg, "num_experts", where, error),
            moe_topk=_int(cfg, "num_experts_per_tok", where, error),
            moe_intermediate_size=_int(cfg, "moe_intermediate_size", where, error),
            moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            moe_shared_intermediate_size=_int(cfg, "shared_expert_intermediate_size", where, error),
            moe_shared_gate=True,
        )
    return dict(
        **routed,
        gdn=gdn,
        linear_layers=tuple(k == "linear_attention" for k in kinds),
        attention_output_gate=True,
        zero_centered_norms=True,
    )


def mla_shape(cfg: dict, where: str, error) -> MLAShape:
    """DeepSeek-V3's attention shape; refuses the biases it never has."""
    if cfg.get("attention_bias"):
        raise error(f"{where}: attention_bias=true with multi-latent attention is not supported")
    if cfg.get("rope_interleave") is False:
        # megatron's MLA always reads the rotary dims interleaved (rope_utils.py:115-118)
        raise error(
            f"{where}: rope_interleave=false is not supported (megatron-core's multi-latent "
            "attention reads the rotary dims interleaved); accepted: rope_interleave=true, the "
            "default of every released DeepSeek-V3 and Kimi-K2"
        )
    check_yarn(cfg.get("rope_scaling") or {}, where, error)
    q_rank = cfg.get("q_lora_rank")
    return MLAShape(
        q_lora_rank=None if q_rank is None else int(q_rank),
        kv_lora_rank=_int(cfg, "kv_lora_rank", where, error),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", where, error),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", where, error),
        v_head_dim=_int(cfg, "v_head_dim", where, error),
    )


def check_yarn(rs: dict, where: str, error) -> None:
    """Refuse yarn settings megatron-core's yarn cannot reproduce."""
    if rs.get("attention_factor") is not None or (
        float(rs.get("mscale") or 1.0) != 1.0 and not rs.get("mscale_all_dim")
    ):
        # transformers takes these as given / ignores mscale without mscale_all_dim
        # (modeling_rope_utils.py:435-439); megatron's yarn always scales by the ratio
        raise error(
            f"{where}: rope_scaling with attention_factor, or mscale != 1 without "
            f"mscale_all_dim ({rs}): megatron-core's yarn scales cos / sin by "
            "get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim); accepted: "
            "DeepSeek-V3's form (mscale = mscale_all_dim, no attention_factor) or none"
        )


def rotary_fraction(cfg: dict, where: str, error) -> float:
    """The fraction of each head's dims that rotary embeds (GLM-4.5: 0.5; others 1.0)."""
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    f = cfg.get("partial_rotary_factor", rp.get("partial_rotary_factor", 1.0))
    if f is None:
        return 1.0
    if not 0 < float(f) <= 1:
        raise error(f"{where}: partial_rotary_factor={f}; accepted: 0 < f <= 1")
    return float(f)
