"""examples/retool with Qwen3: the multi-turn SFT ids of ReTool-SFT rows equal the ids the
rollout builds turn by turn (turnrl/chat_tokens.py), with thinking on, off by the data, and off
by the template switch. The rows and fixtures are test_retool.py's (tests/examples/conftest.py
shares its fixtures)."""

import json

from rollout_svc.parsers import parse_hermes
from trainer_svc.data import ConversationRecord
from trainer_svc.sft import tokenize_conversations
from turnrl.chat_tokens import ConversationTokens

from ..turnrl.test_conversation_loss_mask import masked_runs


def qwen3_turn_text(message: dict, think_block: bool) -> str:
    """What Qwen3 writes for an assistant message: its <think> block (with thinking switched
    off by the template, none), its text, then each call as hermes JSON."""
    text = message["content"]
    if think_block:
        text = f"<think>\n{message.get('reasoning_content', '')}\n</think>\n\n{text}"
    for index, call in enumerate(message.get("tool_calls", [])):
        arguments = json.dumps(call["function"]["arguments"], ensure_ascii=False)
        separator = "\n" if message["content"] or index else ""
        text += (
            f'{separator}<tool_call>\n{{"name": "python", "arguments": {arguments}}}\n</tool_call>'
        )
    return text


def rollout_ids(
    tokenizer,
    messages: list[dict],
    tools: list[dict],
    think_block: bool,
    kwargs: dict | None = None,
) -> tuple[list[int], list[bool]]:
    """The ids and loss mask of a rollout whose engine wrote `messages`' assistant turns, as the
    agent loop builds them: the prompt rendered once, each model turn's output ids kept as they
    came (ending on <|im_end|>) with the message the hermes parser makes of them, and only the
    messages after each turn rendered."""
    tokens = ConversationTokens(tokenizer, None, tools, kwargs)
    first = next(index for index, m in enumerate(messages) if m["role"] == "assistant")
    ids = tokens.prompt_ids(messages[:first])
    loss_mask = [False] * len(ids)
    for index in range(first, len(messages)):
        message = messages[index]
        if message["role"] != "assistant":
            continue
        text = qwen3_turn_text(message, think_block)
        output_ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        parsed = parse_hermes(tokens.model_turn_text(output_ids))
        tokens.append_model_turn(output_ids, parsed.assistant_message())
        following = []
        for later in messages[index + 1 :]:
            if later["role"] == "assistant":
                break
            following.append(later)
        new_ids = tokens.append_messages(following) if following else []
        ids += output_ids + new_ids
        loss_mask += [True] * len(output_ids) + [False] * len(new_ids)
    return ids, loss_mask


def assert_sft_is_the_rollout(tokenizer, sft, rollout) -> None:
    """SFT's ids and loss mask are the rollout's, then what the template writes after the last
    turn (`\\n`), outside the loss."""
    (sft_ids, sft_mask, _), (ids, loss_mask) = sft, rollout
    assert sft_ids[: len(ids)] == ids
    assert sft_mask[: len(ids)] == loss_mask
    assert tokenizer.decode(sft_ids[len(ids) :]) == "\n" and not any(sft_mask[len(ids) :])


def test_qwen3_sft_keeps_every_turns_thinking_as_the_rollout_does(
    qwen3, sft_records, qwen3_max_length
):
    """Thinking on: the SFT path's ids of a ReTool conversation are the ids of a rollout of the
    same turns, each turn's <think> block in the loss."""
    conversation = sft_records[True][0]
    (sft,) = tokenize_conversations(qwen3, [conversation], qwen3_max_length)
    sft_ids, sft_mask, _ = sft
    rollout = rollout_ids(qwen3, conversation.messages, conversation.tools, think_block=True)
    assert_sft_is_the_rollout(qwen3, sft, rollout)
    assert [qwen3.decode(run) for run in masked_runs(sft_ids, sft_mask)][:2] == [
        "<think>\nFirst compute the power exactly.\n</think>\n\n<tool_call>\n"
        '{"name": "python", "arguments": {"code": "n = 2**100\\nprint(n)"}}\n</tool_call><|im_end|>',
        "<think>\nNow add its digits.\n</think>\n\n<tool_call>\n"
        '{"name": "python", "arguments": {"code": "print(sum(int(d) for d in str(n)))"}}\n'
        "</tool_call><|im_end|>",
    ]


def test_qwen3_keeps_the_thinking_its_template_drops_after_a_new_user_turn(
    qwen3, sft_records, qwen3_max_length
):
    """After a second user message Qwen3's template renders the earlier turns without their
    <think> blocks; SFT and rollout keep them, as the model wrote them."""
    first = sft_records[True][0]
    messages = [
        *first.messages,
        {"role": "user", "content": "Check it once more."},
        {"role": "assistant", "content": "\\boxed{115}", "reasoning_content": "115 stands."},
    ]
    conversation = ConversationRecord("two-questions", messages, first.tools)
    (sft,) = tokenize_conversations(qwen3, [conversation], qwen3_max_length)
    assert_sft_is_the_rollout(qwen3, sft, rollout_ids(qwen3, messages, first.tools, True))
    rerendered = qwen3.apply_chat_template(messages, tools=first.tools, tokenize=False)
    assert "First compute the power exactly." not in rerendered
    thinking = qwen3.decode([t for t, m in zip(sft.token_ids, sft.loss_mask, strict=True) if m])
    for reasoning in ("First compute the power exactly.", "Now add its digits.", "115 stands."):
        assert f"<think>\n{reasoning}\n</think>" in thinking


def test_qwen3_thinking_off_the_model_writes_every_empty_think_block(
    qwen3, sft_records, qwen3_max_length
):
    """Thinking off by the data (no reasoning): every assistant turn, as the template writes it
    alone, opens with an empty <think> block the model writes; a re-render of the history would
    drop the earlier ones."""
    conversation = sft_records[False][0]
    (sft,) = tokenize_conversations(qwen3, [conversation], qwen3_max_length)
    assert_sft_is_the_rollout(
        qwen3, sft, rollout_ids(qwen3, conversation.messages, conversation.tools, True)
    )
    runs = [qwen3.decode(run) for run in masked_runs(sft.token_ids, sft.loss_mask)]
    assert len(runs) == 3 and all(run.startswith("<think>\n\n</think>\n\n") for run in runs)
    rerendered = qwen3.apply_chat_template(
        conversation.messages, tools=conversation.tools, tokenize=False
    )
    assert rerendered.count("<think>") == 1


def test_qwen3_thinking_off_by_the_template_agrees_too(qwen3, sft_records, qwen3_max_length):
    """With enable_thinking false (trainer.data.chat_template_kwargs, which the SFT renders with
    and the trainer sends with every RL prompt) the generation prompt holds the empty <think>
    block: it is outside the loss, in SFT as in the rollout."""
    conversation = sft_records[False][0]
    kwargs = {"enable_thinking": False}
    (sft,) = tokenize_conversations(qwen3, [conversation], qwen3_max_length, kwargs)
    rollout = rollout_ids(qwen3, conversation.messages, conversation.tools, False, kwargs)
    assert_sft_is_the_rollout(qwen3, sft, rollout)
    assert not any(
        "<think>" in qwen3.decode(run) for run in masked_runs(sft.token_ids, sft.loss_mask)
    )
    unmasked = qwen3.decode([t for t, m in zip(sft.token_ids, sft.loss_mask, strict=True) if not m])
    assert unmasked.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == 3
