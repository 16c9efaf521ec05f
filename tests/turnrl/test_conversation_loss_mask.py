"""`conversation_ids_and_loss_mask`: a written conversation (SFT data) becomes the trajectory of a
policy that wrote exactly its assistant messages, with the loss on those messages' tokens only.
Checked against every fixture chat template that renders tools (the cases of the rollout's
`ConversationTokens` tests) and, by exact strings, against the fixture Qwen2.5 tokenizer."""

import pytest
from transformers import AutoTokenizer

from turnrl.chat_tokens import conversation_ids_and_loss_mask
from turnrl.errors import FailedPreconditionError, InvalidArgumentError

from ..rollout_svc.chat_template_cases import (
    CASES,
    CONVERSATIONS,
    TOKENIZERS,
    TOOLS,
    Renderer,
    TemplateCase,
    conversation,
    rollout,
)


def masked_runs(ids: list[int], loss_mask: list[bool]) -> list[list[int]]:
    """The ids of each run of consecutive True in `loss_mask`."""
    runs: list[list[int]] = []
    for index, (token, masked) in enumerate(zip(ids, loss_mask, strict=True)):
        if masked:
            if index == 0 or not loss_mask[index - 1]:
                runs.append([])
            runs[-1].append(token)
    return runs


def written(renderer: Renderer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """The ids and loss mask of `messages` with the renderer's template and stop tokens."""
    return conversation_ids_and_loss_mask(
        renderer.tokenizer,
        messages,
        TOOLS,
        renderer.template,
        renderer.case.chat_template_kwargs,
        stop_token_ids=renderer.tokenizer.convert_tokens_to_ids(list(renderer.case.stop_tokens)),
    )


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_written_conversation_is_the_rollout_of_its_assistant_messages(
    case: TemplateCase, tokenizer_name: str
):
    renderer = Renderer(case, tokenizer_name)
    for seed, rounds_count in CONVERSATIONS:
        prompt, rounds = conversation(case, seed, rounds_count)
        whole = [*prompt, *(message for a, answers in rounds for message in (a, *answers))]
        if case.stop_by_next_role:
            # GLM-4.5 closes no assistant message: the model stops on the next message's
            # opener, so a message alone does not say where its turn ends.
            with pytest.raises(FailedPreconditionError, match="none of the stop tokens"):
                written(renderer, whole)
            continue
        segments, _ = rollout(renderer, prompt, rounds)
        ids, loss_mask = written(renderer, whole)
        assert ids == [token for segment in segments for token in segment], f"seed {seed}"
        # Segments alternate prompt-or-delta, model turn, delta, ...
        model_mask = [index % 2 == 1 for index, segment in enumerate(segments) for _ in segment]
        assert loss_mask == model_mask, f"seed {seed}"


def test_qwen25_tool_conversation_masks_exactly_the_assistant_tokens(fixtures):
    tokenizer = AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen2.5")
    paris = {"name": "get_weather", "arguments": {"city": "Paris"}}
    rome = {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking both.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": paris},
                {"id": "b", "type": "function", "function": rome},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
        {"role": "assistant", "content": "Paris: sunny. Rome: rain."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    ids, loss_mask = conversation_ids_and_loss_mask(tokenizer, messages, TOOLS)

    # Qwen2.5's template keeps history as it was written: the ids are one render of the whole.
    assert ids == tokenizer.apply_chat_template(messages, tools=TOOLS, return_dict=False)
    assert [tokenizer.decode(run) for run in masked_runs(ids, loss_mask)] == [
        "Checking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'
        "</tool_call><|im_end|>",
        "Paris: sunny. Rome: rain.<|im_end|>",
        "You're welcome.<|im_end|>",
    ]
    unmasked = tokenizer.decode([t for t, masked in zip(ids, loss_mask, strict=True) if not masked])
    assert unmasked.endswith(
        "<|im_start|>assistant\n\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n\n"
        "<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n\n"
    )


@pytest.mark.parametrize(
    ("roles", "message"),
    [
        (["user"], "needs an assistant message after the first"),
        (["assistant", "user"], "needs an assistant message after the first"),
        (["user", "assistant", "assistant"], "two assistant messages in a row"),
    ],
)
def test_conversations_without_model_turns_in_place_are_refused(fixtures, roles, message):
    tokenizer = AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen2.5")
    messages = [{"role": role, "content": "Hi."} for role in roles]
    with pytest.raises(InvalidArgumentError, match=message) as info:
        conversation_ids_and_loss_mask(tokenizer, messages, None)
    assert repr(roles) in str(info.value)
