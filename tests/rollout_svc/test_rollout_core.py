"""RolloutService in-process on the hf engine with a small random Qwen3 model and the real
Qwen2.5 tokenizer and template, against the real tool and reward services on loopback.

A random model never writes a tool call, so these tests cover what every trajectory does:
token-exact prompts, masks, logprobs equal to a teacher-forced pass, each length limit, abort,
and scoring. Tool-calling trajectories need the trained tiny calculator model.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from rollout_svc.agent_loop import PromptSpec
from rollout_svc.config import RolloutConfig
from rollout_svc.engines.base import SamplingParams
from rollout_svc.service import RolloutService
from tests.in_process_services import reward_service_address, tool_service_address
from turnrl.calculator_data import TOOLS, generate_problems
from turnrl.chat_tokens import ConversationTokens
from turnrl.config import ClientConfig, ServerConfig
from turnrl.errors import InvalidArgumentError, UnavailableError
from turnrl.trajectory import FinishReason, SegmentSource, Trajectory


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


async def test_dead_reward_service_marks_the_reward_as_an_error(random_model_dir):
    async with rollout(random_model_dir) as service:
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
