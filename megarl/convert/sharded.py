"""Initial weights without the whole model on any rank: each rank fills only its own shards.

`load_hf_sharded(chunks, arch, hf_dir)` reads, for every parameter this rank holds (see
`layout.local_params`), only the HF tensors it is made of (`mapping.mapped_tensors`), and of a
tensor split along dim 0 by TP (column-parallel weights, QKV, [gate; up], vocab rows) only this TP
rank's rows: a row range of a row-major safetensors tensor is one contiguous byte range
(`LazyHFTensors.get_rows`). A fused QKV shard holds whole query groups and an fc1 shard is
`[gate_r; up_r]`, so the mapping's pure transforms build the shard from the slices of q/k/v (or
gate/up) directly. Tensors split along dim 1 (row-parallel: o_proj, down_proj) are strided in the
file and are read whole, then sliced. Peak extra memory: one such whole HF tensor, or one QKV
shard's inputs plus the shard. There is no communication (DP replicas read the same bytes), so a
rank that fails to read raises on its own and nothing waits for it. The result is bit-identical
to `layout.load_full_state(chunks, dict(hf_to_canonical(...)))`: both only copy and concatenate.

Heads: a model with a scalar head (`ValueHead`: a critic or a reward model) reads the `score`
head of a sequence classifier's files (`arch.score_head`); from a causal LM's files it reads the
trunk only, and its head stays as the builder made it. A sequence classifier's files do not load
into a policy.

`seeded_init(chunks, arch, seed)` is the random init of a run from `model.config` (no weights to
read): every HF tensor is drawn from its own generator, seeded by (seed, tensor name), and then
sharded exactly like a file's. The initial model is therefore the same at every TP / PP / EP
layout (megatron-core's own init is not: its RNG streams follow the layout), so a run resumed at
another layout rebuilds the same reference model. Distribution as megatron-core's defaults:
normal(0, 0.02) for embeddings and linear weights, 0.02 / sqrt(2 x layers) for the output
projections of attention and MLP (o_proj, down_proj), ones for norms, zeros for biases. Each
call to a tensor draws it whole (fine for the small models random init is for).

`copy_weights(src, dst)` fills a model built at the same layout on the same rank from another
(the reference and the critic trunk from the initial actor): a local copy by parameter name, no
communication. A critic destination's value head is zeroed (the critic starts at value 0), unless
the source has a scalar head too (a reward model: its head is copied).
"""

from __future__ import annotations

import math
import os
import zlib

import torch

from megarl.checkpoint.keys import has_value_head
from megarl.convert.hf_io import LazyHFTensors
from megarl.convert.layout import VOCAB_PARAMS, local_params, split_tp, tp_shard
from megarl.convert.mapping import (
    MappedTensor,
    MappingError,
    canonical_from_hf,
    check_hf_names,
    gate_up_to_megatron,
    mapped_tensors,
    qkv_to_megatron,
)
from megarl.models.builder import ValueHead, unwrap
from megarl.models.hf_config import ModelArch
from megarl.models.lora import is_lora

_EMBED = "embedding.word_embeddings.weight"
_HEAD = "output_layer.weight"


@torch.no_grad()
def load_hf_sharded(
    chunks: list[torch.nn.Module], arch: ModelArch, hf_dir: str | os.PathLike, into=None
) -> None:
    """Fill this rank's parameters of `chunks` from the HF directory `hf_dir` (not collective).

    Names and shapes of the HF files are checked against `arch` before any data is read
    (`MappingError` names the key); a parameter the mapping does not know raises naming it.
    `into(param, tensor)`, when given, receives each parameter's tensor as read (the files'
    precision) instead of the parameter (`megarl.models.optim.main_param_writer`)."""
    _load_sharded(chunks, arch, LazyHFTensors(hf_dir), into)


@torch.no_grad()
def seeded_init(chunks: list[torch.nn.Module], arch: ModelArch, seed: int, into=None) -> None:
    """Fill this rank's parameters of `chunks` with the layout-independent random init (see the
    module docstring), drawn in fp32; not collective. `into`: as `load_hf_sharded`'s."""
    _load_sharded(chunks, arch, SeededHFTensors(arch, seed), into)


class SeededHFTensors:
    """The HF tensors of `arch`, drawn on demand from per-name seeded generators: the same
    read interface as `LazyHFTensors` (`names`, `shape`, `get`, `get_rows`, `dir`)."""

    STD = 0.02

    def __init__(self, arch: ModelArch, seed: int):
        self.dir = f"<random init, seed {seed}>"
        self.seed = seed
        self.layers = arch.num_layers
        self.zero_centered = arch.zero_centered_norms
        self._shapes = {
            n: tuple(shape)
            for item in mapped_tensors(arch).values()
            for n, shape in zip(item.hf, item.shapes, strict=True)
        }

    @property
    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        leaf = name.rsplit(".", 2)
        if "norm" in name:  # scale 1: zero-centred norms store it as 0 (not the DeltaNet's)
            plain = not self.zero_centered or ".linear_attn.norm." in name
            return torch.ones(shape) if plain else torch.zeros(shape)
        if name.endswith(".bias"):
            return torch.zeros(shape)
        std = self.STD
        if len(leaf) == 3 and leaf[-2] in ("o_proj", "down_proj", "w2"):
            std = self.STD / math.sqrt(2.0 * self.layers)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.empty(shape).normal_(0.0, std, generator=g)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.get(name)[start:stop]


def _copy_into_param(p: torch.nn.Parameter, t: torch.Tensor) -> None:
    p.data.copy_(t)


