"""The agent mode of the rollout service (`rollout.agent`): Generate's samples played by a user's
agent in real child processes, through the gateway on a loopback port, on the tiny calculator
model, with a real tool service (for the agent loop it is compared with) and reward service."""

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from reward_svc.config import PluginEntry
from rollout_svc.agent_episodes import NO_REQUEST
from rollout_svc.agent_loop import PromptSpec
from rollout_svc.agent_runner import AgentConfig
from rollout_svc.config import GatewayConfig
from rollout_svc.engines.base import SamplingParams
from rollout_svc.gateway.app import serve_gateway
from rollout_svc.service import RolloutService
from tests.in_process_services import reward_service_address
from tests.reward_svc.test_service import PLUGINS
from tests.rollout_svc.test_agent_runner import beacon, exited  # noqa: F401 (a fixture)
from tests.rollout_svc.test_rollout_core import collect, prompt_specs, rollout
from trainer_svc.rl_step import infra_failed, rollout_batch
from turnrl.chat_tokens import ConversationTokens
from turnrl.config import ServerConfig
from turnrl.failures import AgentFailure
from turnrl.trajectory import FinishReason, SegmentSource, TurnRewardSource
from turnrl.weights import TensorMeta

TEST_AGENTS = "tests.rollout_svc.agents_for_tests"
GREEDY = SamplingParams(max_new_tokens=64, temperature=0.0)


@contextlib.asynccontextmanager
async def agent_rollout(
    model_dir: Path, agent: AgentConfig | None, reward: str = "127.0.0.1:1", **settings
) -> AsyncIterator[RolloutService]:
    """The rollout service with its gateway served, its samples played by `agent` (None: the
    agent loop), as `turnrl serve rollout` runs it."""
    gateway = GatewayConfig(enabled=True, port=0)
    async with (
        rollout(model_dir, reward, gateway=gateway, agent=agent, **settings) as service,
        serve_gateway(gateway, ServerConfig(port=0), service.chat_sessions) as url,
    ):
        if agent is not None:
            service.serve_agents(url, "no-key")
        yield service


def agent_named(name: str, **settings) -> AgentConfig:
    return AgentConfig(callable=f"{TEST_AGENTS}:{name}", timeout_seconds=60, **settings)


@pytest.mark.parametrize("example", ["openai_agent", "langgraph_agent"])
async def test_an_example_agent_records_what_the_agent_loop_does(tiny_model_dir, example):
    """Greedy, an example agent (an openai SDK loop, or LangGraph's ReAct graph over
    LangChain's ChatOpenAI, each running the calculator itself) and the built-in agent loop
    (calling the tool service) produce the same ids, masks, logprobs and rewards for the same
    prompts: the gateway's sessions are token-exact trajectories of agents left unchanged."""
    prompts = prompt_specs(3)
    example = AgentConfig(callable=f"examples.{example}.agent:solve", timeout_seconds=120)
    by_mode = {}
    async with reward_service_address() as reward:
        for agent in (None, example):
            async with agent_rollout(tiny_model_dir, agent, reward) as service:
                limits = service.limits(0, 0, 0, 4)
                trajectories = await collect(service, prompts, 1, GREEDY, limits, scoring=True)
                by_mode[agent is None] = {t.trajectory_id: t for t in trajectories}
    loop, episodes = by_mode[True], by_mode[False]
    assert sorted(episodes) == sorted(loop) == ["p0/0", "p1/0", "p2/0"]
    tool_calls = 0
    for trajectory_id, expected in loop.items():
        played = episodes[trajectory_id]
        assert played.group_id == expected.group_id and played.sample_index == 0
        assert played.finish_reason is expected.finish_reason is FinishReason.STOP
        assert played.token_ids == expected.token_ids
        assert played.loss_mask == expected.loss_mask
        assert played.rollout_logprobs == pytest.approx(expected.rollout_logprobs, abs=1e-5)
        assert played.reward == expected.reward and not played.reward.error  # extras included
        for name in ("turns", "model_tokens", "tool_calls"):  # the trainer's figures
            assert played.metrics[name] == expected.metrics[name]
        tool_calls += played.metrics["tool_calls"]
    assert tool_calls > 0  # the agent ran the calculator, as the agent loop had the tool service
    assert all(t.reward.extras for t in episodes.values())  # the scorer's extracted answer


