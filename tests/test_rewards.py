"""Reward functions: TRL protocol, None handling, weighting, error policy, built-ins, loading."""

from __future__ import annotations

import logging
import math
import textwrap

import pytest
import torch

from megarl.rewards import (
    format_reward,
    length_penalty,
    load_reward_function,
    math_verify_reward,
    score,
)

PROMPTS = ["p0", "p1", "p2", "p3"]


def _score(fns, weights=None, completions=None, ids=None, columns=None, **kw):
    completions = completions or ["a", "bb", "ccc", "dddd"]
    return score(fns, weights, PROMPTS[: len(completions)], completions, ids, columns or {}, **kw)


# ---------------------------------------------------------------- built-ins
def test_math_verify_reward():
    completions = [
        "<think>2+2</think> The answer is \\boxed{4}.",
        "Adding them up, the final answer is 12",
        "so $x = \\frac{2}{4}$",
        "\\boxed{5}",
        "\\boxed{1}",
    ]
    answers = ["4", "12", "0.5", "6", "no number here"]
    got = math_verify_reward([""] * 5, completions, answer=answers)
    assert got == [1.0, 1.0, 1.0, 0.0, None]


def test_format_reward():
    completions = [
        "<think>x</think> 42",
        "<think>x</think>",
        "42",
        "  <think>a\nb</think>\nok",
    ]
    assert format_reward(PROMPTS, completions) == [1.0, 0.0, 0.0, 1.0]
    fn = load_reward_function("format", pattern=r"\d+")
    assert fn.__name__ == "format_reward"
    assert fn(PROMPTS, completions) == [0.0, 0.0, 1.0, 0.0]


def test_length_penalty():
    ids = [[0] * n for n in (6, 7, 8, 10, 11)]
    got = length_penalty([""] * 5, [""] * 5, completion_ids=ids, max_length=10, cache_length=4)
    assert got == [0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="completion_ids"):
        length_penalty([""], [""])
    with pytest.raises(ValueError, match="cache_length"):
        length_penalty([""], [""], completion_ids=[[1]], max_length=4, cache_length=8)


# ---------------------------------------------------------------- combination
def fn_a(prompts, completions, **kw):
    return [1.0, None, 0.5, None]


def fn_b(prompts, completions, **kw):
    return [2.0, 3.0, None, None]


def test_weighted_nansum_and_all_none(caplog):
    with caplog.at_level(logging.WARNING):
        total, per_fn, errors = _score([fn_a, fn_b], [1.0, 0.5])
    # sample 0: 1 + 0.5*2; 1: 0.5*3; 2: 0.5; 3: all None -> 0 and a warning
    assert total.tolist() == [2.0, 1.5, 0.5, 0.0]
    assert total.dtype == torch.float32
    assert errors == 0
    assert per_fn["fn_a"][0].item() == 1.0 and math.isnan(per_fn["fn_a"][1].item())
    assert math.isnan(per_fn["fn_b"][3].item())
    assert "all reward functions returned None for 1 sample(s) (indices [3])" in caplog.text


def test_default_weights_and_duplicate_names():
    total, per_fn, _ = _score([fn_b, fn_b])
    assert total.tolist() == [4.0, 6.0, 0.0, 0.0]
    assert sorted(per_fn) == ["fn_b", "fn_b_1"]


def test_columns_and_ids_are_passed():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kw):
        seen.update(prompts=prompts, ids=completion_ids, answer=answer, extra=kw)
        return [float(len(c)) for c in completions]

    ids = [[1], [1, 2], [3], [4]]
    total, _, _ = _score([spy], ids=ids, columns={"answer": list("wxyz"), "level": [1, 2, 3, 4]})
    assert total.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert seen == {
        "prompts": PROMPTS,
        "ids": ids,
        "answer": list("wxyz"),
        "extra": {"level": [1, 2, 3, 4]},
    }


