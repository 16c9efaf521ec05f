"""`ConversationTokens` one turn at a time: the tokenizer's own template and eos as defaults,
`chat_template_kwargs` in every render, the text a turn decodes to, and what it refuses (a
template that is not prefix-preserving or rewrites the stop token, a turn cut short, calls
out of order, bad messages). Every template's whole rollouts are in test_chat_tokens.py."""

import pytest
from transformers import AutoTokenizer

from turnrl.chat_tokens import ConversationTokens
from turnrl.errors import FailedPreconditionError, InvalidArgumentError

from .chat_template_cases import CASES_BY_ID, TOKENIZERS, Renderer


def assistant(content: str) -> dict:
    """The message a model turn stands for in the conversation."""
    return {"role": "assistant", "content": content}


def test_a_template_that_is_not_prefix_preserving_is_named():
    """vLLM's Mistral template moves the tool list to the newest user message."""
    renderer = Renderer(CASES_BY_ID["mistral-vllm-tool-example"], "qwen3")
    tokens = renderer.conversation_tokens()
    tokens.prompt_ids([{"role": "user", "content": "Hi"}])
    tokens.append_model_turn(renderer.encode(" Hello.<|im_end|>"), assistant(" Hello."))
    with pytest.raises(FailedPreconditionError, match=r"chat template sha256:\w{12} is not pref"):
        tokens.append_messages([{"role": "user", "content": "And now?"}])


def test_a_template_that_rewrites_the_stop_token_is_refused():
    """gpt-oss writes `<|end|>` after a final answer in history; the model stopped on
    `<|return|>`, so its ids cannot be continued."""
    renderer = Renderer(CASES_BY_ID["gpt-oss"], "qwen3")
    tokens = renderer.conversation_tokens()
    tokens.prompt_ids([{"role": "user", "content": "Hi"}])
    # "Hello." is what a harmony parser makes of the turn.
    tokens.append_model_turn(
        renderer.encode("<|channel|>final<|message|>Hello.<|return|>"), assistant("Hello.")
    )
    with pytest.raises(FailedPreconditionError, match=r"stopped on \('<\|return\|>'\)"):
        tokens.append_messages([{"role": "user", "content": "And now?"}])


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_the_tokenizers_own_template_and_eos_close_a_turn_once(tokenizer_name: str, fixtures):
    """Defaults: the tokenizer's chat template and its eos token. The newline ChatML writes after
    `<|im_end|>` comes in the delta, right after the model's stop token."""
    tokenizer = AutoTokenizer.from_pretrained(fixtures / "tokenizers" / tokenizer_name)
    tokens = ConversationTokens(tokenizer, None, None)
    prompt = [{"role": "user", "content": "Hi"}]
    prompt_ids = tokens.prompt_ids(prompt)
    output_ids = tokenizer.encode("Hello!<|im_end|>", add_special_tokens=False)
    assert tokens.model_turn_text(output_ids) == "Hello!"
    tokens.append_model_turn(output_ids, assistant("Hello!"))
    delta = tokens.append_messages([{"role": "user", "content": "Bye"}])
    assert tokenizer.decode(delta) == "\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    whole = [
        *prompt,
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    fresh = tokenizer.apply_chat_template(whole, add_generation_prompt=True, return_dict=False)
    assert prompt_ids + output_ids + delta == fresh


def test_chat_template_kwargs_reach_every_render():
    renderer = Renderer(CASES_BY_ID["qwen3-nothink"], "qwen3")
    tokens = renderer.conversation_tokens()
    prompt_ids = tokens.prompt_ids([{"role": "user", "content": "Hi"}])
    empty_think = renderer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokens.generation_prompt_ids == empty_think
    assert prompt_ids[-len(empty_think) :] == empty_think
    tokens.append_model_turn(renderer.encode("Hello!<|im_end|>"), assistant("Hello!"))
    assert tokens.append_messages([{"role": "user", "content": "Bye"}])[-len(empty_think) :] == (
        empty_think
    )


def test_a_turn_cut_by_max_new_tokens_ends_the_conversation():
    renderer = Renderer(CASES_BY_ID["qwen2.5-instruct"], "qwen2.5")
    tokens = renderer.conversation_tokens()
    tokens.prompt_ids([{"role": "user", "content": "Count to ten."}])
    output_ids = renderer.encode("One, two, three")
    assert tokens.model_turn_text(output_ids) == "One, two, three"
    tokens.append_model_turn(output_ids, assistant("One, two, three"))
    with pytest.raises(FailedPreconditionError, match=r"ended on token \d+, not on a stop token"):
        tokens.append_messages([{"role": "user", "content": "Go on."}])


