"""Bytes per rank of each thing a training step holds: pure arithmetic, one function per row of
`megarl plan`'s table. Each returns `(bytes, formula)`; the formula is what the table prints.

Activation terms are the tensors autograd saves for the backward pass, read off megatron-core's
layers as megarl builds them (and checked on CPU, `tests/test_plan.py`, by the resident-set peak
of a real micro-batch):

- `local` layers (CPU, or GPU with `precision.transformer_engine: false`): per token and layer,
  two RMSNorms each saving their fp32 input, the 1/rms and two `e`-byte [h] tensors (normalised
  input, the linear's input); attention through `F.scaled_dot_product_attention` saving q, k, v
  (k and v repeated to every query head) and its output, plus the log-sum-exp; the output
  projection's input; SwiGLU saving fc1's [2f] output and three [f] tensors.
  CPU bf16 runs SDPA's math kernel, which keeps the [s, s] probabilities in fp32 per head.
- `te` layers (GPU): Transformer-Engine's fused norm + linear saves the input, 1/rms and the
  normalised output; flash attention keeps q, k, v (KV heads not repeated), output and
  log-sum-exp; fc1's [2f] output and fc2's [f] input. Read from the sources, not measured here.

Under sequence parallelism the [s, b, h] tensors outside the TP regions are split over TP too;
without it every TP rank holds them whole. `e` is the element size of the compute dtype.
"""

from __future__ import annotations

import math

from megarl.models.hf_config import ModelArch
from megarl.models.vocab import CHUNK_ELEMENTS

GiB = 2**30
PHASES = ("rollout", "logprobs", "train", "sync")
"""The phases of an RL step whose peaks a plan compares (`megarl.plan.memory`)."""


def gib(n: float) -> str:
    """`n` bytes as the plan prints them: GiB with one decimal, MiB below 0.1 GiB."""
    return f"{n / GiB:.1f} GiB" if n >= 0.1 * GiB else f"{n / 2**20:.1f} MiB"


def layer_activation_bytes_per_token(
    arch: ModelArch,
    *,
    elem: int,
    tp: int,
    sequence_parallel: bool,
    impl: str,
    expert_tp: int | None = None,
) -> tuple[float, str]:
    """Saved-for-backward bytes of one transformer layer per token (no recompute).

    impl: "local" (SDPA flash/efficient kernel), "local-fp32" (the same on fp32 copies of
    16-bit inputs: CPU bf16 / fp16) or "te"."""
    h, d = arch.hidden_size, arch.head_dim
    heads, kv = arch.num_attention_heads / tp, max(1.0, arch.num_key_value_heads / tp)
    sp = tp if sequence_parallel else 1
    if impl == "te":
        norms = 2 * (2 * elem * h + 4) / sp
        attn = (2 * heads * d + 2 * kv * d) * elem + 4 * heads
        proj = 0.0  # the projection's input is flash attention's saved output
        mlp_per_f, norms_text = 3, "2 x (2e h + 4)"
        attn_text = "(2 a d + 2 g d) e / TP + 4 a / TP"
    else:
        norms = 2 * (4 * h + 4 + 2 * elem * h) / sp
        norms_text = "2 x (4 h + 4 + 2e h)"
        if impl == "local-fp32":  # the kernel's fp32 copies of q, k, v and its fp32 output
            attn = 4 * heads * d * 4 + 4 * heads
            attn_text = "(16 a d + 4 a) / TP"
        else:
            attn = 4 * heads * d * elem + 4 * heads
            attn_text = "(4 a d e + 4 a) / TP"
        proj = heads * d * elem
        mlp_per_f = 5
    if arch.is_moe:
        etp = expert_tp or tp
        f = arch.moe_intermediate_size or arch.intermediate_size
        # each token visits top-k experts; per visit the layer saves four [h] copies: the
        # experts' input and the probability-weighted output of the dispatcher (its permuted
        # copy and its unpermuted one); counted by saved-tensor hooks on one layer of a
        # Qwen3-MoE with megatron-core 0.16's alltoall dispatcher (59.6 KB per token, fp32)
        mlp = arch.moe_topk * (mlp_per_f * f * elem / etp + 4 * h * elem)
        mlp_text = f"top{arch.moe_topk} x ({mlp_per_f} f_moe e / ETP + 4 h e)"
    else:
        mlp = mlp_per_f * arch.intermediate_size * elem / tp
        mlp_text = f"{mlp_per_f} f e / TP"
    total = norms + attn + proj + mlp
    formula = (
        f"norms {norms_text}{' / TP (SP)' if sequence_parallel and tp > 1 else ''} + attention "
        f"{attn_text}{' + proj a d e / TP' if proj else ''} + MLP {mlp_text}"
    )
    return total, formula


