"""`--suite peer --model smollm2`: the peer comparison on a real pretrained model, where the
figure that matters is the time to a held-out accuracy, not only tokens/s.

The workload is `examples/grpo_smollm2_arith_cpu.yaml`'s: SmolLM2-135M-Instruct (the GGUF of
`megarl fetch-model smollm2-135m-instruct`, fetched once and dequantized into `$MEGARL_CACHE`),
its training prompts (`examples/data/smollm2_arith_train.jsonl`, read from the repository), the
chat template with the model's default system message, `math_verify` as the reward, GRPO with 8
prompts x 8 samples at temperature 1, at most 48 new tokens, group-scaled advantages, the
token-mean loss (TRL `loss_type="dapo"`), one epoch over one mini-batch, Adam at `LR` (constant,
grad clip 1.0) and a k3 KL penalty to the reference model in the loss with coefficient `BETA`
(TRL `beta`): both systems run a reference forward pass every step.

Held-out accuracy: the first `EVAL_PROMPTS` prompts of `examples/data/smollm2_arith_eval.jsonl`
(operand pairs never trained on), greedy, at most 48 tokens, graded by `math_verify`, before the
first update and every `EVAL_EVERY` steps. megarl evaluates through its colocated vLLM engine
(`eval.*`), TRL through HF `generate` in a callback (batches of 16, left padding). Neither
evaluation is counted in its system's step times. The time to the target is the sum of the step
times up to the first evaluation at or above `TARGET` (an absolute accuracy, the same for both
systems); a run that never reaches it reports NaN with the best accuracy it saw.

Both sides start from the same dequantized fp32 weights; megarl bf16 = bf16 compute weights with
fp32 masters and Adam (`precision.dtype: bf16`), TRL bf16 = `bf16=True` (autocast over fp32
weights). The plan has no bf16-weights TRL run here (without fp32 masters its updates of ~`LR`
round away).
"""

from __future__ import annotations

import json
import os

from megarl.convert.fetch import fetch_gguf
from megarl.convert.gguf import cached_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "examples", "data", "smollm2_arith_train.jsonl")
EVAL = os.path.join(ROOT, "examples", "data", "smollm2_arith_eval.jsonl")
MODEL_NAME = "smollm2-135m-instruct"
PROMPTS, N, MAX_TOKENS, LR, BETA, SEED = 8, 8, 48, 1e-5, 0.001, 0
EVAL_PROMPTS, EVAL_EVERY, TARGET = 64, 2, 0.6
STEPS, QUICK_STEPS = 24, 4
PLAN = (("megarl", "fp32"), ("trl", "fp32"), ("megarl", "bf16"), ("trl", "bf16"))
# SmolLM2-135M's shape (its config.json), for model FLOPs per token
MODEL = dict(
    hidden_size=576,
    num_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
)
PARAMS = 134_515_008
PROMPT_TOKENS = 38.0  # mean tokens of a chat-templated training prompt (36-41)


class WorkloadError(RuntimeError):
    """The workload's data is not where the suite reads it (the suite runs from a checkout)."""


def prepare(tmp: str) -> tuple[str, int]:
    """(the model's HF directory, fetched and converted once, then from the cache; its parameter
    count); writes the workload's prompt files into `tmp` (`prompts.jsonl`, `eval.jsonl`)."""
    for path in (TRAIN, EVAL):
        if not os.path.isfile(path):
            raise WorkloadError(
                f"{path} is missing: --model smollm2 reads the example's data from a checkout of "
                "the repository (python examples/data/make_smollm2_arith.py writes it)"
            )
    _copy_rows(TRAIN, os.path.join(tmp, "prompts.jsonl"), None)
    _copy_rows(EVAL, os.path.join(tmp, "eval.jsonl"), EVAL_PROMPTS)
    return cached_hf_dir(fetch_gguf(MODEL_NAME)), PARAMS


def _copy_rows(src: str, dst: str, limit: int | None) -> None:
    with open(src) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(dst, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[:limit])