@pytest.mark.parametrize("case_id", ["qwen2.5-instruct", "glm-4-moe", "llama-3.1-instruct"])
def test_a_turn_that_ended_on_a_stop_string_is_closed_by_the_template(case_id: str):
    """The model's ids end with a ReAct stop string and no stop token; its message holds the
    text before the stop string. The delta brings the template's end of the turn: a fresh
    render of the conversation ends with that text, then the delta."""
    renderer = Renderer(CASES_BY_ID[case_id], "qwen3")
    tokens = renderer.conversation_tokens()
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    tokens.prompt_ids(prompt)
    content = "Thought: add them.\nAction: calculator 2 + 3"
    output_ids = renderer.encode(content + "\nObservation:")
    tokens.append_model_turn(output_ids, assistant(content), ended_on_stop_string=True)
    observation = {"role": "user", "content": "Observation: 5"}
    delta = tokens.append_messages([observation])
    fresh = renderer.text([*prompt, assistant(content), observation], add_generation_prompt=True)
    assert fresh.endswith(content + renderer.tokenizer.decode(delta))


def test_a_turns_text_is_the_decoded_turn_without_its_stop_token():
    renderer = Renderer(CASES_BY_ID["qwen3"], "qwen3")
    tokens = renderer.conversation_tokens()
    tokens.prompt_ids([{"role": "user", "content": "Hi"}])
    output_ids = renderer.encode("<think>\nhm\n</think>\n\nHello 👋<|im_end|>")
    assert tokens.model_turn_text(output_ids) == "<think>\nhm\n</think>\n\nHello 👋"


def test_calls_out_of_order_and_bad_messages_are_refused():
    renderer = Renderer(CASES_BY_ID["qwen2.5-instruct"], "qwen2.5")
    tokens = renderer.conversation_tokens()
    stop = renderer.encode("Hi<|im_end|>")
    with pytest.raises(FailedPreconditionError, match="after prompt_ids"):
        tokens.generation_prompt_ids  # noqa: B018
    with pytest.raises(FailedPreconditionError, match="before prompt_ids"):
        tokens.append_model_turn(stop, assistant("Hi"))
    with pytest.raises(InvalidArgumentError, match=r"got \[\]"):
        tokens.prompt_ids([])
    tokens.prompt_ids([{"role": "user", "content": "Hi"}])
    with pytest.raises(FailedPreconditionError, match="called already"):
        tokens.prompt_ids([{"role": "user", "content": "Hi"}])
    with pytest.raises(FailedPreconditionError, match="must follow a model turn"):
        tokens.append_messages([{"role": "user", "content": "Hi"}])
    with pytest.raises(InvalidArgumentError, match=r"got \[\]"):
        tokens.append_model_turn([], assistant("Hi"))
    with pytest.raises(InvalidArgumentError, match="expected an assistant message"):
        tokens.append_model_turn(stop, {"role": "user", "content": "Hi"})
    tokens.append_model_turn(stop, assistant("Hi"))
    with pytest.raises(FailedPreconditionError, match="two model turns in a row"):
        tokens.append_model_turn(stop, assistant("Hi"))
    with pytest.raises(InvalidArgumentError, match=r"\['tool', 'assistant'\]"):
        tokens.append_messages([{"role": "tool", "content": "1"}, {"role": "assistant"}])
    with pytest.raises(InvalidArgumentError, match=r"got \[\]"):
        tokens.append_messages([])
    assert tokens.append_messages([{"role": "user", "content": "Bye"}])


def test_a_prompt_is_rendered_once_for_the_conversations_that_share_it(monkeypatch):
    renderer = Renderer(CASES_BY_ID["qwen2.5-instruct"], "qwen2.5")
    renders = []
    render = ConversationTokens._render

    def counted(self, messages, add_generation_prompt):
        renders.append(messages)
        return render(self, messages, add_generation_prompt)

    monkeypatch.setattr(ConversationTokens, "_render", counted)
    prompt = [{"role": "user", "content": "What is 6 x 7?"}]
    first = renderer.conversation_tokens().prompt_ids(prompt)
    # The prompt, and the base with and without the generation prompt unless an earlier test
    # of this tokenizer rendered them.
    assert renders[0] == prompt and len(renders) <= 3
    rendered = len(renders)
    first.append(-1)  # a caller's copy: changing it changes nothing remembered
    group = [renderer.conversation_tokens().prompt_ids(prompt) for _ in range(7)]
    assert len(renders) == rendered
    assert group == [renderer.ids(prompt, add_generation_prompt=True)] * 7
    other = [{"role": "user", "content": "What is 6 x 8?"}]
    assert renderer.conversation_tokens().prompt_ids(other) == renderer.ids(other, True)
    assert len(renders) == rendered + 1
    # Another tokenizer, template and kwargs render for themselves.
    thinking = Renderer(CASES_BY_ID["qwen3-nothink"], "qwen3").conversation_tokens()
    thinking.prompt_ids(prompt)
    assert renders[rendered + 1] == prompt
