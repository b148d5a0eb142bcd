"""Held-out evaluation through the colocated vLLM engine, so it measures the synced weights.

When (`Evaluator.due`): with `eval.every` = e > 0, at step 0 (the policy before any update: its
own metrics.jsonl record, `{"step": 0, "eval/...": ...}`), at every step divisible by e and after
the last step; those figures are merged into that step's record. An evaluation at step s sees
the weights after s updates (it runs after the step's weight sync) and its time is not part of
the step's `time_s`.

What: the held-out prompts (`megarl.data.split`; the first `eval.max_prompts`) are split over the
DP ranks in contiguous blocks and generated like a training step's (`RolloutDispatcher`: each
prompt once, seeds from its position in the held-out list and a base seed fixed for the run, so
the samples do not depend on the DP size), `eval.n` samples each, greedy at
`eval.temperature` 0, at most `eval.max_tokens` tokens. They are scored by the run's reward
functions. Figures (all means over the held-out set, reduced over DP as one process holding
every prompt would compute them; `megarl.metrics.reduce`):
- `eval/<function>`: each reward function's mean value (samples it applies to);
  `eval/reward_mean` the weighted total, as `reward_mean` for training samples;
- `eval/pass@k`: a sample passes when `eval.pass_reward`'s value (default the first reward
  function) is >= `eval.pass_threshold` (default 1.0); for a prompt with c passes among n
  samples, pass@k is the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k),
  the chance that k samples drawn from the n hold a pass; averaged over prompts. With n = 1 and
  greedy decoding pass@1 is the accuracy of the greedy answer;
- `eval/response_len` (tokens), `eval/truncated` (fraction that hit max_tokens),
  `eval/prompts`, `eval/reward_errors` (failures scored 0 under `reward.on_error: zero`),
  `eval/time_s` (slowest DP rank).
The first `eval.samples_logged` prompts' samples go to `RUN/eval_samples.jsonl`, gathered to
global rank 0 from one rank per DP rank.

`megarl eval` (`evaluate_model`) runs one evaluation of a model without training: it builds only
the policy (frozen, no optimizer), the engine and its weight sync.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import torch
import torch.distributed as dist

from megarl.config import ConfigError, RunConfig
from megarl.distributed.process_group import init_distributed
from megarl.metrics.reduce import LocalMetrics
from megarl.metrics.sinks import EVAL_SAMPLES_FILE
from megarl.trainer.samples import gather_rows

log = logging.getLogger("megarl")

EVAL_SEED = 1 << 40
"""Base seed of evaluation sampling (+ trainer.seed), apart from the training steps' seeds."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n samples, c of which pass, hold a pass
    (Chen et al. 2021, as a stable product)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}); accepted: 0 <= c <= n, 1 <= k <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def check_eval(cfg: RunConfig, arch) -> None:
    """The evaluation's longest sequence fits the model (before any model is built)."""
    ev = cfg.eval
    if not (ev.every or ev.path or ev.fraction):
        return
    tokens = ev.max_tokens or cfg.rollout.max_tokens
    longest = cfg.data.max_prompt_length + tokens
    limit = cfg.rollout.max_model_len or arch.max_position_embeddings
    if longest > limit:
        what = (
            "rollout.max_model_len"
            if cfg.rollout.max_model_len
            else "the model's max_position_embeddings"
        )
        raise ConfigError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + eval.max_tokens ({tokens}) "
            f"= {longest} exceeds {what} ({limit}); lower eval.max_tokens"
        )


