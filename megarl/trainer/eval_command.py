"""`megarl eval`: one held-out evaluation of a model, no training.

The run is built by the one recipe (`megarl.trainer.recipe.build_run`) from `EvalStage`: the
policy frozen (no optimizer), the rollout engine and its weight sync, the scorer of the reward
functions and the `Evaluator` of training runs (`megarl.trainer.evaluate`), so its figures are
those a training run logs at an evaluation step. Writes RUN/config.yaml, metrics.jsonl (one
record, at the step of the checkpoint evaluated) and eval_samples.jsonl.
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from megarl.config import ConfigError, RunConfig
from megarl.metrics.sinks import EVAL_SAMPLES_FILE
from megarl.trainer import recipe
from megarl.trainer.stages import EvalStage


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
    key = model_source(path)
    others = [k for k in ("model.hf", "model.mcore_ckpt", "model.config") if k != key]
    return [f"{k}=null" for k in others] + [f"{key}={json.dumps(path)}"]  # YAML-quoted


def checkpoint_step(cfg: RunConfig) -> int:
    """The training step of the model evaluated: a trainer checkpoint's (trainer_state.json),
    otherwise 0."""
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
    """One evaluation of `cfg.model` on the held-out prompts (module docstring); returns the
    figures on global rank 0 (with `step`). Collective."""
    require_held_out(cfg)
    with recipe.build_run(cfg, out_dir, EvalStage(cfg.algorithm)) as run:
        step = checkpoint_step(run.cfg)
        run.logger.truncate_after(step - 1)  # an evaluation written here before is replaced
        metrics, rows = run.evaluator.evaluate(step)
        run.logger.log_samples(step, rows, file=EVAL_SAMPLES_FILE)
        run.logger.log(step, metrics)
    dist.barrier()
    return {"step": step, **metrics}
