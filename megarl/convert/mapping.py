"""Level 2: canonical megatron names <-> Hugging Face names, one declarative table per family
(the tables: `megarl.convert.tables`).

A table is a tuple of `Rule`s. Each rule ties one canonical tensor (megatron-core name with the
*global* layer index `{i}` and global expert index `{e}`, see `megarl.convert.layout`) to the HF
tensor(s) it is made of, with the HF shapes in symbolic dims and the transform that joins them:

- `copy`: one HF tensor, unchanged (norms, o_proj, down_proj, router, embeddings).
- `qkv`: q_proj, k_proj, v_proj -> megatron's `linear_qkv`, laid out per query group g as
  `[q heads of g (heads/kv_heads x head_dim rows); k_g (head_dim rows); v_g (head_dim rows)]`,
  groups concatenated; biases the same way.
- `qkv_gated`: Qwen3-Next's q_proj (each head's [q; gate]), k_proj, v_proj -> `linear_qkv`, per
  query group `[q heads; gate heads; k_g; v_g]`.
- `gdn_in`: Qwen3-Next's `in_proj_qkvz`, `in_proj_ba` (grouped per key head) -> the Gated
  DeltaNet's `in_proj = [q; k; v; z; b; a]`; `gdn_in_split`: Qwen3.5's `in_proj_qkv`,
  `in_proj_z`, `in_proj_b`, `in_proj_a` -> the same, joined.
- `gate_up`: gate_proj, up_proj -> `linear_fc1 = [gate; up]` (megatron's gated-linear layout).
- `gate_up_t`: gpt-oss's one expert `gate_up_proj` [hidden, 2 ffn], gate / up interleaved along
  the output -> `linear_fc1` [2 ffn, hidden] = [gate; up] (transposed, de-interleaved);
  `interleaved`: its bias [2 ffn] the same way; `t`: `down_proj` [ffn, hidden] transposed.

A reward model (`arch.score_head`: `<Family>ForSequenceClassification`, one label) holds
`score.weight` [1, hidden] instead of `lm_head.weight`; it is the canonical `output_layer.weight`
of megarl's scalar head (`megarl.models.builder.ValueHead`), a plain copy.

Vocab rows: canonical tensors have exactly `vocab_size` rows, like the HF ones (megatron's padding
to a multiple of make_vocab_size_divisible_by x TP is added and cut in `layout`), so embeddings and
`lm_head` are plain copies. Tied embeddings: no `lm_head.weight` is produced; one found in HF
files of a tied model is ignored (some exporters write the duplicate).

MoE names are the ones transformers 5.19 writes *to disk* (it fuses experts only in memory):
Mixtral `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down) and `block_sparse_moe.gate`,
Qwen3-MoE, GLM-4.5 and DeepSeek-V3 `mlp.experts.{e}.gate_proj/up_proj/down_proj` and `mlp.gate`
(the last two with `mlp.gate.e_score_correction_bias` and `mlp.shared_experts.*`). Multi-token-
prediction layers (DeepSeek-V3's `model.layers.{num_hidden_layers}.*`, Qwen3-Next's `mtp.*`) are
skipped (`is_mtp_name`).

The pure transforms of the fused layouts are `megarl.models.fused`'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from megarl.convert import stacked
from megarl.convert.tables import TABLES, Rule
from megarl.errors import UserError
from megarl.models.fused import (
    gate_up_from_megatron,
    gate_up_to_megatron,
    gdn_in_from_megatron,
    gdn_in_split_from_megatron,
    gdn_in_split_to_megatron,
    gdn_in_to_megatron,
    interleaved_from_megatron,
    interleaved_to_megatron,
    qkv_from_megatron,
    qkv_gated_from_megatron,
    qkv_gated_to_megatron,
    qkv_to_megatron,
)
from megarl.models.hf_config import ModelArch


class MappingError(UserError, ValueError):
    """HF <-> megatron names or shapes that do not fit; the message names the key."""


# ----------------------------------------------------------------------------- the tables
# HF names that are not parameters (old exporters saved rotary buffers): skipped when reading
_IGNORED_HF = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_mtp_name(arch: ModelArch, hf_name: str) -> bool:
    """Whether `hf_name` belongs to a multi-token-prediction layer (DeepSeek-V3's layer 61):
    megarl builds none and skips them, as transformers does."""
    if hf_name.startswith("mtp."):  # Qwen3-Next's
        return True
    m = _HF_LAYER.match(hf_name)
    return m is not None and arch.num_layers <= int(m.group(1)) < arch.num_layers + arch.mtp_layers


def table_for(arch: ModelArch) -> tuple[Rule, ...]:
    """The rules that apply to `arch` (conditions resolved)."""
    if arch.family not in TABLES:
        raise MappingError(f"no HF mapping for family {arch.family!r}; accepted: {sorted(TABLES)}")
    mla = arch.mla
    feats = {
        "qkv_bias": arch.qkv_bias,
        "qk_norm": arch.qk_norm,
        "untied": not arch.tie_word_embeddings and not arch.score_head,
        "score": arch.score_head,
        "shared": bool(arch.moe_shared_intermediate_size),
        "q_lora": mla is not None and mla.q_lora_rank is not None,
        "q_full": mla is not None and mla.q_lora_rank is None,
        "linear_bias": arch.linear_bias,
    }
    return tuple(r for r in TABLES[arch.family] if r.when is None or feats[r.when])


def _dims(arch: ModelArch) -> dict[str, int]:
    m = arch.mla
    heads = arch.num_attention_heads
    mla = {}
    if m is not None:
        mla = dict(
            q_lora=m.q_lora_rank or 0,
            kv_lora=m.kv_lora_rank,
            kv_a=m.kv_lora_rank + m.qk_rope_head_dim,
            kv_b=heads * (m.qk_nope_head_dim + m.v_head_dim),
            o=heads * m.v_head_dim,
        )
    gdn = {}
    if (g := arch.gdn) is not None:
        gdn = dict(
            qkvz=2 * g.key_heads * g.key_dim + 2 * g.value_heads * g.value_dim,
            ba=2 * g.value_heads,
            qkv_lin=2 * g.key_heads * g.key_dim + g.value_heads * g.value_dim,
            conv=2 * g.key_heads * g.key_dim + g.value_heads * g.value_dim,
            conv_k=g.conv_kernel,
            v_heads=g.value_heads,
            v_dim=g.value_dim,
            v_all=g.value_heads * g.value_dim,
        )
    return {
        **gdn,
        "q2": 2 * heads * arch.head_dim,
        "o": heads * arch.head_dim,
        "shared_ffn": arch.moe_shared_intermediate_size or 0,
        **mla,
        "vocab": arch.vocab_size,
        "hidden": arch.hidden_size,
        "q": arch.num_attention_heads * arch.head_dim,
        "kv": arch.num_key_value_heads * arch.head_dim,
        "head_dim": arch.head_dim,
        "ffn": arch.intermediate_size,
        "moe_ffn": arch.moe_intermediate_size or 0,
        "moe_ffn2": 2 * (arch.moe_intermediate_size or 0),
        "heads": heads,
        "experts": arch.num_experts or 0,
        "one": 1,
    }


@dataclass(frozen=True)
class MappedTensor:
    """One instance of a rule: a canonical tensor and the HF tensor(s) it is made of, with
    concrete names and shapes."""

    rule: Rule
    canonical: str
    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def kind(self) -> str:
        return self.rule.kind


def _instances(arch: ModelArch) -> Iterator[MappedTensor]:
    dims = _dims(arch)
    rules = table_for(arch)
    shapes = {r: tuple(tuple(dims[d] for d in s) for s in r.shapes) for r in rules}

    def inst(r: Rule, **idx) -> MappedTensor:
        return MappedTensor(
            r, r.canonical.format(**idx), tuple(h.format(**idx) for h in r.hf), shapes[r]
        )

    glob = [r for r in rules if "{i}" not in r.canonical]
    layer = [r for r in rules if "{i}" in r.canonical]
    for r in glob:
        if r.canonical.startswith("embedding."):
            yield inst(r)
    for i in range(arch.num_layers):
        kind = "moe" if arch.is_moe_layer(i) else "dense"
        attention = "linear" if arch.is_linear_layer(i) else "full"
        for r in layer:
            if r.layers is not None and r.layers != kind:
                continue
            if r.attention is not None and r.attention != attention:
                continue
            if "{e}" in r.canonical:
                for e in range(arch.num_experts or 0):
                    yield inst(r, i=i, e=e)
            else:
                yield inst(r, i=i)
    for r in glob:
        if not r.canonical.startswith("embedding."):
            yield inst(r)


def hf_names_for(arch: ModelArch) -> list[str]:
    """All HF parameter names of `arch` (what its safetensors files hold)."""
    return [n for item in _instances(arch) for n in item.hf]


def hf_shapes_for(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape."""
    return {n: s for item in _instances(arch) for n, s in zip(item.hf, item.shapes, strict=True)}


def canonical_names_for(arch: ModelArch) -> list[str]:
    """All canonical megatron names of `arch` (global layer and expert indices)."""
    return [item.canonical for item in _instances(arch)]


# ----------------------------------------------------------------------------- transforms
def _to_megatron(arch: ModelArch, kind: str, ts: list[torch.Tensor]) -> torch.Tensor:
    if kind == "copy":
        return ts[0]
    if kind == "qkv":
        return qkv_to_megatron(
            *ts, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        )
    if kind == "qkv_gated":
        return qkv_gated_to_megatron(
            *ts, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        )
    if kind == "gdn_in":
        return gdn_in_to_megatron(*ts, arch.gdn)
    if kind == "gdn_in_split":
        return gdn_in_split_to_megatron(*ts)
    if kind == "gate_up":
        return gate_up_to_megatron(*ts)
    if kind == "gate_up_t":
        return interleaved_to_megatron(ts[0].t())
    if kind == "interleaved":
        return interleaved_to_megatron(ts[0])
    if kind == "t":
        return ts[0].t().contiguous()
    raise MappingError(f"unknown rule kind {kind!r}; accepted: {KINDS}")


def _from_megatron(arch: ModelArch, kind: str, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if kind == "copy":
        return (t,)
    if kind == "qkv":
        return qkv_from_megatron(
            t, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        )
    if kind == "qkv_gated":
        return qkv_gated_from_megatron(
            t, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        )
    if kind == "gdn_in":
        return gdn_in_from_megatron(t, arch.gdn)
    if kind == "gdn_in_split":
        return gdn_in_split_from_megatron(t, arch.gdn)
    if kind == "gate_up":
        return gate_up_from_megatron(t)
    if kind == "gate_up_t":
        return (interleaved_from_megatron(t).t(),)
    if kind == "interleaved":
        return (interleaved_from_megatron(t),)
    if kind == "t":
        return (t.t(),)
    raise MappingError(f"unknown rule kind {kind!r}; accepted: {KINDS}")


KINDS = (
    "copy", "qkv", "qkv_gated", "gdn_in", "gdn_in_split", "gate_up", "gate_up_t", "interleaved",
    "t",
)  # fmt: skip


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...], what: str) -> None:
    if tuple(got) != tuple(want):
        raise MappingError(
            f"{what} {name!r} has shape {tuple(got)}, expected {tuple(want)} from the model "
            "config (hidden_size, heads x head_dim, intermediate_size, vocab_size, experts)"
        )


