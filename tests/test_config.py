"""YAML config loading: strict keys and types, dotted overrides, the embedded default."""

import pytest

from megarl.config import ConfigError, apply_override, load_config, to_dict


def test_default_config_loads_and_round_trips(tmp_path):
    cfg = load_config()
    assert cfg.algorithm.name == "grpo" and cfg.model.tokenizer == "toy"
    assert cfg.rollout.sampling.n == 16 and cfg.data.prompts_per_step == 32
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_config(str(path)) == cfg


def test_overrides_are_typed():
    cfg = load_config(None, ["algorithm.kl_coef=0.05", "trainer.steps=3", "rollout.sampling.n=4",
                             "reward.functions=[toy, format]", "algorithm.dual_clip=null"])
    assert cfg.algorithm.kl_coef == 0.05 and cfg.trainer.steps == 3 and cfg.rollout.sampling.n == 4
    assert cfg.reward.functions == ("toy", "format") and cfg.algorithm.dual_clip is None


@pytest.mark.parametrize(
    "override,expected",
    [
        ("algorithm.klcoef=0.1", "unknown config key algorithm.klcoef; accepted keys under "
                                 "algorithm: ["),
        ("trainer.steps=ten", "trainer.steps='ten': expected an integer"),
        ("algorithm.name=kto",
         "algorithm.name='kto'; accepted: ('grpo', 'ppo', 'distill', 'sft', 'dpo', 'rm')"),
        ("algorithm.agg_mode=mean", "algorithm.agg_mode='mean'; accepted"),
        ("optim.lr_decay_style=step", "optim.lr_decay_style='step'; accepted"),
        ("bogus=1", "unknown config key bogus; accepted keys: ["),
        ("precision.dtype=fp8", "precision.dtype='fp8'; accepted"),
        ("reward.on_error=ignore", "reward.on_error='ignore'; accepted: raise, zero"),
    ],
)
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert expected in str(e.value)


