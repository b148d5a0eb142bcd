"""The TRL side of `--suite peer` (`megarl.benchmarks.peer`), run in its own interpreter:
`python -m megarl.benchmarks.peer_trl MODEL_DIR PRECISION STEPS OUT.json [WORKLOAD.json]`.

Without WORKLOAD.json: the random model's workload (`megarl.benchmarks.peer`). With it (written
by the parent, `peer_smollm2.trl_spec`): the prompts file (prompt / answer rows, rendered with
the model's chat template by TRL), the reward (`math_verify`), `beta` (TRL's k3 KL to its
reference model, computed every step), and held-out prompts evaluated greedily with HF
`generate` before the first step and every `eval_every` steps, outside the step timer.

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

from megarl.benchmarks.peer import LR, MAX_TOKENS, PROMPTS, ROWS, SEED, N, first_char_reward
from megarl.rewards.builtins import math_verify_reward


def trl_main(model_dir: str, precision: str, steps: int, out: str, spec: dict | None) -> None:
    """The TRL side, in its own interpreter: GRPOTrainer on the workload, timed per step."""
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    timings: dict[str, list[float]] = {"step_s": [], "generate_s": [], "gen_score_s": []}
    lengths: list[float] = []
    evals: list[tuple[int, float]] = []
    spec = spec or {
        "batch": PROMPTS * N, "num_generations": N, "max_tokens": MAX_TOKENS, "lr": LR,
        "beta": 0.0, "seed": SEED,
    }  # fmt: skip
    if "prompts" in spec:
        rows = [_chat_row(r) for r in _read_jsonl(spec["prompts"])]
        reward = math_verify_reward
    else:
        rows, reward = ROWS, first_char_reward

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timings["step_s"].append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    callbacks = [StepTimer()]
    if "eval" in spec:
        callbacks.append(_held_out_callback()(_read_jsonl(spec["eval"]), spec, evals, steps))
    with tempfile.TemporaryDirectory(prefix="megarl_peer_trl_out_") as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=spec["batch"],
            gradient_accumulation_steps=1,
            num_generations=spec["num_generations"],
            max_completion_length=spec["max_tokens"],
            temperature=1.0,
            learning_rate=spec["lr"],
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            beta=spec["beta"],
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
            seed=spec["seed"],
            model_init_kwargs={"dtype": torch.bfloat16 if precision == "bf16w" else torch.float32},
        )
        trainer = GRPOTrainer(
            model=model_dir,
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_list(rows),
            callbacks=callbacks,
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
        evals=evals,
        threads=torch.get_num_threads(),
        trl=trl.__version__,
        dtype=str(next(trainer.model.parameters()).dtype),
    )
    with open(out, "w") as f:
        json.dump(result, f)


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _chat_row(row: dict) -> dict:
    """A prompt / answer row in TRL's conversational form (TRL applies the chat template)."""
    return {"prompt": [{"role": "user", "content": row["prompt"]}], "answer": row["answer"]}


def _held_out_accuracy(model, tokenizer, rows: list[dict], max_tokens: int) -> float:
    """Greedy math_verify accuracy of `model` on `rows` (HF generate, batches of 16, left
    padding), in eval mode and without grad; the model's mode is restored."""
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    texts = []
    try:
        with torch.no_grad():
            for i in range(0, len(rows), 16):
                chunk = rows[i : i + 16]
                batch = tokenizer.apply_chat_template(
                    [[{"role": "user", "content": r["prompt"]}] for r in chunk],
                    add_generation_prompt=True,
                    padding=True,
                    return_dict=True,
                    return_tensors="pt",
                )
                out = model.generate(
                    **batch,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
                width = batch["input_ids"].shape[1]
                texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    scores = math_verify_reward(None, texts, answer=[r["answer"] for r in rows])
    return sum(s or 0.0 for s in scores) / len(rows)


def _held_out_callback():
    from transformers import TrainerCallback

    class HeldOut(TrainerCallback):
        """Held-out greedy accuracy before the first step, every `eval_every` steps and after
        the last (after the step timer's `on_step_end`, so outside the step times)."""

        def __init__(self, rows, spec, sink, steps):
            self.rows, self.spec, self.sink, self.steps = rows, spec, sink, steps

        def _eval(self, step, model, tokenizer):
            acc = _held_out_accuracy(model, tokenizer, self.rows, self.spec["max_tokens"])
            self.sink.append((step, acc))

        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
            self._eval(0, model, processing_class)

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            step = state.global_step
            if step % self.spec["eval_every"] == 0 or step == self.steps:
                self._eval(step, model, processing_class)

    return HeldOut


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
    workload = None
    if len(sys.argv) > 5:
        with open(sys.argv[5]) as f:
            workload = json.load(f)
    trl_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], workload)
