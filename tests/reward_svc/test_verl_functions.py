"""verl reward functions (`compute_score(data_source, solution_str, ground_truth,
extra_info=None)`) run unchanged as plugins, through a real reward service on loopback."""

from pathlib import Path

import pytest
from google.protobuf import json_format

from reward_svc.config import PluginEntry, RewardConfig
from reward_svc.service import RewardService
from tests.reward_svc.test_service import PLUGINS, Failure, reward_server, score
from turnrl.config import HttpJsonServerConfig
from turnrl.errors import ConfigError
from turnrl.v1 import reward_pb2

VERL_GSM8K = Path(__file__).parent / "verl_gsm8k.py"
VERL_PLUGINS = [
    PluginEntry(data_sources=["openai/gsm8k"], path=VERL_GSM8K, signature="verl"),
    PluginEntry(
        data_sources=["breakdown"], path=PLUGINS, function="verl_breakdown", signature="verl"
    ),
    PluginEntry(
        data_sources=["fragile"],
        path=PLUGINS,
        function="verl_fails_on_some_responses",
        signature="verl",
    ),
    PluginEntry(
        data_sources=["text"], path=PLUGINS, function="verl_returns_text", signature="verl"
    ),
    PluginEntry(
        data_sources=["per_turn"], path=PLUGINS, function="verl_turn_rewards", signature="verl"
    ),
]


async def test_verl_gsm8k_function_scores_right_and_wrong_answers():
    async with reward_server(plugins=VERL_PLUGINS, workers=1) as stub:
        right = await score(stub, "openai/gsm8k", "18 - 3 - 4 = 11, so 11 * 2 = 22.\n#### 22", "22")
        wrong = await score(stub, "openai/gsm8k", "I think it is\n#### 21", "22")
        unformatted = await score(stub, "openai/gsm8k", "The answer is 22.", "22")
    assert right.scorer == "plugin:compute_score"
    assert (right.reward.score, wrong.reward.score, unformatted.reward.score) == (1.0, 0.0, 0.0)
    assert not right.failure and not wrong.failure and not unformatted.failure


async def test_verl_dict_result_keys_become_extras_and_extra_info_arrives():
    item = reward_pb2.ScoringInput(data_source="breakdown", response_text="Paris")
    json_format.ParseDict("Paris", item.ground_truth)
    item.extra_info.update({"difficulty": "easy"})
    async with reward_server(plugins=VERL_PLUGINS, workers=1) as stub:
        reply = await stub.Score(reward_pb2.ScoreRequest(input=item), timeout=30)
    reward = reply.result.reward
    assert reward.score == 1.0
    assert json_format.MessageToDict(reward.extras) == {"acc": True, "difficulty": "easy"}


async def test_verl_dict_may_carry_turn_rewards():
    async with reward_server(plugins=VERL_PLUGINS, workers=1) as stub:
        result = await score(stub, "per_turn", "x", "x")
    assert result.reward.score == 1.0
    assert json_format.MessageToDict(result.reward.extras) == {"acc": True}
    assert [(r.turn, r.value) for r in result.reward.turn_rewards] == [(0, -0.5), (2, 0.25)]


async def test_verl_function_errors_follow_the_blame_rule():
    async with reward_server(plugins=VERL_PLUGINS, workers=1, error_score=-1.0) as stub:
        on_response = await score(stub, "fragile", "raise", "x")
        text = await score(stub, "text", "anything", "x")
    # It raised on the response but graded the ground truth alone: the model's failure.
    assert on_response.failure == Failure.FAILURE_SCORER_FAILED_ON_RESPONSE
    assert on_response.reward.score == -1.0 and not on_response.reward.error
    assert "cannot parse 'raise'" in on_response.reward.extras["error"]
    # A result that is no number fails on the ground truth too: the scorer's (system's) failure.
    assert text.failure == Failure.FAILURE_SCORER_BROKEN and text.reward.error
    assert "returned str '1.0'; expected a number" in text.reward.error_message


async def test_plugin_of_the_wrong_signature_stops_start_up():
    turnrl_function_as_verl = PluginEntry(data_sources=["x"], path=PLUGINS, signature="verl")
    config = RewardConfig(server=HttpJsonServerConfig(port=0), plugins=[turnrl_function_as_verl])
    with pytest.raises(ConfigError, match=r"reward.plugins\[0\].*is it signature: turnrl\?"):
        await RewardService.create(config)
