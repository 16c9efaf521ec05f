"""gRPC skin of the reward service.

Every RewardService RPC answers UNIMPLEMENTED until the reward service issue lands: the generated
base servicer does that, so no caller ever receives a made-up answer. Health and reflection
are real.
"""

from reward_svc.config import RewardConfig
from turnrl import rpc
from turnrl.v1 import reward_pb2, reward_pb2_grpc


async def serve(config: RewardConfig) -> None:
    """Serves the reward service until SIGTERM or SIGINT."""
    servicer = reward_pb2_grpc.RewardServiceServicer()
    await rpc.serve(
        config.server,
        reward_pb2.DESCRIPTOR.services_by_name["RewardService"],
        lambda server: reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server),
    )