def _load_sharded(chunks: list[torch.nn.Module], arch: ModelArch, lazy, into=None) -> None:
    into = into or _copy_into_param
    check_hf_names(arch, lazy.names, shape_of=lazy.shape)
    items = mapped_tensors(arch)
    scalar = any(has_value_head(unwrap(c)) for c in chunks)  # also where no head is held
    if arch.score_head and not scalar:
        raise MappingError(
            f"{lazy.dir} is a sequence classifier (a score head, no LM head): it loads into a "
            "reward model or a critic, not into a policy"
        )
    for name, local_name, p in local_params(chunks):
        if scalar and name == _HEAD and not arch.score_head:
            continue  # a causal LM's trunk into a scalar-head model: its head stays as built
        item = items.get(name)
        if item is None:
            raise MappingError(
                f"parameter {local_name!r} (canonical {name!r}) has no {arch.family} HF mapping "
                f"in {lazy.dir}"
            )
        t = _read_shard(lazy, arch, item, p)
        if t.shape != p.shape:
            raise MappingError(
                f"{lazy.dir}: {name!r} read as {tuple(t.shape)}, parameter {local_name!r} is "
                f"{tuple(p.shape)}"
            )
        into(p, t)
        del t
    _fill_tied_output(chunks, lazy, items[_EMBED], into)


def _read_shard(lazy: LazyHFTensors, arch: ModelArch, item: MappedTensor, p) -> torch.Tensor:
    """This rank's shard of canonical tensor `item` (vocab rows padded with zeros)."""
    dim, tp, r = tp_shard(p)
    if dim != 0:  # whole on every TP rank, or strided in the file: read whole, keep a slice
        full = canonical_from_hf(arch, item, [lazy.get(n) for n in item.hf])
        return full if dim < 0 else full.chunk(tp, dim=dim)[r]
    if parts := getattr(p, "tp_parts", None):  # a slice of each component (Gated DeltaNet)
        full = canonical_from_hf(arch, item, [lazy.get(n) for n in item.hf])
        return split_tp(item.canonical, full, 0, tp, r, parts)
    if item.kind == "qkv":
        groups = arch.num_key_value_heads // tp  # whole query groups per TP rank
        per = arch.num_attention_heads // arch.num_key_value_heads
        hd = arch.head_dim
        q_rows, kv_rows = groups * per * hd, groups * hd
        q, k, v = (
            lazy.get_rows(n, r * rows, (r + 1) * rows)
            for n, rows in zip(item.hf, (q_rows, kv_rows, kv_rows), strict=True)
        )
        return qkv_to_megatron(q, k, v, groups * per, groups, hd)
    if item.kind == "gate_up":
        rows = item.shapes[0][0] // tp
        gate, up = (lazy.get_rows(n, r * rows, (r + 1) * rows) for n in item.hf)
        return gate_up_to_megatron(gate, up)
    if item.kind != "copy":  # (gpt-oss's transposed experts: read whole, keep this shard)
        full = canonical_from_hf(arch, item, [lazy.get(n) for n in item.hf])
        return split_tp(item.canonical, full, 0, tp, r)
    return _rows_padded(
        lazy, item.hf[0], r * p.shape[0], p.shape[0], item.canonical in VOCAB_PARAMS
    )


def _rows_padded(lazy: LazyHFTensors, hf_name: str, start: int, rows: int, vocab: bool):
    """Rows `start:start+rows` of an HF tensor; for vocab tensors rows past the real vocabulary
    are megatron's padding (zeros, never sampled)."""
    have = lazy.shape(hf_name)[0]
    if not vocab or start + rows <= have:
        return lazy.get_rows(hf_name, start, start + rows)
    got = lazy.get_rows(hf_name, min(start, have), have)
    pad = torch.zeros(rows - got.shape[0], *got.shape[1:], dtype=got.dtype)
    return torch.cat([got, pad])


def _fill_tied_output(chunks, lazy: LazyHFTensors, embed: MappedTensor, into) -> None:
    """With tied embeddings and PP > 1 the last stage holds its own copy of the embedding (the
    first stage's is a regular parameter, filled above)."""
    for chunk in chunks:
        model = unwrap(chunk)
        tied = getattr(model, "share_embeddings_and_output_weights", False)
        if tied and model.post_process and not model.pre_process:
            w = model.shared_embedding_or_output_weight()
            _, _, r = tp_shard(w)
            into(w, _rows_padded(lazy, embed.hf[0], r * w.shape[0], w.shape[0], True))


@torch.no_grad()
def copy_weights(src: list[torch.nn.Module], dst: list[torch.nn.Module]) -> None:
    """Copy `src`'s parameters into `dst`, built at the same layout on this rank (no
    communication). A `dst` with a scalar head (`ValueHead`: a critic) gets the trunk of a
    policy `src` and a zero head, or the trunk and head of a `src` with a scalar head (a reward
    model)."""
    if len(src) != len(dst):
        raise ValueError(f"copy_weights: {len(src)} source chunk(s) but {len(dst)} destination(s)")
    for k, (s_chunk, d_chunk) in enumerate(zip(src, dst, strict=True)):
        s_model, d_model = unwrap(s_chunk), unwrap(d_chunk)
        have = dict(s_model.named_parameters())
        head = getattr(d_model, "output_layer", None)
        from_policy = not has_value_head(s_model)
        for name, p in d_model.named_parameters():
            if is_lora(p):  # `dst`'s own adapters keep their init (B = 0: the copied model)
                continue
            if isinstance(head, ValueHead) and from_policy and name.startswith("output_layer."):
                p.data.zero_()
                continue
            q = have.get(name)
            if q is None or q.shape != p.shape:
                got = "absent" if q is None else f"shape {tuple(q.shape)}"
                raise ValueError(
                    f"copy_weights: chunk {k} parameter {name!r} {tuple(p.shape)} is {got} in "
                    "the source (models must be built from one arch at one layout)"
                )
            p.data.copy_(q.data)
