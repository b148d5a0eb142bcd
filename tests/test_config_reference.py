"""`megarl config --reference` and docs/config.md: every key documented, the file current."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

from megarl.config import load_config
from megarl.config_reference import REGENERATE, reference_markdown, sections, undocumented

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "config.md")


def test_every_key_has_a_docstring():
    assert undocumented() == [], (
        "config fields without a docstring (add one under each field): " + ", ".join(undocumented())
    )


def test_every_key_of_the_resolved_config_is_listed():
    text = reference_markdown()
    cfg = load_config()

    def keys(prefix, obj):  # a dataclass-valued field is a nested section (model.lora.rank)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from keys(f"{prefix}.{f.name}", value)
            else:
                yield f"{prefix}.{f.name}"

    for name, _, _ in sections():
        for key in keys(name, getattr(cfg, name)):
            assert f"- `{key}` (" in text, key
    assert "- `model.lora.rank` (int, default `0`): " in text
    assert "- `rollout.sampling.n` (int, default `8`): Samples per prompt." in text
    assert "- `optim.decay_steps` (int | null, default `null`): " in text
    assert "- `reward.functions` (list[str] | null, default `null`): " in text
    assert "## `rollout`: `RolloutConfig` in `megarl/rollout/config.py`" in text


def test_docs_config_md_is_current():
    with open(DOC, encoding="utf-8") as f:
        current = f.read()
    assert current == reference_markdown(), (
        f"docs/config.md is stale (a config field or its docstring changed); regenerate it "
        f"from the repository root with:  {REGENERATE}"
    )


def test_cli_prints_the_reference():
    proc = subprocess.run(
        [sys.executable, "-m", "megarl", "config", "--reference"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == reference_markdown()
