"""How an LLM judge's prompt reaches its model: chat messages in, the judge's k answers out.

Two transports, one contract (`JudgeTransport`); the judge (reward_svc/scorers/judge.py) parses
and aggregates the answers the same way whichever brought them:

- `ChatCompletionsTransport`: any OpenAI-compatible server over HTTP (vLLM, SGLang, a hosted
  API), `POST {base_url}/chat/completions` with `{model, messages, temperature, max_tokens, n}`,
  answered by `{choices: [{message: {content}}]}`;
- `RolloutServiceTransport`: a turnrl rollout service over gRPC, so that a generative reward
  model runs on turnrl's own engines, replicas and weight sync. One `RolloutService.Generate`
  with the messages as the one prompt, `n` = k, one model turn (`max_turns` 1), no tools and
  no scoring; an answer is the text of each trajectory's final assistant message.

Either raises ScorerUnavailableError when it cannot bring the answers (the server is down or
unreachable, answers an error, runs past the deadline, or a trajectory ends in ERROR or
ABORTED): the judge, not the response, failed.
"""

from typing import Any, Protocol

import httpx

from reward_svc.scorers.base import ScorerUnavailableError
from turnrl import errors, rpc
from turnrl.config import ClientConfig, read_secret_env
from turnrl.http_json import ChatCompletion, HttpJsonError, post_json
from turnrl.messages import dict_to_message
from turnrl.replicas import ReplicaSet
from turnrl.trajectory import FinishReason, Trajectory
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

# Trajectory ends that say the rollout service, not the judge model, failed.
FAILED_FINISH_REASONS = frozenset({FinishReason.ERROR, FinishReason.ABORTED})


class JudgeTransport(Protocol):
    """Brings a judge's answers to one prompt; `complete` may be called concurrently."""

    async def complete(self, messages: list[dict[str, str]]) -> list[str]:
        """The judge model's answers to `messages` (OpenAI chat dicts), one per sample."""
        ...

    async def close(self) -> None: ...


class ChatCompletionsTransport:
    """A judge on an OpenAI-compatible server: one chat-completions call with `n` = samples."""

    def __init__(
        self,
        judge_name: str,
        base_url: str,
        body: dict[str, Any],
        *,
        api_key_env: str | None,
        timeout_seconds: float,
        max_retries: int,
        max_connections: int,
    ) -> None:
        """`body` holds the request's fields besides `messages` (model, sampling, n)."""
        self.url = base_url.rstrip("/") + "/chat/completions"
        self._judge_name = judge_name
        self._body = body
        self._timeout_seconds = timeout_seconds
        self._max_retries = max_retries
        headers = {}
        if api_key_env is not None:
            headers["Authorization"] = f"Bearer {read_secret_env(api_key_env)}"
        # trust_env=False: no proxy or netrc from the environment.
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=timeout_seconds,
            limits=httpx.Limits(max_connections=max_connections),
            trust_env=False,
        )

    async def complete(self, messages: list[dict[str, str]]) -> list[str]:
        """The choices' texts; ScorerUnavailableError naming the URL when the call fails
        (retried on a connection error, HTTP 429 or 5xx, within the timeout)."""
        try:
            completion = await post_json(
                self._client,
                self.url,
                {**self._body, "messages": messages},
                ChatCompletion,
                timeout_seconds=self._timeout_seconds,
                max_retries=self._max_retries,
            )
        except HttpJsonError as e:
            raise ScorerUnavailableError(
                f"judge {self._judge_name!r} at {self.url!r} {e}"
            ) from None
        return [choice.message.content or "" for choice in completion.choices]

    async def close(self) -> None:
        """Closes the HTTP connections."""
        await self._client.aclose()


class RolloutServiceTransport:
    """A judge served by turnrl's rollout service: one Generate call with `n` = samples, to the
    replica of `rollout.address` with the fewest calls in flight (turnrl.replicas)."""

    def __init__(
        self,
        judge_name: str,
        rollout: ClientConfig,
        *,
        samples: int,
        sampling: common_pb2.SamplingParams,
        max_new_tokens: int,
        timeout_seconds: float,
    ) -> None:
        self._judge_name = judge_name
        self._rollout = rollout
        self._replicas = ReplicaSet(rollout, rollout_pb2_grpc.RolloutServiceStub)
        self._samples = samples
        self._sampling = sampling
        # One turn: the judge's answer may use the whole response budget.
        self._limits = common_pb2.LengthLimits(
            max_new_tokens=max_new_tokens, max_response_length=max_new_tokens
        )
        self._timeout_seconds = timeout_seconds

    async def complete(self, messages: list[dict[str, str]]) -> list[str]:
        """The final assistant text of each of the `samples` trajectories. Retried on
        UNAVAILABLE (a replica down or restarting) up to `rollout.max_attempts` tries, within
        the timeout; ScorerUnavailableError naming the address when no answer comes."""
        request = rollout_pb2.GenerateRequest(
            prompts=[
                rollout_pb2.RolloutPrompt(
                    prompt_id="judge", messages=[dict_to_message(m) for m in messages]
                )
            ],
            n=self._samples,
            sampling=self._sampling,
            limits=self._limits,
            max_turns=1,
            enable_scoring=False,
        )
        try:
            trajectories = await rpc.call_idempotent(
                self._generate,
                request,
                timeout_seconds=self._timeout_seconds,
                max_attempts=self._rollout.max_attempts,
            )
        except (errors.RpcError, errors.InvalidArgumentError) as e:
            raise self._unavailable(f"failed: {e}") from e
        if len(trajectories) != self._samples:
            raise self._unavailable(
                f"returned {len(trajectories)} trajectories for n={self._samples}"
            )
        for trajectory in trajectories:
            if trajectory.finish_reason in FAILED_FINISH_REASONS:
                raise self._unavailable(
                    f"ended a judge trajectory with {trajectory.finish_reason.name}: "
                    f"{trajectory.error_message or 'no message'}"
                )
        return [_final_assistant_text(trajectory) for trajectory in trajectories]

    async def _generate(
        self,
        request: rollout_pb2.GenerateRequest,
        timeout: float,  # noqa: ASYNC109 (a stub's signature, for rpc.call_idempotent)
    ) -> list[Trajectory]:
        """One Generate call on one replica, its stream read to the end. Raises the call's
        RpcError, InvalidArgumentError for a trajectory that does not decode."""
        with self._replicas.call() as replica:
            replies = replica.stub.Generate(request, timeout=timeout)
            return [Trajectory.from_proto(reply.trajectory) async for reply in replies]

    def _unavailable(self, what: str) -> ScorerUnavailableError:
        return ScorerUnavailableError(
            f"judge {self._judge_name!r} at rollout service {self._rollout.address} {what}"
        )

    async def close(self) -> None:
        """Closes the channels to the rollout replicas."""
        await self._replicas.close()


def _final_assistant_text(trajectory: Trajectory) -> str:
    """The text of the trajectory's last assistant message; "" when the judge wrote none."""
    for message in reversed(trajectory.messages):
        if message["role"] == "assistant":
            content = message.get("content") or ""
            return content if isinstance(content, str) else ""
    return ""
