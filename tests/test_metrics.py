"""Metrics: stage timer, FLOPs/MFU, metrics.jsonl sink (+ wandb/tensorboard mirrors), progress,
reward plot."""

from __future__ import annotations

import json
import logging
import math
import struct
import sys
import time
import types

import numpy as np
import pytest
import torch

from megarl.metrics import (
    MetricsLogger,
    StageTimer,
    StepProgress,
    flatten,
    flops_per_token,
    format_step_line,
    json_safe,
    mfu,
    peak_flops,
    plot_rewards,
    sinks,
)


# ---------------------------------------------------------------- timer
def test_stage_timer_accumulates_and_resets():
    timer = StageTimer(sync=False)
    with timer("rollout"):
        time.sleep(0.02)
        with timer("inner"):
            time.sleep(0.01)
    with timer("train"):
        pass
    with timer("rollout"):
        time.sleep(0.01)
    t = timer.step_times()
    assert list(t) == ["rollout", "inner", "train"]
    assert 0.04 <= t["rollout"] < 1.0 and 0.01 <= t["inner"] < t["rollout"]
    assert t["train"] < 0.01
    with pytest.raises(RuntimeError), timer("fails"):
        raise RuntimeError
    assert "fails" in timer.step_times()  # time is charged even when the stage raises
    timer.reset()
    assert timer.step_times() == {}


# ---------------------------------------------------------------- FLOPs / MFU
TINY = dict(
    hidden_size=8,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
)


def test_flops_per_token_hand_count():
    # per layer: q 8*8 + k,v 2*8*4 + o 8*8 = 192; SwiGLU 3*8*16 = 384 -> 576; 2 layers = 1152;
    # LM head 8*10 = 80 -> 1232 matmul params -> 2464 FLOPs;
    # attention 4 * 2 layers * (2 heads * 4) * seq 6 = 384 -> forward 2848.
    assert flops_per_token(TINY, seq_len=6) == 2848
    assert flops_per_token(TINY, seq_len=6, training=True) == 3 * 2848
    assert flops_per_token(TINY, seq_len=6, causal=True) == 2464 + 192
    # HF-style names on an object, head_dim and kv heads defaulted (-> 4 and 2)
    hf = types.SimpleNamespace(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=16,
        vocab_size=10,
        head_dim=None,
    )
    # k, v now 2*8*8 = 128 -> attn 256, layer 640, 2 layers 1280 + 80 = 1360 -> 2720 + 384
    assert flops_per_token(hf, seq_len=6) == 2720 + 384


def test_flops_per_token_moe_hand_count():
    moe = dict(TINY, num_experts=4, moe_topk=2, moe_intermediate_size=6)
    # MLP: router 8*4 = 32 + 2 experts * 3*8*6 = 288 -> 320; layer 192 + 320 = 512;
    # 2 layers 1024 + 80 = 1104 -> 2208 + 384
    assert flops_per_token(moe, seq_len=6) == 2208 + 384
    with pytest.raises(ValueError, match="moe_topk.*num_experts_per_tok"):
        flops_per_token(dict(TINY, num_experts=4), seq_len=6)


def test_flops_per_token_matches_param_count_of_a_real_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny import TINY_LLAMA

    cfg = LlamaConfig(**TINY_LLAMA)
    with torch.device("meta"):  # shapes only
        model = LlamaForCausalLM(cfg)
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    seq = 32
    attention = 4 * cfg.num_hidden_layers * cfg.hidden_size * seq
    assert flops_per_token(cfg, seq_len=seq) == 2 * matmul_params + attention


