"""The rollout service end to end: the tiny calculator model on the hf engine (and, for the
agent loop, behind a stand-in SGLang server), the real tool and reward services on loopback,
Generate over gRPC."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import torch
from google.protobuf import json_format
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_svc.config import InteractionEntry, RolloutConfig
from rollout_svc.engines.hf import HfEngine
from rollout_svc.engines.hf_options import HfEngineOptions
from rollout_svc.server import RolloutServicer
from rollout_svc.service import RolloutService
from tests.conftest import serve_in_process
from tests.in_process_services import reward_service_address, tool_service_address
from tests.rollout_svc.sglang_stand_in import SglangStandIn, engine_options
from tests.tool_svc.http_stand_in import serve_app
from turnrl import rpc
from turnrl.calculator_data import TOOLS, generate_problems
from turnrl.config import ClientConfig, ServerConfig
from turnrl.errors import ConfigError, InvalidArgumentError
from turnrl.messages import dict_to_message
from turnrl.trajectory import Trajectory
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

Source = common_pb2.SegmentSource
Finish = common_pb2.FinishReason


@contextlib.asynccontextmanager
async def rollout_server(
    model_dir, tool_address: str, reward_address: str, **settings
) -> AsyncIterator[rollout_pb2_grpc.RolloutServiceStub]:
    config = RolloutConfig(
        server=ServerConfig(port=0),
        model_path=str(model_dir),
        tool_service=ClientConfig(address=tool_address),
        reward_service=ClientConfig(address=reward_address),
        **settings,
    )
    service = await RolloutService.create(config)
    try:
        async with (
            serve_in_process(
                config.server,
                rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
                lambda s: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
                    RolloutServicer(service), s
                ),
            ) as address,
            rpc.open_channel(ClientConfig(address=address)) as channel,
        ):
            yield rollout_pb2_grpc.RolloutServiceStub(channel)
    finally:
        await service.close()


@contextlib.asynccontextmanager
async def rollout_stack(
    model_dir, **settings
) -> AsyncIterator[rollout_pb2_grpc.RolloutServiceStub]:
    """Tool, reward and rollout services on loopback; yields a rollout stub."""
    async with (
        tool_service_address() as tools,
        reward_service_address() as rewards,
        rollout_server(model_dir, tools, rewards, **settings) as stub,
    ):
        yield stub


def prompts(count: int, **fields) -> list[rollout_pb2.RolloutPrompt]:
    result = []
    for i, problem in enumerate(generate_problems(count, split="test")):
        prompt = rollout_pb2.RolloutPrompt(
            prompt_id=f"p{i}",
            messages=[dict_to_message(m) for m in problem.prompt_messages],
            tool_names=[tool["function"]["name"] for tool in TOOLS],
            data_source="openai/gsm8k",
            **fields,
        )
        json_format.ParseDict(str(problem.answer), prompt.ground_truth)
        result.append(prompt)
    return result


async def generate(stub, request: rollout_pb2.GenerateRequest) -> list[common_pb2.Trajectory]:
    return [reply.trajectory async for reply in stub.Generate(request, timeout=300)]


def teacher_forced_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]


@contextlib.asynccontextmanager
async def engine_settings(engine: str, model_dir) -> AsyncIterator[dict]:
    """The rollout config's settings for `engine`: for sglang, a stand-in SGLang server that
    serves the real model in `model_dir` (`sglang_stand_in`, model-backed)."""
    if engine == "hf":
        yield {}
        return
    model = await HfEngine.create(HfEngineOptions(), str(model_dir), max_model_len=2048)
    server = SglangStandIn(model_path=str(model_dir), model=model)
    try:
        async with serve_app(server.app()) as url:
            yield {"engine": "sglang", "engine_options": engine_options(url=url)}
    finally:
        await model.close()


@pytest.mark.parametrize("engine", ["hf", "sglang"])
async def test_multi_turn_trajectories_are_token_exact_and_scored(tiny_model_dir, engine):
    """On either engine: SGLang's (a stand-in of its HTTP API serving the same model) goes
    through the same agent loop, token in and token out."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    async with (
        engine_settings(engine, tiny_model_dir) as settings,
        rollout_stack(tiny_model_dir, **settings) as stub,
    ):
        request = rollout_pb2.GenerateRequest(
                prompts=prompts(4), n=2, enable_scoring=True,
                sampling=common_pb2.SamplingParams(temperature=1.0, seed=7),
                limits=common_pb2.LengthLimits(max_new_tokens=64),
            )  # fmt: skip
        trajectories = await generate(stub, request)
    assert sorted(t.trajectory_id for t in trajectories) == sorted(
        f"p{i}/{j}" for i in range(4) for j in range(2)
    )
    with_tools = [t for t in trajectories if t.metrics["tool_calls"] >= 1]
    assert len(with_tools) >= 4, [t.metrics for t in trajectories]
    for trajectory in trajectories:
        sources = [s.source for s in trajectory.segments]
        assert sources[0] == Source.SEGMENT_SOURCE_PROMPT and Source.SEGMENT_SOURCE_MODEL in sources
        token_ids = [t for s in trajectory.segments for t in s.token_ids]
        assert list(trajectory.loss_mask) == [
            s.source == Source.SEGMENT_SOURCE_MODEL
            for s in trajectory.segments
            for _ in s.token_ids
        ]
        assert list(trajectory.response_mask) == [
            s.source != Source.SEGMENT_SOURCE_PROMPT
            for s in trajectory.segments
            for _ in s.token_ids
        ]
        expected = teacher_forced_logprobs(model, token_ids)
        engine = torch.tensor([lp for s in trajectory.segments for lp in s.logprobs])
        positions = [i - 1 for i, m in enumerate(trajectory.loss_mask) if m]
        assert torch.allclose(engine, expected[positions], atol=1e-4), trajectory.trajectory_id
        assert trajectory.HasField("reward") and not trajectory.reward.error
        # One record on both sides of the wire: the trainer reads back what was sent.
        record = Trajectory.from_proto(trajectory)
        assert record.to_proto() == trajectory
        assert Trajectory.from_proto(record.to_proto()) == record
        assert record.token_ids == token_ids and record.loss_mask == list(trajectory.loss_mask)
    for trajectory in with_tools:
        sources = [s.source for s in trajectory.segments]
        assert sources[:4] == [
            Source.SEGMENT_SOURCE_PROMPT,
            Source.SEGMENT_SOURCE_MODEL,
            Source.SEGMENT_SOURCE_TOOL,
            Source.SEGMENT_SOURCE_TEMPLATE,
        ]
        tool_messages = [m for m in trajectory.messages if m.role == common_pb2.Message.ROLE_TOOL]
        assert tool_messages and tool_messages[0].content[0].text.strip().lstrip("-").isdigit()