def logits_bytes_per_token(
    padded_vocab: int, *, tp: int, elem: int, packed: bool
) -> tuple[float, str]:
    """The last stage's logits per token, in the model's precision (`elem` bytes): the loss
    over the vocabulary (`megarl.models.vocab`) works a chunk of rows at a time and writes the
    gradient over the logits, so they are the only vocabulary-sized tensor, with or without the
    entropy term. Unpacked micro-batches ([b, s] with b > 1) hold two copies at the peak:
    megatron's GPTModel returns the [s, b, V] logits transposed into a new [b, s, V] tensor.
    Plus the chunks' fixed scratch (`vocab_scratch_bytes`)."""
    copies = 1 if packed else 2
    text = f"{copies} x {elem} B x V/TP ({'packed rows' if packed else 'unpacked: + transpose'})"
    return copies * elem * padded_vocab / tp, text


def vocab_scratch_bytes(*, entropy: bool) -> tuple[float, str]:
    """The fp32 scratch of one chunk of rows (`megarl.models.vocab.CHUNK_ELEMENTS`), two with the
    entropy term: a fixed amount, whatever the tokens."""
    n = 2 if entropy else 1
    return n * 4 * CHUNK_ELEMENTS, f"{n} x 4 B x {CHUNK_ELEMENTS} (chunk scratch)"


def forward_working_bytes_per_token(arch: ModelArch, *, elem: int, tp: int) -> tuple[float, str]:
    """A forward pass without grad keeps nothing between layers: its working set is one MLP's
    [2f] + [f] intermediates (MoE: of each of the top-k experts, plus the dispatcher's permuted
    copies of [h]) and two fp32 [h] norm tensors."""
    h = arch.hidden_size
    if arch.is_moe:
        f, k = arch.moe_intermediate_size or arch.intermediate_size, arch.moe_topk
        return k * (
            3 * f * elem / tp + 2 * h * elem
        ) + 8 * h, f"(top{k} x (3 f e / TP + 2 h e) + 8 h)"
    return 3 * arch.intermediate_size * elem / tp + 8 * h, "(3 f e / TP + 8 h)"


def in_flight_layer_passes(
    *, layers_per_chunk: list[int], pp: int, pp_rank: int, vpp: int | None, micro_batches: int
) -> tuple[int, str]:
    """Layer-micro-batches whose activations a pipeline stage holds at its peak.

    No PP: one micro-batch at a time (gradient accumulation frees each before the next).
    1F1B: stage r runs min(PP - r, M) forward passes before its first backward. Interleaved:
    megatron-core's warm-up of (PP - r - 1) x 2 + (VPP - 1) x PP chunk passes (capped at M x VPP)
    plus the one in steady state, each of one chunk's layers."""
    if pp == 1:
        return sum(layers_per_chunk), "1 micro-batch x all layers (no PP)"
    if not vpp:
        n = min(pp - pp_rank, micro_batches)
        return n * layers_per_chunk[0], (
            f"min(PP - stage, M) = {n} micro-batches x {layers_per_chunk[0]} layers (1F1B)"
        )
    warmup = min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, micro_batches * vpp)
    n = min(warmup + 1, micro_batches * vpp)
    per_chunk = max(layers_per_chunk)
    return n * per_chunk, f"{n} chunk passes x {per_chunk} layers (interleaved 1F1B warm-up + 1)"


def optimizer_bytes_per_param(dtype: str) -> tuple[int, str]:
    """Adam state per parameter before DP sharding: fp32 exp_avg and exp_avg_sq, plus an fp32
    master copy of 16-bit parameters (megatron's mixed-precision optimizer)."""
    if dtype == "fp32":
        return 8, "8 B/param (Adam m, v)"
    return 12, "12 B/param (fp32 master + Adam m, v)"


def lora_adapter_params(arch: ModelArch, *, rank: int, modules: tuple[str, ...]) -> int:
    """LoRA adapter parameters of the whole model: A [rank, in] and B [out, rank] per adapted
    HF linear (`modules`: q_proj ... down_proj) and layer, so rank x (in + out) each."""
    h, f = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    sides = {  # HF name -> in + out
        "q_proj": h + q,
        "k_proj": h + kv,
        "v_proj": h + kv,
        "o_proj": q + h,
        "gate_proj": h + f,
        "up_proj": h + f,
        "down_proj": f + h,
    }
    return arch.num_layers * rank * sum(sides[m] for m in modules)


LORA_MERGE_FP32 = 4
"""fp32 copies of one adapted weight while `megarl.models.lora.merged` merges it: its parts'
deltas (scale B A), the fused delta, W in fp32 and W + delta (at most; 3 for o / down_proj)."""


def lora_merged_bytes(adapted: int, largest: int, *, elem: int) -> tuple[float, str]:
    """The weight sync's merged copies (`megarl.models.lora.merged`): W + scale B A of every
    adapted weight on the rank at once, in the weight dtype, plus the fp32 working set of the
    one being merged."""
    text = (
        f"{adapted:,} adapted base-weight elements x {elem} B (W + scale B A, all held during "
        f"the sync) + {LORA_MERGE_FP32} x 4 B x {largest:,} (fp32 working set of the largest)"
    )
    return adapted * elem + LORA_MERGE_FP32 * 4 * largest, text


def kv_bytes_per_token(arch: ModelArch, *, elem: int, vllm_tp: int) -> int:
    """vLLM's KV cache per token on one of its TP ranks (as `check_kv_cache`)."""
    return arch.kv_cache_per_token(vllm_tp, elem)[0]


def round_up(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple)