# megarl's precision settings by name: "<dtype>[+<variant>]" (tools/precision_study.py)
VARIANTS = {
    "res32": {"precision": {"fp32_residual": True}},
    "tis": {"algorithm": {"off_policy_correction": "tis"}},
    "icepop": {"algorithm": {"off_policy_correction": "icepop"}},
}


def megarl_config(
    model_dir: str, precision: str, steps: int, data_dir: str, seed: int = SEED
) -> dict:
    """The workload as a megarl run config (the example's settings, one micro-batch of 16);
    `precision`: fp32, bf16, fp16, or one of them + a name of `VARIANTS` ("bf16+res32");
    `seed`: the trainer's (sampling, mini-batch order; the prompts' order stays)."""
    dtype, _, variant = precision.partition("+")
    if variant and variant not in VARIANTS:
        raise ValueError(f"precision {precision!r}: accepted variants {sorted(VARIANTS)}")
    config = _megarl_base(model_dir, dtype, steps, data_dir, seed)
    for section, values in VARIANTS.get(variant, {}).items():
        config[section].update(values)
    return config


def _megarl_base(model_dir: str, dtype: str, steps: int, data_dir: str, seed: int) -> dict:
    return {
        "model": {"hf": model_dir},
        "precision": {"dtype": dtype},
        "optim": {"lr": LR, "lr_decay_style": "constant", "clip_grad": 1.0},
        "rollout": {
            "sampling": {"n": N, "temperature": 1.0, "max_tokens": MAX_TOKENS, "seed": SEED},
            "engine": {
                "max_model_len": 128,  # prompt (<= 64) + response (<= 48) tokens, as the example
                "kv_cache_memory_bytes": 512 * 2**20,
            },
        },
        "data": {
            "path": os.path.join(data_dir, "prompts.jsonl"),
            "prompts_per_step": PROMPTS,
            "max_prompt_length": 64,
            "seed": SEED,
        },
        "algorithm": {
            "name": "grpo",
            "advantage": "grpo",
            "scale": "group",
            "kl_coef": BETA,
            "kl_kind": "k3",
            "kl_in": "loss",
            "ppo_epochs": 1,
            "mini_batches": 1,
            "micro_batch_size": 16,
        },
        "reward": {"functions": ["math_verify"]},
        "eval": {
            "path": os.path.join(data_dir, "eval.jsonl"),
            "every": EVAL_EVERY,
            "max_tokens": MAX_TOKENS,
        },
        "trainer": {"steps": steps, "seed": seed},
        "logging": {"wandb": False, "tensorboard": False, "progress": False},
    }


def trl_spec(data_dir: str, seed: int = SEED) -> dict:
    """What `megarl.benchmarks.peer_trl` needs to run the same workload (a JSON file)."""
    return {
        "prompts": os.path.join(data_dir, "prompts.jsonl"),
        "eval": os.path.join(data_dir, "eval.jsonl"),
        "batch": PROMPTS * N,
        "num_generations": N,
        "max_tokens": MAX_TOKENS,
        "lr": LR,
        "beta": BETA,
        "seed": seed,
        "eval_every": EVAL_EVERY,
        "reward": "math_verify",
        "chat": True,
    }


def time_to_target(
    evals: list[tuple[int, float]], step_s: list[float], target: float = TARGET
) -> dict:
    """Training seconds until the first evaluation at or above `target`.

    evals: (step, held-out accuracy) in step order, step 0 = before any update; step_s: the
    seconds of steps 1, 2, ... Returns {"seconds", "step", "start", "best"}; seconds and step are
    NaN / None when the target was not reached."""
    start = evals[0][1] if evals and evals[0][0] == 0 else float("nan")
    best = max((a for _, a in evals), default=float("nan"))
    for step, acc in evals:
        if acc >= target:
            return {"seconds": sum(step_s[:step]), "step": step, "start": start, "best": best}
    return {"seconds": float("nan"), "step": None, "start": start, "best": best}
