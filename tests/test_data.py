"""Data: char tokenizer, chat template, row loading and its errors, prompt dataset, toy task."""

from __future__ import annotations

import json

import pytest

from megarl.data import (
    DataConfig,
    DataError,
    PromptDataset,
    TokenizerError,
    build_char_tokenizer,
    load_rows,
    load_tokenizer,
    toy_reward,
    toy_rows,
    toy_tokenizer,
)
from megarl.data.toy import exact_match

CHARS = "abcdefgh 0123456789+=?"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(CHARS)


# ---------------------------------------------------------------- tokenizer
def test_char_tokenizer_vocab_roundtrip_and_reload(tok, tmp_path):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 3 + len(CHARS)
    assert tok("ab 3")["input_ids"] == [3, 4, 3 + CHARS.index(" "), 3 + CHARS.index("3")]
    text = "abc 12+3=?"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, no specials added
    assert tok.decode(ids) == text  # no spaces inserted between characters
    assert tok.decode(ids + [2, 0, 0], skip_special_tokens=True) == text
    assert tok.decode([1, *ids, 2]) == "<bos>" + text + "<eos>"

    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.get_vocab() == tok.get_vocab()
    assert again(text)["input_ids"] == ids
    assert again.decode(ids) == text
    assert again.chat_template == tok.chat_template
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)


def test_char_tokenizer_errors(tok):
    with pytest.raises(ValueError, match="duplicate"):
        build_char_tokenizer("abca")
    with pytest.raises(Exception, match="UNK|Missing"):
        tok("xyz")


def test_load_tokenizer_names_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerError, match="nope"):
        load_tokenizer(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="empty"):
        load_tokenizer(tmp_path / "empty")


