"""YAML config loading: strict keys and types, dotted overrides, the embedded default."""

import pytest

from megarl.config import ConfigError, apply_override, load_config, to_dict


def test_default_config_loads_and_round_trips(tmp_path):
    cfg = load_config()
    assert cfg.algorithm.name == "grpo" and cfg.model.tokenizer == "toy"
    assert cfg.rollout.n == 16 and cfg.data.prompts_per_step == 32
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    assert load_config(str(path)) == cfg


def test_overrides_are_typed():
    cfg = load_config(None, ["algorithm.kl_coef=0.05", "trainer.steps=3", "rollout.n=4",
                             "reward.functions=[toy, format]", "algorithm.dual_clip=null"])
    assert cfg.algorithm.kl_coef == 0.05 and cfg.trainer.steps == 3 and cfg.rollout.n == 4
    assert cfg.reward.functions == ("toy", "format") and cfg.algorithm.dual_clip is None


@pytest.mark.parametrize(
    "override,expected",
    [
        ("algorithm.klcoef=0.1", "unknown config key algorithm.klcoef; accepted keys under "
                                 "algorithm: ["),
        ("trainer.steps=ten", "trainer.steps='ten': expected an integer"),
        ("algorithm.name=kto",
         "algorithm.name='kto'; accepted: ('grpo', 'ppo', 'sft', 'dpo', 'rm')"),
        ("algorithm.agg_mode=mean", "algorithm.agg_mode='mean'; accepted"),
        ("optim.lr_decay_style=step", "optim.lr_decay_style='step'; accepted"),
        ("bogus=1", "unknown config key bogus; accepted keys: ["),
        ("precision.dtype=fp8", "precision.dtype='fp8'; accepted"),
        ("reward.on_error=ignore", "reward.on_error='ignore'; accepted: raise, zero"),
        ("model.hf=/some/dir", "exactly one of model.hf, model.mcore_ckpt, model.config"),
    ],
)
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert expected in str(e.value)


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
