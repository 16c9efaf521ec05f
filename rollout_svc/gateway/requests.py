"""The request of `POST .../v1/chat/completions` as the gateway accepts it: OpenAI's fields,
validated, and the messages as the dicts chat templates render.

Unknown fields are refused, as OpenAI refuses them. OpenAI fields the gateway cannot honour are
accepted only at the value that changes nothing (`frequency_penalty: 0`), so a request never
runs other than it asked. `stop` takes up to 4 non-empty strings of any length: the engine ends
the turn after the token that completes one, keeps that token, and the content stops before it.

User and tool messages may hold `image_url` parts (`detail` only "auto"): a `data:` URL, or a
`file:` URL under the rollout service's `images.file_dirs`, read and checked by turnrl.images
against its `images` limits (`load_images`); the messages then carry each image as the data URL
of its checked bytes, so a history sent back matches by the images' bytes.
"""

import json
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from turnrl.errors import InvalidArgumentError
from turnrl.images import ImageSettings, LoadedImage, load_image
from turnrl.v1 import common_pb2

MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 128  # OpenAI's bound on `n`
IMAGE_ROLES = ("user", "tool")  # a model writes text, and a system prompt is text


class RequestFieldError(InvalidArgumentError):
    """A bad request field; `param` names it as OpenAI's errors do (`messages.2.role`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FunctionCall(_Model):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ImageURL(_Model):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # only "auto": `check_supported`


class ImagePart(_Model):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Model):
    """One message of `messages`; assistant messages may carry `tool_calls`, tool messages
    `tool_call_id`, user and tool messages images. `refusal` is accepted as null: the SDKs send
    back what they received."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: None = None


class FunctionDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(_Model):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ChatCompletionRequest(_Model):
    """The fields of OpenAI's chat completions request that the gateway serves."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    n: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Accepted at the value that changes nothing.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    _tools_as_sent: list[dict[str, Any]] | None = PrivateAttr(default=None)

    def check_supported(self) -> None:
        """Raises InvalidArgumentError, naming the field, for a value the gateway cannot
        honour."""
        if self.tool_choice not in (None, "auto", "none"):
            raise RequestFieldError(
                f"tool_choice {self.tool_choice!r} is not supported; use 'auto' or 'none'",
                "tool_choice",
            )
        if not 1 <= self.choices <= MAX_CHOICES:
            raise RequestFieldError(f"n {self.n!r} must be 1 to {MAX_CHOICES}", "n")
        if self.top_logprobs:
            raise RequestFieldError(
                f"top_logprobs {self.top_logprobs!r} is not supported; only 0 (the sampled "
                "token's logprob, with logprobs: true)",
                "top_logprobs",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise RequestFieldError(f"{name} {getattr(self, name)!r} is not supported; 0", name)
        stops = self.stop_strings
        if len(stops) > MAX_STOP_SEQUENCES:
            raise RequestFieldError(f"stop has {len(stops)} entries; at most 4", "stop")
        if "" in stops:
            raise RequestFieldError(f"stop {stops!r} holds an empty string", "stop")
        for index, position, part in self.image_parts():
            where = f"messages[{index}].content[{position}]"
            if self.messages[index].role not in IMAGE_ROLES:
                raise RequestFieldError(
                    f"{where}: an image in a {self.messages[index].role!r} message; images go "
                    f"in {list(IMAGE_ROLES)} messages",
                    f"messages.{index}.content.{position}",
                )
            if part.image_url.detail not in (None, "auto"):
                raise RequestFieldError(
                    f"{where}.image_url.detail {part.image_url.detail!r} is not supported; "
                    "'auto' (the model's processor sizes every image by its own rule)",
                    f"messages.{index}.content.{position}.image_url.detail",
                )

    @property
    def choices(self) -> int:
        """How many choices the request samples: its `n`, 1 when not given."""
        return 1 if self.n is None else self.n

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def calls_tools(self) -> bool:
        """Whether the model's tool calls are read from its text (tools given, not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template renders them, or None: as the request wrote them
        (their keys in its order), once validated."""
        if not self.tools:
            return None
        return self._tools_as_sent or [tool.model_dump(exclude_none=True) for tool in self.tools]

    def image_parts(self) -> list[tuple[int, int, ImagePart]]:
        """Each image part of the messages, in order, with the index of its message and its
        index in that message's content."""
        return [
            (index, position, part)
            for index, message in enumerate(self.messages)
            if isinstance(message.content, list)
            for position, part in enumerate(message.content)
            if isinstance(part, ImagePart)
        ]

    def load_images(self, settings: ImageSettings) -> list[LoadedImage]:
        """The images of the messages, in order, read and checked against `settings`
        (turnrl.images). Raises RequestFieldError naming the part of one that fails, or the
        first part past `max_images`."""
        parts = self.image_parts()
        if len(parts) > settings.max_images:
            index, position, _ = parts[settings.max_images]
            raise RequestFieldError(
                f"messages hold {len(parts)} images; at most max_images={settings.max_images} "
                f"(the first over the limit: messages[{index}].content[{position}])",
                f"messages.{index}.content.{position}",
            )
        images = []
        for index, position, part in parts:
            image = common_pb2.Image(url=part.image_url.url)
            where = f"messages[{index}].content[{position}]"
            try:
                images.append(load_image(image, settings, where))
            except InvalidArgumentError as e:
                raise RequestFieldError(str(e), f"messages.{index}.content.{position}") from None
        return images

    def message_dicts(self, images: Sequence[LoadedImage]) -> list[dict[str, Any]]:
        """The messages as chat templates read them: text content, tool calls with their
        arguments as text, and a message with images as its parts, each image the data URL of
        its checked bytes (`images`: the messages' images as `load_images` read them)."""
        remaining = iter(images)
        return [_message_dict(message, remaining) for message in self.messages]


def parse_request(body: bytes) -> ChatCompletionRequest:
    """The request in `body`; InvalidArgumentError naming the field for one OpenAI's API would
    refuse or the gateway cannot honour."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise InvalidArgumentError(f"the request body is not JSON: {e}") from None
    try:
        request = ChatCompletionRequest.model_validate(value)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "body"
        message = f"{where}: {first['msg']} (got {first['input']!r:.200})"
        raise RequestFieldError(message, where) from None
    request.check_supported()
    request._tools_as_sent = value.get("tools")
    return request


def _message_dict(message: ChatMessage, images: Iterator[LoadedImage]) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        texts = [part.text for part in content if isinstance(part, TextPart)]
        # Text alone is joined, as OpenAI reads it; with images the parts keep their order.
        has_images = len(texts) < len(content)
        content = [_part_dict(part, images) for part in content] if has_images else "".join(texts)
    result: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.tool_calls:
        result["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        result["name"] = message.name
    return result


def _part_dict(part: TextPart | ImagePart, images: Iterator[LoadedImage]) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    return {"type": "image_url", "image_url": {"url": next(images).data_url()}}
