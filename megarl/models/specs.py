"""Layer specs: Transformer-Engine (GPU, FP8-capable) or megatron-core's local modules (CPU).

The local spec is megatron-core's `get_gpt_layer_local_spec` with megarl's norms
(`megarl.models.norms`: the stock `WrappedTorchNorm` refuses sequence parallelism). Core
attention is `SDPAttention`: megatron's `DotProductAttention` (same construction, state and
head bookkeeping) computing with torch's fused `scaled_dot_product_attention` instead of
baddbmm + an unfused masked softmax + bmm (a third of a CPU training step went there). It also
takes packed rows (megatron's THD format, which the stock local attention refuses): one causal
SDPA per sequence of the row, so no sequence attends to another.
Transformer-Engine is imported lazily, only when the TE spec is asked for.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from megarl.models.norms import LatentRMSNorm, PlainRMSNorm, QKRMSNorm, RMSNorm
from megarl.models.residual import bias_dropout_add


@functools.cache
def sdpa_attention_class():
    """megarl's core attention for megatron's local layers (`SDPAttention` below), defined on
    first use so that importing this module does not import megatron."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        """megatron's local core attention through `F.scaled_dot_product_attention`.

        Assumes what megarl's forward passes guarantee: no attention dropout, no attention
        bias, and for causal layers a mask that is exactly the causal one
        (`megarl.models.forward.causal_mask`; right padding keeps real tokens from seeing
        padding), so `is_causal=True` replaces it. Other mask types use the given mask.
        query: [sq, b, np, hn]; key, value: [sk, b, ng, hn] -> [sq, b, np * hn]. Packed (THD,
        `packed_seq_params`): query [t, np, hn]; key, value [t, ng, hn] -> [t, np * hn], causal
        within each segment of `cu_seqlens_q`. Multi-latent attention's keys are wider than its
        values (`k_channels`, `v_channels`: megatron's local attention takes neither); the output
        is [.., np * v_channels]. Windowed layers and sinks (megatron's window_size and learnable
        softmax offset; gpt-oss) are attended by `_windowed`."""

        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(config, *args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
            if (
                config.attention_dropout
                or config.softmax_type not in ("vanilla", "learnable")
                or config.apply_query_key_layer_scaling
            ):
                raise ValueError(
                    "SDPAttention supports attention_dropout=0, the vanilla or learnable softmax "
                    f"and no query-key layer scaling; got {config.attention_dropout}, "
                    f"{config.softmax_type!r}, {config.apply_query_key_layer_scaling}"
                )
            # (left, right) of this layer, or None (megatron decided it for its own softmax)
            self.window = self.scale_mask_softmax.window_size

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            if attention_bias is not None:
                raise ValueError("SDPAttention: attention bias unsupported")
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params, causal)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
            out = self._attend(q, k, v, None if causal else attention_mask, causal)
            sq, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

        def _packed(self, query, key, value, params, causal: bool):
            if params.qkv_format != "thd" or not causal:
                raise ValueError(
                    f"SDPAttention: packed sequences need qkv_format='thd' and causal attention; "
                    f"got {params.qkv_format!r}, {self.attn_mask_type}"
                )
            t = query.shape[0]
            plan = _packed_plan(tuple(params.cu_seqlens_q.tolist()), str(query.device))
            # per bucket [m, L, heads, hn] -> SDPA's [m, heads, L, hn]
            qs, ks, vs = (_ToBuckets.apply(x, plan) for x in (query, key, value))
            outs = [
                self._attend(*(x.permute(0, 2, 1, 3) for x in qkv), None, True).permute(0, 2, 1, 3)
                for qkv in zip(qs, ks, vs, strict=True)
            ]
            return _FromBuckets.apply(plan, *outs).reshape(t, self.hidden_size_per_partition)

        def _attend(self, q, k, v, mask, causal: bool):
            if self.softmax_offset is None and self.window is None:
                return self._sdpa(q, k, v, mask, causal)
            return self._windowed(q, k, v, mask, causal)

        def _windowed(self, q, k, v, mask, causal: bool):
            """Attention with this layer's window and sinks, written out (SDPA takes neither):
            in fp32, the sink a logit of its own in each softmax that weighs no value, as
            transformers' gpt-oss eager attention. Shapes as `_sdpa`."""
            dtype, heads = q.dtype, q.shape[1]
            rep = heads // k.shape[1]
            k, v = (x.repeat_interleave(rep, 1) if rep > 1 else x for x in (k, v))
            scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
            sq, sk = scores.shape[-2:]
            i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
            j = torch.arange(sk, device=q.device)[None]
            keep = j <= i if causal else torch.ones(sq, sk, dtype=torch.bool, device=q.device)
            if self.window is not None:
                keep = keep & (j >= i - self.window[0]) & (j <= i + self.window[1])
            if mask is not None and not causal:
                keep = keep & ~mask
            scores = scores.masked_fill(~keep, float("-inf"))
            if self.softmax_offset is not None:
                sink = self.softmax_offset.float().view(1, heads, 1, 1)
                scores = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :sk]
            return torch.matmul(probs, v.float()).to(dtype)

        def _sdpa(self, q, k, v, mask, causal: bool):
            """[b, np, s, hn] x [b, ng, s, hn] x2 -> [b, np, s, hn]; grouped-query heads are
            served by SDPA itself (enable_gqa), without copies of the keys and values.

            16-bit inputs on a CPU are attended in fp32 and the result rounded back: SDPA's
            16-bit CPU kernels are slower than its fp32 flash kernel on upcast copies (fwd + bwd,
            2 cores, bf16 [segments, heads, len, head_dim]: [18, 9, 107, 64] math 31.0 ms, flash
            53.5, fp32 flash 18.4; [64, 4, 14, 32] 2.2 / 17.1 / 1.0), and fp32 accumulation is
            what GPU flash attention does too."""
            gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
            dtype = q.dtype
            if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
                q, k, v = q.float(), k.float(), v.float()
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if mask is None else ~mask,
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )
            return out.to(dtype)

    return SDPAttention