@pytest.mark.parametrize(
    ("limits", "max_turns", "finish"),
    [
        ({"max_new_tokens": 3}, 0, Finish.FINISH_REASON_MAX_NEW_TOKENS),
        (
            {"max_new_tokens": 64, "max_response_length": 70},
            0,
            Finish.FINISH_REASON_MAX_RESPONSE_LENGTH,
        ),
        (
            {"max_new_tokens": 64, "max_response_length": 100, "max_model_len": 250},
            0,
            Finish.FINISH_REASON_MAX_MODEL_LEN,
        ),
        ({"max_new_tokens": 64}, 1, Finish.FINISH_REASON_MAX_TURNS),
    ],
)
async def test_each_limit_ends_the_trajectory_with_its_reason(
    tiny_model_dir, limits, max_turns, finish
):
    async with rollout_stack(tiny_model_dir) as stub:
        request = rollout_pb2.GenerateRequest(
                prompts=prompts(2), n=1, max_turns=max_turns,
                sampling=common_pb2.SamplingParams(temperature=0.0),
                limits=common_pb2.LengthLimits(**limits),
            )  # fmt: skip
        trajectories = await generate(stub, request)
    assert {t.finish_reason for t in trajectories} == {finish}
    for trajectory in trajectories:
        response = sum(len(s.token_ids) for s in trajectory.segments[1:])
        total = response + len(trajectory.segments[0].token_ids)
        if "max_response_length" in limits:
            assert response <= limits["max_response_length"]
        if "max_model_len" in limits:
            assert total <= limits["max_model_len"]


