"""The rollout a run builds: its settings resolved and checked before any model exists
(`resolve`), then the component of `rollout.placement.mode` (`build_rollout`)."""

from __future__ import annotations

import dataclasses
import logging

from megarl.distributed.placement import Job
from megarl.distributed.topology import Groups
from megarl.envs.config import EnvConfig
from megarl.models.hf_config import ModelArch
from megarl.models.lora import LoraConfig
from megarl.rollout.api import RolloutComponent
from megarl.rollout.config import RolloutConfig
from megarl.rollout.engine.checks import check_kv_cache, require_vllm
from megarl.rollout.engine.routes import check_routing_replay
from megarl.rollout.engine.stop_tokens import resolve_stop_tokens
from megarl.rollout.multi_turn.runner import Trajectories

log = logging.getLogger("megarl")


def resolve(
    cfg: RolloutConfig, arch: ModelArch, tokenizer, *, dtype: str, gpu: bool, model_dirs=()
) -> RolloutConfig:
    """`cfg` with its stop tokens resolved (None = the model's EOS ids, from the tokenizer, the
    config and any generation_config.json in `model_dirs`), after checking that vLLM is
    importable, that the KV cache holds one whole sequence and that routing replay has experts
    to replay."""
    given = cfg.sampling.stop_token_ids
    stop = resolve_stop_tokens(given, tokenizer, arch.hf_config, list(model_dirs))
    if given is None:
        log.info(
            "rollout.sampling.stop_token_ids: %s (the model's EOS ids)", list(stop) or "none found"
        )
    cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, stop_token_ids=stop))
    check_kv_cache(arch, cfg.engine, dtype=dtype, gpu=gpu)
    check_routing_replay(arch, cfg.engine)
    require_vllm()
    return cfg


def build_rollout(
    cfg: RolloutConfig,
    job: Job,
    *,
    arch: ModelArch,
    policy: list,
    groups: Groups,
    dtype: str,
    out_dir: str,
    lora: LoraConfig | None = None,
    env: EnvConfig | None = None,
    trajectories: Trajectories | None = None,
    tokenizer=None,
    system_prompt: str | None = None,
) -> RolloutComponent:
    """The rollout of `cfg.placement.mode` for the policy whose chunks on this rank are `policy`:
    colocated engines, or the separate engine ranks of `job` (waiting in `serve`). `lora`: the
    policy's adapters; `env` with `trajectories` (`load_trajectories`): every sample a
    trajectory (on separate engines the engine ranks load them from `env` and `tokenizer`).
    Collective over the trainer ranks."""
    if job.placement.separate:
        from megarl.rollout.placement.separate import SeparateRollout  # deferred: imports vLLM

        return SeparateRollout.connect(
            cfg, arch, policy, groups, dtype, job, lora=lora,
            env=env if trajectories is not None else None, tokenizer=tokenizer,
            system_prompt=system_prompt,
        )  # fmt: skip
    from megarl.rollout.placement.colocated import ColocatedRollout  # deferred: imports vLLM

    return ColocatedRollout.build(
        cfg, arch, policy, groups, out_dir, dtype, lora=lora, trajectories=trajectories,
        env=env, system_prompt=system_prompt,
    )  # fmt: skip
