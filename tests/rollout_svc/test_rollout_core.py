"""RolloutService in-process on the hf engine with a small random Qwen3 model and the real
Qwen2.5 tokenizer and template, against the real tool and reward services on loopback.

A random model never writes a tool call, so these tests cover what every trajectory does:
token-exact prompts, masks, logprobs equal to a teacher-forced pass, each length limit, abort,
a weight push mid-trajectory, and scoring. The tests of what follows a tool call (an abort
right after a tool result, how a failed call is counted) run the `AgentLoop` on the trained
tiny calculator model, whose greedy first turn calls the calculator.
"""

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from rollout_svc.agent_loop import AgentLoop, PromptSpec, RolloutLimits
from rollout_svc.config import RolloutConfig
from rollout_svc.engines.base import EngineImage, GenerateOutput, SamplingParams
from rollout_svc.engines.hf import HfEngine, HfEngineOptions
from rollout_svc.parsers import PARSERS
from rollout_svc.service import RolloutService
from rollout_svc.tool_client import ToolClient
from tests.in_process_services import reward_service_address, tool_service_address
from tool_svc.config import ToolEntry
from tool_svc.tools.base import ToolCallError, ToolErrorKind, ToolResult
from tool_svc.tools.calculator import CalculatorTool
from turnrl.calculator_data import TOOLS, generate_problems
from turnrl.chat_tokens import ConversationTokens
from turnrl.config import ClientConfig, ServerConfig
from turnrl.errors import InvalidArgumentError, UnavailableError
from turnrl.replicas import ReplicaSet
from turnrl.trajectory import FinishReason, SegmentSource, Trajectory
from turnrl.v1 import reward_pb2_grpc
from turnrl.weights import TensorMeta


