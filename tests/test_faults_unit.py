"""The rules behind a run that survives its cluster, each checked on its own (seconds):
time-based saves and the time limit on a fake clock, stop requests at the step boundary through
a real one-process gloo all-reduce, the hang watchdog in a child process, damaged checkpoints
skipped (never deleted) at resume, pruning, an earlier attempt's metrics set aside, the critic's
step results, and the config checks. The same rules in real 2-rank runs: tests/test_faults.py.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from megarl.config import ConfigError, TrainerConfig, load_config
from megarl.distributed.launch import spawn
from megarl.trainer import faults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN = 60.0


# ------------------------------------------------------------------ time rules (fake clock)
def test_save_every_minutes_counts_from_process_start_then_from_each_save():
    d = faults.Deadlines(TrainerConfig(save_every_minutes=10), start=0.0)
    assert not d.save_due(9.9 * MIN)
    assert d.save_due(10 * MIN)  # setup counts: nothing was saved since the process started
    d.saved(1 * MIN, now=11 * MIN)
    assert not d.save_due(20.9 * MIN) and d.save_due(21 * MIN)
    off = faults.Deadlines(TrainerConfig(save_every_minutes=0), start=0.0)
    assert not off.save_due(1e9)


def test_time_limit_leaves_room_for_one_step_and_one_save():
    d = faults.Deadlines(TrainerConfig(time_limit_minutes=60), start=0.0)
    d.step_done(10 * MIN)
    # no save yet: a save is assumed to take a step's time
    assert not d.time_up(40 * MIN) and d.time_up(40.1 * MIN)
    d.saved(2 * MIN, now=42 * MIN)
    assert not d.time_up(48 * MIN) and d.time_up(48.1 * MIN)
    assert not faults.Deadlines(TrainerConfig(), start=0.0).time_up(1e9)  # 0 = no limit


def test_collective_timeout_sits_above_the_step_timeout():
    from datetime import timedelta

    assert faults.collective_timeout(TrainerConfig(step_timeout_minutes=0)) is None
    t = faults.collective_timeout(TrainerConfig(step_timeout_minutes=20))
    assert t == timedelta(minutes=20) + faults.COLLECTIVE_MARGIN


def test_process_start_is_before_now():
    import time

    assert faults.process_start() <= time.monotonic()


# ------------------------------------------------------------------ the step boundary
class _Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class _Run:
    """What `RunGuard` uses of a run: its step, directory, save and close."""

    def __init__(self, out_dir, clock, save_s=0.0, on_save=None):
        self.step, self.out_dir, self.clock = 0, out_dir, clock
        self.save_s, self.on_save = save_s, on_save
        self.saved, self.closed = [], False

    def save(self):
        if self.on_save:
            self.on_save(self.step)
        self.clock.t += self.save_s
        self.saved.append(self.step)
        return os.path.join(self.out_dir, "checkpoints", f"step_{self.step:06d}")

    def close(self):
        self.closed = True


def _drive(out_dir, trainer, *, step_s, save_s=0.0, setup_s=0.0, during=None, on_save=None):
    """Steps of `step_s` seconds through a RunGuard on a fake clock; `during(step)` runs inside
    a step. Returns (steps saved, step it stopped at or None, stopped.json or None)."""
    faults._received.clear()
    clock = _Clock(setup_s)
    guard = faults.RunGuard.start(trainer, str(out_dir), clock=clock, start=0.0)
    run = _Run(str(out_dir), clock, save_s, on_save)
    stopped = None
    try:
        while run.step < trainer.steps:
            guard.begin_step(run, SimpleNamespace(current="train"))
            clock.t += step_s
            if during:
                during(run.step + 1)
            run.step += 1
            guard.end_step(run)
    except faults.RunStopped:
        stopped = run.step
    marker = os.path.join(out_dir, faults.STOPPED_FILE)
    record = json.load(open(marker)) if os.path.exists(marker) else None
    return run.saved, stopped, record


def _sigterm_at(n):
    def during(step):
        if step == n:
            os.kill(os.getpid(), faults.signal.SIGTERM)

    return during


def boundary_job(rank: int, world: int, tmp: str) -> dict:
    import signal

    faults.install_stop_signals()
    out = {}
    cfg = lambda **kw: TrainerConfig(steps=6, save_every_minutes=0, step_timeout_minutes=0, **kw)  # noqa: E731
    d = lambda name: os.path.join(tmp, name)  # noqa: E731
    # save_every_minutes=10, 4-minute steps after a 3-minute setup: due at 11 (the clock ran
    # since the process started), then 10 minutes after that save ended (save takes 1)
    out["timed"] = _drive(d("timed"), TrainerConfig(steps=6, save_every_minutes=10,
                                                    step_timeout_minutes=0),
                          step_s=4 * MIN, save_s=1 * MIN, setup_s=3 * MIN)
    out["every"] = _drive(d("every"), cfg(save_every=2), step_s=1.0)
    # 60-minute limit, 10-minute steps, 2-minute saves: after step 4 (t=42) another step and
    # save fit (54 < 60), after step 5 (t=52) they do not
    out["limit"] = _drive(d("limit"), cfg(save_every=2, time_limit_minutes=60),
                          step_s=10 * MIN, save_s=2 * MIN)
    out["sigterm"] = _drive(d("sigterm"), cfg(), step_s=1.0, during=_sigterm_at(3))
    # a signal that arrives while a periodic checkpoint is written stops right after it
    out["in_save"] = _drive(d("in_save"), cfg(save_every=2), step_s=1.0,
                            on_save=lambda step: os.kill(os.getpid(), signal.SIGUSR1))
    out["last_step"] = _drive(d("last_step"), cfg(), step_s=1.0, during=_sigterm_at(6))
    # before the first step: the first begin_step stops, nothing saved
    faults._received.clear()
    guard = faults.RunGuard.start(cfg(), d("early"), clock=_Clock(), start=0.0)
    os.kill(os.getpid(), signal.SIGTERM)
    run = _Run(d("early"), _Clock())
    try:
        guard.begin_step(run, SimpleNamespace(current=None))
        out["early"] = "ran"
    except faults.RunStopped as e:
        out["early"] = (str(e), run.saved, json.load(open(os.path.join(d("early"),
                                                                       faults.STOPPED_FILE))))
    # the stop file: a run does not start while it exists, and keeps the earlier record
    faults._received.clear()
    os.makedirs(d("stopfile"), exist_ok=True)
    open(os.path.join(d("stopfile"), faults.STOP_FILE), "w").close()
    with open(os.path.join(d("stopfile"), faults.STOPPED_FILE), "w") as f:
        json.dump({"step": 4, "reason": "earlier"}, f)
    try:
        faults.RunGuard.start(cfg(), d("stopfile"))
        out["stopfile"] = "started"
    except faults.RunStopped as e:
        out["stopfile"] = (str(e), json.load(open(os.path.join(d("stopfile"),
                                                                faults.STOPPED_FILE))))
    faults._received.clear()
    return out


@pytest.fixture(scope="module")
def boundary(tmp_path_factory):
    return spawn(boundary_job, 1, str(tmp_path_factory.mktemp("boundary")), timeout=300)[0]


def test_time_based_saves(boundary):
    saved, stopped, _ = boundary["timed"]
    # steps end at 7, 11 (due: 11 minutes since the process started; the save ends at 12),
    # 16, 20, 24 (due: 12 since that save), 29 (the last step)
    assert saved == [2, 5, 6] and stopped is None
    assert boundary["every"][:2] == ([2, 4, 6], None)


def test_time_limit_stops_with_a_checkpoint(boundary):
    saved, stopped, record = boundary["limit"]
    assert stopped == 5 and saved == [2, 4, 5]
    assert record["step"] == 5 and "time_limit_minutes=60 is near" in record["reason"]
    assert record["longest_step_s"] == 600 and record["longest_save_s"] == 120


def test_sigterm_saves_the_finished_step_then_stops(boundary):
    saved, stopped, record = boundary["sigterm"]
    assert (saved, stopped) == ([3], 3)
    assert record["reason"] == "SIGTERM received" and record["checkpoint_written"]


def test_a_signal_during_a_save_stops_right_after_it(boundary):
    saved, stopped, record = boundary["in_save"]
    assert (saved, stopped) == ([2], 2) and record["reason"] == "SIGUSR1 received"


def test_a_signal_in_the_last_step_lets_the_run_finish(boundary):
    assert boundary["last_step"][:2] == ([6], None)


def test_a_signal_before_the_first_step_stops_without_a_checkpoint(boundary):
    message, saved, record = boundary["early"]
    assert saved == [] and "before the first step" in message and "no new checkpoint" in message
    assert record["step"] == 0 and not record["checkpoint_written"]


def test_a_stop_file_keeps_the_run_from_starting(boundary):
    message, record = boundary["stopfile"]
    assert "stopped before setup" in message and "remove it to continue" in message
    assert record == {"step": 4, "reason": "earlier"}  # the attempt that saved: kept


# ------------------------------------------------------------------ the hang watchdog
def _child(code: str, tmp_path, timeout=60) -> subprocess.CompletedProcess:
    script = textwrap.dedent(code).replace("OUT", repr(str(tmp_path)))
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_watchdog_dumps_the_stacks_names_the_stage_and_exits(tmp_path):
    proc = _child("""
        import sys, time
        from megarl.trainer.faults import HangWatchdog
        w = HangWatchdog(0.3, OUT, 3, grace_s=0.1)
        def stuck_in_a_collective():
            w.arm(7, lambda: "train", owner=sys._getframe(0))
            time.sleep(60)
        stuck_in_a_collective()
    """, tmp_path)
    assert proc.returncode == faults.EXIT_HUNG, proc.stderr
    dump = (tmp_path / "hang-rank3.txt").read_text()
    assert "rank 3: step 7 ran longer than 0 s" in dump and "in stage 'train'" in dump
    assert "stuck_in_a_collective" in dump and "most recent call first" in dump
    assert "hung in stage 'train'" in proc.stderr


def test_watchdog_fires_past_the_limit_not_before(tmp_path):
    """On a fake clock that the watchdog reads in turn (0 when armed, then 9, 9.99 and 10.01
    s), a 10 s limit fires at the first reading past it: every reading is logged before the
    dump, so the readings end at 10.01."""
    proc = _child("""
        import os, sys, time
        from megarl.trainer.faults import HangWatchdog
        readings = iter([0.0, 9.0, 9.99, 10.01])
        log = open(os.path.join(OUT, "clock.txt"), "w")
        def clock(last=[0.0]):
            last[0] = next(readings, last[0])
            log.write(f"{last[0]}\\n")
            log.flush()
            return last[0]
        w = HangWatchdog(10.0, OUT, 0, grace_s=0.1, clock=clock)
        def stuck():
            w.arm(2, lambda: "train", owner=sys._getframe(0))
            time.sleep(60)
        stuck()
    """, tmp_path)
    assert proc.returncode == faults.EXIT_HUNG, proc.stderr
    assert (tmp_path / "clock.txt").read_text().split() == ["0.0", "9.0", "9.99", "10.01"]
    assert "step 2 ran longer than 10 s" in (tmp_path / "hang-rank0.txt").read_text()


def test_watchdog_stays_quiet_when_disarmed_or_when_the_loop_is_gone(tmp_path):
    proc = _child("""
        import sys, time
        from megarl.trainer.faults import HangWatchdog
        w = HangWatchdog(0.3, OUT, 0, grace_s=0.1)
        w.arm(1, lambda: "rollout")
        w.disarm()
        time.sleep(0.8)
        def loop():
            w.arm(2, lambda: "train", owner=sys._getframe(0))
            raise RuntimeError("a bug")
        try:
            loop()
        except RuntimeError:
            time.sleep(0.8)  # the loop unwound: reporting a hang now would be wrong
        print("quiet")
    """, tmp_path)
    assert proc.returncode == 0 and "quiet" in proc.stdout, proc.stderr
    assert not list(tmp_path.glob("hang-rank*"))


# ------------------------------------------------------------------ damaged checkpoints
def _fake_checkpoint(root, step: int) -> str:
    """A real torch.distributed.checkpoint directory with megatron's side files and a state."""
    import torch.distributed.checkpoint as dcp

    from megarl.checkpoint import files

    path = os.path.join(root, "checkpoints", f"step_{step:06d}")
    dcp.save({"w": torch.arange(4096, dtype=torch.float32) + step}, checkpoint_id=path,
             no_dist=True)
    for name in ("metadata.json", "common.pt"):
        open(os.path.join(path, name), "w").close()
    files.write_trainer_state(
        os.path.join(path, files.STATE_FILE),
        {"step": step, "sampler": {}, "actor_sched": {}, "arch": {"v": 1}},
    )
    return path


