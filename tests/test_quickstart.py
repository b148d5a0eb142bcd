"""The README's CPU quickstarts run as written, in order, in short form, on what a fresh clone
ships.

tests/test_docs.py checks every documented command without running the long ones (a training
command there is resolved with `--print-config`). Here the README's CPU sections are run for
real: each command of a section's blocks, in the order a reader meets them, in a scratch
directory that holds links to the repository's tracked files only (so a command that reads
something no earlier step writes fails here as on a fresh clone). The short form of a command
is the command as written plus `--set` overrides that cut a run to a step or two
(`SHORT_FORMS`); a command with no short form fails, so a new command in a run section must get
one. Every README section with a shell block is listed in `SECTIONS`: run in the CI tier, run
in the extended tier (the real model: a download and minutes per run; tests/test_real_model.py
runs the same example, cut shorter, in the CI tier), or not run, with the reason.

After the default's section the README's prose claims are checked too: the run directory holds
the files the section names, `megarl show runs/default` reports the finished run, and running
the same command again continues from the newest checkpoint instead of starting over.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import docs_check as dc

pytestmark = pytest.mark.slow

README = dc.ROOT / "README.md"
RUN_CI, RUN_EXTENDED = "ci", "extended"
# every README section with a shell block: how this module runs it
SECTIONS = {
    "Two commands": RUN_CI,
    "Quickstart with a real model (CPU)": RUN_EXTENDED,
    "Multi-turn, tools and agents": RUN_EXTENDED,
    "Quickstart on GPUs": "needs GPUs (tests/test_docs.py resolves and dry-runs its commands)",
}
# commands a run section may show that are not run here, and why
NOT_RUN = {
    ("make", "test"): "the CI tier itself",
    ("make", "test-slow"): "the slow tier itself",
}
# the overrides that make each kind of run short; appended to the command as written
SHORT_FORMS = {
    "train": ["--set", "trainer.steps=2", "--set", "eval.max_prompts=8"],
}


def readme_sections() -> dict[str, list[dc.Check]]:
    """{`## ` heading: the command checks of its shell blocks, in order}."""
    text = README.read_text(encoding="utf-8")
    cmds = dc.checks_of("README.md", text)[0]
    headings = [
        (i, line[3:].strip())
        for i, line in enumerate(text.splitlines(), 1)
        if line.startswith("## ")
    ]
    out: dict[str, list[dc.Check]] = {}
    for c in cmds:
        under = [h for i, h in headings if i < c.line]
        if under:
            out.setdefault(under[-1], []).append(c)
    return out


def section_prose(heading: str) -> str:
    text = README.read_text(encoding="utf-8")
    body = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return " ".join(dc.blocks(body)[1].split())  # lines joined: a code span may wrap


def make_recipe(target: str) -> list[list[str]]:
    """The command lines of a Makefile target's recipe, as words."""
    lines = (dc.ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(shlex.split(line.strip()))
    return recipe


def short_form(c: dc.Check) -> list[str] | None:
    """The megarl argv that runs `c` in short form; None where `NOT_RUN` says why not."""
    words = [w for w in c.argv if w]
    if c.kind == "make":
        if tuple([c.kind, *words]) in NOT_RUN:
            return None
        recipe = make_recipe(words[0])
        # the install prerequisite is this checkout's virtualenv: only the megarl line runs
        assert len(recipe) == 1 and recipe[0][0].endswith("/megarl"), (
            f"README.md:{c.line}: `make {words[0]}` runs {recipe}; give it a short form here"
        )
        words = recipe[0][1:]
    elif c.kind != "megarl":
        raise AssertionError(f"README.md:{c.line}: no short form for {c.command!r}")
    return [*words, *SHORT_FORMS.get(words[0], [])]


@pytest.fixture
def clone(tmp_path) -> Path:
    """A scratch working directory with links to the repository's tracked top-level entries:
    what a fresh clone has, nothing a run here wrote (runs/, models/, data/)."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=dc.ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for top in sorted({p.split("/", 1)[0] for p in tracked}):
        (tmp_path / top).symlink_to(dc.ROOT / top)
    return tmp_path


def megarl(cwd: Path, argv: list[str]) -> str:
    """Run `megarl ARGV` in `cwd` as a reader would; its output, or the test fails with it."""
    env = {**os.environ, "PYTHONPATH": str(dc.ROOT), "TORCHDYNAMO_DISABLE": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "megarl", *argv], cwd=cwd, env=env, capture_output=True, text=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"megarl {shlex.join(argv)} -> {proc.returncode}\n{out[-3000:]}"
    return out


def run_section(heading: str, cwd: Path) -> list[tuple[list[str], str]]:
    """Each command of the section in short form, in order: [(argv, output)]."""
    done = []
    for c in readme_sections()[heading]:
        argv = short_form(c)
        if argv is not None:
            done.append((argv, megarl(cwd, argv)))
    assert done, f"README.md section {heading!r} ran nothing"
    return done


def test_every_readme_section_with_commands_is_listed():
    found = set(readme_sections())
    assert found == set(SECTIONS), (
        f"README sections with shell blocks {sorted(found)}; listed here {sorted(SECTIONS)}"
    )
    for heading, how in SECTIONS.items():
        if how in (RUN_CI, RUN_EXTENDED):
            for c in readme_sections()[heading]:
                short_form(c)  # every command has a short form or a reason


def test_two_commands(clone):
    [(argv, out)] = run_section("Two commands", clone)
    run = clone / argv[argv.index("--out") + 1]
    steps = int(SHORT_FORMS["train"][1].split("=")[1])
    # the files the section says the run directory holds
    named = re.findall(r"`([\w.-]+(?:\.\w+|/))`", section_prose("Two commands"))
    assert {"config.yaml", "metrics.jsonl", "reward.png", "checkpoints/"} <= set(named), named
    for name in named:
        assert (run / name).exists(), f"README names {name} in {run.name}/; the run wrote none"
    assert f"megarl show {run.relative_to(clone)}" in section_prose("Two commands")
    shown = megarl(clone, ["show", str(run.relative_to(clone))])
    assert re.search(rf"status\s+finished \(step {steps} of {steps} logged\)", shown), shown
    # "running make train again continues ... from its newest checkpoint"
    again = [*argv[: -len(SHORT_FORMS["train"])], "--set", f"trainer.steps={steps + 1}"]
    out = megarl(clone, again)
    assert f"resumed from {run.relative_to(clone)}/checkpoints/step_{steps:06d}" in out, out[-2000:]
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()]
    assert logged == list(range(1, steps + 2)), logged


@pytest.mark.extended  # a download and two real-model runs: minutes
def test_real_model_quickstarts(clone):
    ran = run_section("Quickstart with a real model (CPU)", clone)
    ran += run_section("Multi-turn, tools and agents", clone)
    for argv, _out in ran:
        if argv[0] == "train":
            run = clone / argv[argv.index("--out") + 1]
            logged = [json.loads(line) for line in (run / "metrics.jsonl").open()]
            assert [r["step"] for r in logged if "reward_mean" in r] == [1, 2], logged
            assert (run / "checkpoints").is_dir() and (run / "samples.jsonl").is_file()