# a bucket of segments is attended as one padded batch while its padded work (segments x longest
# squared) stays within this factor of the exact work (sum of squared lengths); measured on 2 CPU
# cores, fwd + bwd, against one SDPA call per segment and one padded call for all: 128 segments
# of 8-15 tokens 5.3 ms (loop 22, one call 3.9), 16 of 40-107 16.7 ms (16, 22), 6 of 30-2000
# 280 ms (270, 850)
BUCKET_WASTE = 1.5


@dataclasses.dataclass(frozen=True)
class _PackedPlan:
    """A packed row's segments grouped into buckets, each attended as one padded batch."""

    buckets: list
    """Per bucket of m segments, longest L: (index [m, L] long: the row position at each place,
    a segment's last token repeated after its end; take ([n], [n]): the places of its n real
    tokens, segment by segment)."""
    rows: torch.Tensor
    """[t] long: the row position of each bucket's real tokens, buckets concatenated."""
    order: torch.Tensor
    """[t] long: row position i is entry order[i] of that concatenation (argsort of `rows`)."""


@functools.lru_cache(maxsize=64)
def _packed_plan(cu_seqlens: tuple[int, ...], device: str) -> _PackedPlan:
    """Segments of a packed row grouped into buckets of similar length (longest first), each
    attended as one padded batch: padding only inside a bucket, few SDPA calls."""
    starts = cu_seqlens[:-1]
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:], strict=False)]
    groups: list[list[int]] = []
    exact: list[int] = []  # each group's sum of squared lengths
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] ** 2 <= BUCKET_WASTE * (
            exact[-1] + lengths[i] ** 2
        ):
            groups[-1].append(i)
            exact[-1] += lengths[i] ** 2
        else:
            groups.append([i])
            exact.append(lengths[i] ** 2)
    buckets, rows = [], []
    for g in groups:
        n = torch.tensor([lengths[i] for i in g])
        steps = torch.arange(int(n.max()))
        valid = steps[None] < n[:, None]
        index = torch.tensor([starts[i] for i in g])[:, None] + torch.minimum(steps, n[:, None] - 1)
        take = tuple(x.to(device) for x in valid.nonzero(as_tuple=True))
        buckets.append((index.to(device), take))
        rows.append(index[valid])
    rows = torch.cat(rows)
    return _PackedPlan(buckets, rows.to(device), torch.argsort(rows).to(device))


