"""The tools of one trajectory: its model's calls, each to a tool its prompt offered, in the
session its prompt's `tools_kwargs` opens for that tool (released when the trajectory ends), and
what each call gave back. A call the tool service could not run is the system's failure, not
the model's (turnrl.failures), and is marked so: the trajectory is then left out of the loss.
"""

import logging
from dataclasses import dataclass
from typing import Any

from rollout_svc.tool_client import ToolClient
from turnrl.errors import RpcError
from turnrl.failures import MODEL_TOOL_ERROR_KINDS, tool_rpc_error_is_models
from turnrl.v1 import common_pb2, tool_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCallOutcome:
    """How one tool call went: the observation text, whether it failed, whether it failed
    because the tool service could not run it (not the model's doing), its step reward."""

    text: str
    failed: bool = False
    infra_failed: bool = False
    step_reward: float | None = None
    images: tuple[common_pb2.Image, ...] = ()


class TrajectoryTools:
    """The tools one trajectory's model may call (OpenAI schemas), and its tool sessions."""

    def __init__(
        self,
        client: ToolClient,
        timeout_seconds: float,
        tools: list[dict[str, Any]],
        tools_kwargs: dict[str, Any],
    ) -> None:
        self._client = client
        self._timeout_seconds = timeout_seconds
        # A call to any other tool is the model's error: it was shown only these.
        self._offered = [tool["function"]["name"] for tool in tools]
        self._tools_kwargs = tools_kwargs
        self._sessions: dict[str, str] = {}

    async def call(self, name: str, arguments: str) -> ToolCallOutcome:
        """Runs one call of the model's: a tool it was not offered is its error."""
        if name not in self._offered:
            offered = ", ".join(self._offered) or "none"
            return ToolCallOutcome(f"Error: no tool {name!r} here; tools: {offered}", failed=True)
        try:
            session_id = await self._session(name)
            reply = await self._client.execute(
                tool_pb2.ExecuteRequest(tool_name=name, arguments=arguments, session_id=session_id),
                timeout_seconds=self._timeout_seconds,
            )
        except RpcError as e:
            text = f"Error: the tool service could not run {name!r}: {e.status}: {e.details}"
            rpc = e.method.rpartition("/")[2]  # CreateSession or Execute
            return ToolCallOutcome(text, True, not tool_rpc_error_is_models(rpc, e.status))
        result = reply.result
        failed = result.HasField("error")
        return ToolCallOutcome(
            result.text,
            failed,
            failed and result.error.kind not in MODEL_TOOL_ERROR_KINDS,
            result.step_reward if result.HasField("step_reward") else None,
            tuple(result.images),
        )

    async def _session(self, name: str) -> str:
        """The session of a tool that has per-trajectory kwargs; "" for the others."""
        if name in self._sessions or name not in self._tools_kwargs:
            return self._sessions.get(name, "")
        kwargs = self._tools_kwargs[name]
        kwargs = kwargs.get("create_kwargs", kwargs) if isinstance(kwargs, dict) else {}
        request = tool_pb2.CreateSessionRequest(tool_name=name)
        request.session_kwargs.update(kwargs)
        reply = await self._client.create_session(request, timeout_seconds=self._timeout_seconds)
        self._sessions[name] = reply.session_id
        return reply.session_id

    async def release(self) -> None:
        """Releases the trajectory's tool sessions; a failure is logged, not raised."""
        for session_id in self._sessions.values():
            try:
                await self._client.release_session(
                    tool_pb2.ReleaseSessionRequest(session_id=session_id),
                    timeout_seconds=self._timeout_seconds,
                )
            except RpcError as e:
                log.warning("releasing tool session %s failed: %s", session_id, e)
