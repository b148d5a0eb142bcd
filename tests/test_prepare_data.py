"""`megarl prepare-data`: each public layout -> megarl's columns; files of another shape are one
clear error naming the file and row; the output is only ever complete."""

import json
import subprocess
import sys

import pytest

from megarl.data.dataset import DataError, load_rows
from megarl.data.prepare import last_boxed, prepare


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _read(path):
    return [json.loads(line) for line in open(path)]


def test_gsm8k(tmp_path):
    src = _jsonl(
        tmp_path / "gsm8k.jsonl",
        [{"question": "Tom has 3 apples ...", "answer": "3 + 5 = <<3+5=8>>8\n#### 1,008"}],
    )
    assert prepare("gsm8k", src, str(tmp_path / "out.jsonl")) == 1
    (row,) = _read(tmp_path / "out.jsonl")
    assert row == {
        "prompt": "Tom has 3 apples ...",
        "answer": "1008",
        "solution": "3 + 5 = <<3+5=8>>8",
    }


def test_gsm8k_from_a_datasets_directory(tmp_path):
    """`datasets.save_to_disk` writes Arrow IPC streams; read without the datasets package."""
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"question": ["q1", "q2"], "answer": ["a\n#### 4", "b\n#### -2"]})
    d = tmp_path / "gsm8k_train"
    d.mkdir()
    with pa.OSFile(str(d / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (d / "state.json").write_text("{}")  # what save_to_disk writes beside them (not read)
    prepare("gsm8k", str(d), str(tmp_path / "out.jsonl"))
    assert [r["answer"] for r in _read(tmp_path / "out.jsonl")] == ["4", "-2"]


def test_math_boxed():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and finally \boxed{x^{2}}") == "x^{2}"
    assert last_boxed("no box") is None


def test_math(tmp_path):
    src = _jsonl(
        tmp_path / "m.jsonl",
        [
            {"problem": "1/2+1/2?", "solution": r"It is $\boxed{1}$."},
            {"problem": "p", "answer": "7"},
        ],
    )
    prepare("math", src, str(tmp_path / "o.jsonl"))
    assert [r["answer"] for r in _read(tmp_path / "o.jsonl")] == ["1", "7"]


def test_preference_layouts(tmp_path):
    hh = "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: 2+2?\n\nAssistant: "
    conv = [{"role": "user", "content": "2+2?"}]
    rows = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
        {
            "chosen": conv + [{"role": "assistant", "content": "4"}],
            "rejected": conv + [{"role": "assistant", "content": "5"}],
            "score_chosen": 9.0,
            "score_rejected": 2.5,
        },
        {"chosen": hh + "4", "rejected": hh + "5"},
    ]
    prepare("preference", _jsonl(tmp_path / "p.jsonl", rows), str(tmp_path / "o.jsonl"))
    out = _read(tmp_path / "o.jsonl")
    assert [(r["chosen"], r["rejected"]) for r in out] == [("4", "5")] * 3
    assert out[0]["prompt"] == conv and out[1]["prompt"] == conv
    assert out[1]["margin"] == 6.5
    assert [m["role"] for m in out[2]["prompt"]] == ["user", "assistant", "user"]
    assert out[2]["prompt"][-1]["content"] == "2+2?"


def test_sft_layouts(tmp_path):
    rows = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"prompt": "hi", "completion": "hello"},
        {"instruction": "say", "input": "hi", "output": "hello"},
    ]
    prepare("sft", _jsonl(tmp_path / "s.jsonl", rows), str(tmp_path / "o.jsonl"))
    out = _read(tmp_path / "o.jsonl")
    assert all(r["messages"][-1] == {"role": "assistant", "content": "hello"} for r in out)
    assert out[2]["messages"][0]["content"] == "say\n\nhi"


@pytest.mark.parametrize(
    "fmt, row, words",
    [
        ("gsm8k", {"prompt": "x", "answer": "1"}, ["row 0 of", "not a gsm8k row", "question"]),
        ("gsm8k", {"question": "x", "answer": "1"}, ["row 0 of", "#### <number>"]),
        ("preference", {"prompt": "x", "chosen": "a"}, ["not a preference row", "rejected"]),
        ("preference", {"prompt": "x", "chosen": "a", "rejected": "a"}, ["chosen equals"]),
        ("sft", {"text": "x"}, ["not a sft row", "Alpaca"]),
    ],
)
def test_wrong_shape_is_one_clear_error(tmp_path, fmt, row, words):
    src = _jsonl(tmp_path / "bad.jsonl", [row])
    out = tmp_path / "o.jsonl"
    with pytest.raises(DataError) as e:
        prepare(fmt, src, str(out))
    for w in words:
        assert w in str(e.value), str(e.value)
    assert str(src) in str(e.value)
    assert not out.exists() and not (tmp_path / "o.jsonl.tmp").exists()


def test_command_line(tmp_path):
    src = _jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "r\n#### 3"}])
    out = tmp_path / "train.jsonl"
    ok = subprocess.run(
        [sys.executable, "-m", "megarl", "prepare-data", "gsm8k", "--in", src, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "wrote 1 gsm8k rows" in ok.stdout
    assert load_rows(str(out)) == [{"prompt": "q", "answer": "3", "solution": "r"}]
    bad = subprocess.run(
        [sys.executable, "-m", "megarl", "prepare-data", "sft", "--in", src, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("megarl: error: row 0 of"), bad.stderr
