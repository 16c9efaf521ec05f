"""The chat templates `ConversationTokens` is held to (turnrl's own, the tiny model's, and every
fixture chat template that supports tools), random conversations with tools, reasoning and
many scripts, a `Renderer` of fresh template renders (the ground truth) and `rollout`, which
plays a conversation through ConversationTokens as the agent loop does. Used by
test_chat_tokens.py, test_chat_tokens_turns.py and tests/turnrl/test_conversation_loss_mask.py.

Templates with tools (a tool conversation renders both the tool's result and its schema; see
`test_the_tool_templates_are_the_ones_that_render_tools`): qwen2.5-instruct,
qwen2.5-instruct-trl-training-generation-tags, qwen3, qwen3-instruct-2507,
qwen3-trl-training-prefix-preserving, nemotron-3-nano, glm-4-moe, gpt-oss, llama-3.1-instruct,
llama-3.2-instruct, mistral-vllm-tool-example. Left out:
- gemma-3-it raises on a tool message ("roles must alternate");
- cohere2-command-r7b and phi-3.5-mini-instruct render neither the tool result nor the schemas;
- deepseek-v3 and llama-3-instruct render the tool result but never the schemas.

Templates of other families are rendered with the Qwen tokenizers too; their turn markers
(`<|eot_id|>`, `<|observation|>`, `<|call|>`, `[INST]`...) are added to the tokenizer as special
tokens, as each family's own tokenizer has them, because an engine stops on one token.

Prefix-preserving (the rollout's ids equal a fresh render of the whole conversation): both
qwen2.5 templates, qwen3-instruct-2507, qwen3-trl-training-prefix-preserving, llama-3.1,
llama-3.2, mistral-vllm (tool loops without a system prompt) and gpt-oss (tool loops: a final
answer ends a gpt-oss conversation, see below, and a render that holds one drops the analysis
of the calls before it). The others rewrite earlier assistant turns when they render history; the only difference allowed
is this rewrite (`HISTORY_REWRITES`):
- qwen3: drops the `<think>\\n...\\n</think>\\n\\n` block of every turn before the last user
  message, and of later turns whose block is empty (always so with `enable_thinking: False`,
  whose generation prompt writes the empty block);
- glm-4-moe: empties `<think>...</think>` of every turn before the last user message;
- nemotron-3-nano: writes `<think></think>` in place of the `<think>\\n...\\n</think>` block of
  every turn before the last user message, and trims the newline after it where text comes
  between the block and the turn's tool calls.
Two templates cannot continue some conversations at all, and `ConversationTokens` says so:
mistral-vllm moves the tool list to the newest user message (a user turn after the first
changes the render before it), and gpt-oss closes a final answer with `<|end|>` in history
where the model stopped on `<|return|>`. mistral-vllm also writes the system prompt into the
newest user message only, and only while that message is the last one, so its conversations
here have none: with one, the prompt holds it and a fresh render of the whole does not.
"""

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from transformers import AutoTokenizer

from tests.fixture_files import resolve_fixtures
from turnrl.chat_tokens import CHAT_TEMPLATE, ConversationTokens

TOKENIZERS = ("qwen2.5", "qwen3")
LLAMA_MARKERS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)


def _drop_qwen3_think(turn: str, before_last_user: bool) -> str:
    block = re.match(r"(<\|im_start\|>assistant\n)<think>\n(.*?)\n</think>\n\n", turn, re.DOTALL)
    if block and (before_last_user or not block[2]):
        return block[1] + turn[block.end() :]
    return turn


def _empty_glm_think(turn: str, before_last_user: bool) -> str:
    if not before_last_user:
        return turn
    return re.sub(r"<think>.*?</think>", "<think></think>", turn, count=1, flags=re.DOTALL)


def _empty_nemotron_think(turn: str, before_last_user: bool) -> str:
    if not before_last_user:
        return turn
    turn = re.sub(r"<think>\n.*?\n</think>", "<think></think>", turn, count=1, flags=re.DOTALL)
    if "<tool_call>" in turn:  # its text before the calls is trimmed: no newline after the block
        turn = re.sub(r"<think></think>\n(?!<tool_call>)", "<think></think>", turn, count=1)
    return turn


# How each rewriting template renders a model turn once it is history: (the turn's text from
# its generation prompt to its stop token, whether a user message follows it) -> text.
HISTORY_REWRITES: dict[str, Callable[[str, bool], str]] = {
    "qwen3": _drop_qwen3_think,
    "glm-4-moe": _empty_glm_think,
    "nemotron-3-nano": _empty_nemotron_think,
}