def test_mfu_and_peaks():
    assert mfu(1000.0, 6e9, 989e12) == pytest.approx(6e12 / 989e12)
    assert mfu(1000.0, 6e9, 989e12, num_devices=2) == pytest.approx(3e12 / 989e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == 1979e12
    assert peak_flops("NVIDIA H200", "bf16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float16) == 312e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert peak_flops("cpu", torch.bfloat16) is None
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float32) is None


# ---------------------------------------------------------------- metrics.jsonl
def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_json_safe_and_flatten():
    got = json_safe(
        {
            "a": torch.tensor(1.5),
            "b": float("nan"),
            "c": {"d": np.float32(2.0), "e": math.inf},
            "f": torch.tensor([1, 2]),
            "g": np.int64(3),
            "h": True,
            "i": object,
        }
    )
    assert got == {
        "a": 1.5,
        "b": None,
        "c": {"d": 2.0, "e": None},
        "f": [1, 2],
        "g": 3,
        "h": True,
        "i": str(object),
    }
    assert flatten({"x": 1, "time_s": {"rollout": 2.0, "sub": {"k": 3}}}) == {
        "x": 1,
        "time_s/rollout": 2.0,
        "time_s/sub/k": 3,
    }


def test_metrics_jsonl_lines_and_truncate(tmp_path):
    log = MetricsLogger(tmp_path, rank=0, tensorboard=False)
    for step in (1, 2, 3):
        log.log(
            step,
            {
                "reward_mean": torch.tensor(step / 10),
                "kl": float("nan"),
                "time_s": {"rollout": 0.5, "train": 0.25},
            },
        )
        assert len(_lines(log.path)) == step  # flushed line by line
    assert _lines(log.path)[1] == {
        "step": 2,
        "reward_mean": pytest.approx(0.2),
        "kl": None,
        "time_s": {"rollout": 0.5, "train": 0.25},
    }
    with pytest.raises(ValueError, match="step 3 logged after step 3"):
        log.log(3, {"reward_mean": 0.0})
    log.close()

    # resume from a checkpoint at step 2: a torn last line from a crash is dropped too
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')
    resumed = MetricsLogger(tmp_path, rank=0, tensorboard=False)
    assert resumed.truncate_after(2) == 2
    resumed.log(3, {"reward_mean": 0.9})
    resumed.close()
    assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert _lines(tmp_path / "metrics.jsonl")[-1]["reward_mean"] == 0.9


def test_other_ranks_write_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "r1", rank=1, wandb_cfg={"project": "x"})
    log.log(1, {"reward_mean": 1.0})
    assert log.truncate_after(0) == 0
    log.close()
    assert not (tmp_path / "r1").exists()


class _FakeRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged = []
        self.finished = False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


def test_wandb_mirror_flattens_and_defaults_offline(tmp_path, monkeypatch):
    runs = []

    def init(**kwargs):
        runs.append(_FakeRun(**kwargs))
        return runs[-1]

    fake = types.SimpleNamespace(init=init)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log = MetricsLogger(tmp_path, rank=0, wandb_cfg={"project": "p"}, tensorboard=False)
    log.log(5, {"reward_mean": 0.5, "time_s": {"rollout": 1.0}, "note": "x", "kl": None})
    log.close()
    run = runs[0]
    assert run.init["mode"] == "offline" and run.init["project"] == "p"
    run_id = run.init["id"]
    assert len(run_id) == 8 and run.init["dir"] == str(tmp_path)
    assert run.logged == [(5, {"reward_mean": 0.5, "time_s/rollout": 1.0})]
    assert run.finished
    # the config's mode wins over an inherited WANDB_MODE; a resumed run reuses the saved id
    monkeypatch.setenv("WANDB_MODE", "online")
    MetricsLogger(tmp_path, rank=0, wandb_cfg={"mode": "offline"}, tensorboard=False).close()
    assert runs[1].init["mode"] == "offline" and runs[1].init["id"] == run_id
    # without a mode in the config, WANDB_MODE decides
    MetricsLogger(tmp_path, rank=0, wandb_cfg={"dir": "elsewhere"}, tensorboard=False).close()
    assert runs[2].init["mode"] == "online"
    assert runs[2].init["dir"] == "elsewhere" and runs[2].init["resume"] == "allow"


