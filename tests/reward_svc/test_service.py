"""The reward service through a real gRPC server on loopback: routing, isolation of bad
items, batching, plugins, limits."""

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from google.protobuf import json_format

from reward_svc.config import PluginEntry, RewardConfig
from reward_svc.server import RewardServicer
from reward_svc.service import RewardService
from tests.conftest import serve_in_process
from tests.reward_svc.judge_stand_in import judge_options
from turnrl import rpc
from turnrl.config import ClientConfig, HttpJsonServerConfig
from turnrl.errors import ConfigError, DeadlineExceededError, InvalidArgumentError
from turnrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc

PLUGINS = Path(__file__).parent / "plugins" / "probe_scorers.py"
PROBE_PLUGINS = [
    PluginEntry(data_sources=["echo"], path=PLUGINS),
    PluginEntry(data_sources=["raises"], path=PLUGINS, function="raises"),
    PluginEntry(data_sources=["hangs"], path=PLUGINS, function="sleeps_forever"),
    PluginEntry(data_sources=["dies"], path=PLUGINS, function="kills_its_process"),
    PluginEntry(data_sources=["fragile"], path=PLUGINS, function="fails_on_some_responses"),
    PluginEntry(data_sources=["per_turn"], path=PLUGINS, function="rewards_each_turn"),
    PluginEntry(data_sources=["named_turn"], path=PLUGINS, function="rewards_a_named_turn"),
]
Failure = reward_pb2.ScoringResult.Failure


@contextlib.asynccontextmanager
async def serving(
    config: RewardConfig,
) -> AsyncIterator[tuple[reward_pb2_grpc.RewardServiceStub, RewardService]]:
    """A real reward service of `config` on loopback; yields a stub connected to it and the
    service (for its metrics)."""
    service = await RewardService.create(config)
    try:
        async with (
            serve_in_process(
                config.server,
                reward_pb2.DESCRIPTOR.services_by_name["RewardService"],
                lambda server: reward_pb2_grpc.add_RewardServiceServicer_to_server(
                    RewardServicer(service), server
                ),
            ) as address,
            rpc.open_channel(ClientConfig(address=address)) as channel,
        ):
            yield reward_pb2_grpc.RewardServiceStub(channel), service
    finally:
        await service.close()


@contextlib.asynccontextmanager
async def reward_server(**settings) -> AsyncIterator[reward_pb2_grpc.RewardServiceStub]:
    """A real reward service on 127.0.0.1:0; yields a stub connected to it."""
    settings.setdefault("plugins", PROBE_PLUGINS)
    async with serving(RewardConfig(server=HttpJsonServerConfig(port=0), **settings)) as served:
        yield served[0]


def scoring_input(data_source: str, response: str, ground_truth=None) -> reward_pb2.ScoringInput:
    item = reward_pb2.ScoringInput(data_source=data_source, response_text=response)
    if ground_truth is not None:
        json_format.ParseDict(ground_truth, item.ground_truth)
    return item


async def score(stub, data_source: str, response: str, ground_truth=None, deadline=30.0):
    request = reward_pb2.ScoreRequest(input=scoring_input(data_source, response, ground_truth))
    return (await stub.Score(request, timeout=deadline)).result


async def test_plugin_scores_and_lists():
    async with reward_server() as stub:
        right = await score(stub, "echo", "42", "42")
        wrong = await score(stub, "echo", "41", "42")
        listed = await stub.ListScorers(reward_pb2.ListScorersRequest(), timeout=5)
    assert right.reward.score == 1.0 and not right.reward.error
    assert json_format.MessageToDict(right.reward.extras) == {"length": 2.0}
    assert right.scorer == "plugin:compute_score" and wrong.reward.score == 0.0
    names = {s.name: list(s.data_sources) for s in listed.scorers}
    assert names["plugin:compute_score"] == ["echo"]
    assert "openai/gsm8k" in names["gsm8k"]


async def test_a_scorers_turn_rewards_go_on_the_wire_under_its_name():
    item = scoring_input("per_turn", "42", "42")
    for text in ("first", "second"):
        item.messages.add(
            role=common_pb2.Message.ROLE_ASSISTANT, content=[common_pb2.ContentPart(text=text)]
        )
    async with reward_server() as stub:
        reply = await stub.Score(reward_pb2.ScoreRequest(input=item), timeout=30)
        outcome_only = await score(stub, "echo", "42", "42")
    reward = reply.result.reward
    assert reward.score == 1.0 and not reward.error
    assert [(r.turn, r.value, r.source, r.name) for r in reward.turn_rewards] == [
        (0, pytest.approx(0.1), common_pb2.TURN_REWARD_SOURCE_SCORER, "plugin:rewards_each_turn"),
        (1, pytest.approx(0.2), common_pb2.TURN_REWARD_SOURCE_SCORER, "plugin:rewards_each_turn"),
    ]
    assert not outcome_only.reward.turn_rewards


async def test_turn_rewards_that_name_no_turn_index_are_a_broken_scorer():
    async with reward_server() as stub:
        result = await score(stub, "named_turn", "42", "42")
    assert result.reward.error and result.failure == Failure.FAILURE_SCORER_BROKEN
    assert "turn_rewards key 'first' is not a turn index" in result.reward.error_message
    assert not result.reward.turn_rewards


@pytest.mark.parametrize(
    ("data_source", "message"),
    [("raises", "ValueError: cannot grade 'x'"), ("dies", "scorer process died (exit code 3)")],
)
async def test_scorer_failing_on_the_ground_truth_too_is_broken_the_systems(data_source, message):
    async with reward_server(error_score=-1.0) as stub:
        result = await score(stub, data_source, "x", "42")
    assert result.reward.error and result.reward.score == -1.0
    assert result.failure == Failure.FAILURE_SCORER_BROKEN
    assert message in result.reward.error_message
    assert "on the ground truth alone too" in result.reward.error_message
    assert json_format.MessageToDict(result.reward.extras)["error"] == result.reward.error_message


