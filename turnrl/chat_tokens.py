"""Token ids of a multi-turn conversation, kept exact: the model's turns are the engine's ids as
they came out, and everything else is tokenized as a difference of chat-template renders.

The rules (DESIGN.md, "The trajectory is the unit of truth"):

- **Model turns are never re-tokenized.** `append_model_turn` records the engine's output ids,
  which end with the token the model stopped on (`<|im_end|>` for Qwen).
- **New messages are a difference against a fixed base.** For tool results or a user turn M after
  a model turn A, `append_messages` renders `BASE_MESSAGES + [A] + M` with the generation prompt
  and keeps what follows A's stop token. The real history is never rendered again: templates
  rewrite it (Qwen3 and GLM-4.5 drop the reasoning of earlier turns, gpt-oss its analysis), so
  two renders of it would disagree. `BASE_MESSAGES` alone must render to a token prefix of that
  extended render; if not, the template is not prefix-preserving for these messages and
  `FailedPreconditionError` names it (vLLM's Mistral tool template moves the tool list and the
  system prompt to the newest user message, so it fails on user turns).
  A itself is rendered too, because templates render a message after it by what it holds
  (gpt-oss names the tool a result comes from after the last call, Mistral checks call ids), but
  its tokens are not kept: the model's own ids stand for it.
- **The end of a model turn.** Templates often put text between the model's stop token and the
  next message (`<|im_end|>` then `\\n` in ChatML). The delta starts right after the first copy
  of the model's stop token that follows the base, so those tokens are in the delta, once. With
  GLM-4.5 the model stops on the token that opens the next message (`<|observation|>`), which
  the same rule skips. A model turn that did not end with a stop token (cut by `max_new_tokens`)
  leaves the conversation without a valid render to continue from: `append_messages` refuses
  it and the rollout ends the trajectory there. A template that closes the turn with another
  token than the model stopped on (gpt-oss writes `<|end|>` where the model said `<|return|>`)
  is refused the same way.
- **Control tokens inside messages are text.** Renders use transformers'
  `sanitize_control_tokens=True`: a tool result or user turn that spells `<|im_end|>` or
  `<tool_call>` is tokenized as ordinary text, while the tokens the template writes stay single
  control tokens. Control tokens are the tokenizer's special tokens plus the added tokens the
  template's own text contains; a tokenizer loaded with `chat_control_tokens=[...]` names more.
  Text is split only around such spellings, so every other text tokenizes as in one render.

Every call is synchronous CPU work (jinja plus the tokenizer: `append_messages` renders twice,
about 7 ms with ten tool schemas and a 2 KB tool result), so async callers run it with
`asyncio.to_thread`. One instance per trajectory; not thread-safe.
"""

import hashlib
import inspect
from collections.abc import Iterable
from typing import Any

from turnrl.errors import FailedPreconditionError, InvalidArgumentError

# What every difference is taken after: one plain user message, which every template renders
# the same whatever follows (a system message would not do: vLLM's Mistral template writes it
# into the newest user message only).
BASE_MESSAGES = ({"role": "user", "content": "Hello."},)
# Roles `append_messages` accepts: assistant turns come from the model only.
NON_MODEL_ROLES = frozenset({"system", "user", "tool"})


