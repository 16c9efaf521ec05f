"""gRPC skin of the trainer service: proto -> plain types, await TrainerService, plain -> proto.

Errors are raised as `turnrl.errors` exceptions and mapped to status codes by `turnrl.rpc`.
"""

import asyncio
import os
import signal
import sys
from collections.abc import Sequence

from trainer_svc.config import TrainerConfig
from trainer_svc.metrics import trainer_metrics
from trainer_svc.ranks import Ranks, exit_without_finalizing
from trainer_svc.service import RunEvent, RunRecord, TrainerService
from turnrl import rpc, service_main
from turnrl.errors import ConfigError
from turnrl.metrics import loop_registry
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """Implements turnrl.v1.TrainerService over a TrainerService."""

    def __init__(self, service: TrainerService) -> None:
        self._service = service

    async def StartRun(self, request, context):
        record = await self._service.start_run(
            request.config_yaml, request.run_name, request.resume, request.resume_from or None
        )
        return trainer_pb2.StartRunResponse(run=_run_proto(record))

    async def GetRun(self, request, context):
        return trainer_pb2.GetRunResponse(run=_run_proto(self._service.get_run(request.run_name)))

    async def StreamProgress(self, request, context):
        async for event in self._service.stream_progress(request.run_name):
            yield _event_proto(event)

    async def StopRun(self, request, context):
        record = await self._service.stop_run(request.run_name, request.save_checkpoint)
        return trainer_pb2.StopRunResponse(run=_run_proto(record))

    async def SaveCheckpoint(self, request, context):
        folder, step = await self._service.save_checkpoint(request.run_name)
        return trainer_pb2.SaveCheckpointResponse(checkpoint_dir=str(folder), step=step)


async def serve(config: TrainerConfig) -> None:
    """Serves the trainer service until SIGTERM or SIGINT; a running run stops after its step.
    On several ranks only rank 0 serves; the other ranks follow its model calls. Raises
    ConfigError when a launcher started this process as one of a number of ranks (WORLD_SIZE)
    other than `config.ranks`."""
    launched = os.environ.get("WORLD_SIZE")
    if launched is not None and int(launched) != config.ranks:
        raise ConfigError(
            f"this process was started as one of WORLD_SIZE={launched} ranks, but "
            f"trainer.ranks is {config.ranks}; start as many ranks as trainer.ranks says"
        )
    ranks = Ranks()
    if ranks.rank != 0:
        # Ctrl-C and SIGTERM, which a launcher may pass to every rank, are rank 0's to act on: it
        # finishes its step, whose collectives need this rank too, then ends `follow`.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        await asyncio.to_thread(ranks.follow)
        return
    service = TrainerService(ranks, config.model_path, config.runs_root or config.output_dir)
    try:
        await rpc.serve(
            config.server,
            trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"],
            lambda server: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(
                TrainerServicer(service), server
            ),
            metrics=loop_registry(lambda: trainer_metrics(service)),
        )
    finally:
        await service.close()
        await ranks.close()


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m trainer_svc`: serves the `trainer:` section of `--config F` with its
    overrides (turnrl.service_main); `turnrl serve trainer` ends in `serve` too. With
    `trainer.ranks` > 1 it becomes torchrun, which starts this command once per rank on this
    machine, unless a launcher (torchrun itself, or one that starts each rank on any machine)
    already started it as one rank: then WORLD_SIZE and the other env:// variables are set."""
    argv = sys.argv[1:] if argv is None else list(argv)
    config = service_main.load_config("trainer", TrainerConfig, argv)
    if config.ranks > 1 and "WORLD_SIZE" not in os.environ:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        nproc = f"--nproc-per-node={config.ranks}"
        os.execv(sys.executable, [*torchrun, nproc, "-m", "trainer_svc", *argv])
    try:
        service_main.run("trainer", serve, config)
    except SystemExit as e:
        if "WORLD_SIZE" not in os.environ:
            raise
        # One of several ranks, in their process groups still.
        exit_without_finalizing(e.code if isinstance(e.code, int) else 1)


def _run_proto(record: RunRecord) -> trainer_pb2.Run:
    run = trainer_pb2.Run(
        name=record.name,
        state=trainer_pb2.Run.State.Value(record.state.value),
        step=record.step,
        total_steps=record.total_steps,
        output_dir=str(record.output_dir),
        error_message=record.error_message,
        metrics=record.metrics,
    )
    run.start_time.FromNanoseconds(int(record.started * 1e9))
    if record.ended is not None:
        run.end_time.FromNanoseconds(int(record.ended * 1e9))
    return run


def _event_proto(event: RunEvent) -> trainer_pb2.StreamProgressResponse:
    response = trainer_pb2.StreamProgressResponse(
        state=trainer_pb2.Run.State.Value(event.state.value),
        step=event.step,
        stage=event.stage,
        metrics=event.metrics,
        message=event.message,
    )
    response.time.FromNanoseconds(int(event.time * 1e9))
    return response
