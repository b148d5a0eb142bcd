"""The docs check: what README.md and docs/*.md tell a user to run, and the config keys they name.

Reading (pure, in the test process): fenced code blocks are taken apart into commands
(`bash` / `sh` / `shell` / `console` blocks: one command per line, `\\` continuations joined,
`#` comments dropped, `&&` / `;` / `|` split into segments), Python blocks and YAML blocks; the
prose's inline code spans are scanned for dotted config keys (`algorithm.kl_coef`,
`precision.dtype: bf16`, `--set rollout.sampling.n=4`) and its links for relative paths.

Classifying (pure): every command segment becomes one `Check` whose `kind` says how it is
checked; a command this module does not know is a `Check("unknown")`, which fails, so a doc
cannot show a command nobody checks.

- `megarl train CONFIG ...` (also `python -m megarl`, `.venv/bin/megarl`, under `torchrun` /
  `srun`): with `--dry-run`, run for real (meta device, seconds); otherwise resolved with
  `--print-config` (the file and every `--set` key), and under torchrun with a model whose shape
  is at hand also dry-run at the launch's world size. `megarl plan` runs for real (exit status 0
  or 1: it fits or it does not; with `--stage-costs` of run directories, argument-checked),
  `megarl config` too, `megarl prepare-data` on the shipped file it names (its `--out` redirected
  to a scratch directory), `--help` of any subcommand too (it must print a usage). Every other
  subcommand (`bench`, `convert`, `fetch-model`, ...) and `python tools/*.py` is
  argument-checked: its own argparse parser parses the documented arguments (the subcommand and
  every option must exist, types and choices must fit), and nothing runs.
- A command whose inputs are placeholders (`/models/...`, `DIR`, `CONFIG.yaml`, `$VAR`) is
  argument-checked only, with its `--set` keys checked against the config schema.
- `make T`: the Makefile has target T; `pip install`: the extras exist in setup.py and pinned
  versions fit setup.py's ranges and the Makefile's pins; `bash` / `sbatch SCRIPT`: the script
  exists, parses (`bash -n`), and knows the options given; `pytest` / `ruff`: the paths exist.
- Python blocks are executed (`>>>` blocks as doctests); YAML blocks of config sections have
  their keys checked.

Paths: `tests/docs_paths.py` says what each command reads and writes, and reports a read that
neither the repository nor an earlier command of the same page provides.

Running: the checks that need megarl's command line run in ONE child process
(`tests/docs_worker.py`, started by tests/test_docs.py), so the imports are paid once and no
global state (logging, process groups) leaks into the test process. Things that are not in the
repository yet but are documented on purpose are listed in `PENDING_FILES` and
`PENDING_SUBCOMMANDS`: while absent, their checks are skipped with the reason; once present they
are checked like the rest.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
import shlex
import subprocess
import typing
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# documented on purpose before they exist on this branch (other work in progress); a check that
# needs one of these is skipped while it is absent and runs as soon as it exists
PENDING_FILES: set[str] = set()
PENDING_SUBCOMMANDS: set[str] = set()

SHELL_LANGS = {"bash", "sh", "shell", "console"}
SEGMENT_OPS = {"&&", "||", ";", "|", "&"}
# commands a doc may show that this check does not run: navigation, inspection, other tools
NOOP = {
    "cd", "git", "export", "source", "ls", "cat", "tail", "head", "less", "jq", "grep", "du",
    "mkdir", "cp", "mv", "rm", "touch", "echo", "printf", "tee", "sleep", "nvidia-smi", "lscpu",
    "nproc", "free", "df", "ps", "wandb", "tensorboard", "watch", "squeue", "scontrol", "scancel",
    "sacct", "kill", "wc", "sort", "diff", "sha256sum", "hf", "huggingface-cli",
}  # fmt: skip
# prefixes that run the rest of the line as a command: checked as that command
WRAPPERS = {"timeout", "nohup", "time", "env", "exec"}
FILE_EXTENSIONS = (
    ".py", ".yaml", ".yml", ".json", ".jsonl", ".md", ".sh", ".png", ".txt", ".parquet",
    ".arrow", ".gguf", ".pt", ".pth", ".bin", ".safetensors", ".toml", ".log", ".csv", ".whl",
    ".gz", ".zip",
)  # fmt: skip
_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_CAPS = re.compile(r"(?<![a-z])[A-Z][A-Z0-9_]{1,}(?![a-z])")
_KEY = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)(?:\s*[:=].*)?")
_SET = re.compile(r"--set[ =]+([A-Za-z0-9_.]+)=")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


# ------------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # 1-based line of the first line of the block's content
    text: str


def blocks(text: str) -> tuple[list[Block], str]:
    """The fenced code blocks of a markdown text, and the prose with the blocks blanked out."""
    out, prose, lang, start, buf, fence = [], [], None, 0, [], None
    for i, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence, lang, start, buf = m.group(1), m.group(2).lower(), i + 1, []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence[:3]) and not line.strip()[3:]:
            out.append(Block(lang, start, "\n".join(buf)))
            fence = None
            prose.append("")
        elif fence is not None:
            buf.append(line)
            prose.append("")
        else:
            prose.append(line)
    return out, "\n".join(prose)


def command_lines(block: Block) -> list[tuple[int, str]]:
    """(line, command) of a shell block: continuations joined, here-document bodies skipped; a
    `console` block's commands are its `$ ` lines (the rest is output)."""
    out, pending, first, heredoc = [], "", 0, None
    for i, raw in enumerate(block.text.splitlines(), block.line):
        line = raw.rstrip()
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if block.lang == "console":
            if not pending:
                if not line.lstrip().startswith("$ "):
                    continue
                line = line.lstrip()[2:]
        if not pending:
            first = i
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        cmd = (pending + line).strip()
        pending = ""
        doc = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", cmd)
        if doc:
            heredoc = doc.group(1)
        if cmd and not cmd.startswith("#"):
            out.append((first, cmd))
    return out