class _Payload:
    def __reduce__(self):
        return (os.system, ("true",))


def resume_job(rank: int, world: int, tmp: str) -> dict:
    from megarl.checkpoint import files, vetting
    from megarl.checkpoint.files import CheckpointError

    out = {}
    run = os.path.join(tmp, "run")
    for s in (2, 4, 5, 6, 7):
        _fake_checkpoint(run, s)
    ck = lambda s: os.path.join(run, "checkpoints", f"step_{s:06d}")  # noqa: E731
    shard = next(f for f in os.listdir(ck(7)) if f.endswith(".distcp"))
    with open(os.path.join(ck(7), shard), "r+b") as f:
        f.truncate(100)  # cut short
    os.remove(os.path.join(ck(6), shard))  # missing
    with open(os.path.join(ck(5), files.STATE_FILE), "w") as f:
        f.write('{"format": "megarl-trainer-state/1", "st')  # unreadable
    seen, warnings = [], []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger(vetting.__name__).addHandler(handler)
    found = vetting.resumable(run, lambda path, state: seen.append(state["step"]))
    logging.getLogger(vetting.__name__).removeHandler(handler)
    out["warnings"], out["run"] = warnings, run
    out["found"] = (found[0], found[1]["step"])
    out["seen"] = seen
    out["names"] = sorted(os.listdir(os.path.join(run, "checkpoints")))
    # nothing complete left: step 0
    bad = os.path.join(tmp, "bad")
    p = _fake_checkpoint(bad, 3)
    os.remove(os.path.join(p, "common.pt"))
    out["none"] = vetting.resumable(bad)
    # a tampered .metadata is refused, not skipped
    evil = os.path.join(tmp, "evil")
    p = _fake_checkpoint(evil, 3)
    with open(os.path.join(p, ".metadata"), "wb") as f:
        pickle.dump(_Payload(), f)
    try:
        vetting.resumable(evil)
        out["evil"] = "loaded"
    except CheckpointError as e:
        out["evil"] = (type(e).__name__, str(e))
    # a whole checkpoint the caller refuses (another model, say) stops the run as before
    try:
        vetting.resumable(run, lambda path, state: (_ for _ in ()).throw(
            CheckpointError(f"{path}: another model")))
        out["refused"] = "resumed"
    except CheckpointError as e:
        out["refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return spawn(resume_job, 1, str(tmp_path_factory.mktemp("resume")), timeout=300)[0]


def test_damaged_newest_checkpoints_are_skipped_and_kept(resumed, caplog):
    path, step = resumed["found"]
    assert step == 4 and path.endswith("step_000004") and resumed["seen"] == [4]
    assert resumed["names"] == [
        "step_000002",
        "step_000004",
        "step_000005.unreadable",
        "step_000006.unreadable",
        "step_000007.unreadable",
    ]
    assert resumed["none"] is None


def test_a_tampered_checkpoint_is_refused_not_skipped(resumed):
    kind, message = resumed["evil"]
    assert kind == "CheckpointError" and "refusing to load" in message
    assert "another model" in resumed["refused"]


def test_skip_warning_names_both_checkpoints(resumed):
    ck = os.path.join(resumed["run"], "checkpoints")
    lines = resumed["warnings"]
    assert len(lines) == 3, lines
    cut = next(x for x in lines if "step_000007 (" in x)
    assert "is truncated: 100 bytes" in cut and f"kept as {ck}/step_000007.unreadable" in cut
    assert f"resuming from {ck}/step_000004" in cut
    assert any(".distcp is missing" in x and "step_000006" in x for x in lines)
    assert any("trainer_state.json: not a readable megarl trainer state" in x for x in lines)


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path):
    from megarl.checkpoint import files, training

    for s in (1, 2, 8):  # 8: left by an older run in the same directory (trainer.resume=false)
        os.makedirs(tmp_path / "checkpoints" / f"step_{s:06d}")
        (tmp_path / "checkpoints" / f"step_{s:06d}" / files.STATE_FILE).write_text("{}")
    new = tmp_path / "checkpoints" / "step_000003"
    os.makedirs(new)
    (new / files.STATE_FILE).write_text("{}")
    training._prune(str(tmp_path), str(new), keep_last=1)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000003"]


