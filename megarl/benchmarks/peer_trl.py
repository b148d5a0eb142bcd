"""The TRL side of `--suite peer` (`megarl.benchmarks.peer`), run in its own interpreter:
`python -m megarl.benchmarks.peer_trl MODEL_DIR PRECISION STEPS OUT.json`.

`GRPOTrainer` (TRL >= 1.16) on the peer workload with HF `generate`; the settings and why are in
`megarl.benchmarks.peer`'s docstring. Timing: a `TrainerCallback` times each optimizer step
(`on_step_begin` to `on_step_end`: generation, scoring, loss, backward, optimizer step), reads
`completions/mean_length` from each step's log, and the trainer's `_generate_single_turn` (HF
generate) and `_generate_and_score_completions` (generation, rewards, advantages) are wrapped on
the instance to time them. Intra-op threads: `OMP_NUM_THREADS`, as the parent set it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from megarl.benchmarks.peer import LR, MAX_TOKENS, PROMPTS, SEED, N


def trl_main(model_dir: str, precision: str, steps: int, out: str) -> None:
    """The TRL side, in its own interpreter: GRPOTrainer on the workload, timed per step."""
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.benchmarks.peer import ROWS, first_char_reward

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    timings: dict[str, list[float]] = {"step_s": [], "generate_s": [], "gen_score_s": []}
    lengths: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timings["step_s"].append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    with tempfile.TemporaryDirectory(prefix="megarl_peer_trl_out_") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=PROMPTS * N,
            gradient_accumulation_steps=1,
            num_generations=N,
            max_completion_length=MAX_TOKENS,
            temperature=1.0,
            learning_rate=LR,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            beta=0.0,
            num_iterations=1,
            loss_type="dapo",
            scale_rewards="group",
            max_steps=steps,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            bf16=precision != "fp32",
            gradient_checkpointing=False,
            use_vllm=False,
            use_cpu=True,
            seed=SEED,
            model_init_kwargs={"dtype": torch.bfloat16 if precision == "bf16w" else torch.float32},
        )
        trainer = GRPOTrainer(
            model=model_dir,
            reward_funcs=first_char_reward,
            args=config,
            train_dataset=Dataset.from_list(ROWS),
            callbacks=[StepTimer()],
        )
        for name, key in (
            ("_generate_single_turn", "generate_s"),
            ("_generate_and_score_completions", "gen_score_s"),
        ):
            _time_method(trainer, name, timings[key])
        trainer.train()
    result = dict(
        timings,
        mean_length=lengths,
        threads=torch.get_num_threads(),
        trl=trl.__version__,
        dtype=str(next(trainer.model.parameters()).dtype),
    )
    with open(out, "w") as f:
        json.dump(result, f)


def _time_method(obj, name: str, sink: list) -> None:
    """Wrap `obj.name` (an instance attribute, the class stays untouched) to append its wall
    seconds per call to `sink`."""
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t)

    setattr(obj, name, timed)


if __name__ == "__main__":
    trl_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
