"""gRPC skin of the trainer service.

Every TrainerService RPC answers UNIMPLEMENTED until the trainer service issue lands: the generated
base servicer does that, so no caller ever receives a made-up answer. Health and reflection
are real.
"""

from trainer_svc.config import TrainerConfig
from turnrl import rpc
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc


async def serve(config: TrainerConfig) -> None:
    """Serves the trainer service until SIGTERM or SIGINT."""
    servicer = trainer_pb2_grpc.TrainerServiceServicer()
    await rpc.serve(
        config.server,
        trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"],
        lambda server: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server),
    )