async def test_a_reward_the_agent_returns_is_the_trajectorys(tiny_model_dir):
    async with agent_rollout(tiny_model_dir, agent_named("asks_then_rewards")) as service:
        limits = service.limits(0, 0, 0, 0)
        trajectories = await collect(service, prompt_specs(1), 2, GREEDY, limits, scoring=True)
    assert sorted(t.trajectory_id for t in trajectories) == ["p0/0", "p0/1"]
    for trajectory in trajectories:
        assert trajectory.finish_reason is FinishReason.MAX_NEW_TOKENS  # its max_tokens=8
        assert trajectory.reward.score == 0.25 and trajectory.reward.extras["source"] == "agent"
        assert any(trajectory.loss_mask)
        assert trajectory.metrics["agent_seconds"] > 0


async def test_an_agent_that_summarises_its_history_trains_each_part(tiny_model_dir):
    """An agent that replaced its history by a summary mid-episode: its trajectory holds the
    first part as it ran and the summary's as a new part from its own prompt (the model is
    trained on the context it sampled in), and the trainer makes a row of each."""
    async with agent_rollout(tiny_model_dir, agent_named("summarises")) as service:
        limits = service.limits(0, 0, 0, 0)
        [played] = await collect(service, prompt_specs(1), 1, GREEDY, limits, scoring=True)
        tokenizer = service.chat_sessions.tokenizer
    assert played.finish_reason is FinishReason.STOP and played.reward.score == 0.5
    sources = [s.source for s in played.segments]
    prompt, model, user = SegmentSource.PROMPT, SegmentSource.MODEL, SegmentSource.USER
    assert sources == [prompt, model, prompt, model, user, SegmentSource.TEMPLATE, model]
    assert played.metrics["parts"] == 2 and played.metrics["turns"] == 3
    (start, middle), (second, end) = played.parts
    assert start == 0 and middle == second and end == len(played.token_ids)
    summary_messages = played.messages[3:5]  # the first part's prompt and answer come first
    assert summary_messages[-1]["content"].startswith("Earlier you said")
    expected_prompt = ConversationTokens(tokenizer, None, None).prompt_ids(summary_messages)
    assert played.segments[2].token_ids == expected_prompt
    rows = rollout_batch([played], pad_token_id=0)
    assert rows.batch.input_ids.shape[0] == 2 and rows.sequence_index.tolist() == [0, 0]
    assert rows.batch.loss_mask.sum() == sum(played.loss_mask)


@pytest.mark.parametrize(
    ("agent", "kind"),
    [("raises", AgentFailure.RAISED.value), ("reward", NO_REQUEST)],
)
async def test_an_agent_the_system_failed_is_an_error_counted_by_kind(tiny_model_dir, agent, kind):
    """An agent that raised (before any request), or returned a reward without asking the
    policy: out of the loss (ERROR), never scored, counted in the service's stats."""
    prompt = PromptSpec(prompt_id="p", messages=[{"role": "user", "content": "2+2?"}])
    async with agent_rollout(tiny_model_dir, agent_named(agent)) as service:
        limits = service.limits(0, 0, 0, 0)
        [trajectory] = await collect(service, [prompt], 1, GREEDY, limits, scoring=True)
        stats = service.stats()["metrics"]
    assert trajectory.finish_reason is FinishReason.ERROR
    assert trajectory.error_message.startswith(f"{kind}: ")
    assert trajectory.reward is None and not trajectory.segments
    assert infra_failed(trajectory)  # the trainer counts it apart, in training and evaluation
    assert stats[kind] == 1.0


async def test_an_agent_that_runs_into_max_turns_is_scored_as_the_model_ran_long(tiny_model_dir):
    """The agent asks until the gateway refuses its third turn (max_turns=2) and then raises:
    the limit is the model's doing, so the episode keeps MAX_TURNS and is not an error."""
    async with agent_rollout(tiny_model_dir, agent_named("asks_until_refused")) as service:
        limits = service.limits(0, 0, 0, 2)
        [trajectory] = await collect(service, prompt_specs(1), 1, GREEDY, limits)
        stats = service.stats()["metrics"]
    assert trajectory.finish_reason is FinishReason.MAX_TURNS
    assert sum(s.source is SegmentSource.MODEL for s in trajectory.segments) == 2
    assert AgentFailure.RAISED.value not in stats


