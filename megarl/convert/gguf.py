"""GGUF model files (llama.cpp) -> complete Hugging Face directories, dequantized to fp32.

Assumes transformers' GGUF loader (it needs the `gguf` and `accelerate` packages): it reads the
metadata into an HF config, rebuilds the tokenizer and its chat template, and dequantizes every
tensor (Q4_0, Q4_1, Q8_0, K-quants, F16, ...) to fp32, undoing llama.cpp's Q/K row permutation.
transformers refuses `save_pretrained` on a model it loaded from GGUF, so the state dict is moved
into a model built (on the meta device, no init) from the same config without its
`quantization_config`, and that model is saved: fp32 safetensors, config.json, generation_config
.json, tokenizer files and chat template. Tied embeddings stay tied (no `lm_head.weight` file
entry). The weights are the quantized ones made float: a 4-bit GGUF gives 4-bit-precision values
in fp32, not the original checkpoint's weights.

The output is written under a hidden temporary name and renamed (`AtomicDir`). A file that is not
GGUF (checked by its magic bytes) or holds an architecture megarl cannot build is refused before
any tensor is read. `cached_hf_dir` keeps one conversion per file content (sha256) under
`$MEGARL_CACHE/gguf/` (default `~/.cache/megarl`), complete when its marker file is present.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import time

from megarl.convert.hf_write import AtomicDir
from megarl.convert.verify import compare_logits, hf_logits, sample_tokens
from megarl.errors import UserError
from megarl.models.hf_config import ARCHITECTURES, MODEL_TYPES, ModelConfigError, arch_from_hf

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
MARKER = "megarl_gguf.json"
"""Written last into a converted directory: the source file's sha256 and size."""
ACCEPTED = (
    "a llama.cpp GGUF model file (.gguf, starting with the bytes 'GGUF') of a model megarl "
    f"builds: {', '.join(sorted(MODEL_TYPES))} (transformers' {', '.join(sorted(ARCHITECTURES))})"
)


class GGUFError(UserError, ValueError):
    """A GGUF file megarl cannot use; the message names the file and what is accepted."""


def cache_root() -> str:
    """`$MEGARL_CACHE`, default `~/.cache/megarl`: converted GGUF files and downloads."""
    return os.path.abspath(
        os.path.expanduser(os.environ.get("MEGARL_CACHE") or os.path.join("~", ".cache", "megarl"))
    )


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a regular file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def check_gguf_file(path: str | os.PathLike) -> str:
    """The absolute path of `path` if it is a GGUF file; `GGUFError` naming it otherwise."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise GGUFError(f"{path} {what}; accepted: {ACCEPTED}")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {head!r}); accepted: {ACCEPTED}")
    return path


def sha256_file(path: str | os.PathLike, chunk: int = 2**22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _split(path: str) -> tuple[str, str]:
    return os.path.dirname(path), os.path.basename(path)


def _load_config(path: str):
    """transformers' config of the GGUF file (metadata only), checked to be buildable."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(_split(path)[0], gguf_file=_split(path)[1])
    except (ValueError, KeyError, OSError) as e:
        raise GGUFError(
            f"{path}: transformers cannot read this GGUF file ({str(e).splitlines()[0]}); "
            f"accepted: {ACCEPTED}"
        ) from None
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    if config.model_type not in MODEL_TYPES:
        raise GGUFError(
            f"{path}: a GGUF file of a {config.model_type!r} model, which megarl cannot build; "
            f"accepted: {ACCEPTED}"
        )
    try:
        arch_from_hf(config.to_dict(), where=path)
    except ModelConfigError as e:  # a supported family with a setting megarl cannot map
        raise GGUFError(str(e)) from None
    return config


def gguf_hf_config(path: str | os.PathLike) -> dict:
    """The HF config (as a dict) of a GGUF file, from its metadata only (no tensor is read);
    what a dry run or a plan needs. Raises `GGUFError` like `gguf_to_hf`."""
    path = check_gguf_file(path)
    cfg = _load_config(path).to_dict()
    if not cfg.get("architectures"):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg["model_type"]]]
    return cfg


