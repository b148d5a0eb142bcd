"""The docs check's second half: does a page's commands run in order on a fresh clone?

For each command of a page (the `Check`s of `tests/docs_check.py`, in page order) this module
says which paths it reads and which it writes, then reports every read that is neither shipped
in the repository nor written by an earlier command of the same page, nor declared by the page
as the reader's own. Pure: nothing runs, files are only looked up.

What a command reads and writes:

- `megarl train CONFIG`: reads CONFIG, and (a real run) the paths its config names after the
  `--set`s (`model.hf`, `model.mcore_ckpt`, `model.tokenizer`, `model.critic_init`,
  `data.path`, `eval.path`, `reward.model`); `--dry-run` / `--print-config` read only CONFIG
  and the model's shape (`model.hf` / `model.mcore_ckpt`). It writes `--out DIR`, else
  `runs/<config name>-*`; `--resume` reads that directory. `megarl plan` reads like a dry run
  (with `--stage-costs`: its sources);
  `megarl config CONFIG` reads CONFIG.
- `megarl prepare-data --in X --out Y`, `megarl convert ... --hf / --ckpt / --gguf X --out Y`
  (also `python tools/convert.py`), `megarl eval X [--config C] --out Y`: read X (and C), write
  Y; `megarl
  fetch-model NAME --out Y` writes Y; `megarl show / plot RUN` read RUN; `make train` writes
  `runs/default`; `hf download ... --local-dir D` (or `huggingface-cli`) and `git clone URL D`
  write D; `cp A B`, `cat > F`, `> F` write B, F (an empty directory from `mkdir` provides
  nothing to read).
- `sbatch SCRIPT` / `bash SCRIPT`: the config files the script names (`examples/*.yaml`) are
  read as a real `megarl train` of them reads.

A path is the reader's own (not checked) when it is a placeholder (`$VAR`, `<name>`, a part in
capitals such as `DIR`, `RUN`, `CONFIG.yaml`), or when a comment line of a shell block above the
command declares it: `# needs: /data/prompts.jsonl (your prompts: data-and-rewards.md)`; the text
after the paths must say how to get them. A read is satisfied by a write of the path itself or
of a directory above it (`runs/q7b` covers `runs/q7b/checkpoints/step_000500`).
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from pathlib import Path

import yaml

from tests.docs_check import (
    FILE_EXTENSIONS,
    ROOT,
    Check,
    blocks,
    checks_of,
    option_value,
    stage_costs,
)

# config keys whose value is a path a real run reads (None, "toy" and the like are not paths)
READ_KEYS = (
    "model.hf", "model.mcore_ckpt", "model.tokenizer", "model.critic_init", "data.path",
    "eval.path", "reward.model",
)  # fmt: skip
SHAPE_KEYS = ("model.hf", "model.mcore_ckpt")
NOT_PATHS = {"toy", "actor", "reward_model", "null", "none", ""}
READ_OPTIONS = ("--in", "--hf", "--ckpt", "--gguf")
_NEEDS = re.compile(r"^\s*#\s*needs:\s*(.+)$")
_PART_PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(\.[a-z]+)?")
_SCRIPT_CONFIG = re.compile(r"examples/[\w.-]+\.ya?ml")


def _norm(path: str) -> str:
    path = path.strip().rstrip("/")
    return path[2:] if path.startswith("./") else path


def is_own(path: str) -> bool:
    """A path the reader supplies: `$VAR`, `<name>`, `DIR`, `RUN/checkpoints/step_N`, `hf:NAME`."""
    if not path or "$" in path or "<" in path or path.startswith(("hf:", "~")):
        return True
    return any(_PART_PLACEHOLDER.fullmatch(part) for part in path.split("/") if part)


def _overrides(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "--set"]


def config_paths(config: str | None, overrides: list[str], keys=READ_KEYS) -> list[str]:
    """The paths among `keys` of CONFIG (a shipped YAML file; None = the embedded default,
    which reads none) after the `--set key=value` overrides."""
    tree: dict = {}
    if config is not None:
        file = ROOT / config
        if not file.is_file():
            return []  # the config itself is reported as the missing read
        tree = yaml.safe_load(file.read_text()) or {}
    for o in overrides:
        key, _, value = o.partition("=")
        node = tree
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node.get(p), dict | None) else {}
        node[last] = yaml.safe_load(value) if value else None
    out = []
    for key in keys:
        section, name = key.split(".")
        value = (tree.get(section) or {}).get(name) if isinstance(tree.get(section), dict) else None
        if isinstance(value, str) and value.lower() not in NOT_PATHS:
            out.append(value)
    return out


def _train(argv: list[str]) -> tuple[list[str], list[str]]:
    config = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else None
    overrides = _overrides(argv)
    reads = [config] if config else []
    if "--dry-run" in argv or "--print-config" in argv or argv[0] == "plan":
        return reads + config_paths(config, overrides, SHAPE_KEYS), []
    if argv[0] == "config":
        return reads, []
    out = option_value(argv, "--out")
    run = out or f"runs/{Path(config).stem if config else 'default'}-*"
    reads += config_paths(config, overrides)
    if "--resume" in argv:
        return reads + [run], []
    return reads, [run]


def reads_writes(c: Check) -> tuple[list[str], list[str]]:
    """(paths read, paths written) of one command segment (see the module docstring)."""
    argv = c.argv
    if c.kind == "megarl" and argv:
        sub = argv[0]
        if sub == "plan" and "--stage-costs" in argv:
            return stage_costs(argv), []
        if sub in ("train", "plan", "config"):
            return _train(argv)
        if sub in ("show", "plot"):
            return [w for w in argv[1:2] if not w.startswith("-")], []
        if sub == "eval":
            reads = [w for w in argv[1:2] if not w.startswith("-")]
            reads += [v for v in [option_value(argv, "--config")] if v]
            out = option_value(argv, "--out")
            return reads, [out] if out else []
    if c.kind in ("megarl", "tool") and argv:
        reads = [v for o in READ_OPTIONS if (v := option_value(argv, o))]
        out = option_value(argv, "--out") or option_value(argv, "--json")
        return reads, [out] if out else []
    if c.kind == "make":
        return [], ["runs/default"] if "train" in argv else []
    if c.kind == "script":
        script = next((w for w in argv if not w.startswith("-")), "")
        file = ROOT / script
        if not file.is_file():
            return [script], []
        reads = []
        for config in sorted(set(_SCRIPT_CONFIG.findall(file.read_text()))):
            rest = argv[argv.index(script) + 1 :]
            reads += [config, *config_paths(config, _overrides(rest))]
        return reads, []
    return [], _shell_writes(c.command)


def _shell_writes(command: str) -> list[str]:
    """What a plain shell command writes: `hf download --local-dir D`, `git clone URL D`,
    `cp A B`, and every `> F` / `>> F` redirection target."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return []
    out = [words[i + 1] for i, w in enumerate(words[:-1]) if w in (">", ">>")]
    out += [w.lstrip(">") for w in words if w.startswith(">") and w.lstrip(">")]
    head = words[0] if words else ""
    if head in ("hf", "huggingface-cli") and (d := option_value(words, "--local-dir")):
        out.append(d)
    elif head == "git" and words[1:2] == ["clone"] and len(words) > 3:
        out.append(words[3])
    elif head == "cp" and len(words) > 2:
        out.append(words[-1])
    return out


