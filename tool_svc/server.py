"""gRPC skin of the tool service.

Every ToolService RPC answers UNIMPLEMENTED until the tool service issue lands: the generated
base servicer does that, so no caller ever receives a made-up answer. Health and reflection
are real.
"""

from tool_svc.config import ToolConfig
from turnrl import rpc
from turnrl.v1 import tool_pb2, tool_pb2_grpc


async def serve(config: ToolConfig) -> None:
    """Serves the tool service until SIGTERM or SIGINT."""
    servicer = tool_pb2_grpc.ToolServiceServicer()
    await rpc.serve(
        config.server,
        tool_pb2.DESCRIPTOR.services_by_name["ToolService"],
        lambda server: tool_pb2_grpc.add_ToolServiceServicer_to_server(servicer, server),
    )
