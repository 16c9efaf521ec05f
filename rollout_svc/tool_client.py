"""The tool service as the agent loop and `ToolSchemas` call it: one or several replicas.

`rollout.tool_service.address` may name several replicas of the tool service; each call goes
to one of them (`turnrl.replicas.ReplicaSet`), except that a session lives on the replica that
created it, so every call naming the session goes there too. Every replica runs the same
config, so any of them can list the tools.

A call that finds the service UNAVAILABLE (down, or restarting) is tried again within its
deadline, except a call of a session: the session died with the replica that held it. A call
that was running when its replica died may so run twice; tools whose effects outside the
sandbox must not repeat belong in sessions.
"""

from turnrl.config import ClientConfig
from turnrl.replicas import ReplicaSet
from turnrl.v1 import tool_pb2, tool_pb2_grpc


class ToolClient:
    """Calls the tool service's replicas: each method is the RPC of its name."""

    def __init__(self, config: ClientConfig) -> None:
        self._replicas = ReplicaSet(config, tool_pb2_grpc.ToolServiceStub)
        # The deadline of a call that names none (ListTools), retries included.
        self.timeout_seconds = config.timeout_seconds

    @property
    def unavailable_answers(self) -> int:
        """Calls a replica answered UNAVAILABLE (`ReplicaSet.unavailable_answers`)."""
        return self._replicas.unavailable_answers

    async def list_tools(
        self, request: tool_pb2.ListToolsRequest, timeout_seconds: float
    ) -> tool_pb2.ListToolsResponse:
        return await self._replicas.call_with_retries(
            lambda stub: stub.ListTools, request, timeout_seconds=timeout_seconds
        )

    async def create_session(
        self, request: tool_pb2.CreateSessionRequest, timeout_seconds: float
    ) -> tool_pb2.CreateSessionResponse:
        """Opens the session on one replica, which then gets every call naming it."""
        with self._replicas.call() as replica:
            reply = await replica.stub.CreateSession(request, timeout=timeout_seconds)
        self._replicas.pin(reply.session_id, replica)
        return reply

    async def execute(
        self, request: tool_pb2.ExecuteRequest, timeout_seconds: float
    ) -> tool_pb2.ExecuteResponse:
        """Runs the call on its session's replica, or on any for a call without a session
        (tried again while the service is unavailable)."""
        if request.session_id:
            with self._replicas.call(request.session_id) as replica:
                return await replica.stub.Execute(request, timeout=timeout_seconds)
        return await self._replicas.call_with_retries(
            lambda stub: stub.Execute, request, timeout_seconds=timeout_seconds
        )

    async def release_session(
        self, request: tool_pb2.ReleaseSessionRequest, timeout_seconds: float
    ) -> tool_pb2.ReleaseSessionResponse:
        """Releases the session on its replica; the session is forgotten here even when the
        call fails (the replica's TTL then ends it)."""
        try:
            with self._replicas.call(request.session_id) as replica:
                return await replica.stub.ReleaseSession(request, timeout=timeout_seconds)
        finally:
            self._replicas.unpin(request.session_id)

    async def close(self) -> None:
        await self._replicas.close()