@dataclass(frozen=True)
class TemplateCase:
    """A fixture template and what a rollout with it may contain."""

    template: str
    # Turn markers of the template's family that the Qwen vocabulary lacks: added as special.
    control_tokens: tuple[str, ...] = ()
    # What the simulated engine stops a turn on.
    stop_tokens: tuple[str, ...] = ("<|im_end|>",)
    # Message key the template reads reasoning from; None: it renders none.
    reasoning_key: str | None = None
    parallel_calls: bool = True
    # Whether an assistant message with tool calls may carry text too.
    content_with_calls: bool = True
    # Whether a user turn may follow an answer (else rollouts are tool loops only).
    user_turns: bool = True
    system_prompt: bool = True
    # For templates whose turns have no closing token: the model stops on the next one's opener.
    stop_by_next_role: dict = field(default_factory=dict)
    chat_template_kwargs: dict = field(default_factory=dict)
    case_id: str = ""

    @property
    def id(self) -> str:
        return self.case_id or self.template


# turnrl's own template (turnrl/chat_template.jinja, the tiny model's), held to the same rules.
TURNRL_TEMPLATE = "turnrl-chatml"

CASES = (
    TemplateCase(TURNRL_TEMPLATE),
    TemplateCase("qwen2.5-instruct"),
    TemplateCase("qwen2.5-instruct-trl-training-generation-tags"),
    TemplateCase("qwen3", reasoning_key="reasoning_content"),
    TemplateCase("qwen3", chat_template_kwargs={"enable_thinking": False}, case_id="qwen3-nothink"),
    TemplateCase("qwen3-instruct-2507"),
    TemplateCase("qwen3-trl-training-prefix-preserving", reasoning_key="reasoning_content"),
    TemplateCase("nemotron-3-nano", reasoning_key="reasoning_content"),
    TemplateCase(
        "glm-4-moe",
        control_tokens=(
            *("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
            *("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        ),
        stop_tokens=("<|user|>", "<|observation|>"),
        reasoning_key="reasoning_content",
        stop_by_next_role={"user": "<|user|>", "tool": "<|observation|>"},
    ),
    TemplateCase(
        "gpt-oss",
        control_tokens=(
            *("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"),
            *("<|return|>", "<|call|>"),
        ),
        stop_tokens=("<|call|>", "<|return|>"),
        reasoning_key="thinking",
        parallel_calls=False,  # it renders the first call of a message only
        content_with_calls=False,
        user_turns=False,
    ),
    TemplateCase(
        "llama-3.1-instruct",
        control_tokens=LLAMA_MARKERS,
        stop_tokens=("<|eot_id|>", "<|eom_id|>"),
        parallel_calls=False,  # "This model only supports single tool-calls at once!"
        chat_template_kwargs={"date_string": "26 Jul 2024"},
    ),
    TemplateCase(
        "llama-3.2-instruct",
        control_tokens=LLAMA_MARKERS,
        stop_tokens=("<|eot_id|>", "<|eom_id|>"),
        parallel_calls=False,
        chat_template_kwargs={"date_string": "26 Jul 2024"},
    ),
    TemplateCase(
        "mistral-vllm-tool-example",
        control_tokens=(
            *("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"),
            *("[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
        ),
        user_turns=False,
        system_prompt=False,
    ),
)
CASES_BY_ID = {case.id: case for case in CASES}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather and forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search an encyclopedia.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
]
TEXTS = (
    "What is the weather in Paris?",
    "東京の天気を教えてください。",
    "北京今天多云，气温二十五度。",  # noqa: RUF001 (a Chinese comma)
    "Sunny ☀️ then rain 🌧️, thumbs up 👍🏽",
    "مرحبا بالعالم، كيف الطقس؟",
    "שלום עולם",
    "Mixed: Zürich → 東京 → القاهرة 🚆",
    "Lines\nof text\n\nwith a blank one",
)
REASONINGS = (
    "The user wants the weather, so I call the tool.",
    "用户想知道天气。我应该先查询。",
    "Two steps:\n1. search\n2. answer 🙂",
)


def _tool_output(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return ""
    if kind == 1:
        return rng.choice(TEXTS)
    forecast = {"city": rng.choice(["Paris", "東京", "القاهرة"]), "days": [1, 2], "note": "a\nb"}
    return json.dumps(forecast, indent=2, ensure_ascii=False)


def _tool_call(rng: random.Random, call_id: str) -> dict:
    if rng.random() < 0.5:
        name, arguments = "get_weather", {"city": rng.choice(TEXTS[:3]), "days": rng.randrange(7)}
    else:
        name, arguments = "search", {"query": rng.choice(TEXTS)}
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def conversation(
    case: TemplateCase, seed: int, rounds_count: int
) -> tuple[list[dict], list[tuple[dict, list]]]:
    """A prompt and `rounds_count` rounds of (assistant message, the messages answering it)."""
    rng = random.Random(seed)
    prompt = [{"role": "user", "content": rng.choice(TEXTS)}]
    if case.system_prompt and rng.random() < 0.7:
        prompt.insert(0, {"role": "system", "content": "You are terse. 你好 👋"})
    rounds = []
    for _ in range(rounds_count):
        assistant: dict = {"role": "assistant", "content": ""}
        if case.reasoning_key:
            assistant[case.reasoning_key] = rng.choice(REASONINGS)
        if not case.user_turns or rng.random() < 0.6:
            calls = rng.randint(1, 3) if case.parallel_calls else 1
            ids = [f"c{seed:04d}{len(rounds):02d}{i:02d}" for i in range(calls)]  # 9 alnum chars
            assistant["tool_calls"] = [_tool_call(rng, call_id) for call_id in ids]
            if case.content_with_calls and rng.random() < 0.5:
                assistant["content"] = rng.choice(TEXTS)
            answers = [
                {"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"]}
                | {"content": _tool_output(rng)}
                for call in assistant["tool_calls"]
            ]
        else:
            assistant["content"] = rng.choice(TEXTS)
            answers = [{"role": "user", "content": rng.choice(TEXTS)}]
        rounds.append((assistant, answers))
    return prompt, rounds


@cache
def tokenizer_for(tokenizer_name: str, control_tokens: tuple[str, ...]):
    """A fixture tokenizer with a template family's turn markers added as special tokens."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_fixtures() / "tokenizers" / tokenizer_name)
    tokenizer.add_tokens(list(control_tokens), special_tokens=True)
    return tokenizer


@cache
def template_text(name: str) -> str:
    if name == TURNRL_TEMPLATE:
        return CHAT_TEMPLATE.read_text()
    return (resolve_fixtures() / "chat_templates" / f"{name}.jinja").read_text()


class Renderer:
    """Fresh renders of a case's template: the ground truth the rollout is held to."""

    def __init__(self, case: TemplateCase, tokenizer_name: str):
        self.case = case
        self.tokenizer = tokenizer_for(tokenizer_name, case.control_tokens)
        self.template = template_text(case.template)

    def text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=TOOLS,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.case.chat_template_kwargs,
        )

    def ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=TOOLS,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **self.case.chat_template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def model_turn(self, history: list[dict], assistant: dict, answers: list[dict]) -> str:
        """What a model writes for `assistant` after `history`: the template's render of it as
        the newest message, after the generation prompt, up to and with the first stop token
        (for GLM-4.5, whose turns have no closing token, the one that opens `answers`)."""
        prompt = self.text(history, add_generation_prompt=True)
        rendered = self.text([*history, assistant], add_generation_prompt=False)
        assert rendered.startswith(prompt), "the generation prompt does not start the turn"
        turn = rendered[len(prompt) :]
        stops = [turn.find(stop) + len(stop) for stop in self.case.stop_tokens if stop in turn]
        if stops:
            return turn[: min(stops)]
        return turn + self.case.stop_by_next_role[answers[0]["role"]]

    def conversation_tokens(self) -> ConversationTokens:
        tokenizer = self.tokenizer
        return ConversationTokens(
            tokenizer,
            self.template,
            TOOLS,
            self.case.chat_template_kwargs,
            stop_token_ids=tokenizer.convert_tokens_to_ids(list(self.case.stop_tokens)),
        )


def rollout(renderer: Renderer, prompt: list[dict], rounds: list[tuple[dict, list]]):
    """Plays a conversation through ConversationTokens; returns the trajectory's segments
    [prompt, model, delta, model, delta, ...] and the generation prompt's ids."""
    tokens = renderer.conversation_tokens()
    segments = [tokens.prompt_ids(prompt)]
    history = list(prompt)
    for assistant, answers in rounds:
        text = renderer.model_turn(history, assistant, answers)
        output_ids = renderer.encode(text)
        # The message a tool-call parser makes of the turn's text.
        tokens.append_model_turn(output_ids, assistant)
        delta = tokens.append_messages(answers)
        opener = tokens.generation_prompt_ids
        assert delta[len(delta) - len(opener) :] == opener
        segments += [output_ids, delta]
        history += [assistant, *answers]
    return segments, tokens.generation_prompt_ids


# (seed, rounds) of the conversations each case plays.
CONVERSATIONS = tuple(enumerate((1, 2, 3, 4, 6, 8)))