def segments(command: str) -> list[list[str]]:
    """Shell words of each `&&` / `||` / `;` / `|` / `&` segment; comments and redirections
    (`> FILE`, `2>&1`) removed."""
    lex = shlex.shlex(command, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    segs, skip_next = [[]], False
    for w in lex:
        if skip_next:
            skip_next = False
        elif w in SEGMENT_OPS:
            segs.append([])
        elif w and set(w) <= set("<>&"):  # a redirection: drop it, its target and its fd
            if segs[-1][-1:] in (["1"], ["2"]):
                segs[-1].pop()
            skip_next = True
        else:
            segs[-1].append(w)
    return [s for s in segs if s]


@dataclass
class Check:
    """One command segment of a doc and how it is checked (see the module docstring)."""

    doc: str
    line: int
    command: str
    kind: str
    argv: list[str] = field(default_factory=list)
    mode: str = ""
    world: int | None = None
    pending: str | None = None
    index: int = 0

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}#{self.index}"


def is_placeholder(word: str) -> bool:
    """A word a user must replace: `/models/X`, `DIR`, `CONFIG.yaml`, `$VAR`, `<path>`."""
    value = word.split("=", 1)[1] if "=" in word and not word.startswith("-") else word
    if not value or value.startswith("-"):
        return False
    if (ROOT / value).exists():
        return False
    return (
        "$" in value
        or "<" in value
        or value.startswith("/")
        or value.startswith("~")
        or bool(_CAPS.search(value))
        or value.startswith("hf:")
    )


def _strip_env(words: list[str]) -> list[str]:
    """Drop `VAR=value` prefixes and wrappers (`timeout 3600`, `nohup`, `env X=1`)."""
    while words:
        if _ENV.match(words[0]):
            words = words[1:]
        elif words[0] in WRAPPERS:
            wrapper, words = words[0], words[1:]
            if wrapper == "timeout":  # options (`-s INT`, `-k 10`), then the duration
                at = [i for i, w in enumerate(words) if re.fullmatch(r"\d+(\.\d+)?[smhd]?", w)]
                words = words[at[0] + 1 :] if at else words
            while words and words[0].startswith("-"):  # the wrapper's own flags
                words = words[1:]
        else:
            return words
    return words


