"""On-policy distillation (`algorithm.name: distill`, `algorithm.distill_coef`, `teacher.model`).

The advantage against a plain loop; that a policy gradient on it lowers the reverse KL (a
categorical student, exact KL); the config's and the teacher's refusals. End to end through
`megarl train` (real megatron, vLLM, gloo), each step's batch captured after the advantages:
the teacher's logprobs and argmax equal a transformers forward of the teacher (another shape
than the student) at one rank, at TP2, and on multi-turn trajectories (the environment's tokens
get no advantage); the student's are the sampler's; grpo + distill_coef adds the clipped term
to the group advantages; a distilled student's reverse KL falls.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megarl.algorithms.advantages import get_advantage
from megarl.algorithms.distill import distill_advantages
from megarl.config import ConfigError, load_config
from megarl.data.tokenizer import build_char_tokenizer
from megarl.data.toy import toy_tokenizer
from megarl.trainer.teacher import check_teacher, open_teacher
from tests.distill_teacher import TEACHER, teacher_logprobs, write_teacher
from tests.test_multi_turn_e2e import ENV
from tests.test_trainer_e2e import ROOT, _port

TOL = 1e-5  # fp32 megatron against fp32 transformers, same weights
BF16_GAP = 0.1  # a bf16 teacher against fp32 transformers: mean |logprob gap| per token

JOB = r"""
import sys, torch, torch.distributed as dist
from megarl.config import load_config
from megarl.trainer import loop

captured = []
advantages = loop.advantages

def capture(run, batch, scored):
    advantages(run, batch, scored)
    captured.append({**batch.fields(), "rewards": scored.rewards.clone()})

loop.advantages = capture
loop.train(load_config(None, sys.argv[2:]), sys.argv[1])
if dist.get_rank() == 0:
    torch.save(captured, sys.argv[1] + "/captured.pt")
"""

QUICK = [
    "trainer.steps=2",
    "data.prompts_per_step=8",
    "rollout.sampling.n=4",
    "algorithm.mini_batches=1",
    "algorithm.ppo_epochs=1",
    "algorithm.kl_coef=0",
    "algorithm.entropy_coef=0",
    "logging.wandb=false",
    "logging.progress=false",
]


# ---------------------------------------------------------------------------------- the math
def test_advantage_against_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    teacher, student = -3 * torch.rand(4, 9, generator=g), -3 * torch.rand(4, 9, generator=g)
    mask = (torch.rand(4, 9, generator=g) > 0.3).float()
    for clip in (None, 0.5):
        got = distill_advantages(teacher, student, mask, clip=clip)
        for b in range(4):
            for t in range(9):
                want = 0.0
                if mask[b, t]:
                    want = float(teacher[b, t]) - float(student[b, t])
                    if clip is not None:
                        want = max(-clip, min(clip, want))
                assert abs(float(got[b, t]) - want) < 1e-6, (clip, b, t)


def test_a_policy_gradient_on_the_advantage_lowers_the_reverse_kl():
    """A categorical student sampling 512 tokens per step, the surrogate -mean(A * log p_s(y)):
    the exact KL(student || teacher) falls from 1.5 nats to under 0.05 (with the advantage's
    sign flipped it rises)."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.tensor([3.0, 1.0, 0.0, -1.0, -2.0, 0.5]), 0)
    logits = torch.tensor([-2.0, 0.0, 2.0, 1.0, 0.0, -1.0], requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)

    def reverse_kl() -> float:
        s = torch.log_softmax(logits.detach(), 0)
        return float((s.exp() * (s - teacher)).sum())

    start = reverse_kl()
    for _ in range(200):
        student = torch.log_softmax(logits, 0)
        y = torch.multinomial(student.detach().exp(), 512, replacement=True, generator=g)
        ones = torch.ones(1, 512)
        adv = distill_advantages(teacher[y][None], student.detach()[y][None], ones)
        opt.zero_grad()
        (-(adv * student[y][None]).mean()).backward()
        opt.step()
    assert start > 1.5 and reverse_kl() < 0.05, (start, reverse_kl())


# ------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.name=distill"], "algorithm.name=distill needs teacher.model"),
        (["algorithm.distill_coef=0.5"], "algorithm.distill_coef=0.5 needs teacher.model"),
        (["teacher.model=/x"], "nothing reads the teacher"),
        (["algorithm.name=sft", "algorithm.distill_coef=0.5"], "added to grpo / ppo"),
        (["algorithm.distill_coef=-1"], "distill_coef=-1.0; accepted: >= 0"),
        (["algorithm.distill_clip=0"], "distill_clip=0.0; accepted: > 0"),
        (["teacher.model=' '"], "teacher.model is empty"),
        (["teacher.dtype=bf16"], "teacher.dtype=bf16 without teacher.model"),
        (["algorithm.name=distill", "teacher.model=/x", "teacher.dtype=int8"],
         "teacher.dtype='int8'; accepted: "),
    ],
)
def test_config_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        load_config(None, overrides)


