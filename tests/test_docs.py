"""README.md and docs/*.md: every command they show is run, dry-run or argument-checked, every
path a command reads is shipped or written by an earlier command of the same page (or declared
as the reader's own), every Python block runs, every config key they name exists, every relative
link resolves, and none of them (nor the code) names issue numbers or paths outside the
repository.

How each command is checked: `tests/docs_check.py` (module docstring); what each reads and
writes: `tests/docs_paths.py`. The checks that need
megarl's command line run in one child process for the whole module; the rest are pure reads.
The synthetic docs at the end show that the check fails where it should.
"""

from __future__ import annotations

import re
import shlex
import textwrap

import pytest

from tests import docs_check as dc
from tests import docs_paths as dp
from tests.docs_worker import in_one_process

DOCS = {p.relative_to(dc.ROOT).as_posix(): p.read_text(encoding="utf-8") for p in dc.doc_files()}
# the commands in the examples' comments, each example a page of one shell block
EXAMPLES = dp.example_pages()
PARSED = {doc: dc.checks_of(doc, text) for doc, text in {**DOCS, **EXAMPLES}.items()}
COMMANDS = [c for cmds, _, _ in PARSED.values() for c in cmds if c.kind != "noop"]
PYTHON = [(doc, line, code) for doc, (_, py, _) in PARSED.items() for line, code in py]

# a doc as a careless writer might leave it: each of these must fail the check
BAD_DOC = textwrap.dedent(
    """\
    Set `algorithm.kl_coeff` and `rollout.nn: 4`, or `--set trainer.stepz=3`.

    ```bash
    megarl train examples/grpo_tiny_cpu.yaml --set algorithm.no_such_key=1
    megarl bench --sute all
    megarl plan examples/grpo_tiny_cpu.yaml --gpus 1
    megarl prepare-data gsm8k --in examples/grpo_tiny_cpu.yaml --out data/x.jsonl
    megarl train --dry-run --world-size 3 --set parallel.tensor_parallel=2
    megarl train /models/x.yaml --set algorithm.nope=1
    python tools/convert.py hf-to-mcore --hf /models/Llama-3-8B
    megarl frobnicate --all
    megarl frobnicate --help
    make no-such-target
    pip install -e '.[no_such_extra]'
    pip install megatron-core==0.99.0
    bash tools/gpu_check.sh --no-such-option
    frobnicate --all
    ```

    ```python
    from megarl.advantage import NoSuchAdvantage
    ```

    ```yaml
    algorithm:
      kl_coef: 0.1
      no_such_key: 1
    ```

    [a link](docs/no-such-page.md) and [outside](../../elsewhere/notes.md)
    """
)
# the same commands written right: each must pass
GOOD_DOC = textwrap.dedent(
    """\
    ```bash
    megarl train examples/grpo_tiny_cpu.yaml --set algorithm.kl_coef=0.01
    megarl prepare-data gsm8k --in examples/data/gsm8k_format_sample.jsonl --out data/x.jsonl
    megarl train --help
    megarl convert hf-to-mcore --help
    ```
    """
)


def _job(c: dc.Check) -> dict:
    return {"id": c.id, "kind": c.kind, "argv": c.argv, "mode": c.mode, "world": c.world}


def _pending_absent(c: dc.Check) -> str | None:
    """Why `c` is skipped for now: it names something documented before it exists."""
    if c.pending is None:
        return None
    if c.pending.startswith("subcommand "):
        if c.pending.split()[-1] in dc.subcommands():
            return None
    elif (dc.ROOT / c.pending).exists():
        return None
    return f"{c.pending} is not in the repository yet (documented ahead of it)"