class ConversationTokens:
    """The token ids of one conversation, built turn by turn: `prompt_ids` once, then
    `append_model_turn` and `append_messages` alternating.

    `tokenizer` is a transformers tokenizer (5.24 or newer, for `sanitize_control_tokens`);
    `chat_template` is jinja source, or None for the tokenizer's own; `tools` are OpenAI tool
    schemas passed to every render; `chat_template_kwargs` (e.g. `{"enable_thinking": False}`)
    too. `stop_token_ids` are the ids the engine stops a turn on, default the tokenizer's
    `eos_token_id`; pass the engine's full set when there are several (GLM-4.5 stops on
    `<|user|>` and `<|observation|>`, gpt-oss on `<|call|>` and `<|return|>`). Each should be a
    token the template writes where an assistant turn ends: the delta starts after its first
    copy past the base.
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        tools: list[dict] | None,
        chat_template_kwargs: dict | None = None,
        stop_token_ids: Iterable[int] | None = None,
    ):
        if (
            "sanitize_control_tokens"
            not in inspect.signature(tokenizer.apply_chat_template).parameters
        ):
            raise FailedPreconditionError(
                f"{type(tokenizer).__name__}.apply_chat_template has no sanitize_control_tokens; "
                "token-exact conversations need transformers>=5.24"
            )
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._tools = tools
        self._template_kwargs = dict(chat_template_kwargs or {})
        if stop_token_ids is None:
            stop_token_ids = [tokenizer.eos_token_id]
        self._stop_token_ids = frozenset(stop_token_ids)
        if not self._stop_token_ids or None in self._stop_token_ids:
            raise InvalidArgumentError(f"stop_token_ids {stop_token_ids!r} must name token ids")
        # Messages so far, model turns as recorded; the base of the next difference is its last.
        self.messages: list[dict] = []
        # The ids of the last model turn until messages follow it; None while a model turn is due.
        self._model_turn_ids: list[int] | None = None
        self._generation_prompt_ids: list[int] | None = None

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The ids of the first prompt: `messages` rendered with the generation prompt."""
        if self.messages:
            raise FailedPreconditionError("prompt_ids was called already for this conversation")
        if not messages:
            raise InvalidArgumentError("the prompt needs at least one message, got []")
        ids = self._render(list(messages), add_generation_prompt=True)
        # Worked out here, off the caller's event loop: the first render compiles the template.
        base_ids = self._render(list(BASE_MESSAGES), add_generation_prompt=False)
        prompted_ids = self._render(list(BASE_MESSAGES), add_generation_prompt=True)
        self._require_prefix(base_ids, prompted_ids, "the generation prompt")
        self._generation_prompt_ids = prompted_ids[len(base_ids) :]
        self.messages = list(messages)
        return ids

    @property
    def generation_prompt_ids(self) -> list[int]:
        """The ids that open a model turn (`<|im_start|>assistant\\n` in ChatML), which end the
        prompt and every `append_messages` result; known once `prompt_ids` ran."""
        if self._generation_prompt_ids is None:
            raise FailedPreconditionError("generation_prompt_ids is known after prompt_ids")
        return list(self._generation_prompt_ids)

    def append_model_turn(self, output_ids: list[int]) -> dict:
        """Records the engine's `output_ids` for this turn, as they are, and returns the assistant
        message that stands for them in the conversation: the decoded ids (special tokens kept)
        without the stop token. The dict is the conversation's own: a caller that parses tool
        calls updates it in place (`content`, `tool_calls`) before `append_messages`, which
        renders it.
        """
        if not self.messages:
            raise FailedPreconditionError("append_model_turn before prompt_ids")
        if self._model_turn_ids is not None:
            raise FailedPreconditionError(
                "two model turns in a row; append tool results or a user turn between them"
            )
        if not output_ids:
            raise InvalidArgumentError("a model turn needs at least one output id, got []")
        text_ids = output_ids[:-1] if self._ends_turn(output_ids) else output_ids
        message = {"role": "assistant", "content": self._tokenizer.decode(text_ids)}
        self.messages.append(message)
        self._model_turn_ids = list(output_ids)
        return message

    def append_messages(self, messages: list[dict]) -> list[int]:
        """Appends tool results, user turns or system notes after a model turn and returns only
        the new ids: whatever the template writes after the model's stop token, these messages,
        and the generation prompt of the next model turn.
        """
        if self._model_turn_ids is None:
            raise FailedPreconditionError("append_messages must follow a model turn")
        if not messages:
            raise InvalidArgumentError("append_messages needs at least one message, got []")
        roles = [message.get("role") for message in messages]
        if not set(roles) <= NON_MODEL_ROLES:
            raise InvalidArgumentError(
                f"roles {roles!r} are not all in {sorted(NON_MODEL_ROLES)}; model turns go "
                "through append_model_turn"
            )
        stop_id = self._model_turn_ids[-1]
        if not self._ends_turn(self._model_turn_ids):
            raise FailedPreconditionError(
                f"the last model turn ended on token {stop_id}, not on a stop token "
                f"{sorted(self._stop_token_ids)} (cut by max_new_tokens?); a conversation cannot "
                "continue after it"
            )
        base_ids = self._render(list(BASE_MESSAGES), add_generation_prompt=False)
        extended_ids = self._render(
            [*BASE_MESSAGES, self.messages[-1], *messages], add_generation_prompt=True
        )
        self._require_prefix(base_ids, extended_ids, f"messages with roles {roles!r}")
        try:
            cut = extended_ids.index(stop_id, len(base_ids)) + 1
        except ValueError:
            raise FailedPreconditionError(
                f"{self._template_name()} does not close an assistant turn with the token the "
                f"model stopped on ({self._tokenizer.convert_ids_to_tokens(stop_id)!r}) when "
                f"roles {roles!r} follow; the model's ids cannot continue this conversation"
            ) from None
        self.messages.extend(messages)
        self._model_turn_ids = None
        return extended_ids[cut:]

    def _require_prefix(self, base_ids: list[int], extended_ids: list[int], what: str) -> None:
        """Raises unless `base_ids` start `extended_ids`: only then is the rest a pure suffix."""
        if extended_ids[: len(base_ids)] == base_ids:
            return
        at = _first_difference(base_ids, extended_ids)
        raise FailedPreconditionError(
            f"{self._template_name()} is not prefix-preserving for {what}: the render before "
            f"them changes from token {at} on, {self._tokenizer.decode(base_ids[at:])!r} became "
            f"{self._tokenizer.decode(extended_ids[at : len(base_ids)])!r}"
        )

    def _ends_turn(self, output_ids: list[int]) -> bool:
        return output_ids[-1] in self._stop_token_ids

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return self._tokenizer.apply_chat_template(
            messages,
            tools=self._tools,
            chat_template=self._chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
            **self._template_kwargs,
        )

    def _template_name(self) -> str:
        if self._chat_template is None:
            return f"the chat template of {self._tokenizer.name_or_path!r}"
        digest = hashlib.sha256(self._chat_template.encode()).hexdigest()[:12]
        return f"chat template sha256:{digest}"


def _first_difference(left: list[int], right: list[int]) -> int:
    """The first index where the two lists differ, or the shorter length."""
    return next(
        (i for i, (a, b) in enumerate(zip(left, right, strict=False)) if a != b),
        min(len(left), len(right)),
    )