def test_distill_needs_no_reward():
    overrides = ["reward.functions=[]", "reward.weights=null", "eval.every=0"]
    cfg = load_config(None, ["algorithm.name=distill", "teacher.model=/x", *overrides])
    assert cfg.algorithm.uses_teacher and cfg.reward.functions == ()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return write_teacher(str(tmp_path_factory.mktemp("teacher") / "teacher"), sharpen=25.0)


def _checked(path: str, *overrides: str):
    cfg = load_config(None, ["algorithm.name=distill", f"teacher.model={path}", *overrides])
    source = open_teacher(cfg)
    check_teacher(cfg, source, toy_tokenizer())
    return source


def test_teacher_refusals(teacher_dir, tmp_path):
    assert _checked(teacher_dir).arch.num_layers == TEACHER["num_hidden_layers"]
    with pytest.raises(ConfigError, match="teacher.model='/nowhere' does not exist"):
        _checked("/nowhere")
    text = tmp_path / "notes.txt"
    text.write_text("x")
    with pytest.raises(ConfigError, match="is a file but not GGUF"):
        _checked(str(text))

    def variant(name: str, **config) -> str:
        path = str(tmp_path / name)
        shutil.copytree(teacher_dir, path)
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**hf, **config}, f)
        return path

    rm = variant("rm", architectures=["LlamaForSequenceClassification"], num_labels=1)
    with pytest.raises(ConfigError, match="SequenceClassification, without an LM head"):
        _checked(rm)
    short = variant("short", max_position_embeddings=16)
    with pytest.raises(ConfigError, match=r"= 24 exceeds the max_position_embeddings of .*\(16\)"):
        _checked(short)
    other = variant("other")
    for name in os.listdir(other):
        if name.startswith("tokenizer"):
            os.remove(os.path.join(other, name))
    with pytest.raises(ConfigError, match="keeps no tokenizer files"):
        _checked(other)
    build_char_tokenizer("abcdefghij", other)  # another vocabulary
    with pytest.raises(ConfigError, match=rf"its tokenizer \({other}, 13 tokens\) is not the "):
        _checked(other)


def test_a_gguf_teacher_is_converted_once_and_checked_by_its_own_tokenizer(tmp_path, monkeypatch):
    """`teacher.model: FILE.gguf`: the dry run reads its metadata only; the run converts it
    into the cache and reads the converted directory; its byte-level tokenizer is not the toy
    one (refused), and is accepted beside a policy with that tokenizer."""
    from megarl.data.tokenizer import load_tokenizer
    from megarl.trainer.teacher import teacher_arch
    from tests.gguf_files import write_tiny_llama

    path = str(tmp_path / "teacher.gguf")
    write_tiny_llama(path)
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(None, ["algorithm.name=distill", f"teacher.model={path}"])
    shape = teacher_arch(cfg)
    assert not (tmp_path / "cache").exists()
    source = open_teacher(cfg)
    assert source.hf and source.path.startswith(str(tmp_path / "cache"))
    assert source.arch == shape
    with pytest.raises(ConfigError, match="is not the policy's"):
        check_teacher(cfg, source, toy_tokenizer())
    check_teacher(cfg, source, load_tokenizer(source.path))


# ----------------------------------------------------------------------------- end to end
def _captured_run(out, *overrides, nproc: int = 1) -> tuple[list[dict], list[dict]]:
    """(each step's batch after the advantages, metrics.jsonl) of a `megarl train`-equivalent
    run of the embedded default with `overrides`."""
    job = os.path.join(str(out) + ".job.py")
    with open(job, "w") as f:
        f.write(JOB)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(_port()), job, str(out), *QUICK, *overrides]
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)  # tests.*
    with open(str(out) + ".log", "w") as log:
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=600,
            env={**os.environ, "PYTHONPATH": path},
        )
    if proc.returncode:
        with open(str(out) + ".log") as log:
            raise AssertionError(log.read()[-6000:])
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return torch.load(os.path.join(out, "captured.pt")), rows


def _check_teacher_parity(batches: list[dict], rows: list[dict], teacher: str) -> None:
    """The teacher's logprobs and argmax are transformers'; the student's are the sampler's;
    the logged reverse KL and agreement are their means over the sampled tokens."""
    for b, row in zip(batches, rows, strict=True):
        mask = b["loss_mask"].bool()
        lp, top1 = teacher_logprobs(teacher, b["tokens"])
        assert (b["teacher_logprobs"] - lp)[mask].abs().max() <= TOL
        assert torch.equal(b["teacher_top1"].bool()[mask], top1[mask])
        assert (b["old_logprobs"] - b["sampler_logprobs"])[mask].abs().max() <= 1e-4
        gap = (b["old_logprobs"] - lp)[mask].double()
        assert row["distill/reverse_kl"] == pytest.approx(float(gap.mean()), abs=TOL)
        assert row["distill/agreement"] == pytest.approx(float(top1[mask].double().mean()))