def test_cispo_keys_reach_the_loss_and_are_checked():
    alg = load_config(
        None,
        ["algorithm.policy_loss=cispo", "algorithm.cispo_clip_low=0.5",
         "algorithm.cispo_clip_high=2.0"],
    ).algorithm
    opts = alg.policy_loss_options
    assert (alg.policy_loss, opts.cispo_clip_low, opts.cispo_clip_high) == ("cispo", 0.5, 2.0)
    default = load_config(None, ["algorithm.policy_loss=cispo"]).algorithm.policy_loss_options
    assert (default.cispo_clip_low, default.cispo_clip_high) == (1.0, 4.0)
    for override, expected in [
        ("algorithm.cispo_clip_low=1.5", "algorithm.cispo_clip_low=1.5; accepted: 0 <= "),
        ("algorithm.cispo_clip_low=-0.1", "algorithm.cispo_clip_low=-0.1; accepted: 0 <= "),
        ("algorithm.cispo_clip_high=0", "algorithm.cispo_clip_high=0.0; accepted: > 0"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert expected in str(e.value)
    with pytest.raises(ConfigError, match="algorithm.dual_clip=3.0 with algorithm.policy_loss=c"):
        load_config(None, ["algorithm.policy_loss=cispo", "algorithm.dual_clip=3.0"])


def test_override_syntax():
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_override({}, "trainer.steps")


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/megarl.yaml")


def test_kl_in_reward_only_with_ppo():
    """A per-token KL penalty in the reward reaches the update only through GAE (PPO); with the
    GRPO family it would be silently dropped, so it is refused."""
    with pytest.raises(ConfigError, match="algorithm.kl_in=reward needs algorithm.name=ppo"):
        load_config(None, ["algorithm.kl_in=reward", "algorithm.kl_coef=0.01"])
    load_config(None, ["algorithm.name=ppo", "algorithm.kl_in=reward", "algorithm.kl_coef=0.01"])
    load_config(None, ["algorithm.kl_in=reward", "algorithm.kl_coef=0"])  # no KL: nothing lost


OLD_KEYS = [
    "rollout.n=4",
    "rollout.max_tokens=6",
    "rollout.kv_cache_memory_bytes=33554432",
    "rollout.placement=separate",
    "rollout.ranks=2",
    "algorithm.max_staleness=1",
    "rollout.inflight_updates=true",
]
NEW_KEYS = [
    "rollout.sampling.n=4",
    "rollout.sampling.max_tokens=6",
    "rollout.engine.kv_cache_memory_bytes=33554432",
    "rollout.placement.mode=separate",
    "rollout.placement.ranks=2",
    "rollout.placement.max_staleness=1",
    "rollout.placement.inflight_updates=true",
]


def test_the_flat_rollout_keys_of_earlier_releases_still_load_and_name_their_new_key(
    tmp_path, caplog
):
    """Overrides and a config file with the flat keys load to the config the new keys give,
    with one warning per key naming its new one; a key given both ways keeps the new one."""
    new = load_config(None, NEW_KEYS)
    with caplog.at_level("WARNING", logger="megarl"):
        old = load_config(None, OLD_KEYS)
    assert to_dict(old) == to_dict(new) and old.rollout.placement.max_staleness == 1
    warned = [r.getMessage() for r in caplog.records if "config key" in r.getMessage()]
    assert len(warned) == len(OLD_KEYS)
    assert "config key rollout.placement is now rollout.placement.mode;" in warned[3]
    assert "config key algorithm.max_staleness is now rollout.placement.max_staleness;" in "".join(
        warned
    )
    path = tmp_path / "old.yaml"
    path.write_text(
        "model: {config: {architectures: [LlamaForCausalLM], model_type: llama, vocab_size: 20,"
        " hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, num_attention_heads: 2,"
        " num_key_value_heads: 2, max_position_embeddings: 64}, tokenizer: toy}\n"
        "rollout:\n  ranks: 2\n  placement: separate\n  n: 4\n  sampling: {n: 3}\n"
        "algorithm: {max_staleness: 1}\n"
    )
    from_file = load_config(str(path))
    assert from_file.rollout.placement.mode == "separate" and from_file.rollout.placement.ranks == 2
    assert from_file.rollout.sampling.n == 3  # the new key wins
    assert from_file.rollout.placement.max_staleness == 1


def test_inflight_updates_need_generation_ahead_of_training():
    with pytest.raises(ConfigError, match="inflight_updates with rollout.placement.mode=separate"):
        load_config(
            None, ["rollout.placement.mode=separate", "rollout.placement.inflight_updates=true"]
        )


def test_one_model_override_replaces_the_files_source():
    """A user's model on the default task takes one override: `--set model.hf=DIR` replaces the
    embedded default's inline model.config (and an example's model.mcore_ckpt); the rest of the
    model section stays. Two sources set by overrides are still refused."""
    cfg = load_config(None, ["model.hf=/some/dir"])
    assert (cfg.model.hf, cfg.model.config, cfg.model.mcore_ckpt) == ("/some/dir", None, None)
    assert cfg.model.tokenizer == "toy" and cfg.model.init_seed == 1234
    example = "examples/grpo_llama3_70b_fp8.yaml"
    assert load_config(example).model.mcore_ckpt is not None
    cfg = load_config(example, ["model.hf=/models/llama3-70b"])
    assert (cfg.model.hf, cfg.model.mcore_ckpt) == ("/models/llama3-70b", None)
    with pytest.raises(ConfigError, match=r"exactly one of .*; got \['hf', 'mcore_ckpt'\]"):
        load_config(None, ["model.hf=/a", "model.mcore_ckpt=/b"])
    with pytest.raises(ConfigError, match=r"exactly one of .*; got none"):
        load_config(None, ["model.config=null"])


ENV_ONLY = ["reward.functions=[]", "reward.weights=null"]


@pytest.mark.parametrize(
    "env", ["env.name=tests.envs_for_tests:CopyAgain", "env.agent=tests.envs_for_tests:copy_agent"]
)
def test_an_environment_or_agent_reward_alone_is_accepted(env):
    cfg = load_config(None, [*ENV_ONLY, env])
    assert cfg.reward.functions == () and cfg.reward.model is None and cfg.env.multi_turn
    with pytest.raises(ConfigError, match=r"no environment reward; .*reward.env_weight != 0 \(got"):
        load_config(None, [*ENV_ONLY, env, "reward.env_weight=0"])


def test_no_reward_at_all_is_refused():
    with pytest.raises(ConfigError, match="no reward.functions, no reward.model, no reward.judge"):
        load_config(None, ENV_ONLY)


def test_generating_ahead_needs_separate_engines():
    """docs/placement.md: max_staleness > 0 with colocated engines is refused by name (they share
    the trainer's devices); separate engines take it."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.placement.max_staleness=1"])
    assert "rollout.placement.max_staleness=1 with mode=colocated" in str(e.value)
    assert "accepted: mode=separate, or max_staleness=0" in str(e.value)
    overrides = ["rollout.placement.max_staleness=1", "rollout.placement.mode=separate"]
    assert load_config(None, overrides).rollout.placement.max_staleness == 1
