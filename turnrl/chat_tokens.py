"""Token ids of a multi-turn conversation, kept exact: the model's turns are the engine's ids as
they came out, and everything else is tokenized as a difference of chat-template renders.

The rules (DESIGN.md, "The trajectory is the unit of truth"):

- **Model turns are never re-tokenized.** `append_model_turn` records the engine's output ids,
  which end with the token the model stopped on (`<|im_end|>` for Qwen), with the assistant
  message the caller made of them (`model_turn_text`, then its own tool-call parsing).
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
  the same rule skips. A model turn that ended on a stop string (OpenAI's `stop`: the engine
  stopped after the ids that spell it, with no stop token) is closed by the template: the delta
  starts at the first stop token past the base, the one the template writes where the
  assistant message ends (`<|im_end|>`), so that token is in the delta, masked, as the model
  never sampled it. A model turn cut by `max_new_tokens` leaves the conversation without a
  valid render to continue from: `append_messages` refuses it and the rollout ends the
  trajectory there. A template that closes the turn with another token than the model stopped
  on (gpt-oss writes `<|end|>` where the model said `<|return|>`) is refused the same way.
- **Control tokens inside messages are text.** Renders use transformers'
  `sanitize_control_tokens=True`: a tool result or user turn that spells `<|im_end|>` or
  `<tool_call>` is tokenized as ordinary text, while the tokens the template writes stay single
  control tokens. Control tokens are the tokenizer's special tokens plus the added tokens the
  template's own text contains; a tokenizer loaded with `chat_control_tokens=[...]` names more.
  Text is split only around such spellings, so every other text tokenizes as in one render.

- **Images are placeholders, then the processor's tokens.** An image part of a message (OpenAI's
  `image_url`, or `{"type": "image"}`) is rendered as `{"type": "image"}`, which vision-language
  templates write as one image token (`<|image_pad|>` between `<|vision_start|>` and
  `<|vision_end|>`); the ids returned repeat each image's token as many times as its processed
  grid has merged patches (`turnrl.vision`), as the model's processor does. Renders and their
  cache never hold image bytes; the caller passes the processed images of the messages, in
  order, with them.

**Written model turns.** For supervised fine-tuning the conversation is given, not sampled:
`append_assistant_message` stands in for `append_model_turn`, with the ids a model writes for an
assistant message, which are the template's render of it after the generation prompt, through
the first stop token, rendered after `BASE_MESSAGES` like every difference. Everything between
model turns still comes from `append_messages`, so a fine-tuning sequence is the trajectory of a
policy that wrote exactly those assistant messages. `conversation_ids_and_loss_mask` does this
for a whole conversation.

The conversation's messages are the caller's (the rollout's `Trajectory` holds them): an
instance keeps only the last model turn, the one thing the next difference is rendered from.
Every call is synchronous CPU work (jinja plus the tokenizer: `append_messages` renders twice,
about 7 ms with ten tool schemas and a 2 KB tool result), so async callers run it with
`asyncio.to_thread`. One instance per trajectory; not thread-safe.
"""

import functools
import hashlib
import inspect
import itertools
import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from turnrl.errors import FailedPreconditionError, InvalidArgumentError
from turnrl.vision import ProcessedImage, VisionProcessor, with_image_placeholders

# turnrl's own ChatML template (tools in the system turn, hermes `<tool_call>` JSON, each tool
# result its own turn), prefix-preserving by construction; the tiny demo model carries it.
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
# What every difference is taken after: one plain user message, which every template renders
# the same whatever follows (a system message would not do: vLLM's Mistral template writes it
# into the newest user message only).
BASE_MESSAGES = ({"role": "user", "content": "Hello."},)
# Roles `append_messages` accepts: assistant turns come from the model only.
NON_MODEL_ROLES = frozenset({"system", "user", "tool"})
# Renders of prompts kept per tokenizer: a rollout's conversations render the same base and,
# a GRPO group's samples, the same prompt; least recently used ones go beyond this many.
PROMPT_RENDERS_KEPT = 4096
_prompt_renders: "weakref.WeakKeyDictionary[Any, OrderedDict[str, list[int]]]" = (
    weakref.WeakKeyDictionary()
)
_prompt_renders_lock = threading.Lock()