def check_hf_names(
    arch: ModelArch,
    hf_names: Iterable[str],
    *,
    shape_of: Callable[[str], tuple[int, ...]] | None = None,
) -> None:
    """Raise `MappingError` naming them when the HF files hold names no rule consumes or lack
    mapped names; with `shape_of` (shape without loading) check every mapped shape too."""
    items = list(_instances(arch))
    present = set(hf_names)
    expected = {n for item in items for n in item.hf}
    extra = sorted(
        n
        for n in present - expected
        if not _IGNORED_HF.match(n)
        and not (n == "lm_head.weight" and arch.tie_word_embeddings)
        and not is_mtp_name(arch, n)
    )
    if extra:
        raise MappingError(
            f"{len(extra)} HF tensor(s) that no {arch.family} mapping consumes: "
            f"{_show(extra)} (is the config right? tie_word_embeddings="
            f"{arch.tie_word_embeddings}, num_hidden_layers={arch.num_layers})"
        )
    missing = [n for item in items for n in item.hf if n not in present]
    if missing:
        raise MappingError(f"{len(missing)} mapped HF tensor(s) missing: {_show(missing)}")
    if shape_of is not None:
        for item in items:
            for n, s in zip(item.hf, item.shapes, strict=True):
                _check_shape(n, shape_of(n), s, "HF tensor")