async def test_a_tool_service_that_dies_becomes_a_tool_error(tiny_model_dir):
    request = rollout_pb2.GenerateRequest(
            prompts=prompts(2), n=1, sampling=common_pb2.SamplingParams(temperature=0.0),
            limits=common_pb2.LengthLimits(max_new_tokens=64), max_turns=2,
        )  # fmt: skip
    async with contextlib.AsyncExitStack() as tool_lifetime, reward_service_address() as rewards:
        tools = await tool_lifetime.enter_async_context(tool_service_address())
        # A call to the dead service is tried again until its deadline: a short one here.
        async with rollout_server(
            tiny_model_dir, tools, rewards, tool_call_timeout_seconds=3.0
        ) as stub:
            before = await generate(stub, request)  # the rollout service knows the schemas now
            await tool_lifetime.aclose()  # the tool service dies
            trajectories = await generate(stub, request)
    assert sum(t.metrics["tool_calls"] - t.metrics["tool_errors"] for t in before) >= 1
    assert len(trajectories) == 2
    called = [t for t in trajectories if t.metrics["tool_calls"] >= 1]
    assert called and all(t.metrics["tool_errors"] >= 1 for t in called)
    tool_texts = [
        m.content[0].text
        for t in called
        for m in t.messages
        if m.role == common_pb2.Message.ROLE_TOOL
    ]
    # Well-formed calls reach the dead service; after that error the model may write a broken
    # call, which the parser reports instead.
    assert "tool service could not run" in tool_texts[0], tool_texts
    assert all(
        "tool service could not run" in text or "malformed tool call" in text for text in tool_texts
    ), tool_texts
    # Calls the dead service could not run are infrastructure failures, counted apart (the
    # trainer keeps such trajectories out of the loss); a broken call is the model's own.
    assert all(t.metrics["tool_infra_errors"] == 0 for t in before)
    for trajectory in trajectories:
        unrun = sum(
            "tool service could not run" in m.content[0].text
            for m in trajectory.messages
            if m.role == common_pb2.Message.ROLE_TOOL
        )
        assert trajectory.metrics["tool_infra_errors"] == unrun
    assert called[0].metrics["tool_infra_errors"] >= 1  # its first call reached the dead service


async def test_abort_returns_the_partial_trajectories(tiny_model_dir):
    async with rollout_stack(
        tiny_model_dir, max_new_tokens=2000, max_response_length=2000, max_model_len=2048
    ) as stub:
        request = rollout_pb2.GenerateRequest(
                prompts=prompts(2), n=2, request_id="to-abort",
                sampling=common_pb2.SamplingParams(temperature=1.5, seed=1),
                limits=common_pb2.LengthLimits(max_new_tokens=1900, max_response_length=1950, max_model_len=2048),
            )  # fmt: skip
        call = stub.Generate(request, timeout=300)
        stats = rollout_pb2.GetStatsRequest()
        async with asyncio.timeout(60):  # until all four are generating
            while (await stub.GetStats(stats, timeout=10)).running_trajectories < 4:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        aborted = await stub.Abort(rollout_pb2.AbortRequest(request_id="to-abort"), timeout=10)
        trajectories = [reply.trajectory async for reply in call]
    assert aborted.aborted_trajectories >= 1
    assert len(trajectories) == 4
    assert any(t.finish_reason == Finish.FINISH_REASON_ABORTED for t in trajectories)
    # However the abort fell (mid-turn, or between a tool result and the next token), none fails.
    assert all(t.finish_reason != Finish.FINISH_REASON_ERROR for t in trajectories), [
        t.error_message for t in trajectories
    ]


async def test_bad_requests_are_invalid_argument(tiny_model_dir):
    async with rollout_stack(tiny_model_dir) as stub:
        for request, message in [
            (rollout_pb2.GenerateRequest(), "prompts is empty"),
            (
                rollout_pb2.GenerateRequest(
                    prompts=prompts(1), limits=common_pb2.LengthLimits(max_new_tokens=5000)
                ),
                "max_new_tokens 5000 exceeds max_response_length",
            ),
            (
                rollout_pb2.GenerateRequest(
                    prompts=[rollout_pb2.RolloutPrompt(messages=[common_pb2.Message()])]
                ),
                "message role 0 is not set",
            ),
        ]:
            with pytest.raises(InvalidArgumentError) as info:
                await generate(stub, request)
            assert message in info.value.details