def gguf_to_hf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    sha256: str | None = None,
    verify: bool = False,
    text: str | None = None,
    seq_len: int | None = None,
) -> dict:
    """Write the dequantized (fp32) HF directory of `gguf_path` into `out_dir`; returns a summary.

    `out_dir` is refused when it holds files, unless `overwrite`. `sha256` (computed when None)
    is recorded in the marker file. `verify`: the summary's `verify` compares (as
    `megarl.convert.verify.compare_logits`) the logits of transformers' GGUF-loaded model with
    those of the written directory loaded back, on `seq_len` seeded random tokens (default 32)
    or the first `seq_len` tokens of `text`."""
    t0 = time.perf_counter()
    path = check_gguf_file(gguf_path)
    config = _load_config(path)  # refuses an unbuildable model before any tensor is read
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = AtomicDir(out_dir, overwrite=overwrite)
    try:
        folder, name = _split(path)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        log.info("dequantizing %s (transformers' GGUF loader)", path)
        quantized = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
        if verify:
            tokens = _verify_tokens(config, tokenizer, text, seq_len)
            with torch.no_grad():
                ref = quantized.eval()(input_ids=tokens).logits.float()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict(), assign=True, strict=True)
        model.tie_weights()
        del quantized
        model.save_pretrained(out.tmp)
        del model
        tokenizer.save_pretrained(out.tmp)
        ids = {
            k: getattr(tokenizer, k, None)
            if getattr(tokenizer, k, None) is not None
            else getattr(config, k, None)
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        }
        GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(out.tmp)
        _drop_source_name(os.path.join(out.tmp, "config.json"))
        marker = {
            "source": path,
            "sha256": sha256 or sha256_file(path),
            "bytes": os.path.getsize(path),
            "dequantized_to": "float32",
        }
        with open(os.path.join(out.tmp, MARKER), "w") as f:
            json.dump(marker, f, indent=1)
        _readable(out.tmp)
        checked = {}
        if verify:  # the directory as written, loaded back
            checked = compare_logits(ref, hf_logits(out.tmp, tokens))
            checked["tokens"] = int(tokens.shape[1])
        out.commit()
    except BaseException:
        out.abort()
        raise
    summary = {
        "seconds": time.perf_counter() - t0,
        "family": arch_from_hf(out.out).family,
        "tied_embeddings": bool(config.tie_word_embeddings),
        "chat_template": tokenizer.chat_template is not None,
        **ids,
    }
    if verify:
        summary["verify"] = checked
    return summary


def _verify_tokens(config, tokenizer, text: str | None, seq_len: int | None):
    """[1, s] token ids: the first `seq_len` of `text`, or `seq_len` seeded random ones."""
    import torch

    longest = min(seq_len or config.max_position_embeddings, config.max_position_embeddings)
    if text is None:
        return sample_tokens(config.vocab_size, batch=1, seq_len=min(seq_len or 32, longest))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:longest]
    if not ids:
        raise ValueError("verify: the text has no tokens")
    return torch.tensor([ids])


def _readable(directory: str) -> None:
    """Files as the umask makes them (transformers writes the weights through a 0600 temp
    file), so a cache or output directory shared with others is readable by them."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666 & ~umask)


def _drop_source_name(config_json: str) -> None:
    """transformers records the GGUF's `general.name` as `_model_name_or_path`: not a path."""
    with open(config_json) as f:
        cfg = json.load(f)
    if cfg.pop("_model_name_or_path", None) is not None:
        with open(config_json, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)


def cached_hf_dir(gguf_path: str | os.PathLike, *, convert: bool = True) -> str:
    """The HF directory of `gguf_path` in the cache (`$MEGARL_CACHE/gguf/<sha256[:16]>/`),
    converting it first when no complete entry exists (`convert=False`: raise instead). Not
    collective: in a multi-rank run one rank calls it, the others wait (see
    `megarl.trainer.model_source`)."""
    path = check_gguf_file(gguf_path)
    digest = sha256_file(path)
    entry = os.path.join(cache_root(), "gguf", digest[:16])
    if _complete(entry, digest):
        log.info("model.hf %s: cached HF directory %s", path, entry)
        return entry
    if not convert:
        raise GGUFError(f"{path}: no complete converted copy in {entry}")
    if os.path.exists(entry):  # an entry without its marker (or another file's): redo it
        shutil.rmtree(entry, ignore_errors=True)
    log.warning(
        "converting %s (GGUF, dequantized to fp32) into the cache %s; later runs reuse it",
        path,
        entry,
    )
    try:
        gguf_to_hf(path, entry, sha256=digest)
    except OSError:
        if not _complete(entry, digest):  # not a concurrent conversion that finished first
            raise
    return entry


def _complete(entry: str, digest: str) -> bool:
    try:
        with open(os.path.join(entry, MARKER)) as f:
            return json.load(f).get("sha256") == digest
    except (OSError, ValueError, AttributeError):
        return False
