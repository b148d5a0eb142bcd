"""How a run ends: the divergence stop (`stop_if_diverged`, before a step's checkpoint) and
`finish` (the curves' plot, the optional HF export, closing the logs), shared by the RL loop
(`megarl.trainer.loop`) and the offline loop (`megarl.trainer.offline`).
"""

from __future__ import annotations

import logging
import math
import os

import torch.distributed as dist

from megarl.convert.peft import save_peft
from megarl.convert.stream import save_hf_streaming
from megarl.metrics.plots import plot_run
from megarl.models import lora
from megarl.trainer.run import Run

log = logging.getLogger("megarl")


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss."""


def stop_if_diverged(run: Run, metrics: dict) -> None:
    """Raise `TrainingDiverged` after `trainer.max_bad_steps` consecutive steps with a NaN/Inf
    loss (`count_bad_step` counts them); called before the step's checkpoint, so none is written
    from a diverged state."""
    if count_bad_step(run, metrics):
        run.close()
        raise TrainingDiverged(
            f"stopped at step {run.step}: {run.bad_steps} consecutive steps with a NaN/Inf "
            f"loss (trainer.max_bad_steps={run.cfg.trainer.max_bad_steps}); the newest "
            f"checkpoint in {run.out_dir}/checkpoints is from before the divergence"
        )


def count_bad_step(run: Run, metrics: dict) -> bool:
    """Count consecutive steps whose policy or critic loss was non-finite (their updates were
    dropped)."""
    skipped = metrics.get("skipped_steps", 0) + metrics.get("value_skipped_steps", 0)
    losses = (metrics.get("loss", 0.0), metrics.get("value_loss", 0.0))
    if skipped or not all(math.isfinite(x) for x in losses):
        run.bad_steps += 1
        log.warning(
            "step %d: non-finite loss, update skipped (%d in a row)", run.step, run.bad_steps
        )
        return run.bad_steps >= run.cfg.trainer.max_bad_steps
    run.bad_steps = 0
    return False


def finish(run: Run, *, role: str = "actor") -> None:
    """Plot the run's curves (`plot_run`: `reward.png`; an offline run's losses and accuracies:
    `loss.png`); export the trained model of `role` as an HF directory when asked, and always
    for a LoRA reward model (its checkpoints hold no base: the merged export is what an RL run
    scores with); a LoRA policy's adapters as a PEFT directory."""
    metrics = os.path.join(run.out_dir, "metrics.jsonl")
    if dist.get_rank() == 0 and os.path.exists(metrics):
        try:
            plot_run(run.out_dir)
        except ValueError as e:  # e.g. a resumed run that had no step left to do
            log.warning("no plot: %s", e)
    adapters = run.cfg.model.lora
    if adapters.enabled and role == "actor":
        save_peft(
            run.models.actor.chunks,
            adapters,
            os.path.join(run.out_dir, "adapter"),
            base_model=run.cfg.model.hf,
        )
    lora_rm = adapters.enabled and role == "reward"
    if run.cfg.trainer.export_hf or lora_rm:
        if lora_rm and not run.cfg.trainer.export_hf:
            log.info("LoRA reward model: writing its merged HF export to %s/hf", run.out_dir)
        export_hf(run, os.path.join(run.out_dir, "hf"), role=role)
    run.close()
    dist.barrier()


def export_hf(run: Run, out: str, role: str = "actor") -> None:
    """The trained model of `role` (the actor; a reward model: a sequence classifier) as an HF
    directory written by rank 0, streamed one tensor at a time (collective; no rank holds the
    whole model)."""
    tok_dir = os.path.join(run.out_dir, "tokenizer")  # only rank 0 reads it
    chunks = getattr(run.models, role).chunks
    with lora.merged(chunks):  # LoRA: the base with the adapters merged in
        save_hf_streaming(
            chunks,
            run.arch,
            out,
            tokenizer_dir=tok_dir if os.path.isdir(tok_dir) else None,
            overwrite=True,
        )
    dist.barrier()