# ------------------------------------------------------------------ a new attempt's logs
def test_an_earlier_attempts_logs_are_set_aside(tmp_path):
    from megarl.metrics.sinks import set_aside_previous_run

    assert set_aside_previous_run(tmp_path) is None  # nothing there
    (tmp_path / "metrics.jsonl").write_text("")
    assert set_aside_previous_run(tmp_path) is None  # no step in it
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "wandb_run_id").write_text("abc")
    (tmp_path / "samples.jsonl.1").write_text("taken")
    assert set_aside_previous_run(tmp_path) == 2  # the first suffix free for every file
    assert (tmp_path / "metrics.jsonl.2").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (tmp_path / "wandb_run_id.2").read_text() == "abc"  # a new wandb run next
    assert not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------ config and review fixes
@pytest.mark.parametrize("override, key", [
    ("trainer.save_every_minutes=-1", "trainer.save_every_minutes"),
    ("trainer.time_limit_minutes=.nan", "trainer.time_limit_minutes"),
    ("trainer.step_timeout_minutes=-5", "trainer.step_timeout_minutes"),
    ("trainer.keep_last=-1", "trainer.keep_last"),
    ("trainer.max_bad_steps=0", "trainer.max_bad_steps"),
])
def test_trainer_time_keys_are_checked(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_an_unknown_policy_loss_is_refused_naming_the_registry():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["algorithm.policy_loss=gpso"])
    message = str(e.value)
    assert "algorithm.policy_loss='gpso'" in message and "['cispo', 'gspo', 'ppo']" in message
    assert load_config(None, ["algorithm.policy_loss=gspo"]).algorithm.policy_loss == "gspo"


