"""The trainer section's checks across fields: settings that only one algorithm uses."""

import pytest

from trainer_svc.config import TrainerConfig
from turnrl.config import load_config_data, validate_config
from turnrl.errors import ConfigError


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        (
            {"critic": {"optim": {"learning_rate": 1e-4}}},
            "critic is set but algorithm.advantage_estimator is 'grpo'; only gae and turn_gae "
            "train a critic",
        ),
        (
            {"algorithm": {"advantage_estimator": "rloo", "gae_lambda": 0.95}},
            "gae_lambda=0.95 is set but advantage_estimator is 'rloo'",
        ),
        (
            {
                "steps": 3,
                "algorithm": {"advantage_estimator": "gae"},
                "critic": {"critic_only_steps": 3},
            },
            "critic.critic_only_steps=3 leaves no step of the 3 (steps)",
        ),
        (
            {"async_loop": {"max_staleness": 4}},
            "async_loop is set but loop is 'sync'",
        ),
        (
            {"algorithm": {"advantage_estimator": "turn_grpo"}, "critic": {"critic_only_steps": 1}},
            "critic is set but algorithm.advantage_estimator is 'turn_grpo'",
        ),
        (
            {"algorithm": {"advantage_estimator": "turn_grpo", "gae_lambda": 0.9}},
            "gae_lambda=0.9 is set but advantage_estimator is 'turn_grpo'; gae and turn_gae",
        ),
        (
            {"algorithm": {"advantage_estimator": "grpo", "turn_gamma": 0.9}},
            "turn_gamma=0.9 is set but advantage_estimator is 'grpo'; the turn_* estimators",
        ),
        (
            {"algorithm": {"advantage_estimator": "turn_reinforce_plus_plus", "gamma": 0.9}},
            "gamma=0.9 is set but advantage_estimator is 'turn_reinforce_plus_plus'; turn_* "
            "estimators discount per turn: turn_gamma",
        ),
        (
            {
                "steps": 2,
                "algorithm": {"advantage_estimator": "turn_gae"},
                "critic": {"critic_only_steps": 2},
            },
            "critic.critic_only_steps=2 leaves no step of the 2 (steps)",
        ),
        (
            {"algorithm": {"advantage_estimator": "turn_ppo"}},
            "'turn_dr_grpo' or 'turn_gae'",
        ),
        ({"loop": "async", "mode": "sft"}, "loop: async is an RL loop"),
        ({"loop": "async", "async_loop": {"max_staleness": -1}}, "greater than or equal to 0"),
        ({"mode": "sft", "judge_training": {}}, "a judge is co-trained by RL runs only"),
        (
            {
                "algorithm": {"advantage_estimator": "gae"},
                "judge_training": {"model_path": "j", "rollout_service": {"address": "h:1"}},
            },
            "a judge of its own has no critic",
        ),
    ],
)
def test_settings_of_another_algorithm_are_config_errors(trainer, message):
    with pytest.raises(ConfigError, match="invalid config") as info:
        validate_config(TrainerConfig, trainer, path=None, overrides={})
    assert message in str(info.value)


def test_defaults_given_explicitly_are_no_settings_of_another_algorithm():
    # `turnrl run` dumps the config and validates it again, with every field written out.
    dumped = TrainerConfig().model_dump(mode="json")
    assert validate_config(TrainerConfig, dumped, path=None, overrides={}) == TrainerConfig()


def test_a_turn_gae_config_validates_with_its_critic_and_turn_rewards():
    trainer = {
        "steps": 3,
        "algorithm": {
            "advantage_estimator": "turn_gae",
            "turn_gamma": 0.9,
            "gae_lambda": 0.95,
            "enable_turn_rewards": True,
        },
        "critic": {"optim": {"learning_rate": 1e-4}, "critic_only_steps": 1},
    }
    config = validate_config(TrainerConfig, trainer, path=None, overrides={})
    assert config.algorithm.trains_critic and config.algorithm.turn_level
    assert (config.algorithm.turn_gamma, config.algorithm.enable_turn_rewards) == (0.9, True)
    dumped = config.model_dump(mode="json")  # `turnrl run` validates its dump again
    assert validate_config(TrainerConfig, dumped, path=None, overrides={}) == config


def test_a_gae_config_validates():
    trainer = {
        "steps": 3,
        "algorithm": {"advantage_estimator": "gae", "gamma": 0.99, "gae_lambda": 0.95},
        "critic": {"optim": {"learning_rate": 1e-4}, "critic_only_steps": 2},
    }
    config = validate_config(TrainerConfig, trainer, path=None, overrides={})
    assert config.critic.value_clip_range == 0.5
    assert config.critic.optim.learning_rate == 1e-4


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"importance_sampling": "clip"}, "'none', 'truncate', 'mask' or 'reject'"),
        ({"importance_sampling": "truncate", "importance_cap": 0.0}, "greater than 0"),
        ({"importance_cap": None}, "importance_cap"),  # null no longer switches it off
    ],
)
def test_bad_importance_sampling_settings_are_config_errors(algorithm, message):
    with pytest.raises(ConfigError, match="invalid config") as info:
        validate_config(TrainerConfig, {"algorithm": algorithm}, path=None, overrides={})
    assert message in str(info.value)


def test_importance_sampling_settings_are_read():
    data, overrides = load_config_data(None, ["algorithm.importance_sampling=none"])
    config = validate_config(TrainerConfig, data, path=None, overrides=overrides)
    assert config.algorithm.importance_sampling == "none"
    masked = {"algorithm": {"importance_sampling": "mask", "importance_cap": 5.0}}
    config = validate_config(TrainerConfig, masked, path=None, overrides={})
    assert (config.algorithm.importance_sampling, config.algorithm.importance_cap) == ("mask", 5.0)