SYNTHETIC = {
    name: dc.checks_of(f"synthetic-{name}", doc)
    for name, doc in (("bad", BAD_DOC), ("good", GOOD_DOC))
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{check id: (ok, text)} of every check that needs megarl, from one child process."""
    jobs = [_job(c) for c in COMMANDS if c.kind in ("megarl", "tool") and not _pending_absent(c)]
    jobs += [
        {"id": f"{doc}:{line}:python", "kind": "python", "code": code} for doc, line, code in PYTHON
    ]
    for name, (cmds, py, _) in SYNTHETIC.items():
        jobs += [_job(c) for c in cmds if c.kind in ("megarl", "tool")]
        jobs += [
            {"id": f"synthetic-{name}:{n}:python", "kind": "python", "code": code} for n, code in py
        ]
    return in_one_process(jobs, tmp_path_factory.mktemp("docs_check"))


def _outcome(c: dc.Check, results: dict) -> tuple[bool, str]:
    if c.kind in ("megarl", "tool"):
        return tuple(results[c.id][:2])
    problem = dc.check_static(c)
    return problem is None, problem or ""


@pytest.mark.parametrize("check", COMMANDS, ids=[c.id for c in COMMANDS])
def test_doc_command(check, results):
    reason = _pending_absent(check)
    if reason:
        pytest.skip(reason)
    ok, text = _outcome(check, results)
    assert ok, f"{check.doc}:{check.line}: {check.command}\n  ({check.kind} {check.mode}) {text}"


@pytest.mark.parametrize("doc,line,code", PYTHON, ids=[f"{d}:{n}" for d, n, _ in PYTHON])
def test_doc_python_block(doc, line, code, results):
    ok, text, _ = results[f"{doc}:{line}:python"]
    assert ok, f"{doc}:{line}: the Python block fails:\n{text}"


@pytest.mark.parametrize("doc", sorted(DOCS) + sorted(EXAMPLES))
def test_doc_commands_read_only_what_is_shipped_or_written_before(doc):
    problems = dp.page_problems(doc, {**DOCS, **EXAMPLES}[doc])
    assert problems == [], "\n".join(problems)


def _key_problems(doc: str, text: str) -> list[str]:
    schema = dc._schema()
    found, prose = dc.blocks(text)
    keys = dc.named_keys(prose, schema)
    for b in found:
        if b.lang in ("yaml", "yml"):
            keys += [(b.line, k) for k in dc.yaml_keys(b, schema)]
    return [f"{doc}:{n}: {p}" for n, k in keys if (p := dc.key_problem(k, schema))]


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_doc_config_keys_exist(doc):
    problems = _key_problems(doc, DOCS[doc])
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_doc_links_resolve(doc):
    path = dc.ROOT / doc
    problems = dc.link_problems(path, dc.blocks(DOCS[doc])[1])
    assert problems == [], f"{doc}: " + "; ".join(problems)


# development-process words a user-facing repository must not carry (written so that these
# patterns do not match their own source)
INTERNAL = [
    r"\bissues? #?\d+",
    r"\.\./shared",
    r"/w[o]rk/",
    r"this project's (?:machine|CPU)",
    r"\blent\b",
    r"device t[o]ol",
    r"\bdefect \d+",
]


def test_nothing_names_issue_numbers_or_outside_paths():
    roots = ["README.md", "Makefile", "setup.py", "Dockerfile", "docs", "megarl", "tools", "tests",
             "examples"]  # fmt: skip
    hits = []
    for root in roots:
        path = dc.ROOT / root
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        for f in files:
            if f.suffix not in ("", ".md", ".py", ".sh", ".yaml", ".txt") or not f.is_file():
                continue
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                for pattern in INTERNAL:
                    if re.search(pattern, line, re.I):
                        hits.append(f"{f.relative_to(dc.ROOT)}:{n}: {line.strip()[:100]}")
    assert hits == [], "\n".join(hits)


def test_readme_is_a_short_page():
    assert len(DOCS["README.md"].splitlines()) <= 160


# ------------------------------------------------------------------- the check itself fails
def test_a_key_that_does_not_exist_fails():
    problems = _key_problems("synthetic", BAD_DOC)
    for key in ("algorithm.kl_coeff", "rollout.nn", "trainer.stepz", "algorithm.no_such_key"):
        assert any(f"`{key}`" in p for p in problems), (key, problems)
    assert not any("algorithm.kl_coef`" in p for p in problems)
    assert dc.key_problem("algorithm.kl_coef") is None
    assert dc.key_problem("model.config.hidden_size") is None  # below a mapping: free-form
    assert "is a value" in dc.key_problem("algorithm.kl_coef.x")
    assert "no config section" in dc.key_problem("algorithms.kl_coef")


def test_bad_commands_fail_and_good_ones_pass(results):
    bad, _, _ = SYNTHETIC["bad"]
    assert len(bad) == 14
    for c in bad:
        ok, text = _outcome(c, results)
        assert not ok, f"the docs check accepted {c.command!r} ({c.kind} {c.mode}): {text}"
    assert [c.kind for c in bad][-1] == "unknown"
    ((line, _),) = SYNTHETIC["bad"][1]
    assert not results[f"synthetic-bad:{line}:python"][0]
    good, _, _ = SYNTHETIC["good"]
    for c in good:
        ok, text = _outcome(c, results)
        assert ok, f"{c.command}: {text}"
    assert [c.mode for c in good] == ["print-config", "run", "help", "help"]


def test_links_outside_the_repository_fail():
    problems = dc.link_problems(dc.ROOT / "README.md", BAD_DOC)
    assert any("no such file" in p for p in problems)
    assert any("outside the repository" in p for p in problems)


def test_commands_are_taken_apart_as_a_shell_would():
    assert dc.segments("megarl config --reference > docs/config.md") == [
        ["megarl", "config", "--reference"]
    ]
    assert dc.segments("make test 2>&1 | tail -3  # the summary") == [
        ["make", "test"],
        ["tail", "-3"],
    ]
    block = dc.Block("bash", 1, "megarl train X \\\n    --set a.b=c  # note\n# comment\n")
    assert dc.command_lines(block) == [(1, "megarl train X      --set a.b=c  # note")]
    c = dc.classify("d", 1, "", ["torchrun", "--nproc_per_node", "2", "-m", "megarl", "train"])
    assert (c.kind, c.argv, c.world, c.mode) == ("megarl", ["train"], 2, "print-config")
    c = dc.classify("d", 1, "", ["megarl", "train", "CONFIG.yaml", "--set", "model.hf=DIR"])
    assert c.mode == "args"
    c = dc.classify("d", 1, "", ["OMP_NUM_THREADS=1", ".venv/bin/megarl", "plan", "x.yaml"])
    assert (c.kind, c.mode) == ("megarl", "run")
    c = dc.classify("d", 1, "", ["timeout", "-s", "INT", "60", "megarl", "train"])
    assert (c.kind, c.argv) == ("megarl", ["train"])
    block = dc.Block("bash", 1, "cat > x.yaml <<'EOF'\ntrainer:\n  steps: 2\nEOF\nmake test\n")
    assert [c for _, c in dc.command_lines(block)] == ["cat > x.yaml <<'EOF'", "make test"]


# a page whose commands read what no step of it writes: each read must be reported
UNWRITTEN_DOC = textwrap.dedent(
    """\
    ```bash
    megarl train examples/grpo_tiny_cpu.yaml --out runs/a
    megarl train examples/grpo_tiny_cpu.yaml --set data.path=data/nowhere.jsonl --out runs/c
    megarl show runs/b
    megarl convert mcore-to-hf --ckpt runs/b/checkpoints/step_000002 --out exported/b
    megarl train examples/no_such_config.yaml --dry-run
    megarl train examples/grpo_tiny_cpu.yaml --resume
    # needs: /data/prompts.jsonl
    megarl prepare-data gsm8k --in /data/prompts.jsonl --out data/p.jsonl
    bash examples/slurm_llama3_70b.sh
    ```
    """
)
# the same reads, each provided: by an earlier step, the repository or a declaration
WRITTEN_DOC = textwrap.dedent(
    """\
    ```bash
    # needs: /data/prompts.jsonl (your prompts, one JSON object a line)
    megarl prepare-data gsm8k --in /data/prompts.jsonl --out data/p.jsonl
    megarl train examples/grpo_tiny_cpu.yaml --set data.path=data/p.jsonl --out runs/b
    megarl show runs/b
    megarl convert mcore-to-hf --ckpt runs/b/checkpoints/step_000002 --out exported/b
    megarl train examples/grpo_tiny_cpu.yaml
    megarl train examples/grpo_tiny_cpu.yaml --resume
    hf download Qwen/Qwen2.5-7B-Instruct --local-dir /models/Qwen2.5-7B-Instruct
    megarl convert hf-to-mcore --hf /models/Qwen2.5-7B-Instruct --out /ckpt/qwen7b
    megarl train CONFIG.yaml --set model.hf=DIR
    ```
    """
)


def test_a_read_that_no_step_writes_is_reported():
    problems = dp.page_problems("synthetic", UNWRITTEN_DOC)
    for read in ("data/nowhere.jsonl", "runs/b", "runs/b/checkpoints/step_000002",
                 "examples/no_such_config.yaml", "runs/grpo_tiny_cpu-*", "/data/prompts.jsonl",
                 "/data/math_train.jsonl", "/ckpt/llama3-70b"):  # fmt: skip
        assert any(f" reads {read}, " in p for p in problems), (read, problems)
    assert len(problems) == 9, "\n".join(problems)  # the script's config reads three paths
    assert dp.page_problems("synthetic", WRITTEN_DOC) == []


def test_what_commands_read_and_write():
    def rw(words):
        return dp.reads_writes(dc.classify("d", 1, shlex.join(words), words))

    assert rw(["megarl", "train", "examples/grpo_tiny_cpu.yaml", "--out", "runs/x"]) == (
        ["examples/grpo_tiny_cpu.yaml"],
        ["runs/x"],
    )
    reads, _ = rw(["megarl", "train", "examples/grpo_smollm2_arith_cpu.yaml"])
    assert "models/smollm2" in reads and "examples/data/smollm2_arith_train.jsonl" in reads
    config = "examples/grpo_qwen2.5_7b_gsm8k.yaml"
    plan = ["megarl", "plan", config, "--set", "model.mcore_ckpt=null", "--set", "model.hf=m/x"]
    assert rw(plan) == ([config, "m/x"], [])
    assert rw(["make", "train"]) == ([], ["runs/default"])
    assert rw(["megarl", "fetch-model", "smollm2-135m-instruct", "--out", "m"]) == ([], ["m"])
    assert dp._shell_writes("cat > x.yaml <<'EOF'") == ["x.yaml"]
    assert dp._shell_writes("git clone https://example.org/r.git /src/r") == ["/src/r"]
    assert dp.is_own("RUN/checkpoints/step_N") and dp.is_own("$HOME/x") and dp.is_own("hf:gsm8k")
    assert not dp.is_own("/models/Qwen2.5-7B-Instruct") and not dp.is_own("runs/x")