async def test_hung_scorer_times_out_alone():
    async with reward_server(item_timeout_seconds=0.5) as stub:
        hung, fine = await asyncio.gather(score(stub, "hangs", "x"), score(stub, "echo", "a", "a"))
    assert hung.reward.error and "past its 0.5s limit" in hung.reward.error_message
    assert hung.failure == Failure.FAILURE_SCORER_BROKEN
    assert fine.reward.score == 1.0 and not fine.reward.error and not fine.failure


@pytest.mark.parametrize(
    ("response", "message"),
    [
        ("raise", "RecursionError: maximum recursion depth exceeded"),
        ("hang", "past its 0.5s limit"),
        ("die", "scorer process died (exit code 3)"),
    ],
)
async def test_scorer_failing_on_the_response_alone_scores_it_as_the_models(response, message):
    async with reward_server(item_timeout_seconds=0.5, error_score=-1.0) as stub:
        failed = await score(stub, "fragile", response, "42")
        fine = await score(stub, "fragile", "42", "42")
    # The model earned the lowest score: trained on, with the reason kept.
    assert not failed.reward.error and failed.reward.score == -1.0
    assert failed.failure == Failure.FAILURE_SCORER_FAILED_ON_RESPONSE
    assert message in json_format.MessageToDict(failed.reward.extras)["error"]
    assert fine.reward.score == 1.0 and not fine.failure


async def test_unknown_data_source_is_invalid_argument_naming_the_known_ones():
    async with reward_server() as stub:
        with pytest.raises(InvalidArgumentError) as info:
            await score(stub, "gsm8k_v2", "x")
    assert re.search(
        r"unknown data_source 'gsm8k_v2'; known: \[.*'echo'.*'openai/gsm8k'", info.value.details
    )


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (reward_pb2.ScoringInput(response_text="x"), "input.data_source is required"),
        (
            reward_pb2.ScoringInput(data_source="echo", messages=[common_pb2.Message()]),
            "input.messages: message role 0 is not set",
        ),
    ],
)
async def test_malformed_input_is_invalid_argument(item, message):
    async with reward_server() as stub:
        with pytest.raises(InvalidArgumentError) as info:
            await stub.Score(reward_pb2.ScoreRequest(input=item), timeout=5)
    assert message in info.value.details


async def test_ten_megabyte_response_earns_the_error_score():
    async with reward_server(error_score=-1.0) as stub:
        result = await score(stub, "echo", "x" * (10 * 1024 * 1024), "x")
    # The model wrote it: scored, not excluded.
    assert not result.reward.error and result.reward.score == -1.0
    assert result.failure == Failure.FAILURE_RESPONSE_TOO_LARGE
    error = json_format.MessageToDict(result.reward.extras)["error"]
    assert "response is 10485760 bytes; at most 1048576 are scored" in error


async def test_unreachable_judge_is_the_systems_failure():
    with socket.socket() as reserved:  # bound, never listening: connections are refused
        reserved.bind(("127.0.0.1", 0))
        judge = judge_options(
            base_url=f"http://127.0.0.1:{reserved.getsockname()[1]}/v1", max_retries=0
        )
        item = scoring_input("gsm8k_judge", "The answer is 72.", "72")
        question = common_pb2.ContentPart(text="What is 8 * 9?")
        item.messages.add(role=common_pb2.Message.ROLE_USER, content=[question])
        async with reward_server(judges=[judge]) as stub:
            reply = await stub.Score(reward_pb2.ScoreRequest(input=item), timeout=30)
    result = reply.result
    assert result.reward.error and result.failure == Failure.FAILURE_SCORER_UNAVAILABLE
    assert "is unreachable" in result.reward.error_message


async def test_caller_deadline_is_deadline_exceeded():
    async with reward_server(item_timeout_seconds=30) as stub:
        with pytest.raises(DeadlineExceededError):
            await score(stub, "hangs", "x", deadline=0.5)


async def test_score_batch_answers_every_item_once_and_isolates_bad_ones():
    kinds = ["echo", "raises", "echo", "hangs", "nope", "echo"]

    async def requests():
        for i in range(60):
            kind = kinds[i % len(kinds)]
            yield reward_pb2.ScoreBatchRequest(
                item_id=f"item-{i}", input=scoring_input(kind, str(i), str(i))
            )

    async with reward_server(item_timeout_seconds=0.5, max_concurrency=16) as stub:
        results = {
            reply.item_id: reply.result async for reply in stub.ScoreBatch(requests(), timeout=60)
        }
    assert sorted(results) == sorted(f"item-{i}" for i in range(60))
    for i in range(60):
        result, kind = results[f"item-{i}"], kinds[i % len(kinds)]
        if kind == "echo":
            assert result.reward.score == 1.0 and not result.reward.error
        else:
            assert result.reward.error, (kind, result)
    assert "unknown data_source 'nope'" in results["item-4"].reward.error_message
    assert results["item-4"].failure == Failure.FAILURE_UNKNOWN_DATA_SOURCE


async def test_plugin_that_cannot_load_stops_start_up(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("raise ImportError('missing dependency foo')\n")
    config = RewardConfig(
        server=HttpJsonServerConfig(port=0), plugins=[PluginEntry(data_sources=["x"], path=bad)]
    )
    with pytest.raises(ConfigError, match=r"reward.plugins\[0\].*missing dependency foo"):
        await RewardService.create(config)
