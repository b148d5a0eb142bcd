"""How a megarl model's sharded state dict matches the tensor names of a checkpoint.

megatron's sharded state dict names every tensor by its *global* key (layers stacked on a
leading axis, experts by global index, TP shards by offset), so the files do not depend on TP /
PP / VPP / EP. A trainer checkpoint prefixes each role's keys (`actor.`, `critic.`); a converter
checkpoint has no prefix.

Local spec vs Transformer-Engine spec: megatron's local spec already names the fused norms as TE
does (`input_layernorm` -> `self_attention.linear_qkv.layer_norm_weight`, `pre_mlp_layernorm`
-> `mlp.linear_fc1.layer_norm_weight`). For MoE layers the TE spec keeps a standalone
`pre_mlp_layernorm`, while megatron-core 0.16's local spec still maps it onto the (absent) fused
fc1; multi-latent attention's TE spec fuses the latent norms into the up projections
(`linear_q_up_proj.layer_norm_weight`, ...) where the local spec keeps them standalone
(`MLA_NORMS`), and fuses a dense layer's pre-MLP norm where the local MLA spec does not; a Gated
DeltaNet layer's input norm is TE's `in_proj.layer_norm_weight` (`GDN_NORM`). A writer
gives the local names the TE ones (`rename_te_keys`), a reader matches either name
(`match_norm_keys`), for stacked keys and for per-layer keys alike (`_LAYER_KEY`). TE-only
`_extra_state` objects (FP8 metadata) are optional in both directions.
"""

from __future__ import annotations

import re

from megarl.checkpoint.files import CheckpointError
from megarl.models.builder import SCALAR_ROLES, unwrap
from megarl.models.hf_config import ModelArch

MLA_NORMS = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
"""Local-spec name -> Transformer-Engine-spec name of multi-latent attention's latent norms
(within a layer)."""
FUSED_MLP_NORM, MLP_NORM = "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"
QKV_NORM, GDN_NORM = (
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.in_proj.layer_norm_weight",
)
"""A layer's input norm in the local spec's keys map, and in TE's Gated DeltaNet spec."""
_PAIRS = {
    FUSED_MLP_NORM: MLP_NORM,
    MLP_NORM: FUSED_MLP_NORM,
    QKV_NORM: GDN_NORM,
    GDN_NORM: QKV_NORM,
}
for _local, _te in MLA_NORMS.items():
    _PAIRS[_local], _PAIRS[_te] = _te, _local
_LAYER_KEY = re.compile(r"^(.*decoder\.layers\.)(\d+\.)?(.+)$")
"""A layer tensor's key: stacked over layers (`decoder.layers.x`), or one layer's
(`decoder.layers.3.x`: megatron names each layer when they are not all alike, e.g. dense first
layers before MoE ones)."""


def has_value_head(model) -> bool:
    """Whether `model` (one chunk) belongs to a model with a scalar head (a critic, a reward
    model), also on a pipeline stage that holds no output layer."""
    head = getattr(model, "output_layer", None)
    if getattr(model, "megarl_role", None) in SCALAR_ROLES:
        return True
    return head is not None and type(head).__name__ == "ValueHead"


def check_arch(chunks, arch: ModelArch, where: str) -> None:
    """Raise naming each field where the chunks' model differs from the checkpoint's arch."""
    model = unwrap(chunks[0])
    c = model.config
    have = {
        "num_hidden_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_query_groups or c.num_attention_heads,
        "head_dim": c.kv_channels,
        "vocab_size": getattr(model, "megarl_vocab_size", arch.vocab_size),
        "qkv_bias": bool(c.add_qkv_bias),
        "qk_norm": bool(c.qk_layernorm),
        "num_experts": c.num_moe_experts,
    }
    want = {
        "num_hidden_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "vocab_size": arch.vocab_size,
        "qkv_bias": arch.qkv_bias,
        "qk_norm": arch.qk_norm,
        "num_experts": arch.num_experts,
    }
    if arch.is_moe:
        have["moe_intermediate_size"] = c.moe_ffn_hidden_size
        want["moe_intermediate_size"] = arch.moe_intermediate_size
    else:
        have["intermediate_size"] = c.ffn_hidden_size
        want["intermediate_size"] = arch.intermediate_size
    if not has_value_head(model):
        have["tie_word_embeddings"] = bool(model.share_embeddings_and_output_weights)
        want["tie_word_embeddings"] = arch.tie_word_embeddings
    diff = [f"{k}: checkpoint {want[k]} vs model {have[k]}" for k in want if want[k] != have[k]]
    if diff:
        raise CheckpointError(f"{where} was written for a different model: " + "; ".join(diff))


def rename_te_keys(sd: dict, arch: ModelArch) -> None:
    """Rename local-spec keys that differ from the TE spec (module doc): an MoE layer's pre-MLP
    norm, multi-latent attention's latent norms, a Gated DeltaNet layer's input norm."""
    for v in sd.values():
        m = _LAYER_KEY.match(getattr(v, "key", None) or "")
        if m is None:
            continue
        head, layer, rest = m.groups()
        moe_layer = arch.is_moe and (layer is None or arch.is_moe_layer(int(layer[:-1])))
        if rest == FUSED_MLP_NORM and moe_layer:
            v.key = head + (layer or "") + MLP_NORM
        elif rest in MLA_NORMS and arch.mla is not None:
            v.key = head + (layer or "") + MLA_NORMS[rest]
        elif rest == QKV_NORM and layer is not None and arch.is_linear_layer(int(layer[:-1])):
            v.key = head + layer + GDN_NORM


def match_norm_keys(model_sd: dict, file_keys: set[str], prefix: str) -> None:
    """Give a norm whose name differs between the specs the name the checkpoint uses (module
    doc): a pre-MLP norm, multi-latent attention's latent norms; stacked or per layer."""
    for v in model_sd.values():
        key = getattr(v, "key", None) or ""
        m = _LAYER_KEY.match(key)
        if m is None or key in file_keys or not key.startswith(prefix):
            continue
        head, layer, rest = m.groups()
        other = head + (layer or "") + _PAIRS.get(rest, rest)
        if other != key and other in file_keys:
            v.key = other


def strip_prefix(sd: dict, prefix: str) -> dict:
    """`sd` with `prefix` taken off the keys that start with it."""
    if not prefix:
        return sd
    return {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in sd.items()}
