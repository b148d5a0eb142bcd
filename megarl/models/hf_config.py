"""Hugging Face `config.json` -> `ModelArch` -> megatron-core `TransformerConfig`.

`ModelArch` is the small, architecture-level description megarl needs (shapes, norms, rope,
biases, MoE); it is derived from an HF config once, validated with errors that name the field, and
is the only input to the model builders and to the HF <-> Megatron parameter mappings.

Supported families (`megarl.models.families.FAMILIES`): Llama 2/3/3.1 (rope scaling `llama3` and
`linear`), Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k norm, head_dim != hidden/heads), Qwen3-MoE,
Mixtral, GLM-4.5 MoE (partial rotary), DeepSeek-V3 / Kimi-K2 (multi-latent attention, yarn),
gpt-oss (sinks, sliding windows, biases, clamped SwiGLU experts) and Qwen3-Next (Gated DeltaNet
layers, gated attention, zero-centred norms); each as a causal LM
(`<Family>ForCausalLM`) or, for the dense families, Qwen3-MoE and Mixtral, as a reward model
(`<Family>ForSequenceClassification` with one label: the same trunk, a scalar `score` head
instead of the LM head; `ModelArch.score_head`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch

from megarl.dtypes import NAMES
from megarl.errors import UserError
from megarl.models.families import (
    FAMILIES,
    GDN_HYBRID,
    NOT_YET,
    SIGMOID_MOE,
    GDNShape,
    MLAShape,
    check_yarn,
    gdn_hybrid_fields,
    gpt_oss_fields,
    mla_shape,
    moe_fields,
)
from megarl.models.families import rotary_fraction as read_rotary_fraction

ARCHITECTURES = FAMILIES
CLASSIFIER_ARCHITECTURES = {
    cls.replace("ForCausalLM", "ForSequenceClassification"): family
    for cls, family in ARCHITECTURES.items()
    if family not in (*SIGMOID_MOE, "gpt_oss", *GDN_HYBRID)  # not read as reward models
}
"""Sequence classifiers of the same families: megarl reads those with `num_labels: 1` (reward
models; transformers' `GenericForSequenceClassification`)."""
MODEL_TYPES = {v: v for v in ARCHITECTURES.values()} | {"qwen3_5_text": "qwen3_5"}
DTYPES = {k: getattr(torch, v) for k, v in NAMES.items()}
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


class ModelConfigError(UserError, ValueError):
    """An HF config megarl cannot map; the message names the field and the accepted values."""


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int | None = None
    moe_topk: int = 2
    moe_intermediate_size: int | None = None
    moe_norm_topk_prob: bool = True
    moe_score: str = "softmax"
    """Router scores: softmax, or sigmoid (GLM-4.5, DeepSeek-V3)."""
    moe_expert_bias: bool = False
    """A per-expert bias added to the scores only to choose experts (HF `e_score_correction_bias`,
    megatron's `router.expert_bias`)."""
    moe_groups: int = 1
    moe_group_topk: int = 1
    """Group-limited routing: experts in `moe_groups` groups; only the `moe_group_topk` groups of
    highest score (sum of each group's top two) are chosen from."""
    moe_scaling: float = 1.0
    """Routed experts' weights are multiplied by this (HF `routed_scaling_factor`)."""
    moe_shared_intermediate_size: int | None = None
    """Width of the shared experts run on every token beside the routed ones (HF
    n_shared_experts x moe_intermediate_size); None: none."""
    dense_layers: int = 0
    """The first layers have a dense MLP of `intermediate_size` (HF `first_k_dense_replace`)."""
    mtp_layers: int = 0
    """Multi-token-prediction layers in the HF files (`num_nextn_predict_layers`): not built,
    their tensors are skipped on reading and not written (transformers ignores them too)."""
    rotary_fraction: float = 1.0
    """The leading fraction of each head's dims that rotary embeds (GLM-4.5: 0.5)."""
    mla: MLAShape | None = None
    """Multi-latent attention (DeepSeek-V3); `head_dim` is then its query / key head dim."""
    linear_bias: bool = False
    """Every linear has a bias (gpt-oss: q/k/v/o, router, experts; megatron's add_bias_linear)."""
    moe_router_bias: bool = False
    """The router's linear has a bias (gpt-oss); not the expert bias, which only chooses."""
    attention_sinks: bool = False
    """A learned logit per head that joins each softmax without a value (gpt-oss `sinks`;
    megatron's learnable softmax offset)."""
    sliding_window: int | None = None
    """Windowed layers attend to the last `sliding_window` positions, their own included."""
    window_layers: tuple[bool, ...] | None = None
    """Per layer: whether it is windowed (gpt-oss alternates, the first windowed)."""
    swiglu_limit: float | None = None
    """Clamped SwiGLU (gpt-oss experts): gate clamped above and up on both sides at this limit,
    out = gate x sigmoid(1.702 gate) x (up + 1); None: plain SwiGLU."""
    moe_shared_gate: bool = False
    """The shared expert's output is scaled by sigmoid(hidden . gate) (Qwen3-Next
    `shared_expert_gate`; megatron's `moe_shared_expert_gate`)."""
    gdn: GDNShape | None = None
    """Gated DeltaNet shape of the linear-attention layers (Qwen3-Next)."""
    linear_layers: tuple[bool, ...] | None = None
    """Per layer: whether it is a Gated DeltaNet layer (the others attend in full)."""
    attention_output_gate: bool = False
    """Full attention's output is scaled by sigmoid of a gate that q_proj also projects
    (Qwen3-Next: q_proj rows are [q; gate] per head)."""
    zero_centered_norms: bool = False
    """RMSNorm weights are stored as weight - 1 (Qwen3-Next: out = norm(x) x (1 + w)), except
    the Gated DeltaNet's output norm (megatron's `layernorm_zero_centered_gamma`)."""
    stacked_experts: bool = False
    """The HF files hold each layer's experts stacked ([experts, ...]; gpt-oss); megarl's HF
    names are per expert (`megarl.convert.stacked`)."""
    score_head: bool = False
    """The model's files hold a scalar `score` head [1, hidden] (a sequence classifier with one
    label: a reward model) instead of the LM head."""
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def kv_cache_per_token(self, vllm_tp: int, elem: int) -> tuple[int, str]:
        """vLLM's KV cache bytes per token on one of its TP ranks, and the formula. Multi-latent
        attention caches the compressed vector and the rotary key (kv_lora_rank + rope dims),
        once per layer and whole on every rank; grouped-query attention caches K and V of the
        rank's KV heads (replicated when TP exceeds them)."""
        if self.mla is not None:
            width = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
            per = self.num_layers * width * elem
            return per, f"{per} B/token = {self.num_layers} layers x latent {width} x {elem} B"
        kv_heads = max(1, self.num_key_value_heads // vllm_tp)
        # Gated DeltaNet layers keep a fixed state per sequence, no per-token cache
        layers = self.num_layers - sum(self.linear_layers or ())
        per = 2 * layers * kv_heads * self.head_dim * elem
        return per, (
            f"{per} B/token = 2 x {layers} attention layers x {kv_heads} KV heads per rank x "
            f"head_dim {self.head_dim} x {elem} B"
        )

    def is_linear_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) is a Gated DeltaNet layer."""
        return self.linear_layers is not None and self.linear_layers[layer]

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` (0-based) has a routed MLP."""
        return self.is_moe and layer >= self.dense_layers

    def as_classifier(self, pad_token_id: int | None) -> ModelArch:
        """This trunk as a reward model: `<Family>ForSequenceClassification`, one label, a
        score head; `pad_token_id` (where the config has none) decides where it reads its score
        (`megarl.rewards.model.score_positions`)."""
        cfg = dict(self.hf_config)
        causal = (cfg.get("architectures") or [_CAUSAL[self.family]])[0]
        cfg["architectures"] = [causal.replace("ForCausalLM", "ForSequenceClassification")]
        cfg.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        cfg["tie_word_embeddings"] = False  # no LM head to tie
        if cfg.get("pad_token_id") is None:
            cfg["pad_token_id"] = pad_token_id
        return dataclasses.replace(self, score_head=True, tie_word_embeddings=False, hf_config=cfg)

    def padded_vocab_size(self, divisible_by: int, tp: int) -> int:
        """megatron pads the embedding rows to a multiple of `divisible_by x TP`."""
        multiple = divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple


def load_hf_config(path_or_dict: str | os.PathLike | dict) -> dict:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise ModelConfigError(
            f"no HF config at {path}: expected a model directory with config.json"
        )
    with open(path) as f:
        try:
            cfg = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"{path}: not a JSON HF config ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def resolve_hf_config(cfg: dict) -> dict:
    """Map transformers 5 config spellings onto the fields `arch_from_hf` reads: configs it saves
    carry `rope_parameters` instead of `rope_theta` / `rope_scaling`, and Qwen3-MoE's
    `num_local_experts` instead of `num_experts`."""
    cfg = dict(cfg)
    if cfg.get("num_experts") is None and cfg.get("model_type") == "qwen3_moe":
        if cfg.get("num_local_experts") is not None:
            cfg["num_experts"] = cfg["num_local_experts"]
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" not in rp:
        if cfg.get("rope_theta") is None and rp.get("rope_theta") is not None:
            cfg["rope_theta"] = rp["rope_theta"]
        kind = rp.get("rope_type", rp.get("type", "default"))
        if cfg.get("rope_scaling") is None and kind != "default":
            cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    return cfg


def _get(cfg: dict, key: str, where: str, default=dataclasses.MISSING):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is dataclasses.MISSING:
        raise ModelConfigError(f"{where}: required field {key!r} is missing")
    return default


def arch_from_hf(config: str | os.PathLike | dict, *, where: str | None = None) -> ModelArch:
    """Map an HF config (dict, config.json path or model dir) to a validated `ModelArch`."""
    original = load_hf_config(config)
    if (original.get("quantization_config") or {}).get("quant_method") in ("fp8", "mxfp4"):
        # block-FP8 / MXFP4 files are read as the bf16 model they stand for
        # (megarl.convert.fp8_blocks, megarl.convert.stacked): what megarl writes and hands
        # vLLM is that model
        original = {k: v for k, v in original.items() if k != "quantization_config"}
    cfg = resolve_hf_config(original)
    where = where or (os.fspath(config) if not isinstance(config, dict) else "HF config")
    archs = cfg.get("architectures") or []
    score_head = bool(archs) and archs[0] in CLASSIFIER_ARCHITECTURES
    known = {**ARCHITECTURES, **CLASSIFIER_ARCHITECTURES}
    family = known.get(archs[0]) if archs else MODEL_TYPES.get(cfg.get("model_type"))
    if family is None:
        why = NOT_YET.get(archs[0]) if archs else None
        raise ModelConfigError(
            f"{where}: architectures={archs} / model_type={cfg.get('model_type')!r} is not "
            + (f"supported yet: {why}. " if why else "supported; ")
            + f"accepted architectures: {sorted(ARCHITECTURES)}, and as reward models "
            f"(one label) {sorted(CLASSIFIER_ARCHITECTURES)} (docs/models.md)"
        )
    if score_head:
        labels = num_labels(cfg)
        if labels != 1:
            raise ModelConfigError(
                f"{where}: {archs[0]} with num_labels={labels}; a reward model has one scalar "
                "score: accepted num_labels: 1 (id2label with one entry)"
            )
    hidden = int(_get(cfg, "hidden_size", where))
    heads = int(_get(cfg, "num_attention_heads", where))
    kv_heads = int(_get(cfg, "num_key_value_heads", where, heads))
    if heads % kv_heads:
        raise ModelConfigError(
            f"{where}: num_attention_heads={heads} is not divisible by num_key_value_heads="
            f"{kv_heads} (each KV head must serve a whole number of query heads)"
        )
    head_dim = cfg.get("head_dim") or hidden // heads
    if cfg.get("head_dim") is None and hidden % heads:
        raise ModelConfigError(
            f"{where}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
            "and no head_dim is given"
        )
    if family in ("llama", "mistral") and cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelConfigError(f"{where}: attention_bias/mlp_bias=true is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{where}: hidden_act={act!r} is not supported; accepted: 'silu'")
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        kinds = (
            ("yarn", "default")
            if family in ("deepseek_v3", "gpt_oss")
            else ("llama3", "linear", "default")
        )
        if kind not in kinds:
            raise ModelConfigError(
                f"{where}: rope_scaling.rope_type={kind!r} is not supported for {family}; "
                f"accepted: {', '.join(map(repr, kinds))}"
            )
        rope_scaling = None if kind == "default" else {**rope_scaling, "rope_type": kind}
    oss = gpt_oss_fields(cfg, where, ModelConfigError) if family == "gpt_oss" else {}
    if family in GDN_HYBRID:
        oss = gdn_hybrid_fields(cfg, family, where, ModelConfigError)
    if oss and rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
        check_yarn(rope_scaling, where, ModelConfigError)
    if not oss and cfg.get("sliding_window") and cfg.get("use_sliding_window", family == "mistral"):
        if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
            raise ModelConfigError(
                f"{where}: sliding_window={cfg['sliding_window']} attention is not supported"
            )
    moe = {} if family in GDN_HYBRID else moe_fields(cfg, family, where, ModelConfigError)
    mla = mla_shape(cfg, where, ModelConfigError) if family == "deepseek_v3" else None
    if mla is not None:
        head_dim, kv_heads = mla.qk_head_dim, heads
    if moe and moe["moe_topk"] == 1 and moe.get("moe_norm_topk_prob", True):
        # the renormalised weight of a single expert is always 1.0: the router would get no
        # gradient, and megatron-core refuses top-1 unless softmax comes first (weight p)
        raise ModelConfigError(
            f"{where}: num_experts_per_tok=1 with renormalised top-k weights (weight 1.0, no "
            "router gradient) cannot be expressed in megatron-core, which accepts top-1 only "
            "with pre-softmax routing (weight p). Affected: Mixtral-architecture configs with "
            "num_experts_per_tok=1 (Mixtral always renormalises) and Qwen3-MoE configs with "
            "num_experts_per_tok=1 and norm_topk_prob=true; no released Mixtral (8x7B, 8x22B: "
            "top-2) or Qwen3-MoE checkpoint (30B-A3B, 235B-A22B, Coder: top-8) is. Accepted: "
            "num_experts_per_tok >= 2, or norm_topk_prob=false (Qwen3-MoE)"
        )
    return ModelArch(
        family=family,
        vocab_size=int(_get(cfg, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(_get(cfg, "intermediate_size", where)),
        num_layers=int(_get(cfg, "num_hidden_layers", where)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        # a classifier has no LM head to tie (transformers ignores the flag there)
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and not score_head,
        qkv_bias=family in ("qwen2", "gpt_oss") or bool(cfg.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe", *GDN_HYBRID) or bool(cfg.get("use_qk_norm")),
        rotary_fraction=read_rotary_fraction(cfg, where, ModelConfigError),
        mla=mla,
        score_head=score_head,
        hf_config=original,
        **moe,
        **oss,
    )


_CAUSAL = {family: cls for cls, family in ARCHITECTURES.items()}


def num_labels(cfg: dict) -> int:
    """The labels of a sequence classifier's config, as transformers counts them: `num_labels`,
    else the entries of `id2label`, else transformers' default of 2."""
    if cfg.get("num_labels") is not None:
        return int(cfg["num_labels"])
    if cfg.get("id2label"):
        return len(cfg["id2label"])
    return 2


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    dtype: str = "fp32"
    """Parameter/compute dtype: one of fp32, bf16, fp16."""
    fp8: str | None = None
    """FP8 format for Transformer-Engine layers (GPU only): e4m3 or hybrid; None = off."""
    fp8_recipe: str = "delayed"
    """FP8 scaling recipe: delayed, tensorwise, blockwise, mxfp8."""
    fp8_param: bool = False
    """Keep parameters in FP8 (TE fp8_model_init); saves memory, GPU only."""
    transformer_engine: bool | None = None
    """Transformer-Engine layers. None = on GPU (an error if TE is not installed), never on
    CPU; false = megatron's local layers also on GPU (slower, no FP8); true = required."""
    fp32_residual: bool = False
    """bf16 / fp16 only: keep the residual stream (embedding output, every layer's sum) in fp32,
    as autocast over fp32 weights does; norms read it in fp32 and hand `dtype` to the GEMMs.
    megatron's local layers only (TE's asserts its input dtype equals its weights')."""

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"precision.dtype={self.dtype!r}; accepted: {sorted(DTYPES)}")
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise ModelConfigError(f"precision.fp8={self.fp8!r}; accepted: {FP8_FORMATS} or null")
        if self.fp8 is not None and self.transformer_engine is False:
            raise ModelConfigError(
                f"precision.fp8={self.fp8!r} needs Transformer-Engine layers but "
                "precision.transformer_engine=false; accepted: fp8=null, or transformer_engine "
                "true/null"
            )
        if self.fp8_param and self.fp8 is None:
            raise ModelConfigError("precision.fp8_param=true needs precision.fp8 (e4m3 or hybrid)")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ModelConfigError(
                f"precision.fp8_recipe={self.fp8_recipe!r}; accepted: {FP8_RECIPES}"
            )
        if self.fp32_residual and self.dtype == "fp32":
            raise ModelConfigError(
                "precision.fp32_residual=true with precision.dtype=fp32: the stream is fp32 "
                "already; accepted: dtype bf16 or fp16, or fp32_residual: false"
            )
        if self.fp32_residual and self.transformer_engine:
            raise ModelConfigError(
                "precision.fp32_residual=true with precision.transformer_engine=true: TE's "
                "layers assert that their input's dtype is their weights' outside autocast "
                "(transformer_engine/pytorch/module/base.py, set_activation_dtype); accepted: "
                "transformer_engine: false (megatron's local layers), or fp32_residual: false"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def active_fp8_recipe(self) -> str | None:
        """`fp8_recipe` when FP8 is on, else None (what megatron's optimizer is given)."""
        return self.fp8_recipe if self.fp8 is not None else None
