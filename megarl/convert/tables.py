"""The HF <-> megatron mapping's data: one declarative table of `Rule`s per family.

A rule ties one canonical tensor (megatron-core name with the *global* layer index `{i}` and
global expert index `{e}`, see `megarl.convert.layout`) to the HF tensor(s) it is made of, with the
HF shapes in symbolic dims (`megarl.convert.mapping._dims`) and the transform that joins them
(`copy`, `qkv`, `gate_up`: `megarl.convert.mapping`'s docstring). Rules hold for every layer, or
for the dense or the MoE layers only (`layers`), and may need an arch feature (`when`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    canonical: str
    """Megatron name template; `{i}` = global layer index, `{e}` = global expert index."""
    hf: tuple[str, ...]
    """HF name template(s), in the order the transform takes them."""
    shapes: tuple[tuple[str, ...], ...]
    """Symbolic shape of each HF tensor (dims: see `_dims`)."""
    kind: str = "copy"
    """copy | qkv | qkv_gated | gdn_in | gdn_in_split | gate_up | gate_up_t | interleaved | t
    (`megarl.convert.mapping`)."""
    when: str | None = None
    """Arch feature the rule needs: qkv_bias, qk_norm, untied (an LM head of its own), score (a
    scalar score head), shared (shared experts), q_lora / q_full (MLA's query projection);
    None = always."""
    layers: str | None = None
    """Which layers hold it: dense (a dense MLP), moe (a routed one); None = every layer."""
    attention: str | None = None
    """Which layers hold it: linear (Gated DeltaNet), full (attention); None = every layer."""


def _attn(prefix: str = "model.layers.{i}.self_attn.") -> tuple[Rule, ...]:
    c = "decoder.layers.{i}.self_attention."
    return (
        Rule(
            "decoder.layers.{i}.input_layernorm.weight",
            ("model.layers.{i}.input_layernorm.weight",),
            (("hidden",),),
        ),
        Rule(
            c + "linear_qkv.weight",
            tuple(prefix + f"{p}_proj.weight" for p in "qkv"),
            (("q", "hidden"), ("kv", "hidden"), ("kv", "hidden")),
            kind="qkv",
        ),
        Rule(
            c + "linear_qkv.bias",
            tuple(prefix + f"{p}_proj.bias" for p in "qkv"),
            (("q",), ("kv",), ("kv",)),
            kind="qkv",
            when="qkv_bias",
        ),
        Rule(
            c + "q_layernorm.weight", (prefix + "q_norm.weight",), (("head_dim",),), when="qk_norm"
        ),
        Rule(
            c + "k_layernorm.weight", (prefix + "k_norm.weight",), (("head_dim",),), when="qk_norm"
        ),
        Rule(c + "linear_proj.weight", (prefix + "o_proj.weight",), (("hidden", "o"),)),
        Rule(
            "decoder.layers.{i}.pre_mlp_layernorm.weight",
            ("model.layers.{i}.post_attention_layernorm.weight",),
            (("hidden",),),
        ),
    )


_EMBED = Rule(
    "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), (("vocab", "hidden"),)
)
_HEAD = (
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), (("hidden",),)),
    Rule("output_layer.weight", ("lm_head.weight",), (("vocab", "hidden"),), when="untied"),
    Rule("output_layer.weight", ("score.weight",), (("one", "hidden"),), when="score"),
)
_DENSE_MLP = (
    Rule(
        "decoder.layers.{i}.mlp.linear_fc1.weight",
        ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        (("ffn", "hidden"), ("ffn", "hidden")),
        kind="gate_up",
        layers="dense",
    ),
    Rule(
        "decoder.layers.{i}.mlp.linear_fc2.weight",
        ("model.layers.{i}.mlp.down_proj.weight",),
        (("hidden", "ffn"),),
        layers="dense",
    ),
)
_EXP = "decoder.layers.{i}.mlp.experts.local_experts.{e}."
_MIXTRAL_MOE = (
    Rule(
        "decoder.layers.{i}.mlp.router.weight",
        ("model.layers.{i}.block_sparse_moe.gate.weight",),
        (("experts", "hidden"),),
        layers="moe",
    ),
    Rule(
        _EXP + "linear_fc1.weight",
        (
            "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
            "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
        ),
        (("moe_ffn", "hidden"), ("moe_ffn", "hidden")),
        kind="gate_up",
        layers="moe",
    ),
    Rule(
        _EXP + "linear_fc2.weight",
        ("model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",),
        (("hidden", "moe_ffn"),),
        layers="moe",
    ),
)
_QWEN3_MOE = (
    Rule(
        "decoder.layers.{i}.mlp.router.weight",
        ("model.layers.{i}.mlp.gate.weight",),
        (("experts", "hidden"),),
        layers="moe",
    ),
    Rule(
        _EXP + "linear_fc1.weight",
        (
            "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
            "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        ),
        (("moe_ffn", "hidden"), ("moe_ffn", "hidden")),
        kind="gate_up",
        layers="moe",
    ),
    Rule(
        _EXP + "linear_fc2.weight",
        ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",),
        (("hidden", "moe_ffn"),),
        layers="moe",
    ),
)


def _mla(p: str = "model.layers.{i}.self_attn.") -> tuple[Rule, ...]:
    """DeepSeek-V3's multi-latent attention: every tensor a plain copy (megatron splits its
    projections' outputs as transformers does: q heads [nope; rope], kv_a [latent; rope key],
    kv_b heads [k nope; v])."""
    c = "decoder.layers.{i}.self_attention."
    norm, post = _attn()[0], _attn()[-1]
    return (
        norm,
        Rule(c + "linear_q_proj.weight", (p + "q_proj.weight",), (("q", "hidden"),), when="q_full"),
        Rule(
            c + "linear_q_down_proj.weight",
            (p + "q_a_proj.weight",),
            (("q_lora", "hidden"),),
            when="q_lora",
        ),
        Rule(
            c + "q_layernorm.weight", (p + "q_a_layernorm.weight",), (("q_lora",),), when="q_lora"
        ),
        Rule(
            c + "linear_q_up_proj.weight",
            (p + "q_b_proj.weight",),
            (("q", "q_lora"),),
            when="q_lora",
        ),
        Rule(
            c + "linear_kv_down_proj.weight",
            (p + "kv_a_proj_with_mqa.weight",),
            (("kv_a", "hidden"),),
        ),
        Rule(c + "kv_layernorm.weight", (p + "kv_a_layernorm.weight",), (("kv_lora",),)),
        Rule(c + "linear_kv_up_proj.weight", (p + "kv_b_proj.weight",), (("kv_b", "kv_lora"),)),
        Rule(c + "linear_proj.weight", (p + "o_proj.weight",), (("hidden", "o"),)),
        post,
    )


_SHARED = "decoder.layers.{i}.mlp.shared_experts."
_SIGMOID_MOE = (
    *_QWEN3_MOE,
    Rule(
        "decoder.layers.{i}.mlp.router.expert_bias",
        ("model.layers.{i}.mlp.gate.e_score_correction_bias",),
        (("experts",),),
        layers="moe",
    ),
    Rule(
        _SHARED + "linear_fc1.weight",
        (
            "model.layers.{i}.mlp.shared_experts.gate_proj.weight",
            "model.layers.{i}.mlp.shared_experts.up_proj.weight",
        ),
        (("shared_ffn", "hidden"), ("shared_ffn", "hidden")),
        kind="gate_up",
        when="shared",
        layers="moe",
    ),
    Rule(
        _SHARED + "linear_fc2.weight",
        ("model.layers.{i}.mlp.shared_experts.down_proj.weight",),
        (("hidden", "shared_ffn"),),
        when="shared",
        layers="moe",
    ),
)


def _gpt_oss() -> tuple[Rule, ...]:
    """gpt-oss: biases on q / k / v / o, a sink per head, a biased router, experts stored
    stacked with gate / up interleaved along the output and every weight as [in, out]. The HF
    names are per expert (`mlp.experts.{e}.gate_up_proj` [hidden, 2 ffn] ...): the slices of
    transformers' stacked tensors (`megarl.convert.stacked`), and what vLLM 0.32's gpt-oss
    loader takes one expert at a time (gpt_oss.py `_try_load_streamed_expert`)."""
    a, c, x = "model.layers.{i}.self_attn.", "decoder.layers.{i}.self_attention.", _EXP
    h = "model.layers.{i}.mlp.experts.{e}."
    attn = _attn()
    return (
        *attn[:-2],
        attn[-2],
        Rule(c + "linear_proj.bias", (a + "o_proj.bias",), (("hidden",),)),
        Rule(c + "core_attention.softmax_offset", (a + "sinks",), (("heads",),)),
        attn[-1],
        Rule(
            "decoder.layers.{i}.mlp.router.weight",
            ("model.layers.{i}.mlp.router.weight",),
            (("experts", "hidden"),),
        ),
        Rule(
            "decoder.layers.{i}.mlp.router.bias",
            ("model.layers.{i}.mlp.router.bias",),
            (("experts",),),
        ),
        Rule(
            x + "linear_fc1.weight", (h + "gate_up_proj",), (("hidden", "moe_ffn2"),), "gate_up_t"
        ),
        Rule(x + "linear_fc1.bias", (h + "gate_up_proj_bias",), (("moe_ffn2",),), "interleaved"),
        Rule(x + "linear_fc2.weight", (h + "down_proj",), (("moe_ffn", "hidden"),), "t"),
        Rule(x + "linear_fc2.bias", (h + "down_proj_bias",), (("hidden",),)),
    )


def _gdn_hybrid(in_proj: Rule) -> tuple[Rule, ...]:
    """The attention side of Qwen3-Next / Qwen3.5 layers: Gated DeltaNet layers (`linear_attn.*`,
    their q / k / v / z / b / a projections joined by `in_proj` into megatron's one) and gated
    full-attention layers (q_proj's rows per head [q; gate]); zero-centred norms as stored."""
    a, c, g = "model.layers.{i}.self_attn.", "decoder.layers.{i}.self_attention.", "linear_attn."
    la = "model.layers.{i}." + g
    attn = _attn()

    def full(r: Rule) -> Rule:
        return Rule(r.canonical, r.hf, r.shapes, r.kind, r.when, r.layers, "full")

    def linear(canonical: str, hf: str, shape: tuple[str, ...]) -> Rule:
        return Rule(c + canonical, (la + hf,), (shape,), attention="linear")

    return (
        attn[0],
        Rule(
            c + "linear_qkv.weight",
            tuple(a + f"{p}_proj.weight" for p in "qkv"),
            (("q2", "hidden"), ("kv", "hidden"), ("kv", "hidden")),
            kind="qkv_gated",
            attention="full",
        ),
        *(full(r) for r in attn[3:6]),  # q / k norms, o_proj
        in_proj,
        linear("conv1d.weight", "conv1d.weight", ("conv", "one", "conv_k")),
        linear("dt_bias", "dt_bias", ("v_heads",)),
        linear("A_log", "A_log", ("v_heads",)),
        linear("out_norm.weight", "norm.weight", ("v_dim",)),
        linear("out_proj.weight", "out_proj.weight", ("hidden", "v_all")),
        attn[-1],
    )


_GDN_IN = "decoder.layers.{i}.self_attention.in_proj.weight"
_LA = "model.layers.{i}.linear_attn."


def _qwen3_5() -> tuple[Rule, ...]:
    """Qwen3.5 (dense, text): Qwen3-Next's layers with q / k / v, z, b and a from projections of
    their own (`in_proj_qkv` holds q, k, v each with its heads contiguous) and dense MLPs."""
    in_proj = Rule(
        _GDN_IN,
        tuple(_LA + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
        (("qkv_lin", "hidden"), ("v_all", "hidden"), ("v_heads", "hidden"), ("v_heads", "hidden")),
        kind="gdn_in_split",
        attention="linear",
    )
    return (*_gdn_hybrid(in_proj), *_DENSE_MLP)


def _qwen3_next() -> tuple[Rule, ...]:
    """Qwen3-Next: q / k / v / z and b / a projections grouped per key head; every layer routed,
    with a shared expert behind a sigmoid gate."""
    in_proj = Rule(
        _GDN_IN,
        (_LA + "in_proj_qkvz.weight", _LA + "in_proj_ba.weight"),
        (("qkvz", "hidden"), ("ba", "hidden")),
        kind="gdn_in",
        attention="linear",
    )
    return (
        *_gdn_hybrid(in_proj),
        *_QWEN3_MOE,
        Rule(
            _SHARED + "linear_fc1.weight",
            (
                "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
                "model.layers.{i}.mlp.shared_expert.up_proj.weight",
            ),
            (("shared_ffn", "hidden"), ("shared_ffn", "hidden")),
            kind="gate_up",
        ),
        Rule(
            _SHARED + "linear_fc2.weight",
            ("model.layers.{i}.mlp.shared_expert.down_proj.weight",),
            (("hidden", "shared_ffn"),),
        ),
        Rule(
            _SHARED + "gate_weight",
            ("model.layers.{i}.mlp.shared_expert_gate.weight",),
            (("one", "hidden"),),
        ),
    )


# family -> table (rules in canonical order: embedding, layers, final norm, output layer)
TABLES: dict[str, tuple[Rule, ...]] = {
    "llama": (_EMBED, *_attn(), *_DENSE_MLP, *_HEAD),
    "mistral": (_EMBED, *_attn(), *_DENSE_MLP, *_HEAD),
    "qwen2": (_EMBED, *_attn(), *_DENSE_MLP, *_HEAD),  # + q/k/v biases (when=qkv_bias)
    "qwen3": (_EMBED, *_attn(), *_DENSE_MLP, *_HEAD),  # + q/k norms (when=qk_norm)
    "qwen3_moe": (_EMBED, *_attn(), *_QWEN3_MOE, *_HEAD),
    "mixtral": (_EMBED, *_attn(), *_MIXTRAL_MOE, *_HEAD),
    "glm4_moe": (_EMBED, *_attn(), *_DENSE_MLP, *_SIGMOID_MOE, *_HEAD),
    "deepseek_v3": (_EMBED, *_mla(), *_DENSE_MLP, *_SIGMOID_MOE, *_HEAD),
    "gpt_oss": (_EMBED, *_gpt_oss(), *_HEAD),
    "qwen3_next": (_EMBED, *_qwen3_next(), *_HEAD),
    "qwen3_5": (_EMBED, *_qwen3_5(), *_HEAD),
}
