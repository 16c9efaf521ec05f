"""gRPC skin of the trainer service: proto -> TrainerService -> proto.

Errors are raised as `turnrl.errors` exceptions and mapped to status codes by `turnrl.rpc`.
"""

import asyncio
import signal

from trainer_svc.config import TrainerConfig
from trainer_svc.ranks import Ranks
from trainer_svc.service import TrainerService
from turnrl import rpc
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Implements turnrl.v1.TrainerService over a TrainerService."""

    def __init__(self, service: TrainerService) -> None:
        self._service = service

    async def StartRun(self, request, context):
        record = await self._service.start_run(
            request.config_yaml, request.run_name, request.resume
        )
        return trainer_pb2.StartRunResponse(run=record.to_proto())

    async def GetRun(self, request, context):
        return trainer_pb2.GetRunResponse(run=self._service.get_run(request.run_name).to_proto())

    async def StreamProgress(self, request, context):
        async for event in self._service.stream_progress(request.run_name):
            yield event

    async def StopRun(self, request, context):
        record = await self._service.stop_run(request.run_name, request.save_checkpoint)
        return trainer_pb2.StopRunResponse(run=record.to_proto())

    async def SaveCheckpoint(self, request, context):
        folder, step = await self._service.save_checkpoint(request.run_name)
        return trainer_pb2.SaveCheckpointResponse(checkpoint_dir=str(folder), step=step)


async def serve(config: TrainerConfig) -> None:
    """Serves the trainer service until SIGTERM or SIGINT; a running run stops after its step.
    Under torchrun only rank 0 serves; the other ranks follow its model calls."""
    ranks = Ranks()
    if ranks.rank != 0:
        # Ctrl-C and SIGTERM, which torchrun passes to every rank, are rank 0's to act on: it
        # finishes its step, whose collectives need this rank too, then ends `follow`.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        await asyncio.to_thread(ranks.follow)
        return
    service = TrainerService(ranks, config.model_path)
    try:
        await rpc.serve(
            config.server,
            trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"],
            lambda server: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(
                TrainerServicer(service), server
            ),
        )
    finally:
        await service.close()
        await ranks.close()