def test_wrong_length_raises():
    def short(prompts, completions, **kw):
        return [1.0]

    with pytest.raises(ValueError, match=r"'short' returned 1 values for 4 completions"):
        _score([short])
    with pytest.raises(ValueError, match=r"2 entries but there are 1"):
        _score([short], [1.0, 2.0])


def test_bad_value_raises():
    def text(prompts, completions, **kw):
        return ["yes"] * len(completions)

    with pytest.raises(ValueError, match=r"'text' returned 'yes' \(str\) for sample 0"):
        _score([text])


def flaky(prompts, completions, **kw):
    out = []
    for c in completions:
        if c == "ccc":
            raise KeyError("boom")
        out.append(1.0)
    return out


def test_raising_function_policy_raise():
    with pytest.raises(RuntimeError, match=r"'flaky' raised on sample 2: KeyError") as info:
        _score([flaky, fn_b])
    assert isinstance(info.value.__cause__, KeyError)


def test_raising_function_policy_zero(caplog):
    with caplog.at_level(logging.WARNING):
        total, per_fn, errors = _score([flaky, fn_b], on_error="zero")
    assert errors == 1
    assert per_fn["flaky"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert total.tolist() == [3.0, 4.0, 0.0, 1.0]
    assert "'flaky' raised on sample 2" in caplog.text


def test_batch_only_failure():
    def batch_only(prompts, completions, **kw):
        if len(completions) > 1:
            raise RuntimeError("cannot batch")
        return [0.25]

    with pytest.raises(RuntimeError, match="raised on the batch of 4 samples"):
        _score([batch_only])
    total, _, errors = _score([batch_only], on_error="zero")
    assert total.tolist() == [0.25] * 4 and errors == 0
    with pytest.raises(ValueError, match=r"on_error must be one of \['raise', 'zero'\]"):
        _score([batch_only], on_error="skip")


# ---------------------------------------------------------------- loading
def test_load_builtins_and_dotted_paths(tmp_path, monkeypatch):
    assert load_reward_function("math_verify") is math_verify_reward
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def half(prompts, completions, **kw):
                return [0.5] * len(completions)
            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("my_rewards:half", "my_rewards.half"):
        fn = load_reward_function(spec)
        assert fn(PROMPTS, ["x"]) == [0.5]
    with pytest.raises(ValueError, match="has no 'missing'"):
        load_reward_function("my_rewards:missing")
    with pytest.raises(TypeError, match="not callable"):
        load_reward_function("my_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        load_reward_function("no_such_module_xyz.fn")
    with pytest.raises(ValueError, match=r"neither a built-in \(\['format', 'last_number'"):
        load_reward_function("accuracy")


def test_reward_model_pairs_are_ranked_by_the_copy_reward():
    from megarl.data.tokenizer import SPECIAL_TOKENS
    from megarl.data.toy import TOY_CHARS, toy_reward, toy_reward_model_rows

    rows = toy_reward_model_rows()
    assert rows == toy_reward_model_rows() and len(rows) == 3 * 1080
    chosen = [r["chosen"] for r in rows]
    rejected = [r["rejected"] for r in rows]
    answers = [r["answer"] for r in rows]
    # the pairs as a policy's responses ended by <eos>, graded by the task's own reward
    eos, first = SPECIAL_TOKENS.index("<eos>"), len(SPECIAL_TOKENS)
    ids = lambda texts: [[first + TOY_CHARS.index(c) for c in t] + [eos] for t in texts]  # noqa: E731
    good = toy_reward([], chosen, answer=answers, completion_ids=ids(chosen))
    bad = toy_reward([], rejected, answer=answers, completion_ids=ids(rejected))
    assert all(g >= b + 0.15 for g, b in zip(good, bad, strict=True))
    assert all(c.strip() and r.strip() for c, r in zip(chosen, rejected, strict=True))
    both_wrong = sum(c != a for c, a in zip(chosen, answers, strict=True)) / len(rows)
    assert 0.1 < both_wrong < 0.3  # ~18% of the pairs rank two wrong answers
