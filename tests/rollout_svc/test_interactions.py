"""Simulated users: the GSM8K checker, and a chat model on an OpenAI-compatible endpoint."""

import pytest

from rollout_svc.interactions.gsm8k import Gsm8kInteraction, Gsm8kInteractionOptions
from rollout_svc.interactions.llm_user import LlmUser, LlmUserOptions
from tests.reward_svc.judge_stand_in import ChatCompletionsStandIn
from tests.tool_svc.http_stand_in import serve_app


async def test_gsm8k_checker_lets_the_model_retry_then_stops():
    checker = Gsm8kInteraction(Gsm8kInteractionOptions(max_attempts=2))
    state = await checker.start(ground_truth="#### 18")
    wrong = await checker.respond(state, [{"role": "assistant", "content": "It is 17."}])
    assert not wrong.terminate and wrong.score == 0.0 and "incorrect" in wrong.text
    right = await checker.respond(state, [{"role": "assistant", "content": "So #### 18"}])
    assert right.terminate and right.score == 1.0
    state = await checker.start(ground_truth="3")
    await checker.respond(state, [{"role": "assistant", "content": "1"}])
    last = await checker.respond(state, [{"role": "assistant", "content": "2"}])
    assert last.terminate and last.score == 0.0  # out of tries


async def test_gsm8k_checker_needs_a_number():
    with pytest.raises(ValueError, match="numeric ground_truth"):
        await Gsm8kInteraction(Gsm8kInteractionOptions()).start(ground_truth="unknown")


async def test_llm_user_sees_the_conversation_from_its_side_and_ends_it():
    stand_in = ChatCompletionsStandIn(["Thanks, and what is 2+2?", "Great. [DONE]"])
    async with serve_app(stand_in.app) as url:
        user = LlmUser(
            LlmUserOptions(
                base_url=f"{url}/v1", model="sim", system_prompt="You want help with {topic}."
            )
        )
        try:
            state = await user.start(topic="arithmetic")
            conversation = [
                {"role": "system", "content": "policy system prompt"},
                {"role": "user", "content": "What is 1+1?"},
                {"role": "assistant", "content": "2"},
            ]
            first = await user.respond(state, conversation)
            second = await user.respond(
                state,
                [
                    *conversation,
                    {"role": "user", "content": first.text},
                    {"role": "assistant", "content": "4"},
                ],
            )
        finally:
            await user.close()
    assert not first.terminate and first.text == "Thanks, and what is 2+2?"
    assert first.score is None  # it scores no turn: no turn reward
    assert second.terminate and second.text == "Great."
    sent = stand_in.requests[0].body["messages"]
    assert sent == [
        {"role": "system", "content": "You want help with arithmetic."},
        {"role": "assistant", "content": "What is 1+1?"},
        {"role": "user", "content": "2"},
    ]


async def test_llm_user_persona_placeholders_must_be_given():
    user = LlmUser(
        LlmUserOptions(base_url="http://127.0.0.1:1/v1", model="m", system_prompt="{goal}")
    )
    try:
        with pytest.raises(ValueError, match=r"interaction_kwargs\['goal'\]"):
            await user.start()
    finally:
        await user.close()


async def test_llm_user_unreachable_names_the_url():
    user = LlmUser(LlmUserOptions(base_url="http://127.0.0.1:1/v1", model="m", max_retries=0))
    try:
        state = await user.start()
        with pytest.raises(
            RuntimeError,
            match=r"simulated user at 'http://127.0.0.1:1/v1/chat/completions' is unreachable",
        ):
            await user.respond(state, [{"role": "assistant", "content": "hi"}])
    finally:
        await user.close()