def declared(text: str) -> list[tuple[int, str]]:
    """(line, path) of every `# needs: PATH ... (how)` comment line in the page's shell blocks;
    a declaration without the words on how to get the path is not one."""
    out = []
    for b in blocks(text)[0]:
        for n, line in enumerate(b.text.splitlines(), b.line):
            m = _NEEDS.match(line)
            if not m:
                continue
            words = [w.rstrip(",:;") for w in m.group(1).split()]
            paths = [
                w for w in words if ("/" in w or w.endswith(FILE_EXTENSIONS)) and w[0] not in "(`"
            ]
            if len(paths) < len(words):  # something beyond the paths: how to get them
                out += [(n, _norm(p)) for p in paths]
    return out


def _covered(path: str, written: list[str]) -> bool:
    # fnmatch's `*` matches `/` too: `runs/x-*` covers `runs/x-1/checkpoints`
    return any(
        path == w
        or path.startswith(w + "/")
        or fnmatch.fnmatch(path, w)
        or fnmatch.fnmatch(path, w + "/*")
        for w in written
    )


def page_problems(doc: str, text: str) -> list[str]:
    """Every path a command of the page reads that nothing provides: '{doc}:{line}: ...'."""
    cmds = checks_of(doc, text)[0]
    needs = declared(text)
    written: list[str] = []
    problems = []
    for c in cmds:
        reads, writes = reads_writes(c)
        mine = [p for n, p in needs if n < c.line]
        for path in map(_norm, reads):
            if is_own(path) or _covered(path, written + mine):
                continue
            if not path.startswith("/") and (ROOT / path).exists():
                continue
            problems.append(
                f"{doc}:{c.line}: `{c.command}` reads {path}, which is not in the repository "
                "and no earlier command of the page writes (write it in an earlier step, or "
                "declare it in the block: `# needs: PATH (how to get it)`)"
            )
        written += [_norm(w) for w in writes]
    return problems


_SUBCOMMANDS = "train|plan|config|prepare-data|fetch-model|convert|eval|show|plot|bench"
_COMMENT_COMMAND = re.compile(
    rf"^(?:(?:\w+=\S+\s+)*(?:megarl (?:{_SUBCOMMANDS})\b|sbatch |hf download |"
    r"python tools/\S+\.py |torchrun --))"
)


def example_page(path: Path) -> str:
    """The commands in the comments of an example (`#   megarl train examples/x.yaml ...`,
    continuation lines included) and its `# needs: ...` lines as a markdown page of one shell
    block whose line N is line N of the file (the fence takes the place of line 1, a title), so
    that they are checked as a page's commands are. "" when the comments show no command."""
    lines, more = [], False
    for raw in path.read_text().splitlines():
        text = raw.split("#", 1)[1].strip() if raw.lstrip().startswith("#") else None
        if text is not None and (more or _COMMENT_COMMAND.match(text)):
            lines.append(text)
            more = text.endswith("\\")
        elif text is not None and text.startswith("needs:"):  # a declaration, as on a page
            lines.append(f"# {text}")
            more = False
        else:
            lines.append("")
            more = False
    if not any(lines[1:]):
        return ""
    return "\n".join(["```bash", *lines[1:], "```"]) + "\n"


def example_pages() -> dict[str, str]:
    """{examples/NAME: its commands as a page} of every example whose comments show commands."""
    files = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "examples").glob("*.sh"))
    pages = {f.relative_to(ROOT).as_posix(): example_page(f) for f in files}
    return {name: page for name, page in pages.items() if page}