def test_the_update_takes_its_policy_loss_from_the_registry(monkeypatch):
    """A loss registered under a new name is what the update calls (no 'gspo'-or-else)."""
    from megarl.algorithms import losses
    from megarl.trainer import update

    calls = []

    def marked(*args, **kwargs):
        calls.append(kwargs.get("ratio_level"))
        return losses.policy_loss(*args, **kwargs)

    monkeypatch.setitem(losses._POLICY_LOSSES, "marked", marked)
    alg = SimpleNamespace(policy_loss="marked", policy_loss_options=losses.PolicyLossOptions())
    rollout = SimpleNamespace(temperature=1.0, max_tokens=4)
    groups = SimpleNamespace(tp=None)
    fn = update._policy_loss_fn(alg, rollout, 8, groups, tokens=3.0, seqs=1.0)
    monkeypatch.setattr(update.forward, "token_logprobs",
                        lambda micro, logits, **kw: logits[..., 0])
    logits = torch.zeros(1, 3, 8)
    micro = {"targets": torch.zeros(1, 3, dtype=torch.long), "old_logprobs": None,
             "advantages": torch.ones(1, 3), "loss_mask": torch.ones(1, 3),
             "sampler_logprobs": None, "ref_logprobs": None, "index": torch.tensor([0])}
    loss, _ = fn(micro, logits)
    assert calls == [None] and torch.isfinite(loss)  # 'marked' ran, with no ratio_level flag