@dataclasses.dataclass
class Evaluator:
    """One run's held-out evaluation (module docstring); `run(step)` is collective."""

    cfg: RunConfig
    prompts: object
    """The held-out `PromptDataset`, already cut to `eval.max_prompts`."""
    dispatcher: object
    tokenizer: object
    reward_fns: list
    groups: object

    @staticmethod
    def create(cfg: RunConfig, held_out, dispatcher, tokenizer, reward_fns, groups):
        if held_out is None:
            return None
        cap = cfg.eval.max_prompts
        if cap is not None and cap < len(held_out):
            held_out = _first(held_out, cap)
        return Evaluator(cfg, held_out, dispatcher, tokenizer, reward_fns, groups)

    def due(self, step: int) -> bool:
        every, last = self.cfg.eval.every, self.cfg.trainer.steps
        return every > 0 and (step % every == 0 or step == last)

    def run(self, step: int) -> tuple[dict, list[dict]]:
        """(global eval/... figures, eval_samples rows on global rank 0, [] elsewhere)."""
        from megarl.rewards import score

        t0 = time.perf_counter()
        ev, g = self.cfg.eval, self.groups
        total = len(self.prompts)
        mine = range(g.dp_rank * total // g.dp_size, (g.dp_rank + 1) * total // g.dp_size)
        greedy = ev.temperature == 0
        rollout = self.dispatcher.generate(
            [self.prompts.prompt_ids[i] for i in mine],
            list(mine),
            EVAL_SEED + self.cfg.trainer.seed,
            n=ev.n,
            greedy=greedy,
            temperature=None if greedy else ev.temperature,
            max_tokens=ev.max_tokens or self.cfg.rollout.max_tokens,
        )
        index = [mine.start + i for i in rollout.prompt_index]  # held-out prompt of each sample
        local = LocalMetrics()
        rows = []
        if len(rollout):
            texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
            batch = self.prompts.batch(index)
            totals, per_fn, errors = score(
                self.reward_fns,
                self.cfg.reward.weights,
                batch.prompts,
                texts,
                rollout.response_ids,
                batch.columns,
                on_error=self.cfg.reward.on_error,
            )
            local.add_sum("eval/reward_errors", errors)
            passed = self._passes(per_fn)
            self._figures(local, index, totals, per_fn, passed, rollout)
            rows = self._rows(index, batch, texts, totals, per_fn, passed, rollout)
        else:  # a DP rank without held-out prompts: zeros, the same keys
            local.add_sum("eval/reward_errors", 0)
            self._figures(local, [], torch.zeros(0), self._empty_fns(), torch.zeros(0), rollout)
        local.add_max("eval/time_s", time.perf_counter() - t0)
        out = local.reduce(g.dp)
        cp_rank = dist.get_rank(g.cp) if g.cp is not None else 0
        first = g.tp_rank == 0 and g.pp_rank == 0 and cp_rank == 0
        rows = gather_rows(rows if first else None)
        return out, rows

    # ------------------------------------------------------------------ helpers
    def _names(self) -> list[str]:
        from megarl.rewards import function_name

        names: list[str] = []
        for i, fn in enumerate(self.reward_fns):
            name = function_name(fn)
            names.append(name if name not in names else f"{name}_{i}")  # as rewards.score
        return names

    def _empty_fns(self) -> dict:
        return {k: torch.zeros(0) for k in self._names()}

    def _passes(self, per_fn: dict) -> torch.Tensor:
        fns = self.cfg.reward.functions
        which = 0 if self.cfg.eval.pass_reward is None else fns.index(self.cfg.eval.pass_reward)
        values = list(per_fn.values())[which]
        return (values >= self.cfg.eval.pass_threshold).double()  # NaN (not applicable): fails

    def _figures(self, local, index, totals, per_fn, passed, rollout) -> None:
        ev = self.cfg.eval
        for k, v in per_fn.items():
            ok = ~torch.isnan(v)
            local.add_ratio(f"eval/{k}", v[ok].double().sum(), ok.sum())
        local.add_ratio("eval/reward_mean", totals.double().sum(), len(totals))
        lengths = [len(r) for r in rollout.response_ids]
        local.add_ratio("eval/response_len", sum(lengths), len(lengths))
        cut = sum(f == "length" for f in rollout.finish_reason)
        local.add_ratio("eval/truncated", cut, len(lengths))
        passes: dict[int, int] = {}
        for p, ok in zip(index, passed.tolist(), strict=True):
            passes[p] = passes.get(p, 0) + int(ok)
        for k in ev.ks:
            est = sum(pass_at_k(ev.n, c, k) for c in passes.values())
            local.add_ratio(f"eval/pass@{k}", est, len(passes))
        local.add_sum("eval/prompts", len(passes))

    def _rows(self, index, batch, texts, totals, per_fn, passed, rollout) -> list[dict]:
        keep = self.cfg.eval.samples_logged
        seen: dict[int, int] = {}
        rows = []
        for j, p in enumerate(index):
            k = seen[p] = seen.get(p, -1) + 1
            if keep is not None and p >= keep:
                continue
            rows.append(
                {
                    "index": p,
                    "sample": k,
                    "prompt": batch.prompts[j],
                    "completion": texts[j],
                    "rewards": {name: float(v[j]) for name, v in per_fn.items()},
                    "reward": float(totals[j]),
                    "passed": bool(passed[j]),
                    "length": len(rollout.response_ids[j]),
                    "finish_reason": rollout.finish_reason[j],
                }
            )
        return rows


def _first(dataset, count: int):
    """`dataset` cut to its first `count` prompts (a shallow copy)."""
    import copy

    out = copy.copy(dataset)
    out.prompt_ids = dataset.prompt_ids[:count]
    out.prompts = dataset.prompts[:count]
    out.columns = {k: v[:count] for k, v in dataset.columns.items()}
    out.source_rows = dataset.source_rows[:count]
    return out


def _display_order(key: str) -> tuple[int, str]:
    """pass@k, then reward_mean, the functions, then length and truncation."""
    if key.startswith("eval/pass@"):
        return 0, key
    if key == "eval/reward_mean":
        return 1, key
    return (3 if key in ("eval/response_len", "eval/truncated") else 2), key


def summary(head: str, metrics: dict, ev) -> str:
    """`<head>: 24 prompts x 1 (greedy): pass@1 0.417 | reward_mean 0.702 | ... | 1.3 s`."""
    how = "greedy" if ev.temperature == 0 else f"T={ev.temperature:g}"
    skip = ("eval/prompts", "eval/time_s", "eval/reward_errors")
    keys = sorted(
        (k for k in metrics if k.startswith("eval/") and k not in skip), key=_display_order
    )
    figures = " | ".join(f"{k.removeprefix('eval/')} {metrics[k]:.3f}" for k in keys)
    return (
        f"{head}: {int(metrics.get('eval/prompts', 0))} prompts x {ev.n} ({how}): {figures} | "
        f"{metrics.get('eval/time_s', 0.0):.1f} s"
    )


def evaluate(run) -> dict:
    """The eval/... figures when an evaluation is due at `run.step` ({} otherwise); writes its
    samples to eval_samples.jsonl. Collective."""
    ev = run.evaluator
    if ev is None or not ev.due(run.step):
        return {}
    metrics, rows = ev.run(run.step)
    run.logger.log_samples(run.step, rows, file=EVAL_SAMPLES_FILE)
    if dist.get_rank() == 0:
        log.info(summary(f"eval at step {run.step}", metrics, run.cfg.eval))
    return metrics


# ---------------------------------------------------------------------- megarl eval
def model_source(path: str) -> str:
    """The `model.*` key a model path is read through: `model.hf` for an HF directory
    (config.json) or a file, `model.mcore_ckpt` for any other directory: a megarl checkpoint
    (whatever that key accepts)."""
    if os.path.isfile(path) or os.path.isfile(os.path.join(path, "config.json")):
        return "model.hf"
    return "model.mcore_ckpt"


def model_overrides(path: str) -> list[str]:
    """--set overrides that make `path` the model (the other model sources cleared; the
    tokenizer stays as the config says, where unset the model directory's)."""
    import json

    key = model_source(path)
    others = [k for k in ("model.hf", "model.mcore_ckpt", "model.config") if k != key]
    return [f"{k}=null" for k in others] + [f"{key}={json.dumps(path)}"]  # YAML-quoted


def checkpoint_step(cfg: RunConfig) -> int:
    """The training step of the model evaluated: a trainer checkpoint's (trainer_state.json),
    otherwise 0."""
    import json

    path = cfg.model.mcore_ckpt
    state = os.path.join(path, "trainer_state.json") if path else ""
    if state and os.path.isfile(state):
        with open(state) as f:
            step = json.load(f).get("step", 0)
        return step if isinstance(step, int) else 0
    return 0


def require_held_out(cfg: RunConfig) -> None:
    """`megarl eval` has prompts to evaluate on (checked before any process group exists)."""
    if cfg.eval.path is None and cfg.eval.fraction == 0:
        raise ConfigError(
            "megarl eval needs held-out prompts: set eval.path (a prompt file) or eval.fraction "
            "(the held-out share of data.path, as in training)"
        )


def evaluate_model(cfg: RunConfig, out_dir: str) -> dict:
    """`megarl eval`: one evaluation of `cfg.model` on the held-out prompts, no training.
    Writes out_dir/config.yaml, metrics.jsonl (one record) and eval_samples.jsonl; returns the
    figures on global rank 0 (with `step`). Collective."""
    from megarl.data.split import prompt_sets
    from megarl.distributed import device
    from megarl.models.builder import BuildConfig, build_model
    from megarl.trainer import run as R
    from megarl.trainer.model_source import resolve_model
    from megarl.trainer.models import _initial_state

    require_held_out(cfg)
    _, world = init_distributed()
    R.check_paths(cfg)
    cfg = resolve_model(cfg)  # a GGUF file -> its cached HF dir; a run dir -> its checkpoint
    arch = R.load_arch(cfg)
    check_eval(cfg, arch)
    gpu = device.use_gpu()
    _, groups = R.build_topology(cfg, arch, world, out_dir)
    tokenizer = R.load_tokenizer(cfg, out_dir)
    cfg = R._resolve_rollout(cfg, arch, tokenizer, gpu)
    _, held_out = prompt_sets(cfg.data, cfg.eval, tokenizer)
    reward_fns = R._reward_functions(cfg)
    R._check_model_files(cfg, arch)
    step = checkpoint_step(cfg)
    R.write_config(cfg, out_dir)
    build = BuildConfig(
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        routing_replay=cfg.rollout.routing_replay,
    )
    # frozen: the evaluated weights need no gradients, optimizer or DDP buffers
    policy = build_model(arch, cfg.parallel, cfg.precision, role="reference", build=build, gpu=gpu)
    _initial_state(cfg, arch, policy)
    rollout = R.build_rollout(cfg, arch, policy, groups, out_dir)
    rollout.sync_weights()
    logger = R.build_logger(cfg, out_dir)
    logger.truncate_after(step - 1)  # an evaluation written here before is replaced
    evaluator = Evaluator.create(cfg, held_out, rollout.dispatcher, tokenizer, reward_fns, groups)
    metrics, rows = evaluator.run(step)
    logger.log_samples(step, rows, file=EVAL_SAMPLES_FILE)
    logger.log(step, metrics)
    logger.close()
    rollout.engine.close()
    dist.barrier()
    return {"step": step, **metrics}