def test_wandb_mode_from_the_config_wins_over_the_environment():
    """logging.wandb_mode set: it decides; null: WANDB_MODE, else offline (the Dockerfile and
    the Slurm example export WANDB_MODE=offline, which must not silence `online`)."""
    from megarl.config import load_config
    from megarl.metrics.sinks import wandb_mode

    assert wandb_mode("online", {"WANDB_MODE": "offline"}) == "online"
    assert wandb_mode("disabled", {"WANDB_MODE": "online"}) == "disabled"
    assert wandb_mode(None, {"WANDB_MODE": "disabled"}) == "disabled"
    assert wandb_mode(None, {}) == "offline"
    assert load_config(None, []).logging.wandb_mode is None
    with pytest.raises(ValueError, match="logging.wandb_mode='onlin'; accepted: offline, online"):
        load_config(None, ["logging.wandb_mode=onlin"])


def test_tensorboard_is_off_by_default_and_says_so_when_missing(tmp_path, monkeypatch, caplog):
    """tensorboard is not a dependency: the default writes none, and asking for it without the
    package is a warning, not a silent no-op."""
    from megarl.config import load_config

    assert load_config(None, []).logging.tensorboard is False
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with caplog.at_level("WARNING"):
        MetricsLogger(tmp_path, rank=0, tensorboard=True).close()
    assert "tensorboard is not installed" in caplog.text
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_mirror(tmp_path, monkeypatch):
    scalars = []

    class Writer:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, key, value, step):
            scalars.append((key, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(sinks, "_open_tensorboard", lambda d: Writer(d))
    with MetricsLogger(tmp_path, rank=0, tensorboard=True) as log:
        log.log(1, {"loss": 2.0, "time_s": {"train": 3.0}})
    assert scalars == [("loss", 2.0, 1), ("time_s/train", 3.0, 1)]


# ---------------------------------------------------------------- progress
def test_progress_log_line_without_tty(caplog):
    line = format_step_line(3, 10, {"reward_mean": 0.5312, "kl": 0.001214, "x": 1}, 2.5)
    assert line == "step 3/10 | reward_mean 0.531 | kl 0.00121 | 2.50 s/step"

    class NotATty:
        def isatty(self):
            return False

    progress = StepProgress(10, rank=0, file=NotATty())
    with caplog.at_level(logging.INFO, logger="megarl.progress"):
        progress.update(1, {"reward_mean": 0.25})
    progress.close()
    assert caplog.messages[-1].startswith("step 1/10 | reward_mean 0.250 | ")


def test_progress_bar_when_forced(capsys):
    import io

    buf = io.StringIO()
    progress = StepProgress(4, rank=0, force=True, file=buf)
    progress.update(1, {"reward_mean": 0.75, "kl": 0.5})
    progress.close()
    out = buf.getvalue()
    assert "1/4" in out and "reward_mean=0.750" in out and "kl=0.500" in out
    silent = StepProgress(4, rank=2, force=True, file=buf)
    silent.update(1, {})
    assert silent._bar is None


# ---------------------------------------------------------------- plot
def test_plot_rewards_writes_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as log:
        for step in range(1, 31):
            log.log(step, {"reward_mean": step / 30, "kl": 0.01 * step, "response_len": 5.0})
    out = plot_rewards(path, tmp_path / "plots" / "reward.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert (width, height) == (700, 780)  # 3 panels: reward, response length, kl
    assert [p.name for p in out.parent.iterdir()] == ["reward.png"]  # no temp file left
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"step": 1, "kl": 0.1}\n')
    with pytest.raises(ValueError, match="reward_mean"):
        plot_rewards(empty, tmp_path / "x.png")


def test_plot_shows_per_function_rewards_that_differ_from_the_total():
    from megarl.metrics.plots import _function_rewards

    records = [{"step": s, "reward_mean": s / 4, "reward/toy_reward": s / 4,
                "reward/exact_match": s / 8} for s in range(1, 5)]
    got = _function_rewards(records, [r["reward_mean"] for r in records])
    assert got == [("reward/exact_match", [1, 2, 3, 4], [0.125, 0.25, 0.375, 0.5])]