def test_chat_template_renders_only_contents(tok):
    msgs = [{"role": "system", "content": "ab"}, {"role": "user", "content": "1+2="}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "ab1+2="
    user = [{"role": "user", "content": "3+4="}]
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == "3+4="


# ---------------------------------------------------------------- loading rows
ROWS = [
    {"prompt": "1+2=", "answer": "3"},
    {"prompt": "abc", "answer": "x", "extra": 1},
    {"prompt": [{"role": "user", "content": "4+4="}], "answer": "8"},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_rows_jsonl_json_dir(tmp_path):
    jsonl = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    assert load_rows(jsonl) == ROWS
    (tmp_path / "b.json").write_text(json.dumps(ROWS[:2]))
    assert load_rows(tmp_path / "b.json") == ROWS[:2]
    cols = tmp_path / "cols.json"
    cols.write_text(json.dumps({"prompt": ["x", "y"], "answer": ["1", "2"]}))
    assert load_rows(cols) == [{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "2"}]
    lines_as_json = tmp_path / "lines.json"  # what datasets' to_json writes
    lines_as_json.write_text(jsonl.read_text())
    assert load_rows(lines_as_json) == ROWS
    sub = tmp_path / "d"
    sub.mkdir()
    _write_jsonl(sub / "2.jsonl", ROWS[2:])
    _write_jsonl(sub / "1.jsonl", ROWS[:2])
    (sub / "README.md").write_text("ignored")
    assert load_rows(sub) == ROWS  # files in name order


def test_load_rows_errors(tmp_path):
    with pytest.raises(DataError, match="missing.jsonl"):
        load_rows(tmp_path / "missing.jsonl")
    csv = tmp_path / "x.csv"
    csv.write_text("prompt\n1")
    with pytest.raises(ValueError, match=r"'\.csv'.*\.jsonl.*\.json.*\.parquet"):
        load_rows(csv)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON"):
        load_rows(bad)
    notobj = tmp_path / "list.jsonl"
    notobj.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        load_rows(notobj)
    empty_dir = tmp_path / "e"
    empty_dir.mkdir()
    with pytest.raises(DataError, match="no data files"):
        load_rows(empty_dir)
    with pytest.raises(ValueError, match="hf:NAME"):
        load_rows("hf:")


def test_load_rows_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "abc", "answer": "x"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    assert load_rows(tmp_path / "p.parquet") == rows


def test_parquet_and_hf_without_packages_say_what_to_install(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_rows(tmp_path / "p.parquet")
    with pytest.raises(ImportError, match="pip install datasets"):
        load_rows("hf:gsm8k:test")


# ---------------------------------------------------------------- PromptDataset
def test_prompt_dataset_tokenizes_once_and_keeps_columns(tok, tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", ROWS)
    cfg = DataConfig(path=str(path), system_prompt="h")
    ds = PromptDataset.from_config(cfg, tok)
    assert len(ds) == 3
    enc = lambda s: tok(s)["input_ids"]
    assert ds.prompt_ids == [enc("h1+2="), enc("habc"), enc("h4+4=")]
    assert ds.prompts == [r["prompt"] for r in ROWS]
    assert ds.columns == {"answer": ["3", "x", "8"], "extra": [None, 1, None]}
    b = ds.batch([2, 0])
    assert b.indices == [2, 0]
    assert b.prompt_ids == [enc("h4+4="), enc("h1+2=")]
    assert b.columns == {"answer": ["8", "3"], "extra": [None, None]}


def test_prompt_dataset_without_template(tok):
    cfg = DataConfig(apply_chat_template=False, system_prompt="a")
    ds = PromptDataset([{"prompt": "1+2="}], tok, cfg)
    assert ds.prompt_ids == [tok("a1+2=")["input_ids"]]
    with pytest.raises(DataError, match="row 0 of <rows>.*apply_chat_template is off"):
        PromptDataset([{"prompt": [{"role": "user", "content": "1"}]}], tok, cfg)


def test_prompt_dataset_missing_key_names_file_and_columns(tok, tmp_path):
    path = _write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(ValueError, match=r"'prompt'.*q\.jsonl.*\['answer', 'question'\]"):
        PromptDataset.from_config(DataConfig(path=str(path)), tok)
    ds = PromptDataset.from_config(DataConfig(path=str(path), prompt_key="question"), tok)
    assert ds.columns == {"answer": ["2"]}


def test_prompt_dataset_overlong_policies(tok):
    rows = [{"prompt": "abc"}, {"prompt": "abcdef", "k": 1}, {"prompt": "ab"}]
    cfg = dict(max_prompt_length=4, path="f.jsonl")
    with pytest.raises(ValueError, match=r"row 1 in f\.jsonl is 6 tokens.*max_prompt_length=4"):
        PromptDataset(rows, tok, DataConfig(**cfg))
    dropped = PromptDataset(rows, tok, DataConfig(**cfg, overlong="drop"))
    assert dropped.prompt_ids == [tok("abc")["input_ids"], tok("ab")["input_ids"]]
    assert dropped.source_rows == [0, 2] and dropped.num_dropped == 1
    assert dropped.columns == {"k": [None, None]}
    cut = PromptDataset(rows, tok, DataConfig(**cfg, overlong="truncate-left"))
    assert cut.prompt_ids[1] == tok("cdef")["input_ids"]
    assert cut.num_truncated == 1 and len(cut) == 3


def test_prompt_dataset_names_untokenizable_row(tok):
    with pytest.raises(ValueError, match="row 1 of <rows>: cannot tokenize"):
        PromptDataset([{"prompt": "ab"}, {"prompt": "aZ"}], tok, DataConfig())


def test_data_config_checks_name_the_field():
    with pytest.raises(ValueError, match="overlong.*'error', 'drop', 'truncate-left'.*'cut'"):
        DataConfig(overlong="cut")
    with pytest.raises(ValueError, match="max_prompt_length"):
        DataConfig(max_prompt_length=0)
    with pytest.raises(ValueError, match="prompts_per_step"):
        DataConfig(prompts_per_step=0)
    with pytest.raises(TypeError):
        DataConfig("x.jsonl")  # keyword-only


# ---------------------------------------------------------------- toy task
def test_toy_task(tmp_path):
    rows = toy_rows()
    assert len(rows) == 3 * 360
    assert rows[0] == {"prompt": "copy 01=", "answer": "01"}
    assert rows == toy_rows()  # fixed (seeded) rows
    lengths = [len(r["answer"]) for r in rows]
    assert [lengths.count(n) for n in (2, 3, 4)] == [360, 360, 360]
    for r in rows:
        assert r["prompt"] == f"copy {r['answer']}=" and r["answer"].isdigit()
        assert len(set(r["answer"])) == len(r["answer"])  # distinct digits
    assert len({r["answer"] for r in rows if len(r["answer"]) == 2}) == 90
    assert len({r["answer"] for r in rows if len(r["answer"]) == 4}) == 360
    tok = toy_tokenizer(tmp_path)
    assert len(tok) == 20
    assert load_tokenizer(tmp_path).get_vocab() == tok.get_vocab()
    ds = PromptDataset.from_config(DataConfig(), tok)  # path=None: the toy task
    assert len(ds) == 1080 and sorted({len(p) for p in ds.prompt_ids}) == [8, 9, 10]
    assert tok.decode(ds.prompt_ids[0]) == "copy 01="


def _ids(tok, text: str, eos: bool = True) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])


def test_toy_reward_values():
    tok = toy_tokenizer()
    responses = [
        ("371", True),
        ("371", False),
        ("3712", True),
        ("37", True),
        ("9", True),
        ("", True),
        ("", False),
        ("37177777", False),
    ]
    ids = [_ids(tok, t, eos) for t, eos in responses]
    texts = tok.batch_decode(ids, skip_special_tokens=True)  # what the trainer passes
    n = len(ids)
    got = toy_reward(["copy 371="] * n, texts, answer=["371"] * n, completion_ids=ids)
    assert got == pytest.approx([1.0, 0.75, 0.6, 0.5, 0.0, 0.0, 0.0, 3 / 9])
    assert exact_match(["copy 371="] * n, texts, answer=["371"] * n, completion_ids=ids) == [
        1.0,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
    ]
    # a special token inside the response is never a digit
    inner = _ids(tok, "3", eos=False) + [tok.pad_token_id] + _ids(tok, "1")
    assert toy_reward(["p"], ["31"], answer=["371"], completion_ids=[inner]) == [0.75]
    assert exact_match(["p"], ["31"], answer=["371"], completion_ids=[inner]) == [0.0]
    # without ids (plain TRL strings): the text is graded and counts as stopped
    plain = ["371", "37", [{"role": "assistant", "content": "371"}]]
    assert toy_reward(["p"] * 3, plain, answer=["371"] * 3) == [1.0, 0.5, 1.0]
    assert exact_match(["p"] * 3, plain, answer=["371"] * 3) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        toy_reward(["a", "b"], ["1", "2"], answer=["1"])
    with pytest.raises(ValueError, match="2 completions but 1 completion_ids"):
        exact_match(["a", "b"], ["1", "2"], answer=["1", "2"], completion_ids=[[2]])


def test_toy_reward_through_scoring():
    """The default's reward setup: the shaped reward counts, exact match is only logged."""
    from megarl.config import load_config
    from megarl.rewards import score
    from megarl.rewards.scorer import load_functions

    cfg = load_config()
    fns = load_functions(cfg.reward)
    tok = toy_tokenizer()
    ids = [_ids(tok, "12"), _ids(tok, "13")]
    total, per_fn, _ = score(
        fns,
        cfg.reward.weights,
        ["copy 12=", "copy 12="],
        ["12", "13"],
        ids,
        {"answer": ["12", "12"]},
    )
    assert total.tolist() == pytest.approx([1.0, 2 / 3])
    assert per_fn["exact_match"].tolist() == [1.0, 0.0]