async def test_gsm8k_interaction_answers_the_model(tiny_model_dir):
    interaction = InteractionEntry(name="checker", class_name="gsm8k", config={"max_attempts": 2})
    async with rollout_stack(tiny_model_dir, interactions=[interaction]) as stub:
        request = rollout_pb2.GenerateRequest(
                prompts=prompts(3, interaction_name="checker"), n=1,
                sampling=common_pb2.SamplingParams(temperature=0.0),
                limits=common_pb2.LengthLimits(max_new_tokens=64),
            )  # fmt: skip
        for prompt, problem in zip(
            request.prompts, generate_problems(3, split="test"), strict=True
        ):
            prompt.interaction_kwargs.update({"ground_truth": str(problem.answer)})
        trajectories = await generate(stub, request)
    ended = {t.finish_reason for t in trajectories}
    # A right answer ends the conversation; after "try again" the tiny model may ramble on.
    assert Finish.FINISH_REASON_INTERACTION_TERMINATED in ended
    assert ended <= {
        Finish.FINISH_REASON_INTERACTION_TERMINATED,
        Finish.FINISH_REASON_MAX_TURNS,
        Finish.FINISH_REASON_MAX_NEW_TOKENS,
    }
    users = [s for t in trajectories for s in t.segments if s.source == Source.SEGMENT_SOURCE_USER]
    replies = [
        m for t in trajectories for m in t.messages[2:] if m.role == common_pb2.Message.ROLE_USER
    ]
    assert len(users) == len(replies)


async def test_a_stop_id_of_ordinary_text_ends_the_turn_and_the_template_closes_it(
    tiny_model_dir,
):
    """A caller's stop id that is no special token ("\\n", a word) is where the model stopped,
    not where the template ends a turn: the next turn's tokens (a tool result or the checker's
    answer) start with the template's own close of the assistant turn, as after a stop string,
    and the stop text stays out of the message."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    interaction = InteractionEntry(name="checker", class_name="gsm8k", config={"max_attempts": 2})
    async with rollout_stack(tiny_model_dir, interactions=[interaction]) as stub:
        request = rollout_pb2.GenerateRequest(
            prompts=prompts(1, interaction_name="checker"),
            sampling=common_pb2.SamplingParams(temperature=0.0),
            limits=common_pb2.LengthLimits(max_new_tokens=64),
        )
        request.prompts[0].interaction_kwargs.update({"ground_truth": "-1"})  # never right
        [unstopped] = await generate(stub, request)
        first_turn = next(s for s in unstopped.segments if s.source == Source.SEGMENT_SOURCE_MODEL)
        # Its first id of visible text past the first token ("{" of a tool call's JSON).
        special = set(tokenizer.all_special_ids)
        stop_id = next(
            i
            for i in first_turn.token_ids[1:]
            if i not in special and tokenizer.decode([i]).strip()
        )
        request.sampling.stop_token_ids.append(stop_id)
        [stopped] = await generate(stub, request)
    assert stopped.finish_reason != Finish.FINISH_REASON_ERROR, stopped.error_message
    sources = [s.source for s in stopped.segments]
    model_turn = sources.index(Source.SEGMENT_SOURCE_MODEL)
    assert stopped.segments[model_turn].token_ids[-1] == stop_id
    next_turn = stopped.segments[model_turn + 1]  # a tool result or the checker's answer
    assert next_turn.source in (Source.SEGMENT_SOURCE_TOOL, Source.SEGMENT_SOURCE_USER)
    assert tokenizer.decode(next_turn.token_ids).startswith("<|im_end|>\n<|im_start|>")
    message = stopped.messages[2]
    assert message.role == common_pb2.Message.ROLE_ASSISTANT
    assert tokenizer.decode([stop_id]) not in str(message)


async def test_a_service_without_a_model_refuses_to_start():
    """No service builds the tiny model for itself: the wiring (`turnrl serve`, `up`, `run`)
    sets a null model_path, and a service given none says so."""
    config = RolloutConfig(server=ServerConfig(port=0))
    with pytest.raises(ConfigError, match=r"rollout\.model_path is null"):
        await RolloutService.create(config)