def _from_buckets(outs, plan: _PackedPlan) -> torch.Tensor:
    """Per bucket [m, L, ...] -> the row's [t, ...]: each real token's place, in row order."""
    return torch.cat([o[take] for o, (_, take) in zip(outs, plan.buckets, strict=True)])[plan.order]


class _ToBuckets(torch.autograd.Function):
    """The row [t, heads, hn] as each bucket's padded batch [m, L, heads, hn] (gathers).

    The backward reads each token's gradient at its own place only, a gather again instead of
    the scatter-add autograd would run: the places after a segment's end (copies of its last
    token) get exactly zero gradient from causal attention whose padded outputs are dropped
    (no real query attends to them, and the padded queries' outputs have zero gradient)."""

    @staticmethod
    def forward(ctx, x, plan):
        ctx.plan = plan
        return tuple(x[index] for index, _ in plan.buckets)

    @staticmethod
    def backward(ctx, *grads):
        return _from_buckets(grads, ctx.plan), None


class _FromBuckets(torch.autograd.Function):
    """Each bucket's attention output [m, L, ...] back to the row [t, ...] (gathers); the
    backward places the row's gradient at the same places, zeros after each segment's end."""

    @staticmethod
    def forward(ctx, plan, *outs):
        ctx.plan, ctx.shapes = plan, [o.shape for o in outs]
        return _from_buckets(outs, plan)

    @staticmethod
    def backward(ctx, grad):
        grad = grad[ctx.plan.rows]  # the buckets' real tokens, concatenated
        out, start = [], 0
        for (_, take), shape in zip(ctx.plan.buckets, ctx.shapes, strict=True):
            n = take[0].numel()
            placed = grad.new_zeros(shape)
            placed[take] = grad[start : start + n]
            out.append(placed)
            start += n
        return (None, *out)


def require_transformer_engine(what: str) -> None:
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"{what} needs Transformer-Engine (pip install 'megarl[gpu]' on a CUDA machine); "
            f"it is not importable here: {e}"
        ) from e


def layer_spec(arch, *, use_te: bool, moe: bool | None = None, linear: bool = False):
    """The `ModuleSpec` of one layer of `arch` (a `ModelArch`); `moe`: whether it routes (default:
    whether `arch` is MoE; the dense first layers of GLM-4.5 / DeepSeek-V3 pass False);
    `linear`: a Gated DeltaNet layer in place of attention (Qwen3-Next)."""
    spec = _attention_layer_spec(arch, use_te=use_te, moe=moe)
    if linear:
        spec.submodules.self_attention = gdn_spec(use_te)
        if use_te:  # TE's in_proj carries the input norm (`self_attention.in_proj.layer_norm_*`)
            from megatron.core.transformer.identity_op import IdentityOp

            spec.submodules.input_layernorm = IdentityOp
    return spec


