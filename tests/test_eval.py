"""Held-out evaluation and visible samples, the parts without an engine: pass@k, the held-out
split, config errors, which samples are picked, samples files on resume, the plot, `megarl eval`
argument handling, the console lines. The end-to-end runs are in tests/test_eval_e2e.py."""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import random
import sys
import types

import pytest

from megarl.config import DEFAULT_CONFIG, ConfigError, load_config
from megarl.data.split import held_out_split, prompt_sets
from megarl.data.toy import toy_rows, toy_tokenizer
from megarl.metrics import MetricsLogger, StepProgress
from megarl.metrics.plots import eval_series, plot_rewards
from megarl.metrics.progress import format_sample
from megarl.trainer.eval_command import model_overrides, model_source
from megarl.trainer.evaluate import Evaluator, evaluation_due, pass_at_k
from megarl.trainer.samples import candidates, pick, priority


# ---------------------------------------------------------------- pass@k
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_is_the_chance_that_k_of_n_hold_a_pass(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert math.isclose(pass_at_k(n, c, k), brute, abs_tol=1e-12), (n, c, k)
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(n, n + 1, 1)


# ---------------------------------------------------------------- the held-out split
def test_fraction_split_is_seeded_disjoint_and_keeps_repeated_prompts_together():
    rows = toy_rows()  # the two-digit prompts are repeated 4 times each
    prompts = [r["prompt"] for r in rows]
    train, held = held_out_split(prompts, 0.1, seed=3)
    assert held_out_split(prompts, 0.1, seed=3) == (train, held)
    assert held_out_split(prompts, 0.1, seed=4) != (train, held)
    distinct = set(prompts)
    held_prompts = [prompts[i] for i in held]
    assert len(held_prompts) == len(set(held_prompts)) == round(0.1 * len(distinct))
    assert not set(held_prompts) & {prompts[i] for i in train}
    # every row of a held-out prompt left training; nothing else did
    assert set(train) == {i for i, p in enumerate(prompts) if p not in set(held_prompts)}
    assert train == sorted(train)
    # the held-out order is seeded, not the file order (its first prompts are a random subset)
    assert held != sorted(held)


def test_prompt_sets_remove_the_held_out_prompts_from_training():
    tok = toy_tokenizer()
    cfg = load_config(None, ["eval.fraction=0.05", "eval.every=1"])
    train, held = prompt_sets(cfg.data, cfg.eval, tok)
    assert len(held) == round(0.05 * len({r["prompt"] for r in toy_rows()}))
    assert not {tuple(p) for p in train.prompt_ids} & {tuple(p) for p in held.prompt_ids}
    assert len(train) + sum(train.prompts.count(p) == 0 for p in held.prompts) <= len(toy_rows())
    assert held.columns["answer"] == [p[len("copy ") : -1] for p in held.prompts]
    # no held-out prompts: training is untouched
    plain, none = prompt_sets(cfg.data, load_config(None).eval, tok)
    assert none is None and len(plain) == len(toy_rows())


def test_eval_path_is_read_with_the_data_settings(tmp_path):
    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in toy_rows()[-5:]))
    cfg = load_config(None, [f"eval.path={path}", "eval.every=2"])
    train, held = prompt_sets(cfg.data, cfg.eval, toy_tokenizer())
    assert held.prompts == [r["prompt"] for r in toy_rows()[-5:]]
    assert len(train) == len(toy_rows())  # eval.path leaves the training data as it is


# ---------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["eval.every=-1"], "eval.every=-1"),
        (["eval.every=5"], "needs held-out prompts"),
        (["eval.fraction=1.5"], "eval.fraction=1.5"),
        (["eval.fraction=0.1", "eval.path=x.jsonl"], "both set"),
        (["eval.n=4"], "eval.n=4 with eval.temperature=0"),
        (["eval.temperature=3"], "eval.temperature=3"),
        (["eval.n=4", "eval.temperature=1", "eval.pass_k=[1,8]"], "eval.pass_k=[1, 8]"),
        (["eval.max_tokens=0"], "eval.max_tokens=0"),
        (["eval.max_prompts=0"], "eval.max_prompts=0"),
        (["eval.samples_logged=-2"], "eval.samples_logged=-2"),
        (["eval.pass_reward=format"], "eval.pass_reward='format' is not one of"),
        (["logging.samples_per_step=-1"], "logging.samples_per_step=-1"),
        (["logging.samples_per_step=1", "logging.show_samples=true"], "--show-samples"),
    ],
)
def test_bad_eval_and_samples_settings_are_clear_errors(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value), str(err.value)


def test_an_eval_longer_than_the_model_is_refused_before_anything_is_built():
    from megarl.models.hf_config import arch_from_hf
    from megarl.trainer.evaluate import check_eval

    cfg = load_config(None, ["eval.every=1", "eval.fraction=0.1", "eval.max_tokens=60"])
    with pytest.raises(ConfigError) as err:
        check_eval(cfg, arch_from_hf(cfg.model.config))
    assert "eval.max_tokens (60) = 76 exceeds the model's max_position_embeddings (64)" in str(
        err.value
    )
    check_eval(
        load_config(None, ["eval.every=1", "eval.fraction=0.1", "eval.max_tokens=48"]),
        arch_from_hf(cfg.model.config),
    )


