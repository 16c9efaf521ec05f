"""`llm_user`: a user simulated by a chat model on any OpenAI-compatible endpoint.

The simulated user sees the conversation from its own side: the policy's turns arrive as the
user's input ("user" role for it) and its own earlier turns are its "assistant" turns, under a
persona prompt (`system_prompt`, which may use the prompt's interaction_kwargs as
`{placeholders}`). It ends the conversation by writing `stop_marker`, or after `max_replies`.
"""

from typing import Any, ClassVar

import httpx
from pydantic import Field

from rollout_svc.interactions.base import Interaction, InteractionReply
from turnrl.config import StrictModel, read_secret_env
from turnrl.http_json import ChatCompletion, HttpJsonError, post_json


class LlmUserOptions(StrictModel):
    """The chat model playing the user, and its persona."""

    base_url: str = Field(description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(description="Model name sent with each request.")
    api_key_env: str | None = Field(
        default=None, description="Environment variable holding an API key; None: no key."
    )
    system_prompt: str = Field(
        default="You are a user talking to an assistant. Reply briefly. When your request is "
        "fully answered, reply with [DONE].",
        description="The persona; may use interaction_kwargs as {placeholders}.",
    )
    stop_marker: str = Field(default="[DONE]", description="Text that ends the conversation.")
    max_replies: int = Field(default=4, ge=1, description="User replies before the end.")
    temperature: float = Field(default=0.7, ge=0, description="Sampling temperature.")
    max_tokens: int = Field(default=256, gt=0, description="Longest reply, in tokens.")
    request_timeout_seconds: float = Field(default=60.0, gt=0, description="Per reply, seconds.")
    max_retries: int = Field(default=2, ge=0, description="Retries on 429/5xx/connection errors.")


class LlmUser(Interaction):
    """A simulated user backed by a chat model."""

    Options: ClassVar = LlmUserOptions

    def __init__(self, options: LlmUserOptions) -> None:
        super().__init__(options)
        key = read_secret_env(options.api_key_env) if options.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.AsyncClient(headers=headers, trust_env=False)
        self._url = options.base_url.rstrip("/") + "/chat/completions"

    async def start(self, **interaction_kwargs: Any) -> dict[str, Any]:
        options: LlmUserOptions = self.options
        try:
            persona = options.system_prompt.format(**interaction_kwargs)
        except KeyError as e:
            raise ValueError(f"llm_user persona needs interaction_kwargs[{e.args[0]!r}]") from None
        return {"persona": persona, "replies": 0}

    async def respond(
        self, state: dict[str, Any], messages: list[dict[str, Any]]
    ) -> InteractionReply:
        options: LlmUserOptions = self.options
        body = {
            "model": options.model,
            "messages": [{"role": "system", "content": state["persona"]}, *_as_user_sees(messages)],
            "temperature": options.temperature,
            "max_tokens": options.max_tokens,
        }
        try:
            completion = await post_json(
                self._client,
                self._url,
                body,
                ChatCompletion,
                timeout_seconds=options.request_timeout_seconds,
                max_retries=options.max_retries,
            )
        except HttpJsonError as e:
            raise RuntimeError(f"simulated user at {self._url!r} {e}") from None
        text = (completion.choices[0].message.content or "") if completion.choices else ""
        state["replies"] += 1
        done = options.stop_marker in text or state["replies"] >= options.max_replies
        return InteractionReply(terminate=done, text=text.replace(options.stop_marker, "").strip())

    async def close(self) -> None:
        await self._client.aclose()


def _as_user_sees(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The conversation with roles swapped; tool traffic and the policy's system prompt are
    the assistant's business, not the user's."""
    swapped = {"user": "assistant", "assistant": "user"}
    return [
        {"role": swapped[m["role"]], "content": m.get("content") or ""}
        for m in messages
        if m["role"] in swapped and isinstance(m.get("content") or "", str)
    ]