@pytest.mark.slow
def test_distill_scores_every_sampled_token_and_the_student_moves_toward_its_teacher(
    teacher_dir, tmp_path
):
    """No reward function, the teacher the only signal, 12 steps: every step's advantages are
    the teacher's logprob (transformers') - the student's on the sampled tokens, 0 elsewhere;
    the reverse KL per token falls by over 40% and the share of sampled tokens that are the
    teacher's argmax rises by half."""
    batches, rows = _captured_run(
        tmp_path / "run",
        "algorithm.name=distill",
        f"teacher.model={teacher_dir}",
        "reward.functions=[]",
        "reward.weights=null",
        "trainer.steps=12",
    )
    _check_teacher_parity(batches, rows, teacher_dir)
    for b in batches:
        mask = b["loss_mask"].bool()
        lp, _ = teacher_logprobs(teacher_dir, b["tokens"])
        assert (b["advantages"] - (lp - b["old_logprobs"]))[mask].abs().max() <= TOL
        assert not b["advantages"][~mask].any()
    kl = [r["distill/reverse_kl"] for r in rows]
    agree = [r["distill/agreement"] for r in rows]
    assert sum(kl[-3:]) / 3 < 0.6 * kl[0], kl
    assert sum(agree[-3:]) / 3 > 1.5 * agree[0], agree


@pytest.mark.slow
def test_distill_at_tp2_on_multi_turn_trajectories(teacher_dir, tmp_path):
    """Two ranks at TP2, trajectories of up to 3 turns: the environment's tokens (inside the
    response) get no advantage, the sampled ones the teacher's - the student's."""
    batches, rows = _captured_run(
        tmp_path / "run",
        "algorithm.name=distill",
        f"teacher.model={teacher_dir}",
        "parallel.tensor_parallel=2",
        *ENV,
        nproc=2,
    )
    _check_teacher_parity(batches, rows, teacher_dir)
    env_tokens = 0
    for b in batches:
        mask = b["loss_mask"].bool()
        lp, _ = teacher_logprobs(teacher_dir, b["tokens"])
        assert (b["advantages"] - (lp - b["old_logprobs"]))[mask].abs().max() <= TOL
        assert not b["advantages"][~mask].any()
        for row, first, n in zip(mask, b["prompt_len"] - 1, b["response_len"], strict=True):
            env_tokens += int((~row[first : first + n]).sum())
    assert env_tokens > 0  # some trajectories took a second turn


@pytest.mark.slow
def test_grpo_with_a_clipped_distillation_term(teacher_dir, tmp_path):
    coef, clip = 0.5, 1.0
    batches, _ = _captured_run(
        tmp_path / "run",
        f"algorithm.distill_coef={coef}",
        f"algorithm.distill_clip={clip}",
        f"teacher.model={teacher_dir}",
    )
    for b in batches:
        mask = b["loss_mask"]
        lp, _ = teacher_logprobs(teacher_dir, b["tokens"])
        group = get_advantage("grpo")(b["rewards"], num_generations=4, scale="batch")
        term = (lp - b["old_logprobs"]).clamp(-clip, clip)
        want = (group[:, None] + coef * term) * mask
        assert (b["advantages"] - want).abs().max() <= TOL
        assert (term.abs() * mask).max() == clip  # the clip bites


@pytest.mark.slow
def test_a_bf16_teacher_beside_an_fp32_student(teacher_dir, tmp_path):
    """`teacher.dtype: bf16`: the teacher's logprobs move off transformers' fp32 forward by
    bf16's rounding (not fp32's ~1e-7) and stay near it; the student's stay the sampler's."""
    batches, _ = _captured_run(
        tmp_path / "run",
        "algorithm.name=distill",
        f"teacher.model={teacher_dir}",
        "teacher.dtype=bf16",
        "reward.functions=[]",
        "reward.weights=null",
    )
    for b in batches:
        mask = b["loss_mask"].bool()
        lp, _ = teacher_logprobs(teacher_dir, b["tokens"])
        gap = (b["teacher_logprobs"] - lp)[mask].abs()
        assert 1e-4 < float(gap.mean()) < BF16_GAP, float(gap.mean())
        assert (b["old_logprobs"] - b["sampler_logprobs"])[mask].abs().max() <= 1e-4
