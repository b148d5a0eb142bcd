"""How a megarl model's sharded state dict matches the tensor names of a checkpoint.

megatron's sharded state dict names every tensor by its *global* key (layers stacked on a
leading axis, experts by global index, TP shards by offset), so the files do not depend on TP /
PP / VPP / EP. A trainer checkpoint prefixes each role's keys (`actor.`, `critic.`); a converter
checkpoint has no prefix.

Local spec vs Transformer-Engine spec: megatron's local spec already names the fused norms as TE
does (`input_layernorm` -> `self_attention.linear_qkv.layer_norm_weight`, `pre_mlp_layernorm`
-> `mlp.linear_fc1.layer_norm_weight`). For MoE layers the TE spec keeps a standalone
`pre_mlp_layernorm` (`MOE_TE_NORM`), while megatron-core 0.16's local spec still maps it onto
the (absent) fused fc1 (`MOE_LOCAL_NORM`): a writer renames that key (`rename_te_keys`), so
CPU-written MoE checkpoints carry the TE name, and a reader matches either name
(`match_norm_keys`). TE-only `_extra_state` objects (FP8 metadata) are optional in both
directions.
"""

from __future__ import annotations

from megarl.checkpoint.files import CheckpointError
from megarl.models.builder import SCALAR_ROLES, unwrap
from megarl.models.hf_config import ModelArch

MOE_LOCAL_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
MOE_TE_NORM = "decoder.layers.pre_mlp_layernorm.weight"


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
    """Rename local-spec keys that differ from the TE spec (module doc)."""
    if not arch.is_moe:
        return
    for v in sd.values():
        if getattr(v, "key", None) == MOE_LOCAL_NORM:
            v.key = MOE_TE_NORM


def match_norm_keys(model_sd: dict, file_keys: set[str], prefix: str) -> None:
    """Give an MoE pre-MLP norm the name the checkpoint uses (module doc)."""
    local, te = prefix + MOE_LOCAL_NORM, prefix + MOE_TE_NORM
    for v in model_sd.values():
        key = getattr(v, "key", None)
        if key == local and key not in file_keys and te in file_keys:
            v.key = te
        elif key == te and key not in file_keys and local in file_keys:
            v.key = local


def strip_prefix(sd: dict, prefix: str) -> dict:
    """`sd` with `prefix` taken off the keys that start with it."""
    if not prefix:
        return sd
    return {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in sd.items()}
