"""gRPC skin of the rollout service.

Every RolloutService RPC answers UNIMPLEMENTED until the rollout service issue lands: the generated
base servicer does that, so no caller ever receives a made-up answer. Health and reflection
are real.
"""

from rollout_svc.config import RolloutConfig
from turnrl import rpc
from turnrl.v1 import rollout_pb2, rollout_pb2_grpc


async def serve(config: RolloutConfig) -> None:
    """Serves the rollout service until SIGTERM or SIGINT."""
    servicer = rollout_pb2_grpc.RolloutServiceServicer()
    await rpc.serve(
        config.server,
        rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
        lambda server: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server),
    )