def canonical_from_hf(
    arch: ModelArch, item: MappedTensor, tensors: list[torch.Tensor]
) -> torch.Tensor:
    """The canonical tensor of `item` from its HF tensors (in `item.hf` order), shapes checked."""
    for n, s, t in zip(item.hf, item.shapes, tensors, strict=True):
        _check_shape(n, t.shape, s, "HF tensor")
    return _to_megatron(arch, item.kind, tensors)


def hf_to_canonical(
    arch: ModelArch,
    get: Callable[[str], torch.Tensor],
    hf_names: Iterable[str],
    *,
    shape_of: Callable[[str], tuple[int, ...]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(canonical_name, tensor)` built from HF tensors read lazily with `get(name)`.

    `hf_names` are the names the HF files hold; before anything is read, names no rule consumes
    and mapped names that are missing raise `MappingError` naming them. With `shape_of` (shape
    without loading) shapes are checked up front too; otherwise each is checked when read."""
    check_hf_names(arch, hf_names, shape_of=shape_of)
    for item in _instances(arch):
        yield item.canonical, canonical_from_hf(arch, item, [get(n) for n in item.hf])


def mapped_tensors(arch: ModelArch) -> dict[str, MappedTensor]:
    """Canonical name -> its `MappedTensor`, in canonical (= HF writing) order."""
    return _canonical_index(arch)


def _canonical_index(arch: ModelArch) -> dict[str, MappedTensor]:
    return {item.canonical: item for item in _instances(arch)}


def canonical_to_hf(
    arch: ModelArch, items: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(hf_name, tensor)` for canonical `(name, tensor)` pairs, in their order.

    Nothing is buffered: each canonical tensor yields its HF tensor(s) at once. With tied
    embeddings an `output_layer.weight` (if given) is dropped; with `arch.score_head` it is the
    score head (`score.weight`). Unknown names and shape mismatches
    raise `MappingError`."""
    index = _canonical_index(arch)
    for name, t in items:
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            continue
        item = index.get(name)
        if item is None:
            raise MappingError(
                f"canonical tensor {name!r} has no HF mapping for {arch.family} "
                f"(layers={arch.num_layers}, experts={arch.num_experts})"
            )
        outs = _from_megatron(arch, item.rule.kind, t)
        for n, s, out in zip(item.hf, item.shapes, outs, strict=True):
            _check_shape(n, out.shape, s, f"canonical {name!r} -> HF tensor")
            yield n, out


def transposed_hf(arch: ModelArch) -> frozenset[str]:
    """HF names stored [in, out], the transpose of the trainer's [out, in] (gpt-oss's experts:
    rule kinds `gate_up_t`, `t`)."""
    return frozenset(
        n for item in _instances(arch) if item.kind in ("gate_up_t", "t") for n in item.hf
    )


def to_files(
    arch: ModelArch, items: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[str, torch.Tensor]]:
    """HF `(name, tensor)` as the model's files hold them: gpt-oss's per-expert tensors joined
    into their stacked ones (`megarl.convert.stacked`); other families unchanged."""
    if not arch.stacked_experts:
        return items
    return stacked.stack(items, arch.num_experts, MappingError)


def file_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """`hf_shapes_for` as the files hold them (`to_files`)."""
    shapes = hf_shapes_for(arch)
    return stacked.stacked_shapes(shapes, arch.num_experts) if arch.stacked_experts else shapes


def canonical_shapes_for(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape (no vocab padding)."""
    out = {}
    for item in _instances(arch):
        s, kind = item.shapes, item.rule.kind
        if kind in ("copy", "interleaved"):
            out[item.canonical] = s[0]
        elif kind in ("gate_up_t", "t"):
            out[item.canonical] = s[0][::-1]
        else:
            out[item.canonical] = (sum(x[0] for x in s), *s[0][1:])
    return out


def _show(names: list[str], n: int = 8) -> str:
    head = ", ".join(repr(x) for x in names[:n])
    return head + (f", ... ({len(names) - n} more)" if len(names) > n else "")
