"""Checkpoint directories are untrusted input: reading one must not run code.

The trainer state is JSON; an old pickled `trainer_state.pt` is read with weights_only and
refused when it holds a payload; torch.distributed.checkpoint's pickled `.metadata` is vetted
before megatron reads it. Every payload here is live: plain unpickling runs it (checked)."""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle

import pytest
import torch

from megarl.checkpoint import files
from megarl.checkpoint.files import CheckpointError
from megarl.checkpoint.vetting import check_dcp_metadata


class _Payload:
    """Unpickling it creates the file `marker` (stands for any code an attacker picks)."""

    def __init__(self, marker):
        self.marker = pathlib.Path(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def write_payload_pickle(path, marker) -> None:
    """A legacy-format trainer state whose unpickling runs code."""
    torch.save({"step": 1, "sampler": _Payload(marker), "torch_rng": torch.get_rng_state()}, path)


def _plain_state() -> dict:
    return {
        "step": 3,
        "sampler": {"epoch": 0, "position": 3, "steps": 3, "num_rows": 9, "prompts_per_step": 1,
                    "seed": 0, "shuffle": True},
        "actor_sched": {"max_lr": 1e-3, "num_steps": 3, "lr_decay_style": "cosine"},
        "arch": {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5, "vocab_size": 15},
    }


def test_trainer_state_is_json_and_exact(tmp_path):
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    files.write_trainer_state(str(tmp_path / files.STATE_FILE), _plain_state())
    with open(tmp_path / files.STATE_FILE) as f:
        assert json.load(f)["format"] == files.STATE_FORMAT
    state = files.read_trainer_state(str(tmp_path))
    assert torch.equal(state.pop("torch_rng"), rng)
    assert {k: state[k] for k in _plain_state()} == _plain_state()
    torch.set_rng_state(files.read_trainer_state(str(tmp_path))["torch_rng"])
    a = torch.rand(4)
    torch.set_rng_state(rng)
    assert torch.equal(a, torch.rand(4))


def test_a_value_that_is_not_plain_fails_at_save(tmp_path):
    with pytest.raises(TypeError):
        files.write_trainer_state(str(tmp_path / "s.json"), {"x": object()})


def test_old_pt_state_is_read_without_pickle_code(tmp_path):
    torch.save({**_plain_state(), "torch_rng": torch.get_rng_state()},
               tmp_path / files.LEGACY_STATE_FILE)
    state = files.read_trainer_state(str(tmp_path))
    assert state["step"] == 3 and state["arch"] == _plain_state()["arch"]
    assert files.list_checkpoints(str(tmp_path)) == []  # not under checkpoints/step_N


def test_tampered_old_pt_state_is_refused(tmp_path):
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Payload(control)))
    assert control.exists(), "the payload must be live for this test to mean anything"
    marker = tmp_path / "pwned"
    write_payload_pickle(tmp_path / files.LEGACY_STATE_FILE, marker)
    with pytest.raises(CheckpointError) as e:
        files.read_trainer_state(str(tmp_path))
    assert not marker.exists()
    msg = str(e.value)
    assert str(tmp_path / files.LEGACY_STATE_FILE) in msg and "refusing to load" in msg
    assert "it refers to getattr" in msg  # how the payload reaches Path.touch


def test_malformed_json_state_names_the_file(tmp_path):
    (tmp_path / files.STATE_FILE).write_text('{"format": "megarl-trainer-state/1", "step"')
    with pytest.raises(CheckpointError, match="trainer_state.json: not a readable"):
        files.read_trainer_state(str(tmp_path))
    (tmp_path / files.STATE_FILE).write_text('{"format": "something-else"}')
    with pytest.raises(CheckpointError, match="format 'something-else'"):
        files.read_trainer_state(str(tmp_path))
    os.remove(tmp_path / files.STATE_FILE)
    with pytest.raises(CheckpointError, match="not a complete megarl checkpoint"):
        files.read_trainer_state(str(tmp_path))


def test_dcp_metadata_is_vetted(tmp_path):
    import torch.distributed.checkpoint as dcp

    good = tmp_path / "good"
    dcp.save({"w": torch.ones(3), "extra": io.BytesIO(b"x")}, checkpoint_id=str(good))
    check_dcp_metadata(good)  # a real torch.distributed.checkpoint record passes
    bad = tmp_path / "bad"
    bad.mkdir()
    marker = tmp_path / "pwned"
    (bad / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match=r"bad/\.metadata: refusing to load"):
        check_dcp_metadata(bad)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="no .metadata"):
        check_dcp_metadata(tmp_path)
