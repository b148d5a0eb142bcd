"""Qwen3-Next (Gated DeltaNet layers beside gated full attention) trained end to end on CPU by a
stage without a rollout engine: SFT through `torchrun -m megarl train` at TP2 with sequence
parallelism (the DeltaNet's projections split over TP by component), unpacked (megatron-core's
GatedDeltaNet takes no packed rows), exported to HF. Conversion and layout parity:
tests/test_convert_roundtrip.py and tests/test_parallel_parity.py; refusals:
tests/test_model_config.py."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.test_moe_e2e import TOY
from tests.test_trainer_e2e import ROOT, _metrics, _train
from tests.tiny import TINY_QWEN3_NEXT


@pytest.mark.slow
def test_sft_trains_a_qwen3_next_at_tp2_sp_and_exports_it(tmp_path):
    with open(os.path.join(ROOT, "examples/sft_copy_cpu.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["config"] = {**TINY_QWEN3_NEXT, **TOY}
    path = tmp_path / "sft_qwen3_next.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "sft"
    _train(
        out,
        "trainer.steps=12",
        "eval.fraction=0.05",
        "eval.every=6",
        "algorithm.pack_sequences=false",
        "parallel.tensor_parallel=2",
        "parallel.sequence_parallel=true",
        nproc=2,
        config=str(path),
    )
    rows = _metrics(out)
    print(
        f"qwen3_next sft tp2-sp: loss {rows[1]['loss']:.3f} -> {rows[-1]['loss']:.3f}, "
        f"eval/loss {rows[0]['eval/loss']:.3f} -> {rows[-1]['eval/loss']:.3f}"
    )
    assert rows[-1]["loss"] < rows[1]["loss"] - 0.3
    assert rows[-1]["eval/loss"] < rows[0]["eval/loss"] - 0.3
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3NextForCausalLM"]
    assert exported["layer_types"] == TINY_QWEN3_NEXT["layer_types"]