def test_pass_k_defaults_to_1_and_n():
    assert load_config(None, ["eval.n=8", "eval.temperature=1"]).eval.ks == (1, 8)
    assert load_config(None).eval.ks == (1,)
    cfg = load_config(None, ["eval.n=8", "eval.temperature=1", "eval.pass_k=[4,2,4]"])
    assert cfg.eval.ks == (2, 4)


def test_eval_is_due_at_step_0_every_e_steps_and_after_the_last():
    cfg = load_config(None, ["eval.every=3", "eval.fraction=0.1", "trainer.steps=7"])
    ev = Evaluator(cfg, None, None, None, None, None)
    assert [s for s in range(8) if ev.due(s)] == [0, 3, 6, 7]
    assert [s for s in range(8) if evaluation_due(s, cfg.eval, 7)] == [0, 3, 6, 7]
    never = load_config(None, ["eval.every=0", "eval.fraction=0.1"]).eval
    assert not any(evaluation_due(s, never, 7) for s in range(8))  # 0 = no evaluation


# ---------------------------------------------------------------- which samples are shown
def _rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        response = [rng.randrange(20) for _ in range(rng.randrange(1, 6))]
        rows.append(
            {
                "prompt_id": i // 4,
                "reward": rng.choice([0.0, 0.25, 0.5, 1.0]),  # ties on purpose
                "_priority": priority(0, 7, i // 4, response),
                "response": response,
            }
        )
    return rows


@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_the_pick_does_not_depend_on_how_samples_are_split_over_ranks(m):
    rows = _rows(48)
    whole = pick(rows, m)
    assert len(whole) == min(m, len(rows))
    labels = [r["pick"] for r in whole]
    assert labels[0] == "best" and (m < 2 or labels[1] == "worst")
    assert whole[0]["reward"] == max(r["reward"] for r in rows)
    if m >= 2:
        assert whole[1]["reward"] == min(r["reward"] for r in rows)
    for ranks in (2, 3, 8):
        shuffled = rows[:]
        random.Random(ranks).shuffle(shuffled)
        offered = []
        for part in (shuffled[r::ranks] for r in range(ranks)):
            chosen = candidates([r["reward"] for r in part], [r["_priority"] for r in part], m)
            assert len(chosen) <= m + 2
            offered += [part[i] for i in chosen]
        assert pick(offered, m) == whole, ranks


def test_priority_depends_on_the_sample_not_its_place():
    assert priority(0, 3, 5, [1, 2]) == priority(0, 3, 5, [1, 2])
    assert (
        len(
            {
                priority(0, 3, 5, [1, 2]),
                priority(0, 4, 5, [1, 2]),
                priority(0, 3, 6, [1, 2]),
                priority(0, 3, 5, [2, 1]),
                priority(1, 3, 5, [1, 2]),
            }
        )
        == 5
    )


# ---------------------------------------------------------------- files on resume
def test_samples_files_are_truncated_with_metrics(tmp_path):
    log = MetricsLogger(tmp_path, rank=0, tensorboard=False)
    log.log(0, {"eval/pass@1": 0.1})
    for step in (1, 2, 3):
        log.log_samples(step, [{"completion": "a"}, {"completion": "b"}], file="samples.jsonl")
        log.log_samples(step, [{"completion": "c"}], file="eval_samples.jsonl")
        log.log(step, {"reward_mean": step / 10})
    log.log_samples(0, [{"completion": "z"}], file="eval_samples.jsonl")  # step 0 after 3: kept
    with pytest.raises(ValueError):
        log.log_samples(1, [{}], file="other.jsonl")
    log.truncate_after(1)
    log.close()

    def steps(name):
        return [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()]

    assert steps("metrics.jsonl") == [0, 1]
    assert steps("samples.jsonl") == [1, 1]
    assert steps("eval_samples.jsonl") == [1, 0]
    log = MetricsLogger(tmp_path, rank=0, tensorboard=False)
    log.log(2, {"reward_mean": 0.2})  # continues after the kept step
    log.truncate_after(-1)  # a fresh start in the same directory
    log.close()
    assert steps("metrics.jsonl") == steps("samples.jsonl") == steps("eval_samples.jsonl") == []


def test_samples_become_a_wandb_table(tmp_path, monkeypatch):
    logged = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        def log(self, data, step):
            logged.append((step, data))

        def finish(self):
            pass

    fake = types.SimpleNamespace(init=lambda **kw: Run(), Table=Table)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLogger(tmp_path, rank=0, wandb_cfg={"project": "p"}, tensorboard=False)
    row = {
        "prompt": [{"role": "user", "content": "hi"}],
        "completion": "x",
        "reward": 1.0,
        "rewards": {"f": 1.0},
    }
    log.log_samples(4, [row], file="samples.jsonl")
    log.close()
    ((step, data),) = logged
    table = data["samples"]
    assert step == 4 and table.columns == ["step", "prompt", "completion", "reward", "rewards"]
    assert table.data == [[4, '[{"role": "user", "content": "hi"}]', "x", 1.0, '{"f": 1.0}']]


# ---------------------------------------------------------------- the plot
def _records() -> list[dict]:
    out = [
        {
            "step": 0,
            "eval/pass@1": 0.1,
            "eval/exact_match": 0.1,
            "eval/toy_reward": 0.3,
            "eval/reward_mean": 0.3,
            "eval/response_len": 5.0,
            "eval/time_s": 1.0,
        }
    ]
    for s in range(1, 9):
        r = {"step": s, "reward_mean": s / 10, "response_len": 4.0, "kl": 0.01 * s}
        if s % 4 == 0:
            r.update(
                {
                    "eval/pass@1": s / 10,
                    "eval/exact_match": s / 10,
                    "eval/toy_reward": s / 9,
                    "eval/reward_mean": s / 9,
                }
            )
        out.append(r)
    return out


def test_the_plot_draws_the_eval_curves_beside_the_reward(tmp_path, monkeypatch):
    records = _records()
    series = eval_series(records)
    # exact_match repeats pass@1 and toy_reward repeats reward_mean: left out
    assert [(n, s) for n, s, _ in series] == [
        ("eval/pass@1", [0, 4, 8]),
        ("eval/reward_mean", [0, 4, 8]),
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    drawn = []
    from matplotlib.axes import Axes

    original = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append(kwargs.get("label"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    png = plot_rewards(path, tmp_path / "reward.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "eval/pass@1 (held-out)" in drawn and "eval/reward_mean (held-out)" in drawn


# ---------------------------------------------------------------- megarl eval's target
def test_a_model_directory_picks_its_model_key(tmp_path):
    hf = tmp_path / "hf: x"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    ckpt = tmp_path / "step_000003"
    ckpt.mkdir()
    assert model_source(str(hf)) == "model.hf"
    assert model_source(str(ckpt)) == "model.mcore_ckpt"
    over = model_overrides(str(hf))
    assert over[:2] == ["model.mcore_ckpt=null", "model.config=null"]
    cfg = load_config(None, over)  # the path's ': ' survives YAML
    assert cfg.model.hf == str(hf) and cfg.model.config is None
    assert cfg.model.tokenizer == "toy"  # kept from the config


def _cli(*argv: str) -> int:
    """The CLI in this process, which it must leave as it found it: a process group left behind
    (and its RANK / MASTER_PORT in the environment) would be inherited by every later test's
    `python -m megarl` subprocess, which would then fail to bind that port."""
    import torch.distributed as dist

    from megarl import cli

    env = dict(os.environ)
    try:
        return cli.run_command(cli.parse_args(list(argv)))
    finally:
        initialised = dist.is_initialized()
        if initialised:
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
        assert not initialised, "an input error initialised torch.distributed"


def test_megarl_eval_input_errors(tmp_path, capsys):
    assert _cli("eval", str(tmp_path / "nope")) == 2
    assert "no such file or directory" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text(open(DEFAULT_CONFIG).read())
    assert _cli("eval", str(cfg), "--config", str(cfg)) == 2
    assert "two configs" in capsys.readouterr().err
    assert _cli("eval", str(cfg), "--out", str(tmp_path / "o")) == 2
    err = capsys.readouterr().err
    assert "megarl eval needs held-out prompts" in err and err.count("megarl: error:") == 1


# ---------------------------------------------------------------- the console
def test_show_samples_prints_the_best_and_worst_lines():
    rows = [
        {
            "pick": "best",
            "prompt": "copy 371=",
            "completion": "371",
            "reward": 1.0,
            "advantage": 0.84,
            "length": 4,
            "finish_reason": "stop",
        },
        {
            "pick": "worst",
            "prompt": "copy 12=",
            "completion": "9" * 500,
            "reward": 0.0,
            "advantage": -1.2,
            "length": 8,
            "finish_reason": "length",
        },
        {
            "pick": "random",
            "prompt": "copy 5=",
            "completion": "",
            "reward": 0.0,
            "advantage": 0.0,
            "length": 1,
            "finish_reason": "stop",
        },
    ]
    assert (
        format_sample(rows[0]) == "best  reward 1.000 adv +0.84   4 tok stop | 'copy 371=' -> '371'"
    )
    out = io.StringIO()
    bar = StepProgress(3, rank=0, file=out, progress=False)
    bar.update(2, {"reward_mean": 0.5}, rows)
    lines = out.getvalue().splitlines()
    assert [ln.split()[:3] for ln in lines] == [["step", "2", "best"], ["step", "2", "worst"]]
    assert len(lines[1]) < 200 and lines[1].endswith("...'")
    quiet = io.StringIO()
    StepProgress(3, rank=1, file=quiet).update(2, {}, rows)  # rank 1 shows nothing
    assert quiet.getvalue() == ""