def option_value(argv: list[str], name: str) -> str | None:
    for i, w in enumerate(argv):
        if w == name and i + 1 < len(argv):
            return argv[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return None


def _world(launcher: list[str]) -> int | None:
    """Ranks of a torchrun launch: --nproc_per_node x --nnodes, when both are numbers."""
    nproc = option_value(launcher, "--nproc_per_node") or option_value(launcher, "--nproc-per-node")
    nodes = option_value(launcher, "--nnodes") or "1"
    if nproc and nproc.isdigit() and nodes.isdigit():
        return int(nproc) * int(nodes)
    return None


def _clean(words: list[str]) -> list[str]:
    """Drop optional-argument brackets (`[--rank 63]`) and ellipses."""
    out = []
    for w in words:
        if w.startswith("[") and "]" not in w:
            w = w[1:]
        elif w.endswith("]") and "[" not in w:
            w = w[:-1]
        elif w.startswith("[") and w.endswith("]") and w.count("[") == 1:
            w = w[1:-1]
        if w and w not in {"...", "…"}:
            out.append(w)
    return out


def classify(doc: str, line: int, command: str, words: list[str]) -> Check:
    words = _clean(_strip_env(words))
    c = Check(doc, line, command, "unknown", argv=words)
    if not words:
        c.kind = "noop"
        return c
    head = os.path.basename(words[0])
    launch = {"srun", "torchrun", "docker"}
    if head in launch or (
        head.startswith("python") and words[1:3] == ["-m", "torch.distributed.run"]
    ):
        at = [i for i in range(len(words) - 1) if words[i : i + 2] == ["-m", "megarl"]]
        if not at and head == "docker":  # `docker run [OPTIONS] IMAGE megarl SUB ...`
            # the command `megarl` follows the image, a word that is neither `run` nor an option
            at = [i - 1 for i, w in enumerate(words) if w == "megarl" and i > 2]
            at = [i for i in at if words[i] != "run" and not words[i].startswith("-")][-1:]
        if not at:
            c.kind = "noop" if head == "docker" else c.kind
            return c
        launcher = words[: at[0]]
        torchrun = any(w == "torchrun" or w == "torch.distributed.run" for w in launcher)
        return _megarl(c, words[at[0] + 2 :], world=_world(launcher) if torchrun else None)
    if head == "megarl":
        return _megarl(c, words[1:])
    if head.startswith("python"):
        rest = words[1:]
        if rest[:2] == ["-m", "megarl"]:
            return _megarl(c, rest[2:])
        if rest[:2] == ["-m", "pytest"]:
            c.kind, c.argv = "paths", rest[2:]
            return c
        if rest[:2] == ["-m", "pip"]:
            c.kind, c.argv = "pip", rest[2:]
            return c
        if rest and rest[0].startswith("tools/") and rest[0].endswith(".py"):
            c.kind, c.argv = "tool", rest
            return c
        if rest[:1] == ["-c"] or rest[:2] == ["-m", "venv"]:
            c.kind = "noop"
        return c
    if head in {"pip", "pip3"}:
        c.kind, c.argv = "pip", words[1:]
    elif head == "make":
        c.kind, c.argv = "make", words[1:]
    elif head in {"bash", "sbatch", "sh"} and len(words) > 1:
        c.kind, c.argv = "script", words[1:]
    elif head in {"pytest", "ruff"}:
        c.kind, c.argv = "paths", words[1:]
    elif head in NOOP:
        c.kind = "noop"
    return c


def _megarl(c: Check, argv: list[str], world: int | None = None) -> Check:
    c.kind, c.argv, c.world = "megarl", argv, world
    if not argv:
        c.mode = "args"
        return c
    sub = argv[0]
    inputs = [w for i, w in enumerate(argv) if i == 0 or argv[i - 1] != "--out"]
    placeholders = any(is_placeholder(w) for w in inputs)
    if sub in PENDING_SUBCOMMANDS:
        c.pending = f"subcommand megarl {sub}"
    for w in argv:
        if w.rstrip("/") in PENDING_FILES:
            c.pending = w.rstrip("/")
    if "--help" in argv or "-h" in argv:
        c.mode = "help"
    elif placeholders or sub not in {"train", "plan", "config", "prepare-data"}:
        c.mode = "args"
    elif sub == "plan" and not all((ROOT / w).exists() for w in stage_costs(argv)):
        # run directories the page's training commands write: the path check follows them
        c.mode = "args"
    elif sub == "train":
        c.mode = "dry-run" if "--dry-run" in argv else "print-config"
    else:
        c.mode = "run"
    return c


def stage_costs(argv: list[str]) -> list[str]:
    """The sources of `megarl plan --stage-costs SOURCE...` (none without the option)."""
    if "--stage-costs" not in argv:
        return []
    rest = argv[argv.index("--stage-costs") + 1 :]
    return rest[: next((i for i, w in enumerate(rest) if w.startswith("-")), len(rest))]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def checks_of(doc: str, text: str) -> tuple[list[Check], list[tuple[int, str]], list[Block]]:
    """(command checks, python blocks as (line, code), yaml blocks) of one markdown text."""
    found, cmds, py, yml = blocks(text)[0], [], [], []
    for b in found:
        if b.lang in SHELL_LANGS:
            for line, command in command_lines(b):
                for words in segments(command):
                    c = classify(doc, line, command, words)
                    c.index = len(cmds)
                    cmds.append(c)
        elif b.lang in {"python", "py", "pycon"}:
            py.append((b.line, b.text))
        elif b.lang in {"yaml", "yml"}:
            yml.append(b)
    return cmds, py, yml


# ------------------------------------------------------------------------- config keys, links
@functools.cache
def _schema() -> dict[str, type]:
    from megarl.config_reference import sections

    return {name: cls for name, cls, _ in sections()}


def _unwrap(tp):
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def key_problem(key: str, schema: dict[str, type] | None = None) -> str | None:
    """Why dotted `key` is not a config key (None when it is). Keys below a mapping-typed field
    (`model.config.hidden_size`, `reward.kwargs.format.pattern`) are free-form."""
    schema = schema if schema is not None else _schema()
    parts = key.split(".")
    cls = schema.get(parts[0])
    if cls is None:
        return f"`{key}`: no config section {parts[0]!r}; sections: {sorted(schema)}"
    for i, part in enumerate(parts[1:], 1):
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            where = ".".join(parts[:i])
            return f"`{key}`: {where} has no key {part!r}; its keys: {names}"
        tp = _unwrap(hints[part])
        if dataclasses.is_dataclass(tp):
            cls = tp
            continue
        if tp is dict or typing.get_origin(tp) is dict or tp is typing.Any:
            return None
        if i < len(parts) - 1:
            return f"`{key}`: {'.'.join(parts[: i + 1])} is a value, not a section"
    return None


def named_keys(prose: str, schema: dict[str, type]) -> list[tuple[int, str]]:
    """(line, dotted key) of every config key the prose names in inline code."""
    out = []
    for n, line in enumerate(prose.splitlines(), 1):
        for span in re.findall(r"`([^`]+)`", line):
            keys = _SET.findall(span)
            m = _KEY.fullmatch(span.strip())
            if m and not m.group(1).endswith(FILE_EXTENSIONS):
                keys.append(m.group(1))
            out += [(n, k) for k in keys if k.split(".")[0] in schema]
    return out


def yaml_keys(block: Block, schema: dict[str, type]) -> list[str]:
    """Dotted keys of a YAML block whose top-level keys are config sections ([] otherwise)."""
    import yaml

    try:
        tree = yaml.safe_load(block.text)
    except yaml.YAMLError:
        return []
    if not isinstance(tree, dict) or not set(tree) & set(schema):
        return []

    def walk(node, prefix):
        if isinstance(node, dict) and (not prefix or key_problem(prefix, schema) is None):
            sub = [walk(v, f"{prefix}.{k}" if prefix else str(k)) for k, v in node.items()]
            return [k for keys in sub for k in keys] or [prefix]
        return [prefix]

    return [k for k in walk(tree, "") if k]


def link_problems(doc: Path, prose: str) -> list[str]:
    out = []
    for target in _LINK.findall(prose):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        rel = target.split("#", 1)[0]
        path = (doc.parent / rel).resolve()
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else None
        if name is None:
            out.append(f"{target}: outside the repository")
        elif not path.exists() and name not in PENDING_FILES:
            out.append(f"{target}: no such file")
    return out


# --------------------------------------------------------------------- checks without megarl
def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def _setup_requirements() -> dict[str, list[str]]:
    """{"": install_requires, extra: its requirements} from setup.py's literal lists."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
    )
    kw = {k.arg: k.value for k in call.keywords}
    out = {"": ast.literal_eval(kw["install_requires"])}
    out.update(ast.literal_eval(kw["extras_require"]))
    return out


def _makefile_pins() -> dict[str, str]:
    return dict(
        re.findall(
            r"pip install [^\n]*?([A-Za-z0-9_.-]+)==([0-9][^\s']*)", (ROOT / "Makefile").read_text()
        )
    )


def check_pip(argv: list[str]) -> str | None:
    """Extras named (`.[gpu]`) exist; pinned versions (`megatron-core==0.16.1`) are inside
    setup.py's ranges and equal the Makefile's pins."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    reqs = _setup_requirements()
    ranges: dict[str, list] = {}
    for lst in reqs.values():
        for r in lst:
            req = Requirement(r)
            ranges.setdefault(canonicalize_name(req.name), []).append(req.specifier)
    make = {canonicalize_name(k): v for k, v in _makefile_pins().items()}
    for w in argv:
        extras = re.fullmatch(r"\.\[([^\]]+)\]", w)
        for extra in extras.group(1).split(",") if extras else []:
            if extra.strip() not in reqs:
                return f"pip extra [{extra}] is not in setup.py's extras_require {sorted(reqs)}"
        pin = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([0-9][^\s]*)", w)
        if pin:
            name, version = canonicalize_name(pin.group(1)), pin.group(2)
            for spec in ranges.get(name, []):
                if version not in spec:
                    return f"{w}: outside setup.py's range {name}{spec}"
            if name in make and make[name] != version:
                return f"{w}: the Makefile installs {name}=={make[name]}"
    return None


def check_static(c: Check) -> str | None:
    """The checks that need no megarl import; None = passed."""
    if c.kind == "unknown":
        return (
            f"the docs check does not know how to check {c.command!r}; run it in a test, or "
            "teach tests/docs_check.py (classify) what it is"
        )
    if c.kind == "make":
        missing = [t for t in c.argv if not t.startswith("-") and "=" not in t]
        missing = [t for t in missing if t not in _makefile_targets()]
        return f"Makefile has no target {missing}" if missing else None
    if c.kind == "pip":
        return check_pip(c.argv)
    if c.kind == "paths":
        for w in c.argv:
            p = w.split("::", 1)[0]
            if not w.startswith("-") and "/" in p and not (ROOT / p).exists():
                return f"{p}: no such path in the repository"
        return None
    if c.kind == "script":
        script = next((w for w in c.argv if not w.startswith("-")), "")
        if not (ROOT / script).is_file():
            return f"{script}: no such script in the repository"
        proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        if proc.returncode:
            return f"bash -n {script}: {proc.stderr.strip()}"
        text = (ROOT / script).read_text()
        rest = c.argv[c.argv.index(script) + 1 :]
        unknown = [w for w in rest if w.startswith("--") and w.split("=")[0] not in text]
        if unknown:
            return f"{script} does not know the options {unknown}"
        for key in [rest[i + 1].split("=")[0] for i, w in enumerate(rest[:-1]) if w == "--set"]:
            problem = key_problem(key)
            if problem:
                return problem
    return None


def subcommands() -> frozenset[str]:
    """The subcommands `megarl --help` lists (the test process asks, to skip PENDING ones)."""
    from tests.docs_worker import subcommands as listed

    return listed()
