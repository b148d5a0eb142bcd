"""Hugging Face `config.json` -> `ModelArch` -> megatron-core `TransformerConfig`.

`ModelArch` is the small, architecture-level description megarl needs (shapes, norms, rope,
biases, MoE); it is derived from an HF config once, validated with errors that name the field, and
is the only input to the model builders and to the HF <-> Megatron parameter mappings.

Supported families: Llama 2/3/3.1 (rope scaling `llama3` and `linear`), Mistral, Qwen2/2.5 (QKV
bias), Qwen3 (q/k norm, head_dim != hidden/heads), Qwen3-MoE and Mixtral; each as a causal LM
(`<Family>ForCausalLM`) or as a reward model (`<Family>ForSequenceClassification` with one label:
the same trunk, a scalar `score` head instead of the LM head; `ModelArch.score_head`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import torch

from megarl.dtypes import NAMES
from megarl.errors import UserError
from megarl.models.specs import require_transformer_engine

# HF `architectures[0]` / `model_type` -> family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
CLASSIFIER_ARCHITECTURES = {
    cls.replace("ForCausalLM", "ForSequenceClassification"): family
    for cls, family in ARCHITECTURES.items()
}
"""Sequence classifiers of the same families: megarl reads those with `num_labels: 1` (reward
models; transformers' `GenericForSequenceClassification`)."""
MODEL_TYPES = {v: v for v in ARCHITECTURES.values()}
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
    score_head: bool = False
    """The model's files hold a scalar `score` head [1, hidden] (a sequence classifier with one
    label: a reward model) instead of the LM head."""
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

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
    cfg = resolve_hf_config(original)
    where = where or (os.fspath(config) if not isinstance(config, dict) else "HF config")
    archs = cfg.get("architectures") or []
    score_head = bool(archs) and archs[0] in CLASSIFIER_ARCHITECTURES
    known = {**ARCHITECTURES, **CLASSIFIER_ARCHITECTURES}
    family = known.get(archs[0]) if archs else MODEL_TYPES.get(cfg.get("model_type"))
    if family is None:
        raise ModelConfigError(
            f"{where}: architectures={archs} / model_type={cfg.get('model_type')!r} is not "
            f"supported; accepted architectures: {sorted(ARCHITECTURES)}, and as reward models "
            f"(one label) {sorted(CLASSIFIER_ARCHITECTURES)}"
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
        if kind not in ("llama3", "linear", "default"):
            raise ModelConfigError(
                f"{where}: rope_scaling.rope_type={kind!r} is not supported; accepted: "
                "'llama3', 'linear', 'default'"
            )
        rope_scaling = None if kind == "default" else {**rope_scaling, "rope_type": kind}
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", family == "mistral"):
        if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
            raise ModelConfigError(
                f"{where}: sliding_window={cfg['sliding_window']} attention is not supported"
            )
    moe = {}
    if family == "mixtral":
        moe = dict(
            num_experts=int(_get(cfg, "num_local_experts", where)),
            moe_topk=int(_get(cfg, "num_experts_per_tok", where)),
            moe_intermediate_size=int(_get(cfg, "intermediate_size", where)),
        )
    elif family == "qwen3_moe":
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ModelConfigError(
                f"{where}: mixed dense/MoE layers (mlp_only_layers, decoder_sparse_step != 1) "
                "are not supported"
            )
        moe = dict(
            num_experts=int(_get(cfg, "num_experts", where)),
            moe_topk=int(_get(cfg, "num_experts_per_tok", where)),
            moe_intermediate_size=int(_get(cfg, "moe_intermediate_size", where)),
            moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        )
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
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        score_head=score_head,
        hf_config=original,
        **moe,
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

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def active_fp8_recipe(self) -> str | None:
        """`fp8_recipe` when FP8 is on, else None (what megatron's optimizer is given)."""
        return self.fp8_recipe if self.fp8 is not None else None


def transformer_config(
    arch: ModelArch, parallel, precision: PrecisionConfig, *, gpu: bool, routing_replay=False
):
    """Build megatron-core's `TransformerConfig` for `arch` under a `ParallelConfig`;
    `routing_replay`: MoE routers that can replay given routes (`megarl.models.routing`)."""
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
        pipeline_dtype=dtype,
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
            # fp32 routing goes through a TE GEMM in megatron-core 0.16 (NameError without TE)
            moe_router_dtype="fp32" if gpu else None,
            moe_enable_routing_replay=routing_replay,
        )
    if precision.fp8 is not None:
        kw.update(fp8=precision.fp8, fp8_recipe=precision.fp8_recipe, fp8_param=precision.fp8_param)
    return TransformerConfig(**kw)


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
    bad = [f"{k} = {v}" for k, v in dims.items() if v % align]
    if bad:
        raise ModelConfigError(
            f"precision.fp8={precision.fp8!r} (recipe {precision.fp8_recipe}) needs GEMM weight "
            f"dimensions divisible by {align}; not divisible: {'; '.join(bad)}. Accepted: "
            "another tensor_parallel, or precision.fp8=null"
        )
