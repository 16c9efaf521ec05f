"""`ConversationTokens` against turnrl's own chat template (the tiny model's) and every fixture
chat template that supports tools, with both Qwen tokenizers: simulated rollouts must add up to
exactly what the template renders for the whole conversation, or differ from it only by the
history rewrite the template is known for; control tokens spelled in messages stay text. The
templates, and what each is known to rewrite, are described in chat_template_cases.py; one
conversation's turns, defaults and refusals are in test_chat_tokens_turns.py.
"""

from pathlib import Path

import jinja2
import pytest

from .chat_template_cases import (
    CASES,
    CONVERSATIONS,
    HISTORY_REWRITES,
    TOKENIZERS,
    TOOLS,
    TURNRL_TEMPLATE,
    Renderer,
    TemplateCase,
    conversation,
    rollout,
    tokenizer_for,
)


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_rollout_adds_up_to_the_template_render(case: TemplateCase, tokenizer_name: str):
    renderer = Renderer(case, tokenizer_name)
    rewrite = HISTORY_REWRITES.get(case.template)
    rewritten_turns = 0
    for seed, rounds_count in CONVERSATIONS:
        prompt, rounds = conversation(case, seed, rounds_count)
        segments, generation_prompt = rollout(renderer, prompt, rounds)
        whole = [*prompt, *(message for a, answers in rounds for message in (a, *answers))]
        fresh = renderer.ids(whole, add_generation_prompt=True)
        if rewrite is None:
            assert [token for segment in segments for token in segment] == fresh, f"seed {seed}"
            continue
        # The fresh render must be the trajectory with each model turn, from its generation
        # prompt on, in the form the template gives it as history; nothing else may differ.
        expected = []
        for turn, (before, model_ids) in enumerate(
            zip(segments[::2], segments[1::2], strict=False)
        ):
            expected += before[: len(before) - len(generation_prompt)]
            turn_ids = generation_prompt + model_ids
            turn_text = renderer.tokenizer.decode(turn_ids)
            answers_after = [message for _, answers in rounds[turn:] for message in answers]
            history_text = rewrite(turn_text, any(m["role"] == "user" for m in answers_after))
            rewritten_turns += history_text != turn_text
            expected += turn_ids if history_text == turn_text else renderer.encode(history_text)
        expected += segments[-1]
        assert expected == fresh, f"seed {seed}"
    assert rewrite is None or rewritten_turns > 0, "no conversation exercised the rewrite"


def renders_tools(tokenizer, template: str) -> bool:
    """Whether a tool conversation renders both the tool's result and its schema, with the
    call's arguments as an object or as JSON text (templates take one or the other)."""
    for arguments in ({"city": "Paris"}, '{"city": "Paris"}'):
        call = {"id": "c00000001", "type": "function"}
        call["function"] = {"name": "get_weather", "arguments": arguments}
        probe = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "name": "get_weather"}
            | {"content": "RESULT_7f3"},
        ]
        try:
            text = tokenizer.apply_chat_template(
                probe, tools=TOOLS, chat_template=template, tokenize=False, bos_token="<s>"
            )
        except (jinja2.TemplateError, TypeError):  # refuses the tool role or these arguments
            continue
        if "RESULT_7f3" in text and "Current weather and forecast" in text:
            return True
    return False


def test_the_tool_templates_are_the_ones_that_render_tools(fixtures: Path):
    """The template list above is turnrl's and every fixture template that renders tools."""
    tokenizer = tokenizer_for("qwen3", ())
    with_tools = {
        path.stem
        for path in (fixtures / "chat_templates").glob("*.jinja")
        if renders_tools(tokenizer, path.read_text())
    }
    assert with_tools | {TURNRL_TEMPLATE} == {case.template for case in CASES}


SPELLED = "<|im_end|> <|im_start|>user <tool_call> </tool_call> </tool_response> <think>"


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_control_tokens_spelled_in_messages_stay_text(case: TemplateCase, tokenizer_name: str):
    """A prompt, tool result and user turn that spell control tokens (ChatML's, Qwen's tool tags,
    the family's turn markers) add no control ids: the trajectory holds the same control ids,
    in the same order, as with plain text there, and decodes back to the spelled text."""
    renderer = Renderer(case, tokenizer_name)
    tokenizer = renderer.tokenizer
    spelled = " ".join((SPELLED, *case.control_tokens, *case.stop_tokens))
    # transformers' control tokens: the special ones and the added ones the template writes.
    control_ids = set(tokenizer.all_special_ids) | {
        token_id
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.content in renderer.template
    }
    call = {"id": "c00000001", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": {"city": "Paris"}}

    thinking = {case.reasoning_key: "Thinking."} if case.reasoning_key else {}

    def play(text: str) -> tuple[list[int], str]:
        rounds = [
            (
                {"role": "assistant", "content": "", "tool_calls": [call], **thinking},
                [
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "name": "get_weather",
                        "content": text,
                    }
                ],
            )
        ]
        if case.user_turns:
            rounds.append(
                (
                    {"role": "assistant", "content": "Done.", **thinking},
                    [{"role": "user", "content": text}],
                )
            )
        segments, _ = rollout(renderer, [{"role": "user", "content": text}], rounds)
        ids = [token for segment in segments for token in segment]
        return [token for token in ids if token in control_ids], tokenizer.decode(ids)

    plain_control_ids, _ = play("before after")
    spelled_control_ids, decoded = play(f"before {spelled} after")
    assert spelled_control_ids == plain_control_ids
    assert decoded.count(f"before {spelled} after") == (3 if case.user_turns else 2)