class ConversationTokens:
    """The token ids of one conversation, built turn by turn: `prompt_ids` once, then
    `append_model_turn` (or `append_assistant_message`) and `append_messages` alternating.

    `tokenizer` is a transformers tokenizer (5.24 or newer, for `sanitize_control_tokens`);
    `chat_template` is jinja source, or None for the tokenizer's own; `tools` are OpenAI tool
    schemas passed to every render; `chat_template_kwargs` (e.g. `{"enable_thinking": False}`)
    too. `stop_token_ids` are the ids the engine stops a turn on, default the tokenizer's
    `eos_token_id`; pass the engine's full set when there are several (GLM-4.5 stops on
    `<|user|>` and `<|observation|>`, gpt-oss on `<|call|>` and `<|return|>`). Each should be a
    token the template writes where an assistant turn ends: the delta starts after its first
    copy past the base.

    Message text must be Unicode: a string holding a lone surrogate (what a JSON `"\\ud800"`
    escape reads as), which no tokenizer encodes, is refused with InvalidArgumentError.

    `vision`, for a vision-language model, expands the image tokens of messages with images;
    without it, a message with an image is refused with InvalidArgumentError.
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        tools: list[dict] | None,
        chat_template_kwargs: dict | None = None,
        stop_token_ids: Iterable[int] | None = None,
        vision: VisionProcessor | None = None,
    ):
        if not _sanitizes_control_tokens(type(tokenizer)):
            raise FailedPreconditionError(
                f"{type(tokenizer).__name__}.apply_chat_template has no sanitize_control_tokens; "
                "token-exact conversations need transformers>=5.24"
            )
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._tools = tools
        self._template_kwargs = dict(chat_template_kwargs or {})
        self._vision = vision
        self._images_so_far = 0
        if stop_token_ids is None:
            stop_token_ids = [tokenizer.eos_token_id]
        self._stop_token_ids = frozenset(stop_token_ids)
        if not self._stop_token_ids or None in self._stop_token_ids:
            raise InvalidArgumentError(f"stop_token_ids {stop_token_ids!r} must name token ids")
        # The last model turn's message, which the next difference is rendered after, its ids
        # until messages follow it (None while a model turn is due), and whether it ended on
        # a stop string.
        self._model_message: dict | None = None
        self._model_turn_ids: list[int] | None = None
        self._model_turn_on_stop_string = False
        # Renders of BASE_MESSAGES alone and of the generation prompt after them, made once by
        # `prompt_ids`: every difference starts from them.
        self._base_ids: list[int] = []
        self._generation_prompt_ids: list[int] | None = None

    def prompt_ids(self, messages: list[dict], images: Sequence[ProcessedImage] = ()) -> list[int]:
        """The ids of the first prompt: `messages` rendered with the generation prompt, the
        tokens of `images` (those of the messages, in order) in their places."""
        if self._generation_prompt_ids is not None:
            raise FailedPreconditionError("prompt_ids was called already for this conversation")
        if not messages:
            raise InvalidArgumentError("the prompt needs at least one message, got []")
        placeheld = self._with_image_placeholders(messages, images)
        ids = self._expanded(self._render_prompt(placeheld, add_generation_prompt=True), images)
        # Worked out here, off the caller's event loop: the first render compiles the template.
        self._base_ids = self._render_prompt(list(BASE_MESSAGES), add_generation_prompt=False)
        prompted_ids = self._render_prompt(list(BASE_MESSAGES), add_generation_prompt=True)
        self._require_prefix(self._base_ids, prompted_ids, "the generation prompt")
        self._generation_prompt_ids = prompted_ids[len(self._base_ids) :]
        return ids

    @property
    def generation_prompt_ids(self) -> list[int]:
        """The ids that open a model turn (`<|im_start|>assistant\\n` in ChatML), which end the
        prompt and every `append_messages` result; known once `prompt_ids` ran."""
        if self._generation_prompt_ids is None:
            raise FailedPreconditionError("generation_prompt_ids is known after prompt_ids")
        return list(self._generation_prompt_ids)

    def model_turn_text(self, output_ids: list[int]) -> str:
        """The text of a model turn: its ids decoded (special tokens kept) without the stop
        token it ended on."""
        if not output_ids:
            raise InvalidArgumentError("a model turn needs at least one output id, got []")
        text_ids = output_ids[:-1] if self._ends_turn(output_ids) else output_ids
        return self._tokenizer.decode(text_ids)

    def append_model_turn(
        self, output_ids: list[int], message: dict, ended_on_stop_string: bool = False
    ) -> None:
        """Records the engine's `output_ids` for this turn, as they are, and the assistant
        `message` that stands for them in the conversation (`model_turn_text`, with the tool
        calls parsed out of it), which `append_messages` renders them as.
        `ended_on_stop_string`: the engine stopped after ids that spell a stop string (its
        text is left out of the message), so the template closes the turn."""
        self._require_model_turn_due("append_model_turn")
        if not output_ids:
            raise InvalidArgumentError("a model turn needs at least one output id, got []")
        if message.get("role") != "assistant":
            raise InvalidArgumentError(f"expected an assistant message, got {message!r}")
        self._model_message = message
        self._model_turn_ids = list(output_ids)
        self._model_turn_on_stop_string = ended_on_stop_string

    def append_assistant_message(self, message: dict) -> list[int]:
        """Records the assistant `message` as this model turn and returns the ids a model writes
        for it: the template's render of the message after the generation prompt, through the
        first stop token. The message stands in the conversation as given.
        """
        self._require_model_turn_due("append_assistant_message")
        if message.get("role") != "assistant":
            raise InvalidArgumentError(f"expected an assistant message, got {message!r}")
        opening_ids = self._base_ids + self.generation_prompt_ids
        rendered_ids = self._render([*BASE_MESSAGES, message], add_generation_prompt=False)
        self._require_prefix(opening_ids, rendered_ids, "an assistant message")
        stop_at = next(
            (
                index
                for index in range(len(opening_ids), len(rendered_ids))
                if rendered_ids[index] in self._stop_token_ids
            ),
            None,
        )
        if stop_at is None:
            raise FailedPreconditionError(
                f"{self._template_name()} ends an assistant message with none of the stop tokens "
                f"{sorted(self._stop_token_ids)}; a model cannot write it as one turn"
            )
        self._model_message = message
        self._model_turn_ids = rendered_ids[len(opening_ids) : stop_at + 1]
        self._model_turn_on_stop_string = False
        return list(self._model_turn_ids)

    def closing_ids(self) -> list[int]:
        """The ids the template writes after the last model turn's stop token when the
        conversation ends there (`\\n` in ChatML), which end a render of the whole conversation."""
        return self._ids_after_model_turn(
            [], add_generation_prompt=False, what="the end of the conversation"
        )

    def append_messages(
        self, messages: list[dict], images: Sequence[ProcessedImage] = ()
    ) -> list[int]:
        """Appends tool results, user turns or system notes after a model turn and returns only
        the new ids: whatever the template writes after the model's stop token, these messages
        (the tokens of `images`, theirs in order, in their places), and the generation prompt
        of the next model turn.
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
        if images and self._images_so_far and self._template_kwargs.get("add_vision_id"):
            raise FailedPreconditionError(
                "add_vision_id numbers the images of the whole conversation, and a difference "
                "rendered after the base would number these from 1; it is not supported with "
                "images after the prompt"
            )
        placeheld = self._with_image_placeholders(messages, images)
        new_ids = self._ids_after_model_turn(
            placeheld, add_generation_prompt=True, what=f"messages with roles {roles!r}"
        )
        self._model_turn_ids = None
        return self._expanded(new_ids, images)

    def _with_image_placeholders(
        self, messages: list[dict], images: Sequence[ProcessedImage]
    ) -> list[dict]:
        """`messages` with each image part as a placeholder; raises InvalidArgumentError when
        they hold images for a text-only model, or another number than `images`."""
        placeheld, count = with_image_placeholders(messages)
        if count and self._vision is None:
            raise InvalidArgumentError(
                f"the messages hold {count} images for a text-only model (no vision processor): "
                "images need a vision-language model"
            )
        if count != len(images):
            raise InvalidArgumentError(f"the messages hold {count} images, given {len(images)}")
        self._images_so_far += count
        return placeheld

    def _expanded(self, ids: list[int], images: Sequence[ProcessedImage]) -> list[int]:
        if self._vision is None:
            return ids
        return self._vision.expand_image_tokens(ids, list(images))

    def _require_model_turn_due(self, method: str) -> None:
        if self._generation_prompt_ids is None:
            raise FailedPreconditionError(f"{method} before prompt_ids")
        if self._model_turn_ids is not None:
            raise FailedPreconditionError(
                "two model turns in a row; append tool results or a user turn between them"
            )

    def _ids_after_model_turn(
        self, messages: list[dict], add_generation_prompt: bool, what: str
    ) -> list[int]:
        """What the template writes after the last model turn's stop token when `messages`
        (described by `what`) follow it: the render of `BASE_MESSAGES`, that turn and them,
        from that stop token's first copy past the base on; for a turn that ended on a stop
        string, from the first stop token past the base, included."""
        assert self._model_turn_ids is not None and self._model_message is not None
        stop_id = self._model_turn_ids[-1]
        ends_turn = self._ends_turn(self._model_turn_ids)
        if not ends_turn and not self._model_turn_on_stop_string:
            raise FailedPreconditionError(
                f"the last model turn ended on token {stop_id}, not on a stop token "
                f"{sorted(self._stop_token_ids)} (cut by max_new_tokens?); a conversation cannot "
                "continue after it"
            )
        extended_ids = self._render(
            [*BASE_MESSAGES, self._model_message, *messages], add_generation_prompt
        )
        self._require_prefix(self._base_ids, extended_ids, what)
        closing_ids = {stop_id} if ends_turn else self._stop_token_ids
        cut = next(
            (
                i
                for i in range(len(self._base_ids), len(extended_ids))
                if extended_ids[i] in closing_ids
            ),
            None,
        )
        if cut is None:
            names = self._tokenizer.convert_ids_to_tokens(sorted(closing_ids))
            closing = (
                f"the token the model stopped on ({names[0]!r})"
                if ends_turn
                else f"a stop token {names!r} after the model's stop string"
            )
            raise FailedPreconditionError(
                f"{self._template_name()} does not close an assistant turn with {closing} before "
                f"{what}; the model's ids cannot continue this conversation"
            )
        return extended_ids[cut + 1 if ends_turn else cut :]

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

    def _render_prompt(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """`_render`, remembered per tokenizer for the conversations that render the same
        prompt with the same template, tools and kwargs (a render is deterministic)."""
        key = json.dumps(
            [
                messages,
                add_generation_prompt,
                self._chat_template,
                self._tools,
                self._template_kwargs,
            ]
        )
        with _prompt_renders_lock:
            renders = _prompt_renders.setdefault(self._tokenizer, OrderedDict())
            ids = renders.get(key)
            if ids is not None:
                renders.move_to_end(key)
                return list(ids)
        ids = self._render(messages, add_generation_prompt)
        with _prompt_renders_lock:
            renders[key] = ids
            if len(renders) > PROMPT_RENDERS_KEPT:
                renders.popitem(last=False)
        return list(ids)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        _require_unicode(messages)
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


@functools.cache
def _sanitizes_control_tokens(tokenizer_type: type) -> bool:
    """Whether the tokenizer class's apply_chat_template takes sanitize_control_tokens (once
    per class: a signature costs about what a short render does)."""
    parameters = inspect.signature(tokenizer_type.apply_chat_template).parameters
    return "sanitize_control_tokens" in parameters


def _require_unicode(messages: list[dict]) -> None:
    """Raises InvalidArgumentError for a message whose text holds a lone surrogate: the
    tokenizer would fail on it with a TypeError that does not say why."""
    for message in messages:
        for text in _strings(message):
            try:
                text.encode()
            except UnicodeEncodeError as e:
                raise InvalidArgumentError(
                    f"a {message.get('role')!r} message holds a lone surrogate "
                    f"{text[e.start]!r} at char {e.start} of {text[:40]!r}; message text must "
                    "be Unicode"
                ) from None


def _strings(value: Any) -> Iterator[str]:
    """Every string in a message: keys and values, nested ones too."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _first_difference(left: list[int], right: list[int]) -> int:
    """The first index where the two lists differ, or the shorter length."""
    return next(
        (i for i, (a, b) in enumerate(zip(left, right, strict=False)) if a != b),
        min(len(left), len(right)),
    )


def conversation_ids_and_loss_mask(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    stop_token_ids: Iterable[int] | None = None,
    vision: VisionProcessor | None = None,
    images: Sequence[ProcessedImage] = (),
) -> tuple[list[int], list[bool]]:
    """A whole written conversation's token ids and loss mask, True on the tokens the model
    writes: each assistant message's ids through its stop token (`append_assistant_message`).
    False on the rest: the prompt (the messages before the first assistant message), tool
    results, user turns, generation prompts, and what the template writes after the last turn,
    images included.

    The arguments are `ConversationTokens`'s; `images` are the conversation's images (its
    messages' image parts, in order) as `vision` processed them. Raises InvalidArgumentError
    when no assistant message follows the prompt, two assistant messages are adjacent, or an
    assistant message holds an image, and FailedPreconditionError when the template cannot
    split the conversation into turns.
    """
    roles = [message.get("role") for message in messages]
    # Each model turn: an assistant message, then the messages up to the next one.
    starts = [index for index, role in enumerate(roles) if role == "assistant"]
    if not starts or starts[0] == 0:
        raise InvalidArgumentError(
            f"a conversation needs an assistant message after the first message; roles {roles!r}"
        )
    if any(a == b == "assistant" for a, b in itertools.pairwise(roles)):
        raise InvalidArgumentError(
            f"two assistant messages in a row in roles {roles!r}; a model turn ends where "
            "tool results or a user turn begin"
        )
    if any(with_image_placeholders([messages[start]])[1] for start in starts):
        raise InvalidArgumentError("an assistant message holds an image; models write text")
    held = with_image_placeholders(messages)[1]
    if vision is not None and held != len(images):  # a text model refuses them, saying so
        raise InvalidArgumentError(f"{len(images)} images given for a conversation holding {held}")
    tokens = ConversationTokens(
        tokenizer, chat_template, tools, chat_template_kwargs, stop_token_ids, vision
    )
    remaining = iter(images)

    def images_of(part: list[dict]) -> list[ProcessedImage]:
        return list(itertools.islice(remaining, with_image_placeholders(part)[1]))

    ids = tokens.prompt_ids(messages[: starts[0]], images_of(messages[: starts[0]]))
    loss_mask = [False] * len(ids)
    for start, end in zip(starts, [*starts[1:], len(messages)], strict=True):
        turn_ids = tokens.append_assistant_message(messages[start])
        following = messages[start + 1 : end]
        after_ids = (
            tokens.append_messages(following, images_of(following))
            if following
            else tokens.closing_ids()
        )
        ids += turn_ids + after_ids
        loss_mask += [True] * len(turn_ids) + [False] * len(after_ids)
    return ids, loss_mask