def gdn_spec(use_te: bool):
    """megatron's `GatedDeltaNet` with its projections and output norm: local layers, or TE's as
    megatron's experimental spec builds them (experimental_attention_variant_module_specs.py:
    56-73), the output norm never zero-centred."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    if use_te:
        from megatron.core.extensions import transformer_engine as te

        return ModuleSpec(
            module=GatedDeltaNet,
            submodules=GatedDeltaNetSubmodules(
                in_proj=te.TELayerNormColumnParallelLinear,
                out_norm=plain_te_norm_class(),
                out_proj=te.TERowParallelLinear,
            ),
        )
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=PlainRMSNorm, out_proj=RowParallelLinear
        ),
    )


@functools.cache
def plain_te_norm_class():
    """TE's RMSNorm without the zero-centred weight of the model's other norms: `TENorm` takes
    `zero_centered_gamma` from the config (extensions/transformer_engine.py: TENorm.__new__)."""
    import dataclasses

    from megatron.core.extensions.transformer_engine import TENorm

    class PlainTENorm:
        def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
            plain = dataclasses.replace(config, layernorm_zero_centered_gamma=False)
            return TENorm(plain, hidden_size, eps)

    return PlainTENorm


def _attention_layer_spec(arch, *, use_te: bool, moe: bool | None):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = arch.num_experts if (arch.is_moe if moe is None else moe) else None
    mla = arch.mla is not None
    # MLA's q / kv norms (q_a_layernorm, kv_a_layernorm) are megatron's "qk" norms
    qk_norm = arch.qk_norm or mla
    if use_te:
        require_transformer_engine("the Transformer-Engine layer spec")
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts,
            moe_grouped_gemm=False,
            qk_layernorm=qk_norm,
            multi_latent_attention=mla,
        )
    spec = specs.get_gpt_layer_local_spec(
        num_experts=experts,
        moe_grouped_gemm=False,
        qk_layernorm=qk_norm,
        multi_latent_attention=mla,
        normalization="RMSNorm",
    )
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    sub.self_attn_bda = sub.mlp_bda = bias_dropout_add
    attn = sub.self_attention.submodules
    attn.core_attention = sdpa_attention_class()
    if mla:
        attn.q_layernorm = LatentRMSNorm
        attn.kv_layernorm = LatentRMSNorm
        # the down projections replicated over TP, as the Transformer-Engine spec builds them
        # (`TELinear`, parallel_mode="duplicated"): the local spec's column-parallel ones gather
        # their output with `gather_from_tensor_model_parallel_region`, whose backward keeps
        # each rank's partial gradient of the rotary key (each TP rank attends with its own
        # heads), so the key's weights got 1/TP-partial grads (multi_latent_attention.py:604-
        # 614). Replicated, the rotary key is gathered over the sequence, whose backward
        # reduce-scatters (sums) them, and the weights' grads are reduced over TP under SP.
        from megatron.core.post_training.modelopt.layers import Linear

        attn.linear_q_down_proj = Linear
        attn.linear_kv_down_proj = Linear
    elif arch.qk_norm:
        attn.q_layernorm = QKRMSNorm
        attn.k_layernorm = QKRMSNorm
    if experts and arch.linear_bias:
        sub.mlp.submodules.experts.submodules.linear_fc2 = expert_fc2_class()
    return spec


@functools.cache
def expert_fc2_class():
    """megatron's `RowParallelLinear` for biased experts (gpt-oss) on the local layers: their MLP
    adds the routed weight x bias to fc2's output in place (mlp.py:244-247), and at TP 1 that
    output is the input handed back by the TP reduce's autograd Function, which autograd refuses
    to see modified in place once gradients flow. This one returns a fresh tensor."""
    from megatron.core.tensor_parallel import RowParallelLinear

    class ExpertRowParallelLinear(RowParallelLinear):
        def forward(self, *args, **kwargs):
            out, bias = super().forward(*args, **kwargs)
            return (out.clone() if out.requires_grad else out), bias

    return ExpertRowParallelLinear


def block_spec(arch, config, *, use_te: bool, vp_stage: int | None, pp_rank: int | None = None):
    """Spec of this stage's transformer block, with the final norm megarl needs; dense and
    routed layers where `arch` has both."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    kinds = [(arch.is_moe_layer(first + i), arch.is_linear_layer(first + i)) for i in range(n)]
    specs = {k: layer_spec(arch, use_te=use_te, moe=k[0], linear=k[1]) for k in set(kinds)}
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = RMSNorm
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(
            layer_specs=[specs[k] for k in kinds], layer_norm=final_norm
        ),
    )
