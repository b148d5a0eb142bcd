"""Prompt datasets: load rows, tokenize prompts once, keep the other columns for reward functions.

Sources (`load_rows`): a `.jsonl` / `.json` / `.parquet` / `.arrow` file, a directory of such
files (read in name order; `datasets.save_to_disk` writes a directory of `.arrow` files), or
`hf:NAME[:SPLIT]` / `hf:NAME:CONFIG:SPLIT` for a `datasets` dataset that is already in the local
cache. Parquet and Arrow need `pyarrow`, `hf:` needs `datasets`; each is imported
only when used. Every problem with the data itself raises `DataError` naming the file, row or
column (a user error: the command line prints it as one line).

A prompt is either a string (one user message) or a list of chat messages
(`[{"role": ..., "content": ...}, ...]`). With a chat template (and `apply_chat_template`), the
messages — preceded by `system_prompt` if given — are rendered with the generation prompt and
tokenized without extra special tokens (the template owns them). Without a template, a string
prompt is tokenized as is (with the tokenizer's own special tokens), `system_prompt` prepended as
plain text. Token ids are computed once here; rollout feeds them to the engine directly.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megarl.data.toy import toy_rows
from megarl.errors import MissingDependencyError, UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class DataError(UserError, ValueError):
    """A prompt source megarl cannot use; the message names the file, row or column."""


OVERLONG = ("error", "drop", "truncate-left")
EXTENSIONS = (".jsonl", ".json", ".parquet", ".arrow")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    path: str | None = None
    """Prompt source: a .jsonl/.json/.parquet/.arrow file, a directory of them (e.g. from
    `datasets.save_to_disk`), or `hf:NAME[:SPLIT]` (`hf:NAME:CONFIG:SPLIT`) for a locally cached
    `datasets` dataset. None: the embedded toy task (`megarl.data.toy`)."""

    prompt_key: str = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""

    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (when it has one)."""

    system_prompt: str | None = None
    """Optional system message put before every prompt."""

    max_prompt_length: int = 512
    """Longest prompt in tokens (after the chat template); see `overlong`."""

    overlong: str = "error"
    """What to do with a longer prompt (offline stages: a longer prompt + response, see
    `max_length`): `error`, `drop` it, or `truncate-left` (keep its end)."""

    shuffle: bool = True
    """Visit prompts in a seeded random order each epoch (else in file order)."""

    seed: int = 0
    """Seed of the per-epoch permutation (epoch e uses seed + e)."""

    prompts_per_step: int = 8
    """Prompts per optimizer step, global across data-parallel ranks (offline stages: rows,
    or preference pairs, per optimizer step)."""

    max_length: int | None = None
    """Offline stages (sft, dpo): longest prompt + response in tokens (see `overlong`, where
    truncate-left keeps a sequence's end); null = the model's max_position_embeddings."""

    def __post_init__(self) -> None:
        if not self.prompt_key:
            raise ValueError("data.prompt_key must be a non-empty column name")
        if self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if self.overlong not in OVERLONG:
            raise ValueError(f"data.overlong must be one of {OVERLONG}, got {self.overlong!r}")
        if self.prompts_per_step < 1:
            raise ValueError(f"data.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.seed < 0:
            raise ValueError(f"data.seed must be >= 0, got {self.seed}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"data.max_length must be null or >= 2, got {self.max_length}")
        if self.path is not None and not self.path:
            raise ValueError("data.path must be a file, a directory, 'hf:NAME[:SPLIT]' or None")


def load_rows(path: str | os.PathLike) -> list[dict]:
    """All rows of a prompt source as dicts (see the module docstring for the accepted forms)."""
    text = str(path)
    if text.startswith("hf:"):
        return _load_hf(text)
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in EXTENSIONS)
        if any(f.suffix == ".arrow" for f in files):  # `save_to_disk`: its .json are metadata
            files = [f for f in files if f.suffix == ".arrow"]
        if not files:
            present = sorted(f.name for f in p.iterdir())[:20]
            raise DataError(
                f"directory {text!r} holds no data files with extension {EXTENSIONS} "
                f"(found: {present})"
            )
        rows = [row for f in files for row in _load_file(f)]
    elif p.is_file():
        rows = _load_file(p)
    else:
        raise DataError(
            f"data path {text!r} does not exist (expected a {'/'.join(EXTENSIONS)} file, a "
            "directory of them, or 'hf:NAME[:SPLIT]')"
        )
    if not rows:
        raise DataError(f"data path {text!r} holds no rows")
    return rows


def _load_file(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return _read_jsonl(path, _read_text(path))
    if path.suffix == ".json":
        return _read_json(path)
    if path.suffix == ".arrow":
        return _read_arrow(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(
        f"data file {str(path)!r} has unknown extension {path.suffix!r}; accepted: {EXTENSIONS}"
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); a .jsonl/.json data file "
            "must be UTF-8 JSON"
        ) from None
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None


def _read_jsonl(path: Path, text: str) -> list[dict]:
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path}:{lineno}: invalid JSON ({err.msg}, column {err.colno})"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict]:
    """A list of objects, or a dict of equal-length columns; JSON lines in a .json file (what
    `datasets.Dataset.to_json` writes) are accepted too."""
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":
            return _read_jsonl(path, text)
        raise DataError(
            f"{path}:{err.lineno}: invalid JSON ({err.msg}, column {err.colno})"
        ) from None
    if isinstance(data, list):
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise DataError(f"{path}: item {i} is a {type(row).__name__}, expected an object")
        return data
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {k: len(v) for k, v in data.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"{path}: columns have different lengths {lengths}")
        keys = list(data)
        return [dict(zip(keys, values, strict=True)) for values in zip(*data.values(), strict=True)]
    raise DataError(
        f"{path}: expected a list of objects or an object of equal-length column lists, "
        f"got {type(data).__name__}"
    )


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise MissingDependencyError(
            f"reading {str(path)!r} needs pyarrow: pip install pyarrow (or convert it to .jsonl)"
        ) from err
    try:
        return pq.read_table(path).to_pylist()
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable parquet file ({err})") from None


def _read_arrow(path: Path) -> list[dict]:
    """An Arrow IPC stream file, as `datasets.save_to_disk` writes them (no `datasets` needed)."""
    try:
        import pyarrow as pa
    except ImportError as err:
        raise MissingDependencyError(
            f"reading {str(path)!r} needs pyarrow: pip install pyarrow"
        ) from err
    try:
        with pa.memory_map(str(path)) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(source).read_all()
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: not a readable Arrow file ({err})") from None
    return table.to_pylist()


def _load_hf(spec: str) -> list[dict]:
    parts = spec[len("hf:") :].split(":")
    if not parts[0] or len(parts) > 3:
        raise DataError(
            f"data path {spec!r}: expected 'hf:NAME', 'hf:NAME:SPLIT' or 'hf:NAME:CONFIG:SPLIT'"
        )
    name, config, split = parts[0], None, "train"
    if len(parts) == 2:
        split = parts[1]
    elif len(parts) == 3:
        config, split = parts[1], parts[2]
    try:
        import datasets
    except ImportError as err:
        raise MissingDependencyError(
            f"data path {spec!r} needs the `datasets` package: pip install datasets"
        ) from err
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as err:
        raise DataError(
            f"data path {spec!r}: datasets.load_dataset({name!r}, {config!r}, split={split!r}) "
            f"failed (is it in the local cache? set HF_DATASETS_OFFLINE=1 to stay offline): {err}"
        ) from err
    return [dict(row) for row in ds]


@dataclass(frozen=True)
class PromptBatch:
    """The prompts of one step (or one rank's share of it)."""

    indices: list[int]
    """Dataset indices (global prompt ids) of the prompts."""
    prompt_ids: list[list[int]]
    """Tokenized prompts (chat template applied)."""
    prompts: list[Any]
    """The raw prompt column values, for reward functions (`prompts=`)."""
    columns: dict[str, list]
    """The other dataset columns, one entry per prompt (reward functions' `**columns`)."""


class PromptDataset:
    """Rows with their prompts tokenized once.

    Attributes: `prompt_ids[i]` (token ids), `prompts[i]` (raw prompt value), `columns[name][i]`
    (every other column; None where a row lacks it), `source_rows[i]` (the row's index in the
    input, which differs from i after `overlong="drop"`), `num_dropped`, `num_truncated`.
    """

    def __init__(
        self,
        rows: list[dict],
        tokenizer: PreTrainedTokenizerBase,
        cfg: DataConfig,
        *,
        source: str | None = None,
    ) -> None:
        source = source or cfg.path or "<rows>"
        if not rows:
            raise DataError(f"no rows in {source}")
        key = cfg.prompt_key
        for i, row in enumerate(rows):
            if key not in row:
                raise DataError(
                    f"prompt column {key!r} missing from row {i} of {source}; columns present: "
                    f"{sorted(row)} (set data.prompt_key)"
                )
        ids = _tokenize([row[key] for row in rows], tokenizer, cfg, source)
        self.num_dropped = 0
        self.num_truncated = 0
        keep: list[int] = []
        limit = cfg.max_prompt_length
        for i, tokens in enumerate(ids):
            if len(tokens) > limit:
                if cfg.overlong == "error":
                    raise DataError(
                        f"prompt of row {i} in {source} is {len(tokens)} tokens, longer than "
                        f"data.max_prompt_length={limit} (set data.overlong to 'drop' or "
                        "'truncate-left', or raise the limit)"
                    )
                if cfg.overlong == "drop":
                    self.num_dropped += 1
                    continue
                ids[i] = tokens[-limit:]
                self.num_truncated += 1
            keep.append(i)
        if self.num_dropped or self.num_truncated:
            logger.warning(
                "%s: %d prompts over %d tokens dropped, %d truncated on the left",
                source,
                self.num_dropped,
                limit,
                self.num_truncated,
            )
        if not keep:
            raise DataError(f"every prompt in {source} is longer than {limit} tokens")

        names = list(dict.fromkeys(k for row in rows for k in row if k != key))
        self.source = source
        self.source_rows = keep
        self.prompt_ids = [ids[i] for i in keep]
        self.prompts = [rows[i][key] for i in keep]
        self.columns = {n: [rows[i].get(n) for i in keep] for n in names}

    @classmethod
    def from_config(cls, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> PromptDataset:
        """Load `cfg.path` (the toy task when None) and tokenize it."""
        if cfg.path is None:
            return cls(toy_rows(), tokenizer, cfg, source="<toy copy task>")
        return cls(load_rows(cfg.path), tokenizer, cfg, source=cfg.path)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def subset(self, indices: list[int]) -> PromptDataset:
        """The prompts at `indices`, in that order, as a dataset of their own."""
        out = copy.copy(self)
        out.prompt_ids = [self.prompt_ids[i] for i in indices]
        out.prompts = [self.prompts[i] for i in indices]
        out.columns = {n: [col[i] for i in indices] for n, col in self.columns.items()}
        out.source_rows = [self.source_rows[i] for i in indices]
        return out

    def batch(self, indices: list[int]) -> PromptBatch:
        """The prompts at `indices` (e.g. `PromptSampler.next_step()`)."""
        return PromptBatch(
            indices=list(indices),
            prompt_ids=[self.prompt_ids[i] for i in indices],
            prompts=[self.prompts[i] for i in indices],
            columns={n: [col[i] for i in indices] for n, col in self.columns.items()},
        )


def prompt_messages(prompt: Any, system_prompt: str | None, where: str) -> list[dict]:
    """A prompt (a string: one user message, or a list of chat messages) as chat messages,
    `system_prompt` first unless the prompt opens with a system message; raises `DataError`
    naming `where` for anything else."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = list(prompt)
    else:
        raise DataError(
            f"{where}: prompt must be a string or a list of chat messages "
            f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}"
        )
    if system_prompt is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def prompt_text(
    prompt: Any, tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, where: str
) -> tuple[str, bool]:
    """(the text a prompt is tokenized from, whether the tokenizer adds its special tokens):
    the chat template with the generation prompt when there is one (it owns the special
    tokens), else the string itself after `system_prompt`."""
    use_template = cfg.apply_chat_template and getattr(tokenizer, "chat_template", None)
    if use_template:
        messages = prompt_messages(prompt, cfg.system_prompt, where)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, False
    if isinstance(prompt, str):
        return (cfg.system_prompt or "") + prompt, True
    why = (
        "data.apply_chat_template is off"
        if not cfg.apply_chat_template
        else "the tokenizer has no chat template"
    )
    raise DataError(
        f"{where}: prompt is a {type(prompt).__name__} (chat messages?) but {why}; "
        "only string prompts can be tokenized without a template"
    )


def _tokenize(
    prompts: list[Any], tokenizer: PreTrainedTokenizerBase, cfg: DataConfig, source: str
) -> list[list[int]]:
    texts = []
    add_special = True
    for i, prompt in enumerate(prompts):
        text, add_special = prompt_text(prompt, tokenizer, cfg, f"row {i} of {source}")
        texts.append(text)
    try:
        return [list(x) for x in tokenizer(texts, add_special_tokens=add_special)["input_ids"]]
    except Exception:
        # Find the row that fails, to name it.
        for i, text in enumerate(texts):
            try:
                tokenizer(text, add_special_tokens=add_special)
            except Exception as err:
                raise DataError(
                    f"row {i} of {source}: cannot tokenize prompt {text[:80]!r}: {err}"
                ) from err
        raise
