"""The offline readers (SFT rows, preference pairs), their batching, and the checks that refuse
bad rows before any model is built.

A character tokenizer with a ChatML-like template (`<role>content|`, generation prompt
`<assistant>`) stands in for a real chat model's tokenizer: every character is one token, so
the expected ids and trained spans can be written down exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.data.batch import MicroBatching, collate_sequences, split_micro_batches
from megarl.data.dataset import DataConfig, DataError
from megarl.data.offline import read_preferences, read_sft, split_held_out
from megarl.data.tokenizer import build_char_tokenizer
from megarl.data.toy import toy_preference_rows, toy_sft_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHATML = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# marks the last message: the rendering of a prefix is not the start of the longer one's
MOVING = CHATML.replace(
    "{% for m in messages %}", "{% for m in messages %}{% if loop.last %}*{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    t = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 <>|*=")
    t.chat_template = CHATML
    return t


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def trained_text(tok, t) -> str:
    kept = [i for i, f in zip(t.ids, t.trained, strict=True) if f]
    return "".join(tok.convert_ids_to_tokens(kept))


def read(kind, rows, tok, max_length=256, **cfg):
    fn = read_sft if kind == "sft" else read_preferences
    return fn(rows, tok, DataConfig(**cfg), max_length=max_length, source="data.jsonl")


def test_sft_prompt_response_is_the_rl_prompt_then_the_response_and_eos(tok):
    ds = read("sft", [{"prompt": "copy 12=", "response": "12"}], tok)
    (t,) = ds.sequences
    prompt = ids(tok, "<user>copy 12=|<assistant>")  # as the RL prompt dataset renders it
    assert t.ids == prompt + ids(tok, "12") + [tok.eos_token_id]
    assert t.trained == [False] * len(prompt) + [True] * 3
    plain = read("sft", [{"prompt": "copy 12=", "response": "12"}], tok, apply_chat_template=False)
    assert plain.sequences[0].ids == ids(tok, "copy 12=12") + [tok.eos_token_id]


def test_sft_messages_train_every_assistant_turn_only(tok):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "add 2=3"},
        {"role": "assistant", "content": "no"},
        {"role": "user", "content": "bye"},
    ]
    (t,) = read("sft", [{"messages": msgs}], tok).sequences
    full = tok.apply_chat_template(msgs, tokenize=False)
    # the tokens after the last assistant turn are dropped (they change no loss)
    assert t.ids == ids(tok, full[: full.index("no|") + 3])
    assert trained_text(tok, t) == "yo|no|"
    # the prompt + response-as-messages form: only the continuation is trained
    row = {"prompt": msgs[:4], "response": msgs[4:5]}
    (u,) = read("sft", [row], tok).sequences
    assert u.ids == t.ids and trained_text(tok, u) == "no|"


def test_a_template_that_cannot_place_a_turn_is_refused_naming_the_row(tok):
    bad = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789 <>|*=")
    bad.chat_template = MOVING
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    with pytest.raises(DataError, match=r"row 0 of data.jsonl: the chat template cannot place"):
        read("sft", rows, bad)
    with pytest.raises(DataError, match="row 0 of data.jsonl: messages is a chat conversation"):
        read("sft", rows, tok, apply_chat_template=False)


@pytest.mark.parametrize(
    "kind,row,match",
    [
        ("sft", {"prompt": "a"}, r"row 0 of data.jsonl: column 'response' is missing"),
        ("sft", {"prompt": "a", "response": " "}, "column 'response' is empty"),
        ("sft", {"text": "a"}, r"an sft row holds 'prompt' \+ 'response', or 'messages'"),
        ("sft", {"messages": [{"role": "user", "content": "a"}]}, "has no assistant turn"),
        ("sft", {"messages": "hello"}, "must be a non-empty list of chat messages"),
        ("dpo", {"prompt": "a", "chosen": "b"}, "column 'rejected' is missing"),
        ("dpo", {"prompt": "a", "chosen": "", "rejected": "b"}, "column 'chosen' is empty"),
        ("dpo", {"prompt": "a", "chosen": "b", "rejected": "b"}, "'chosen' equals 'rejected'"),
        ("dpo", {"chosen": "ab", "rejected": "ac"}, "no 'prompt' column, so 'chosen' and"),
        ("dpo", {"prompt": "a", "chosen": "b", "rejected": "c", "margin": "x"}, "must be a number"),
    ],
)
def test_bad_rows_are_refused_naming_file_row_and_column(tok, kind, row, match):
    good = (
        {"prompt": "q", "response": "r"}
        if kind == "sft"
        else {"prompt": "q", "chosen": "r", "rejected": "s"}
    )
    with pytest.raises(DataError, match=match) as err:
        read(kind, [good, row] if "row 0" not in match else [row], tok)
    assert "data.jsonl" in str(err.value)
    if "row 0" not in match:
        assert "row 1 of data.jsonl" in str(err.value)


def test_preference_forms_give_the_same_pairs(tok):
    user = [{"role": "user", "content": "copy 12="}]
    good, bad = [{"role": "assistant", "content": "12"}], [{"role": "assistant", "content": "21"}]
    explicit = read("dpo", [{"prompt": user, "chosen": good, "rejected": bad}], tok)
    implicit = read("dpo", [{"chosen": user + good, "rejected": user + bad}], tok)
    assert explicit.chosen == implicit.chosen and explicit.rejected == implicit.rejected
    assert trained_text(tok, implicit.chosen[0]) == "12|"
    assert trained_text(tok, implicit.rejected[0]) == "21|"
    strings = read("dpo", [{"prompt": "copy 12=", "chosen": "12", "rejected": "21"}], tok)
    assert strings.chosen[0].ids[-1] == tok.eos_token_id
    # no shared prompt in the implicit form
    with pytest.raises(DataError, match="do not share a prompt"):
        read("dpo", [{"chosen": good, "rejected": bad}], tok)
    with pytest.raises(DataError, match="do not share a prompt"):
        read("dpo", [{"chosen": user + good, "rejected": user}], tok)


def test_margins_are_kept_per_pair_and_all_or_none(tok):
    rows = [
        {"prompt": "a", "chosen": "b", "rejected": "c", "margin": 2},
        {"prompt": "d", "chosen": "e", "rejected": "f", "margin": 0.5},
    ]
    ds = read("dpo", rows, tok)
    assert ds.margins == [2.0, 0.5]
    batch = ds.batch([1, 0], pad_id=0)
    assert batch["margin"].tolist() == [0.5, 0.5, 2.0, 2.0]
    assert batch["pair"].tolist() == [0, 0, 1, 1]
    with pytest.raises(DataError, match="row 1 of data.jsonl: no 'margin' while other rows"):
        read("dpo", [rows[0], {"prompt": "d", "chosen": "e", "rejected": "f"}], tok)


def test_overlong_rows_follow_data_overlong(tok):
    rows = [{"prompt": "ab", "response": "c"}, {"prompt": "abcdefghij", "response": "klm"}]
    # "<user>ab|<assistant>c<eos>" is 22 tokens, the second row 32
    with pytest.raises(DataError, match=r"row 1 of data.jsonl: prompt \+ response is 32 tokens"):
        read("sft", rows, tok, max_length=25)
    dropped = read("sft", rows, tok, max_length=25, overlong="drop")
    assert len(dropped) == 1 and dropped.num_dropped == 1 and dropped.source_rows == [0]
    cut = read("sft", rows, tok, max_length=25, overlong="truncate-left")
    full = read("sft", rows, tok)
    assert cut.num_truncated == 1 and cut.sequences[1].ids == full.sequences[1].ids[-25:]
    assert cut.sequences[1].trained[-4:] == [True] * 4  # the end (the response) is kept
    pairs = [{"prompt": "abcdefghij", "chosen": "k", "rejected": "lmnopqrstu"}] * 2
    with pytest.raises(DataError, match=r"row 0 of data.jsonl: prompt \+ rejected is 39 tokens"):
        read("dpo", pairs, tok, max_length=30)
    with pytest.raises(DataError, match="every pair of data.jsonl is longer than"):
        read("dpo", pairs, tok, max_length=30, overlong="drop")


def test_collated_mask_and_pairs_stay_in_one_micro_batch():
    b = collate_sequences([[5, 6, 7, 8], [9, 10]], [[False, True, False, True], [False, True]], 0)
    # loss_mask[i] = trained[i + 1]: position i predicts token i + 1
    assert b["loss_mask"].tolist() == [[1, 0, 1, 0], [1, 0, 0, 0]]
    assert b["targets"].tolist() == [[6, 7, 8, 0], [10, 0, 0, 0]]
    assert b["response_len"].tolist() == [2, 1]
    lengths = [7, 2, 3, 9, 4, 4, 8, 1]  # pair p = rows 2p, 2p + 1
    seqs = [[1] * n for n in lengths]
    batch = collate_sequences(seqs, [[False] + [True] * (n - 1) for n in lengths], 0)
    batch["pair"] = torch.arange(4).repeat_interleave(2)
    for mbs, budget in ((2, None), (3, None), (4, 20), (1, None)):
        for pack in (False, True):
            how = MicroBatching(size=mbs, max_tokens=budget, pack=pack)
            micro = split_micro_batches(batch, how, together=batch["pair"])
            seen = sorted(i for m in micro for i in m["index"].tolist())
            assert seen == list(range(8))
            for m in micro:
                idx = m["index"].tolist()
                assert all(
                    i % 2 == 0 and j == i + 1 for i, j in zip(idx[0::2], idx[1::2], strict=True)
                )


def test_held_out_split_is_seeded_and_disjoint():
    train, held = split_held_out(list(range(100)), 0.1, seed=3)
    assert len(held) == 10 and sorted(train + held) == list(range(100))
    assert split_held_out(list(range(100)), 0.1, seed=3) == (train, held)
    assert split_held_out(list(range(100)), 0.1, seed=4)[1] != held


def test_toy_rows_read_cleanly(tok):
    toy = build_char_tokenizer("0123456789+= copy")
    sft = read("sft", toy_sft_rows()[:50], toy)
    pairs = toy_preference_rows()
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    dpo = read("dpo", pairs[:50], toy)
    assert len(sft) == 50 and len(dpo) == 50


@pytest.mark.parametrize(
    "override,match",
    [
        ("algorithm.dpo_loss=kto", "algorithm.dpo_loss='kto'; accepted: .*'sigmoid'"),
        ("algorithm.dpo_beta=0", "algorithm.dpo_beta=0.0; accepted: > 0"),
        ("algorithm.dpo_label_smoothing=0.5", "accepted: 0 <= eps < 0.5"),
        ("trainer.epochs=0", "trainer.epochs=0.0; accepted: null or > 0"),
    ],
)
def test_offline_config_checks_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["algorithm.name=dpo", override])
    with pytest.raises(ConfigError, match="label smoothing applies to sigmoid and simpo only"):
        load_config(None, ["algorithm.dpo_loss=ipo", "algorithm.dpo_label_smoothing=0.1"])


@pytest.mark.slow
def test_a_bad_row_stops_the_run_before_any_model_is_built(tmp_path):
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "copy 12=", "chosen": "12", "rejected": "21"}] * 3
    rows.append({"prompt": "copy 34=", "chosen": "34", "rejected": "34"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megarl",
            "train",
            "--out",
            str(tmp_path / "run"),
            "--set",
            "algorithm.name=dpo",
            "--set",
            f"data.path={data}",
            "--set",
            "logging.wandb=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("megarl: error:")]
    assert errors == [
        f"megarl: error: row 3 of {data}: 'chosen' equals 'rejected'; a pair needs two answers"
    ]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert "building" not in proc.stderr.lower()


def test_offline_plot_and_epochs(tmp_path):
    from megarl.metrics.plots import plot_offline
    from megarl.trainer.stages import get_stage

    lines = [{"step": 0, "eval/loss": 0.69, "eval/preference_accuracy": 0.6}]
    lines += [
        {
            "step": s,
            "loss": 0.69 - 0.01 * s,
            "rewards/accuracies": 0.5 + 0.01 * s,
            "rewards/margins": 0.01 * s,
            "preference_accuracy": 0.6,
        }
        for s in range(1, 11)
    ]
    lines.append({"step": 10, "eval/loss": 0.6, "eval/preference_accuracy": 0.8})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    png = plot_offline(path, tmp_path / "loss.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path.write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    with pytest.raises(ValueError, match="no step has a numeric 'loss'"):
        plot_offline(path, tmp_path / "none.png")
    cfg = load_config(
        None, ["algorithm.name=sft", "trainer.epochs=2.5", "data.prompts_per_step=32"]
    )
    stage, rows = get_stage(cfg.algorithm), [None] * 100
    assert stage.resolve(cfg, rows).trainer.steps == 8  # ceil(2.5 x 100 / 32)
    assert stage.resolve(load_config(None, ["trainer.steps=7"]), rows).trainer.steps == 7
