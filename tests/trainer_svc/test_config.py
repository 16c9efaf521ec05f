"""The trainer section's checks across fields: settings that only one algorithm uses."""

import pytest

from trainer_svc.config import TrainerConfig
from turnrl.config import validate_config
from turnrl.errors import ConfigError


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        (
            {"critic": {"optim": {"learning_rate": 1e-4}}},
            "critic is set but algorithm.advantage_estimator is 'grpo'; only gae trains a critic",
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


def test_a_gae_config_validates():
    trainer = {
        "steps": 3,
        "algorithm": {"advantage_estimator": "gae", "gamma": 0.99, "gae_lambda": 0.95},
        "critic": {"optim": {"learning_rate": 1e-4}, "critic_only_steps": 2},
    }
    config = validate_config(TrainerConfig, trainer, path=None, overrides={})
    assert config.critic.value_clip_range == 0.5
    assert config.critic.optim.learning_rate == 1e-4