@pytest.fixture(scope="module")
def random_model_dir(fixtures: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Qwen3 with the real Qwen2.5 tokenizer, saved like a real model."""
    tokenizer = AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen2.5")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=4096,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=True,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("random_qwen3")
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@contextlib.asynccontextmanager
async def rollout(
    model_dir: Path, reward: str = "127.0.0.1:1", **settings
) -> AsyncIterator[RolloutService]:
    """The rollout service on `model_dir`, calling a real tool service and the reward service
    at `reward` (by default none: nothing listens on port 1)."""
    async with tool_service_address() as tools:
        config = RolloutConfig(
            server=ServerConfig(port=0),
            model_path=str(model_dir),
            tool_service=ClientConfig(address=tools),
            reward_service=ClientConfig(address=reward),
            **settings,
        )
        service = await RolloutService.create(config)
        try:
            yield service
        finally:
            await service.close()


def prompt_specs(count: int) -> list[PromptSpec]:
    return [
        PromptSpec(
            prompt_id=f"p{i}",
            messages=problem.prompt_messages,
            tool_names=[tool["function"]["name"] for tool in TOOLS],
            data_source="openai/gsm8k",
            ground_truth=str(problem.answer),
        )
        for i, problem in enumerate(generate_problems(count, split="test"))
    ]


async def collect(
    service: RolloutService, prompts, n, sampling, limits, scoring=False, request_id=""
):
    return [t async for t in service.generate(prompts, n, sampling, limits, scoring, request_id)]


async def test_trajectories_are_token_exact_with_the_engines_logprobs(random_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).eval()
    prompts = prompt_specs(3)
    async with reward_service_address() as reward, rollout(random_model_dir, reward) as service:
        limits = service.limits(0, 0, 24, 0)
        sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11)
        trajectories = await collect(service, prompts, 2, sampling, limits, scoring=True)
    assert sorted(t.trajectory_id for t in trajectories) == [
        f"p{i}/{j}" for i in range(3) for j in range(2)
    ]
    for trajectory in trajectories:
        prompt = prompts[int(trajectory.group_id[1:])]
        expected_prompt = ConversationTokens(tokenizer, None, TOOLS).prompt_ids(prompt.messages)
        assert trajectory.segments[0].source is SegmentSource.PROMPT
        assert trajectory.segments[0].token_ids == expected_prompt
        model_segments = [s for s in trajectory.segments if s.source is SegmentSource.MODEL]
        assert model_segments and all(s.policy_version == 0 for s in model_segments)
        ids = trajectory.token_ids
        assert trajectory.loss_mask == [False] * len(expected_prompt) + [True] * (
            len(ids) - len(expected_prompt)
        )
        assert trajectory.response_mask == trajectory.loss_mask  # one model turn, nothing else
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        reference = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[
            :, 0
        ]
        engine = torch.tensor([lp for s in model_segments for lp in s.logprobs])
        assert torch.allclose(engine, reference[len(expected_prompt) - 1 :], atol=1e-4)
        assert trajectory.reward is not None and not trajectory.reward.error
        assert trajectory.reward.score == 0.0  # a random model does not solve arithmetic
        proto = trajectory.to_proto()
        assert list(proto.loss_mask) == trajectory.loss_mask and len(proto.messages) == 3
        assert Trajectory.from_proto(proto) == trajectory


@pytest.mark.parametrize(
    ("limits", "reason"),
    [
        ((0, 0, 8, 0), FinishReason.MAX_NEW_TOKENS),
        ((0, 10, 8, 0), FinishReason.MAX_NEW_TOKENS),
        ((0, 6, 6, 0), FinishReason.MAX_RESPONSE_LENGTH),
    ],
)
async def test_length_limits_name_the_limit_that_ended_the_trajectory(
    random_model_dir, limits, reason
):
    async with rollout(random_model_dir) as service:
        sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, stop_token_ids=())
        trajectories = await collect(service, prompt_specs(2), 1, sampling, service.limits(*limits))
    for trajectory in trajectories:
        assert trajectory.finish_reason in (reason, FinishReason.STOP)
        assert trajectory.response_length <= limits[1] or limits[1] == 0


async def test_the_context_limit_ends_a_long_prompt(random_model_dir):
    async with rollout(random_model_dir) as service:
        prompt_length = len(
            ConversationTokens(
                AutoTokenizer.from_pretrained(random_model_dir), None, TOOLS
            ).prompt_ids(prompt_specs(1)[0].messages)
        )
        limits = service.limits(prompt_length + 2, 3, 3, 0)
        [trajectory] = await collect(
            service, prompt_specs(1), 1, SamplingParams(max_new_tokens=3, seed=1), limits
        )
    assert trajectory.finish_reason in (FinishReason.MAX_MODEL_LEN, FinishReason.STOP)
    assert len(trajectory.token_ids) <= prompt_length + 2


async def test_abort_brings_every_trajectory_back(random_model_dir):
    settings = {"max_model_len": 4096, "max_response_length": 3000, "max_new_tokens": 2000}
    async with rollout(random_model_dir, **settings) as service:
        limits = service.limits(4096, 3000, 2000, 0)
        sampling = SamplingParams(max_new_tokens=2000, temperature=1.0, seed=2, stop_token_ids=())
        collecting = asyncio.create_task(
            collect(service, prompt_specs(2), 2, sampling, limits, request_id="abort-me")
        )
        async with asyncio.timeout(60):  # until all four are generating
            # The engine's counters have no event to wait on; poll them.
            while service.in_flight < 4 or service.stats()["metrics"]["tokens_generated"] < 8:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert await service.abort("abort-me") == 4
        trajectories = await collecting
    assert len(trajectories) == 4
    assert {t.finish_reason for t in trajectories} == {FinishReason.ABORTED}
    assert all(0 < t.response_length < 2000 for t in trajectories)


async def test_a_weight_push_mid_generate_splits_the_trajectory_by_policy_version(
    random_model_dir,
):
    """Partial rollout: a push while a trajectory generates pauses it, loads the new weights,
    and it goes on; each model token keeps the version, and the logprob, of the policy that
    sampled it."""
    old_model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).eval()
    new_model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    new_weights = {
        name: parameter.detach() + 0.2 * torch.randn(parameter.shape, generator=generator)
        for name, parameter in old_model.named_parameters()
    }
    new_model.load_state_dict(new_weights, strict=False)
    metas = [TensorMeta(name, t.dtype, tuple(t.shape)) for name, t in new_weights.items()]

    async def chunks() -> AsyncIterator[tuple[int, int, bytes]]:
        for index, tensor in enumerate(new_weights.values()):
            yield index, 0, tensor.contiguous().numpy().tobytes()

    async with rollout(random_model_dir) as service:
        limits = service.limits(0, 0, 1000, 0)
        sampling = SamplingParams(max_new_tokens=1000, temperature=1.0, seed=3, stop_token_ids=())
        collecting = asyncio.create_task(collect(service, prompt_specs(1), 1, sampling, limits))
        async with asyncio.timeout(60):
            # The engine's counters have no event to wait on; poll them.
            while service.stats()["metrics"]["tokens_generated"] < 8:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        await service.pause()  # the trainer's Pause, then the push, then Resume
        assert not collecting.done()
        size = sum(meta.nbytes for meta in metas)
        assert await service.push_weights(metas, chunks(), policy_version=1) == (1, size)
        assert service.stats()["policy_version"] == 1 and not collecting.done()
        assert await service.resume() == 1
        [trajectory] = await collecting
    assert trajectory.finish_reason in (FinishReason.MAX_NEW_TOKENS, FinishReason.STOP)
    prompt, before, after = trajectory.segments
    assert (prompt.source, before.source, after.source) == (
        SegmentSource.PROMPT,
        SegmentSource.MODEL,
        SegmentSource.MODEL,
    )
    assert (before.policy_version, after.policy_version) == (0, 1)
    assert len(before.token_ids) >= 8 and after.token_ids
    ids = trajectory.token_ids
    for model, segment, start in [
        (old_model, before, len(prompt.token_ids)),
        (new_model, after, len(prompt.token_ids) + len(before.token_ids)),
    ]:
        end = start + len(segment.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids[:end]])).logits[0].float()
        expected = torch.log_softmax(logits[start - 1 : end - 1], -1)
        expected = expected.gather(1, torch.tensor(segment.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(segment.logprobs), expected, atol=1e-4)
    assert Trajectory.from_proto(trajectory.to_proto()) == trajectory


async def test_dead_reward_service_marks_the_reward_as_an_error(random_model_dir):
    # Scoring is tried again until its deadline: a short one keeps the test short.
    async with rollout(random_model_dir, reward_timeout_seconds=3.0) as service:
        limits = service.limits(0, 0, 4, 0)
        [trajectory] = await collect(
            service,
            prompt_specs(1),
            1,
            SamplingParams(max_new_tokens=4, seed=1),
            limits,
            scoring=True,
        )
    assert trajectory.reward is not None and trajectory.reward.error
    assert "reward service: UNAVAILABLE" in trajectory.reward.error_message


async def test_contradictory_limits_and_empty_calls_are_invalid(random_model_dir):
    async with rollout(random_model_dir) as service:
        with pytest.raises(InvalidArgumentError, match="exceeds max_response_length"):
            service.limits(0, 10, 20, 0)
        with pytest.raises(InvalidArgumentError, match="leaves no room for a prompt"):
            service.limits(100, 100, 10, 0)
        with pytest.raises(InvalidArgumentError, match="exceeds the engine's context"):
            service.limits(RolloutConfig().max_model_len + 1, 0, 0, 0)
        with pytest.raises(InvalidArgumentError, match="prompts is empty"):
            await collect(
                service, [], 1, SamplingParams(max_new_tokens=4), service.limits(0, 0, 4, 0)
            )


async def test_a_prompt_naming_a_tool_the_tool_service_lacks_is_invalid(random_model_dir):
    unknown = PromptSpec(prompt_id="p", messages=[{"role": "user", "content": "Hi"}],
                         tool_names=["calculator", "teleport"])  # fmt: skip
    async with rollout(random_model_dir) as service:
        limits = service.limits(0, 0, 4, 0)
        with pytest.raises(InvalidArgumentError, match=r"\['teleport'\] are not served"):
            await collect(service, [unknown], 1, SamplingParams(max_new_tokens=4), limits)
        assert service.in_flight == 0


async def test_a_call_naming_tools_of_an_unreachable_tool_service_fails_unavailable(
    random_model_dir,
):
    config = RolloutConfig(
        model_path=str(random_model_dir),
        tool_service=ClientConfig(address="127.0.0.1:1", timeout_seconds=5),
    )
    service = await RolloutService.create(config)
    try:
        limits = service.limits(0, 0, 4, 0)
        with pytest.raises(UnavailableError, match=r"ListTools at 127\.0\.0\.1:1 failed"):
            await collect(service, prompt_specs(1), 1, SamplingParams(max_new_tokens=4), limits)
        assert service.stats()["finished_trajectories"] == 0
    finally:
        await service.close()


@contextlib.asynccontextmanager
async def agent_loop(model_dir: Path, tool_address: str) -> AsyncIterator[AgentLoop]:
    """The agent loop as the rollout service builds it, on `model_dir`'s hf engine and the tool
    service at `tool_address`; no reward service."""
    config = RolloutConfig(model_path=str(model_dir))
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_dir)
    engine = await HfEngine.create(HfEngineOptions(), str(model_dir), config.max_model_len)
    loop = AgentLoop(
        engine=engine,
        tokenizer=tokenizer,
        chat_template=None,
        parser=PARSERS[config.tool_parser],
        tool_client=ToolClient(ClientConfig(address=tool_address, timeout_seconds=10)),
        reward_replicas=ReplicaSet(
            ClientConfig(address="127.0.0.1:1"), reward_pb2_grpc.RewardServiceStub
        ),
        interactions={},
        tool_call_timeout_seconds=10,
        reward_timeout_seconds=10,
    )
    try:
        yield loop
    finally:
        await loop.tool_client.close()
        await loop.reward_replicas.close()
        await engine.close()


GREEDY = SamplingParams(max_new_tokens=64, temperature=0.0)


async def run_one(
    loop: AgentLoop, prompt: PromptSpec, max_turns: int, request_id: str, tools=TOOLS
):
    limits = RolloutLimits(max_model_len=2048, max_response_length=1024, max_new_tokens=64,
                           max_turns=max_turns)  # fmt: skip
    try:
        return await loop.run(prompt, tools, 0, GREEDY, limits, False, request_id)
    finally:
        loop.forget(request_id)


class AbortAtTheSecondTurn:
    """The hf engine, except that the Generate call is aborted as a trajectory's second model
    turn (the one after its tool result) starts. `queued`: once the turn's request waits in
    the paused engine, before its first token (where a pause for a weight push, or a full
    batch, leaves it). `unregistered`: before the request reaches the engine, which then runs
    it to its end (as a remote engine may)."""

    def __init__(self, engine: HfEngine, agent_loop: AgentLoop, when: str) -> None:
        self.engine = engine
        self.agent_loop = agent_loop
        self.when = when
        self.turns: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def abort_every_call(self) -> None:
        for call in list(self.agent_loop.engine_requests):
            await self.agent_loop.abort(call)

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        session_id: str = "",
        *,
        images: Sequence[EngineImage] = (),
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerateOutput:
        assert not images  # a text model's test
        self.turns[session_id] += 1
        if self.turns[session_id] == 1:
            return await self.engine.generate(
                input_ids, sampling, request_id, session_id, on_tokens=on_tokens
            )
        if self.when == "unregistered":
            await self.abort_every_call()
            return await self.engine.generate(
                input_ids, sampling, request_id, session_id, on_tokens=on_tokens
            )
        await self.engine.pause()
        queued = asyncio.create_task(
            self.engine.generate(input_ids, sampling, request_id, session_id, on_tokens=on_tokens)
        )
        await asyncio.sleep(0)  # the task runs until it awaits its result: the request is queued
        assert self.engine.stats()["waiting"] == 1
        await self.abort_every_call()
        await self.engine.resume()
        return await queued


@pytest.mark.parametrize(
    ("when", "last_sources", "last_roles", "turns"),
    [
        # No empty model turn, no empty assistant message: the tool result and the next turn's
        # opener end it.
        ("queued", [SegmentSource.TOOL, SegmentSource.TEMPLATE], ["assistant", "tool"], 1),
        # The turn the engine finished is kept; the tool calls it made are not run.
        ("unregistered", [SegmentSource.TEMPLATE, SegmentSource.MODEL], ["tool", "assistant"], 2),
    ],
)
async def test_an_abort_between_a_tool_result_and_the_next_token_ends_the_trajectory_aborted(
    tiny_model_dir, when, last_sources, last_roles, turns
):
    async with tool_service_address() as tools, agent_loop(tiny_model_dir, tools) as loop:
        engine = loop.engine = AbortAtTheSecondTurn(loop.engine, loop, when)
        trajectories = [
            await run_one(loop, prompt, max_turns=4, request_id=f"call-{i}")
            for i, prompt in enumerate(prompt_specs(2))
        ]
    raced = [t for t in trajectories if engine.turns[t.trajectory_id] == 2]
    assert raced, [t.metrics for t in trajectories]
    for trajectory in raced:
        assert trajectory.finish_reason is FinishReason.ABORTED, trajectory.error_message
        assert trajectory.error_message == ""
        assert trajectory.segments[0].source is SegmentSource.PROMPT
        assert [s.source for s in trajectory.segments[-2:]] == last_sources
        assert all(s.token_ids for s in trajectory.segments)
        assert [m["role"] for m in trajectory.messages[-2:]] == last_roles
        assert all(m.get("content") or m.get("tool_calls") for m in trajectory.messages)
        assert len(trajectory.turns) == trajectory.metrics["turns"] == turns
        assert trajectory.metrics["tool_calls"] == trajectory.turns[0].tool_calls >= 1
        assert Trajectory.from_proto(trajectory.to_proto()) == trajectory


class UnreachableCalculator(CalculatorTool):
    """The calculator as a tool whose backend is down would answer."""

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        raise ToolCallError(ToolErrorKind.UNAVAILABLE, "backend at 127.0.0.1:1 is unreachable")


@contextlib.asynccontextmanager
async def tool_address(serving: str) -> AsyncIterator[str]:
    """A tool service serving the calculator under another name, or its unreachable twin
    under its own, or nothing at all."""
    if serving == "dead":
        yield "127.0.0.1:1"
        return
    entry = {
        "renamed": ToolEntry(class_name="calculator", name="abacus"),
        "unreachable": ToolEntry(class_name=f"{__name__}:UnreachableCalculator"),
    }[serving]
    async with tool_service_address(entry) as address:
        yield address


@pytest.mark.parametrize("with_session", [False, True])
@pytest.mark.parametrize(
    ("serving", "infra_failed"),
    [
        # The model's fault: an unknown tool is an error result of Execute, or NOT_FOUND from
        # CreateSession. The trajectory trains as usual.
        ("renamed", False),
        # Not the model's: the service is down (UNAVAILABLE from Execute or CreateSession), or a
        # dependency of the tool is.
        ("dead", True),
        ("unreachable", True),
    ],
)
async def test_tool_calls_that_could_not_run_are_counted_apart_from_the_models_errors(
    tiny_model_dir, serving, infra_failed, with_session
):
    [prompt] = prompt_specs(1)
    if with_session:
        prompt = dataclasses.replace(prompt, tools_kwargs={"calculator": {}})
    async with tool_address(serving) as tools, agent_loop(tiny_model_dir, tools) as loop:
        trajectory = await run_one(loop, prompt, max_turns=1, request_id="call")
    assert_every_tool_call_failed(trajectory, infra_failed)
    assert Trajectory.from_proto(trajectory.to_proto()).metrics == trajectory.metrics


def assert_every_tool_call_failed(trajectory: Trajectory, infra_failed: bool) -> None:
    """The one-turn trajectory's tool calls all failed, each counted as the system's when
    `infra_failed`, else as the model's; the model read the failure as a tool message either
    way."""
    assert trajectory.finish_reason is FinishReason.MAX_TURNS, trajectory.error_message
    metrics = trajectory.metrics
    assert metrics["tool_calls"] >= 1 and metrics["tool_errors"] == metrics["tool_calls"]
    assert metrics["tool_infra_errors"] == (metrics["tool_calls"] if infra_failed else 0)
    assert [m["role"] for m in trajectory.messages[-2:]] == ["assistant", "tool"]
