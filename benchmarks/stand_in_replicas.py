"""The stand-in rollout replicas of `router_scale.py`: servers that speak the real
RolloutService protocol over an engine that only keeps time, all in one process (one gRPC
server each, one event loop), so that the router's process has its CPU to itself.

A stand-in's engine batches continuously: at most `batch` trajectories decode at once, a decode
step costs its replica's step time of waiting whatever the batch holds, and a trajectory
finishes after its own number of steps (`trajectory_steps`), the others waiting for a slot in
arrival order. The work can be even (every trajectory `tokens` steps, every replica the same
step time) or uneven: heavy-tailed lengths (lognormal around `tokens`, `length_sigma`, capped at
LENGTH_CAP_FACTOR x `tokens`) and replicas of unequal speed (every odd-numbered replica's step
takes `slow_factor` times as long).
"""

import argparse
import asyncio
import random
import sys
import time
from collections import deque
from dataclasses import dataclass

from turnrl import rpc
from turnrl.config import ServerConfig
from turnrl.trajectory import FinishReason, Segment, SegmentSource, Trajectory
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

QUESTION = "What is 2+3?"
# The longest trajectory of uneven work, in multiples of the median: without a cap one draw in
# thousands (sigma 1) would run for minutes and be all that is measured.
LENGTH_CAP_FACTOR = 8


def trajectory_steps(prompt_id: str, sample_index: int, args: argparse.Namespace) -> int:
    """Decode steps of the trajectory: `tokens`, or for uneven work (`length_sigma` > 0) a
    lognormal draw of median `tokens`, the same in the replicas' and the router's process."""
    if not args.length_sigma:
        return args.tokens
    draw = random.Random(f"{prompt_id}/{sample_index}").lognormvariate(0.0, args.length_sigma)
    return max(1, min(round(args.tokens * draw), LENGTH_CAP_FACTOR * args.tokens))


def replica_step_seconds(index: int, args: argparse.Namespace) -> float:
    """The decode step of replica `index`: odd-numbered replicas are `slow_factor` slower."""
    return args.step_ms / 1000 * (args.slow_factor if index % 2 else 1.0)


@dataclass(eq=False)
class Job:
    """One trajectory on a stand-in engine."""

    prompt: rollout_pb2.RolloutPrompt
    sample_index: int
    done: asyncio.Queue  # its Generate call's: the job goes there when finished
    steps_left: int
    cancelled: bool = False


class SteppedEngine:
    """Continuous batching at a fixed cost per decode step: up to `batch` jobs decode together,
    each step waits `step_seconds` whatever the batch holds, a job is done after its
    `steps_left`."""

    def __init__(self, batch: int, step_seconds: float) -> None:
        self.batch, self.step_seconds = batch, step_seconds
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._work = asyncio.Event()
        self.steps = 0
        self.step_seconds_total = 0.0  # as measured: lateness of the event loop included
        self.slot_steps = 0  # sum over steps of the jobs decoding
        self.finished = 0
        # When it last went from idle to busy, and back (loop.time(): time.monotonic()).
        self.busy_since = self.idle_since = 0.0

    def submit(self, job: Job) -> None:
        self._waiting.append(job)
        self._work.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._work.wait()
            self.busy_since = deadline = loop.time()
            while self._waiting or self._running:
                while self._waiting and len(self._running) < self.batch:
                    job = self._waiting.popleft()
                    if not job.cancelled:
                        self._running.append(job)
                started = loop.time()
                # Steps keep to a fixed schedule: a timer that fires late shortens the next
                # wait, so the mean step stays `step_seconds` unless this process falls behind
                # by a whole step (then it counts from now).
                if started - deadline > self.step_seconds:
                    deadline = started
                deadline += self.step_seconds
                await asyncio.sleep(deadline - started)
                self.steps += 1
                self.step_seconds_total += loop.time() - started
                self.slot_steps += len(self._running)
                still_running = []
                for job in self._running:
                    job.steps_left -= 1
                    if job.cancelled:
                        continue
                    if job.steps_left:
                        still_running.append(job)
                    else:
                        self.finished += 1
                        job.done.put_nowait(job)
                self._running = still_running
            self._work.clear()  # no await since the loop's check: nothing new was submitted
            self.idle_since = loop.time()


class StandInRolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Generate through a SteppedEngine; GetStats reports its counts; Pause and Resume do
    nothing. Other RPCs are the base class's UNIMPLEMENTED."""

    def __init__(
        self, engine: SteppedEngine, template: common_pb2.Trajectory, args: argparse.Namespace
    ) -> None:
        self._engine = engine
        self._args = args
        # Every reply is this trajectory with new ids: the stand-in's own cost per trajectory
        # (it shares two cores with the router) stays small.
        self._template = template

    async def Generate(self, request, context):
        finished: asyncio.Queue[Job] = asyncio.Queue()
        jobs = [
            Job(prompt, index, finished, trajectory_steps(prompt.prompt_id, index, self._args))
            for prompt in request.prompts
            for index in range(request.n)
        ]
        for job in jobs:
            self._engine.submit(job)
        try:
            for _ in jobs:
                job = await finished.get()
                reply = rollout_pb2.GenerateResponse(trajectory=self._template)
                reply.trajectory.group_id = job.prompt.prompt_id
                reply.trajectory.trajectory_id = f"{job.prompt.prompt_id}/{job.sample_index}"
                reply.trajectory.sample_index = job.sample_index
                yield reply
        finally:  # also when the caller goes away: frees the slots of what is left
            for job in jobs:
                job.cancelled = True

    async def GetStats(self, request, context):
        engine = self._engine
        return rollout_pb2.GetStatsResponse(
            engine="stand-in",
            finished_trajectories=engine.finished,
            metrics={
                "steps": engine.steps,
                "step_seconds": engine.step_seconds_total,
                "slot_steps": engine.slot_steps,
                "busy_since": engine.busy_since,
                "idle_since": engine.idle_since,
                "process_cpu_seconds": time.process_time(),  # the child's, all replicas
            },
        )

    async def Pause(self, request, context):
        return rollout_pb2.PauseResponse()

    async def Resume(self, request, context):
        return rollout_pb2.ResumeResponse()


def stand_in_trajectory(prompt_tokens: int, tokens: int) -> common_pb2.Trajectory:
    """A finished trajectory of a `prompt_tokens`-token prompt and a `tokens`-token answer."""
    return Trajectory(
        trajectory_id="template/0",
        group_id="template",
        sample_index=0,
        segments=[
            Segment(SegmentSource.PROMPT, list(range(1, prompt_tokens + 1))),
            Segment(SegmentSource.MODEL, [101 + 7 * i for i in range(tokens)], [-0.5] * tokens),
        ],
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "5"},
        ],
        finish_reason=FinishReason.STOP,
        data_source="stand_in",
        metrics={"model_tokens": float(tokens)},
        reward=common_pb2.Reward(score=1.0),
    ).to_proto()


async def serve_replicas(count: int, args: argparse.Namespace) -> None:
    """Starts `count` stand-in replicas, prints their addresses comma-separated on one line,
    and serves until stdin closes (the parent closes it, or dies)."""
    engines = [SteppedEngine(args.batch, replica_step_seconds(i, args)) for i in range(count)]
    template = stand_in_trajectory(args.prompt_tokens, args.tokens)
    descriptor = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
    servers = [
        await rpc.start_server(
            ServerConfig(port=0),
            descriptor,
            lambda server, engine=engine: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
                StandInRolloutServicer(engine, template, args), server
            ),
        )
        for engine in engines
    ]
    engine_loops = [asyncio.create_task(engine.run()) for engine in engines]
    print(",".join(f"127.0.0.1:{s.port}" for s in servers), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    for engine_loop in engine_loops:
        engine_loop.cancel()
    await asyncio.gather(*engine_loops, return_exceptions=True)
    for server in servers:
        await rpc.stop_server(server, grace_seconds=0)