def critic_job(rank: int, world: int) -> dict:
    from megarl.trainer import loop
    from megarl.trainer.finish import count_bad_step
    from tests.test_metrics_global import _config  # the tiny PPO setup of the DP1/DP2 test

    run, batch = _ppo_run(_config("ppo"))
    batch.returns = torch.full_like(batch.returns, float("nan"))  # a diverged critic
    metrics = loop.update(run, batch).reduce(run.groups.dp)
    counter = SimpleNamespace(bad_steps=0, step=1, cfg=run.cfg)
    count_bad_step(counter, metrics)
    return {"metrics": metrics, "bad_steps": counter.bad_steps}


def _ppo_run(cfg):
    from megarl.convert.layout import load_full_state
    from megarl.data.batch import MicroBatching
    from megarl.distributed import Topology
    from megarl.metrics.reduce import LocalMetrics
    from megarl.models.builder import build_model
    from megarl.models.hf_config import arch_from_hf
    from megarl.models.optim import build_optimizer
    from megarl.trainer import experience as xp
    from megarl.trainer import loop
    from megarl.trainer.models import Models, Trained
    from tests.test_metrics_global import LENGTHS, PROMPTS, REWARDS, _state
    from tests.tiny import TINY_LLAMA

    torch.set_num_threads(1)
    arch = arch_from_hf(TINY_LLAMA)
    groups = Topology.for_model(cfg.parallel, 1, arch).initialize(seed=0)
    state = _state(arch)

    def make(role, weights):
        chunks = build_model(arch, cfg.parallel, cfg.precision, role=role)
        load_full_state(chunks, weights)
        return chunks

    actor = make("actor", state)
    opt, sched = build_optimizer(actor, cfg.optim, dtype="fp32", total_steps=4)
    critic = make("critic", {**state, "output_layer.weight": torch.zeros(1, arch.hidden_size)})
    critic_opt, critic_sched = build_optimizer(critic, cfg.critic_optim, dtype="fp32")
    g = torch.Generator().manual_seed(7)
    responses = [torch.randint(3, 200, (n,), generator=g).tolist() for n in LENGTHS]
    batch = xp.build_batch([PROMPTS[i // 4] for i in range(len(LENGTHS))], responses,
                           [[-1.0] * n for n in LENGTHS], pad_id=0, pad_to=1)
    models = Models(
        actor=Trained(actor, opt, sched),
        reference=make("reference", state),
        critic=Trained(critic, critic_opt, critic_sched),
    )
    run = SimpleNamespace(cfg=cfg, groups=groups, arch=arch, step=0, models=models, pad_to=1,
                          micro_batching=MicroBatching.of(cfg.algorithm, pad_to=1))
    loop.forward_passes(run, batch)
    scored = xp.Scored(rewards=torch.tensor(REWARDS), per_function={}, metrics=LocalMetrics(),
                       group_ids=torch.tensor([i // 4 for i in range(len(LENGTHS))]))
    loop.advantages(run, batch, scored)
    return run, batch


def test_the_critics_non_finite_steps_are_logged_and_counted():
    res = spawn(critic_job, 1, timeout=600)[0]
    m = res["metrics"]
    # 2 epochs x 2 mini-batches: every critic step dropped, the policy's applied
    assert m["value_skipped_steps"] == 4 and m["skipped_steps"] == 0
    assert "value_grad_norm" in m and "value_lr" in m
    assert res["bad_steps"] == 1  # counted toward trainer.max_bad_steps


def test_a_hidden_size_not_divisible_by_the_heads_names_the_keys(tmp_path):
    """The converter (`tools/convert.py hf-to-mcore`) on such a config names hidden_size and
    num_attention_heads, before it compares any tensor shape (q_proj's would differ)."""
    from safetensors.torch import save_file

    from megarl.convert.pipeline import hf_to_mcore
    from megarl.models.hf_config import ModelConfigError

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
           "hidden_size": 130, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(128, 130)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelConfigError) as e:
        hf_to_mcore(str(tmp_path), str(tmp_path / "out"))
    assert ("hidden_size=130 is not divisible by num_attention_heads=4 and no head_dim is given"
            in str(e.value))


# ------------------------------------------------------------------ the Slurm example
SLURM = os.path.join(ROOT, "examples", "slurm_llama3_70b.sh")
# stand-ins for Slurm's commands on PATH: `scontrol` records what it is asked; `srun` plays
# megarl under torchrun: it records its arguments, then (FAKE_STOP=1) sends USR1 to the batch
# script (its parent) as Slurm's --signal=B:USR1 would, waits for the trap's RUN/STOP, writes
# RUN/stopped.json as megarl does after its checkpoint, and exits 1 as torchrun then does
FAKE = {
    "scontrol": """#!/usr/bin/env bash
echo "scontrol $*" >> "$FAKE_LOG"
# one line at a time, as for a large allocation: a reader that stops early gets SIGPIPE here
if [[ $1 == show ]]; then for n in node-a node-b node-c node-d; do echo $n; sleep 0.02; done; fi
""",
    "srun": """#!/usr/bin/env bash
echo "srun $*" >> "$FAKE_LOG"
out=""; prev=""
for a in "$@"; do [[ $prev == --out ]] && out=$a; prev=$a; done
[[ -e "$out/STOP" ]] && echo "STOP left from before" >> "$FAKE_LOG"
if [[ ${FAKE_STOP:-0} == 1 ]]; then
  kill -USR1 "$PPID"
  for _ in $(seq 100); do [[ -e "$out/STOP" ]] && break; sleep 0.05; done
  [[ -e "$out/STOP" ]] || exit 9
  echo '{"step": 3, "reason": "STOP exists"}' > "$out/stopped.json"
  exit 1
fi
""",
}


def _sbatch(tmp_path, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in FAKE.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
            "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]"}
    proc = subprocess.run(["bash", SLURM, "--set", "trainer.steps=9"], cwd=tmp_path,
                          env={**base, **env}, capture_output=True, text=True, timeout=60)
    return proc, log.read_text().splitlines()


def test_the_slurm_example_parses():
    subprocess.run(["bash", "-n", SLURM], check=True)
    text = open(SLURM).read()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@", "--max-restarts"):
        assert line in text


def test_the_slurm_example_requeues_after_a_stop_and_keeps_its_run_directory(tmp_path):
    # 1. USR1 before the time limit: the trap writes the stop file, megarl stops after a
    #    checkpoint, the script requeues the job
    proc, calls = _sbatch(tmp_path, FAKE_STOP="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    srun = next(c for c in calls if c.startswith("srun "))
    assert "--out runs/llama3-70b-4242 --set trainer.steps=9" in srun
    assert "--rdzv_id 4242" in srun and "--rdzv_endpoint node-a:29500" in srun
    assert "scontrol requeue 4242" in calls and "STOP left from before" not in calls
    assert (tmp_path / "runs/llama3-70b-4242/STOP").exists()
    # 2. the requeued job: the same SLURM_JOB_ID, so the same directory; the stop request of
    #    the attempt before is cleared first; it finishes, so no requeue
    proc, calls = _sbatch(tmp_path, SLURM_RESTART_COUNT="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--out runs/llama3-70b-4242 " in next(c for c in calls if c.startswith("srun "))
    assert "STOP left from before" not in calls
    assert not any(c.startswith("scontrol requeue") for c in calls)
    assert not (tmp_path / "runs/llama3-70b-4242/stopped.json").exists()
    # 3. a fresh sbatch (another job id) continues the same run by name
    proc, calls = _sbatch(tmp_path, SLURM_JOB_ID="5151", RUN_NAME="llama3-70b-4242")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--out runs/llama3-70b-4242 " in next(c for c in calls if c.startswith("srun "))
