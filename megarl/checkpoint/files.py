"""What a megarl checkpoint directory holds besides megatron's `dist_checkpointing` files, and
the listing of a run's checkpoints.

Two kinds of directory:
- a converter checkpoint (`megarl convert hf-to-mcore`, `writer.save_model_checkpoint`): one
  model, described by `megarl_model.json` (`META`: format tag `FORMAT`, the HF config, dtype,
  vocab padding, whether the output layer is a scalar head, the layout it was written from);
- a trainer checkpoint `RUN/checkpoints/step_000042/` (`training.save`): every trained role
  under its prefix plus `trainer_state.json` (`STATE_FILE`: format tag `STATE_FORMAT`, step,
  sampler, schedulers, model config, torch's RNG state as base64). Checkpoints written before
  the JSON state hold `trainer_state.pt` (`LEGACY_STATE_FILE`), read with
  `torch.load(weights_only=True)` (plain containers, numbers, strings and tensors only) and
  refused, naming the file, if it holds anything else.

Both files are JSON (no pickle), so reading them runs no code. `IncompleteCheckpoint` marks a
directory that a save left cut short or a disk damaged (a resume skips it, `vetting.resumable`);
any other `CheckpointError` is a whole checkpoint that cannot be used.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import re
import shutil

import torch

from megarl.errors import UserError

log = logging.getLogger(__name__)

META = "megarl_model.json"
FORMAT = "megarl-mcore/1"
STATE_FILE = "trainer_state.json"
LEGACY_STATE_FILE = "trainer_state.pt"  # a pickle, written by megarl before the JSON state
STATE_FORMAT = "megarl-trainer-state/1"
STATE_KEYS = ("step", "sampler", "arch", "torch_rng")
"""Keys every trainer state holds; besides them `<role>_sched` per trained role (`actor_sched`,
`critic_sched`, `reward_sched`), `archs` for a role built from another model, and
`reward_model_stats` (running reward-model statistics)."""
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be written or loaded; the message names the file or key."""


class IncompleteCheckpoint(CheckpointError):
    """A checkpoint with a missing, truncated or unreadable file (a save cut short, a damaged
    disk): a resume skips it for the one before (`megarl.checkpoint.vetting.resumable`)."""


# --------------------------------------------------------------------------- converter checkpoints
def read_checkpoint_meta(ckpt_dir: str | os.PathLike) -> dict:
    path = os.path.join(os.fspath(ckpt_dir), META)
    if not os.path.exists(path):
        raise CheckpointError(
            f"{ckpt_dir}: no {META}; not a megarl megatron checkpoint (write one with "
            "`tools/convert.py hf-to-mcore` or the trainer)"
        )
    try:
        with open(path) as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a JSON object ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}; expected {FORMAT!r}")
    if not os.path.exists(os.path.join(os.fspath(ckpt_dir), "metadata.json")):
        raise CheckpointError(f"{ckpt_dir}: megatron's metadata.json is missing (incomplete save)")
    return meta


# --------------------------------------------------------------------------- trainer checkpoints
def is_trainer_checkpoint(path: str) -> bool:
    """Whether directory `path` holds a trainer state (of either format)."""
    return any(os.path.exists(os.path.join(path, f)) for f in (STATE_FILE, LEGACY_STATE_FILE))


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, directory) of every checkpoint in `run_dir/checkpoints` that has a trainer state,
    oldest first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and is_trainer_checkpoint(os.path.join(root, name)):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def latest_checkpoint(run_dir: str) -> str | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def write_trainer_state(path: str, trainer_state: dict) -> None:
    """JSON: plain values only, so reading it back can run no code. A value that is not plain
    fails here, at the first save, not at the resume."""
    rng = torch.get_rng_state().numpy().tobytes()
    state = {
        "format": STATE_FORMAT,
        **trainer_state,
        "torch_rng": base64.b64encode(rng).decode("ascii"),
    }
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, indent=1)
    os.replace(path + ".tmp", path)


def read_trainer_state(path: str) -> dict:
    """The trainer state of checkpoint directory `path` (`torch_rng` as a uint8 tensor); raises
    `CheckpointError` naming the file when it is missing, malformed or unsafe to read."""
    state_file = os.path.join(path, STATE_FILE)
    if os.path.exists(state_file):
        try:
            with open(state_file) as f:
                state = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise IncompleteCheckpoint(
                f"{state_file}: not a readable megarl trainer state ({e})"
            ) from e
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"{state_file}: format {got!r}; expected {STATE_FORMAT!r}")
        try:
            rng = base64.b64decode(state["torch_rng"], validate=True)
        except (KeyError, TypeError, ValueError) as e:
            raise IncompleteCheckpoint(f"{state_file}: torch_rng is not base64 bytes ({e})") from e
        state["torch_rng"] = torch.frombuffer(bytearray(rng), dtype=torch.uint8)
    elif os.path.exists(os.path.join(path, LEGACY_STATE_FILE)):
        state_file = os.path.join(path, LEGACY_STATE_FILE)
        state = _read_legacy_state(state_file, path)
    else:
        raise IncompleteCheckpoint(f"{path} is not a complete megarl checkpoint (no {STATE_FILE})")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise IncompleteCheckpoint(f"{state_file}: keys {missing} are missing")
    return state


def _read_legacy_state(state_file: str, path: str) -> dict:
    """A pickled `trainer_state.pt` of an older megarl, read without running code."""
    try:
        state = torch.load(state_file, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a page long; its "Unsupported global: GLOBAL x" names the culprit
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        why = f"it refers to {found.group(1)}" if found else str(e).splitlines()[0]
        raise CheckpointError(
            f"{state_file}: refusing to load this old-format (pickled) trainer state: it holds "
            f"more than the tensors, numbers, strings, lists and dicts megarl writes ({why}), "
            "so it may have been tampered with and loading it could run code. Delete the "
            f"checkpoint {path} to resume from the one before it, or start a new run directory "
            "(--out) or set trainer.resume=false"
        ) from None
    except (OSError, RuntimeError, EOFError) as e:
        raise IncompleteCheckpoint(f"{state_file}: not a readable trainer state ({e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_file}: expected a dict, got {type(state).__name__}")
    log.warning(
        "%s: old-format trainer state, read safely (weights_only); the next save writes %s",
        state_file,
        STATE_FILE,
    )
    return state


# ----------------------------------------------------------------------------- directories
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""The files of a tokenizer (and its generation config) a model directory may hold."""
HF_INDEX = "model.safetensors.index.json"


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer (and generation config) files present in `src` to `dst`."""
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(dst, name))
            copied.append(name)
    if not copied:
        log.warning("no tokenizer files in %s (looked for %s)", src, ", ".join(TOKENIZER_FILES))
    return copied


def looks_like_checkpoint(directory: str) -> bool:
    """True when `directory` holds an HF or megatron checkpoint (what --overwrite guards)."""
    if not os.path.isdir(directory):
        return False
    names = os.listdir(directory)
    markers = ("config.json", HF_INDEX, "metadata.json", META)
    return any(n in markers or n.endswith(".safetensors") for n in names)