async def test_an_episode_the_reward_service_scores_gets_the_scorers_turn_rewards(
    tiny_model_dir,
):
    plugin = PluginEntry(data_sources=["openai/gsm8k"], path=PLUGINS, function="rewards_each_turn")
    async with (
        reward_service_address(plugins=[plugin]) as reward,
        agent_rollout(tiny_model_dir, agent_named("asks_until_refused"), reward) as service,
    ):
        limits = service.limits(0, 0, 0, 2)
        [trajectory] = await collect(service, prompt_specs(1), 1, GREEDY, limits, scoring=True)
    assert trajectory.finish_reason is FinishReason.MAX_TURNS and not trajectory.reward.error
    assert [(r.turn, r.value, r.source) for r in trajectory.turn_rewards] == [
        (0, pytest.approx(0.1), TurnRewardSource.SCORER),
        (1, pytest.approx(0.2), TurnRewardSource.SCORER),
    ]
    assert trajectory.metrics["scorer_turn_reward_sum"] == pytest.approx(0.3)


async def test_an_aborted_call_kills_its_agents_and_keeps_their_tokens(tiny_model_dir, beacon):  # noqa: F811
    prompt = prompt_specs(1)[0]
    prompt.extra_info["beacon"] = beacon.port
    async with agent_rollout(tiny_model_dir, agent_named("asks_then_hangs")) as service:
        limits = service.limits(0, 0, 0, 0)
        running = asyncio.create_task(collect(service, [prompt], 1, GREEDY, limits, request_id="r"))
        message, _ = await beacon.next()
        pidfd = os.pidfd_open(message["pid"])
        assert await service.abort("r") == 1
        [trajectory] = await asyncio.wait_for(running, 30)
    assert trajectory.finish_reason is FinishReason.ABORTED
    assert trajectory.trajectory_id == "p0/0" and any(trajectory.loss_mask)
    assert await exited(pidfd)


async def test_an_episode_goes_on_across_a_weight_push(tiny_model_dir, beacon):  # noqa: F811
    """A push between two of an episode's turns: the episode is not cut, its first turn keeps
    policy version 0 and its second is version 1's, as a Generate trajectory's would."""
    prompt = prompt_specs(1)[0]
    prompt.extra_info["beacon"] = beacon.port
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = {name: parameter.detach() for name, parameter in model.named_parameters()}
    metas = [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in weights.items()]

    async def chunks() -> AsyncIterator[tuple[int, int, bytes]]:
        for index, tensor in enumerate(weights.values()):
            yield index, 0, tensor.contiguous().numpy().tobytes()

    async with agent_rollout(tiny_model_dir, agent_named("asks_across_a_push")) as service:
        limits = service.limits(0, 0, 0, 0)
        running = asyncio.create_task(collect(service, [prompt], 1, GREEDY, limits))
        _, writer = await beacon.next()
        await service.pause()
        assert (await service.push_weights(metas, chunks(), policy_version=1))[0] == 1
        await service.resume()
        writer.write(b"go\n")
        await writer.drain()
        [trajectory] = await asyncio.wait_for(running, 60)
    assert trajectory.finish_reason is not FinishReason.ERROR, trajectory.error_message
    assert trajectory.reward.score == 1.0
    assert trajectory.policy_versions == [0, 1]


async def test_an_episodes_session_is_ended_by_the_service_not_the_agent(tiny_model_dir):
    async with agent_rollout(tiny_model_dir, agent_named("ends_its_session")) as service:
        limits = service.limits(0, 0, 0, 0)
        [trajectory] = await collect(service, prompt_specs(1), 1, GREEDY, limits)
    assert trajectory.reward.score == 409  # FailedPrecondition: the service ends it
    assert trajectory.finish_reason is FinishReason.MAX_NEW_TOKENS and any(trajectory.loss_mask)
