"""Rollout router scale-out: throughput against the number of rollout replicas, and the router's
own time per trajectory.

The replicas are stand-ins that speak the real RolloutService protocol, all hosted by one child
process (one gRPC server each, on 127.0.0.1, one event loop), so that the router's process has
its CPU to itself. A stand-in's engine batches continuously: at most `--batch` trajectories
decode at once, a decode step costs `--step-ms` of waiting whatever the batch holds, and a
trajectory finishes after `--tokens` steps (the others wait for a slot in arrival order). One
replica therefore finishes batch / (tokens x step) trajectories a second, and N replicas
ideally N times that. A finished trajectory streams back as a valid Trajectory proto: a prompt
segment of `--prompt-tokens` tokens, a model segment of `--tokens` tokens with logprobs, masks,
messages, a reward.

For each N in `--replicas`, a RolloutRouter over the first N replicas gets N x batch x
`--waves` trajectories as groups of `--samples`, one `generate` call per group and all in
flight at once (the async trainer loop's shape). Throughput is trajectories / wall time;
efficiency is throughput(N) / (N x throughput(1)). The router's time is measured two ways:
the time its coroutines (`generate` and each replica's call) spend running on the event loop,
which is its dispatch, grpc's Python side of reading and parsing each reply and
`Trajectory.from_proto`; and the whole router process's CPU time (grpc's C threads and the
event loop included). Where the wall time goes past the ideal shows in three figures: the
start (until the last replica began decoding), the tail (from the last decode step to the last
trajectory back), and the decode step as the replicas measured it (their one process falls
behind when it has more to do than a step's time allows). Each N runs `--repeats` times,
interleaved; the figures are medians.

    .venv/bin/python benchmarks/router_scale.py [--replicas 1,2,4,8,16,32,64] [--step-ms 20]
        [--tokens 32] [--batch 16] [--samples 8]      # about 1 min

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass

from trainer_svc.rollout_router import RolloutRouter
from turnrl import rpc
from turnrl.config import ClientConfig, ServerConfig
from turnrl.trajectory import FinishReason, Segment, SegmentSource, Trajectory
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

QUESTION = "What is 2+3?"
RUN_TIMEOUT_SECONDS = 300.0


# ------------------------------- the stand-in replicas (child) -------------------------------


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
    each step waits `step_seconds` whatever the batch holds, a job is done after `tokens`
    steps."""

    def __init__(self, batch: int, tokens: int, step_seconds: float) -> None:
        self.batch, self.tokens, self.step_seconds = batch, tokens, step_seconds
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

    def __init__(self, engine: SteppedEngine, template: common_pb2.Trajectory) -> None:
        self._engine = engine
        # Every reply is this trajectory with new ids: the stand-in's own cost per trajectory
        # (it shares two cores with the router) stays small.
        self._template = template

    async def Generate(self, request, context):
        finished: asyncio.Queue[Job] = asyncio.Queue()
        jobs = [
            Job(prompt, index, finished, self._engine.tokens)
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
    engines = [SteppedEngine(args.batch, args.tokens, args.step_ms / 1000) for _ in range(count)]
    template = stand_in_trajectory(args.prompt_tokens, args.tokens)
    descriptor = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
    servers = [
        await rpc.start_server(
            ServerConfig(port=0),
            descriptor,
            lambda server, engine=engine: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
                StandInRolloutServicer(engine, template), server
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


# -------------------------------------- the router (parent) ----------------------------------


class TimedRouter(RolloutRouter):
    """A RolloutRouter that adds up the time its coroutines spend running, and `_assign`'s."""

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self.running_seconds = 0.0
        self.assign_seconds = 0.0

    async def generate(self, request, *, timeout_seconds):
        return await _Timed(super().generate(request, timeout_seconds=timeout_seconds), self)

    async def _call(self, *args):
        # A task of its own under generate's gather: its steps are not generate's.
        return await _Timed(super()._call(*args), self)

    def _assign(self, prompts, n):
        started = time.perf_counter()
        try:
            return super()._assign(prompts, n)
        finally:
            self.assign_seconds += time.perf_counter() - started


class _Timed:
    """Awaits `coroutine`, adding to `router.running_seconds` the time spent inside each of its
    steps (from being resumed to its next wait), not the time it waits."""

    def __init__(self, coroutine, router: TimedRouter) -> None:
        self._coroutine = coroutine
        self._router = router

    def __await__(self):
        resume, value = self._coroutine.send, None
        while True:
            started = time.perf_counter()
            try:
                waiting_on = resume(value)
            except StopIteration as done:
                return done.value
            finally:
                self._router.running_seconds += time.perf_counter() - started
            try:
                value, resume = (yield waiting_on), self._coroutine.send
            except BaseException as e:  # cancellation: thrown into the coroutine, as await does
                value, resume = e, self._coroutine.throw


@dataclass
class Run:
    replicas: int
    trajectories: int
    wall_seconds: float
    start_lag_seconds: float  # until the last replica began decoding
    tail_seconds: float  # from the last decode step's end to the last trajectory back
    running_seconds: float  # the router's coroutines on the event loop
    assign_seconds: float
    cpu_seconds: float  # the router's process
    server_cpu_seconds: float  # the replicas' process
    engine_steps: float
    engine_step_seconds: float
    engine_slot_steps: float


async def never_lost(replica) -> None:
    """The router's catch-up: no stand-in is ever lost here."""
    raise AssertionError(f"stand-in replica {replica.address} was lost")


async def measure(addresses: list[str], args: argparse.Namespace) -> Run:
    """One workload of N x batch x waves trajectories through a fresh router over `addresses`."""
    router = TimedRouter(ClientConfig(address=",".join(addresses)), catch_up=never_lost)
    try:
        before = await router.stats()  # also opens every channel, outside the timing
        groups = len(addresses) * args.batch * args.waves // args.samples
        requests = [group_request(f"g{k}", args.samples) for k in range(groups)]
        # time.monotonic() is the clock of the replicas' loop.time() as well.
        cpu_started, started = time.process_time(), time.monotonic()
        results = await asyncio.gather(
            *(router.generate(r, timeout_seconds=RUN_TIMEOUT_SECONDS) for r in requests)
        )
        ended, cpu = time.monotonic(), time.process_time() - cpu_started
        after = await router.stats()
    finally:
        await router.close()
    trajectories = sum(map(len, results))
    assert trajectories == groups * args.samples, f"{trajectories} trajectories came back"

    def engine_total(name: str) -> float:
        return sum(s.metrics[name] for s in after) - sum(s.metrics[name] for s in before)

    return Run(
        replicas=len(addresses),
        trajectories=trajectories,
        wall_seconds=ended - started,
        start_lag_seconds=max(s.metrics["busy_since"] for s in after) - started,
        tail_seconds=ended - max(s.metrics["idle_since"] for s in after),
        running_seconds=router.running_seconds,
        assign_seconds=router.assign_seconds,
        cpu_seconds=cpu,
        server_cpu_seconds=after[0].metrics["process_cpu_seconds"]
        - before[0].metrics["process_cpu_seconds"],
        engine_steps=engine_total("steps"),
        engine_step_seconds=engine_total("step_seconds"),
        engine_slot_steps=engine_total("slot_steps"),
    )


def group_request(prompt_id: str, samples: int) -> rollout_pb2.GenerateRequest:
    question = common_pb2.Message(
        role=common_pb2.Message.ROLE_USER, content=[common_pb2.ContentPart(text=QUESTION)]
    )
    return rollout_pb2.GenerateRequest(
        prompts=[
            rollout_pb2.RolloutPrompt(
                prompt_id=prompt_id, messages=[question], data_source="stand_in"
            )
        ],
        n=samples,
        sampling=common_pb2.SamplingParams(temperature=1.0),
        enable_scoring=True,
        request_id=f"bench/{prompt_id}",
    )


def summarize(runs: list[Run], args: argparse.Namespace) -> dict:
    """Medians over the repeats of one N."""
    first = runs[0]
    per_replica = args.batch / (args.tokens * args.step_ms / 1000)  # trajectories/s
    wall = statistics.median(r.wall_seconds for r in runs)
    trajectories = first.trajectories

    def per_trajectory_ms(seconds) -> float:
        return statistics.median(seconds(r) for r in runs) / trajectories * 1000

    return {
        "replicas": first.replicas,
        "trajectories": trajectories,
        "wall_s": wall,
        "ideal_s": trajectories / (first.replicas * per_replica),
        "throughput": trajectories / wall,
        "start_lag_s": statistics.median(r.start_lag_seconds for r in runs),
        "tail_s": statistics.median(r.tail_seconds for r in runs),
        "router_ms": per_trajectory_ms(lambda r: r.running_seconds),
        "assign_ms": per_trajectory_ms(lambda r: r.assign_seconds),
        "router_cpu_ms": per_trajectory_ms(lambda r: r.cpu_seconds),
        "server_cpu_ms": per_trajectory_ms(lambda r: r.server_cpu_seconds),
        "step_ms": statistics.median(r.engine_step_seconds / r.engine_steps for r in runs) * 1000,
        "batch_fill": statistics.median(r.engine_slot_steps / r.engine_steps for r in runs)
        / args.batch,
    }


def print_table(rows: list[dict], efficiency: dict[int, float]) -> None:
    print(
        f"{'N':>3} {'traj':>5} {'wall s':>7} {'ideal s':>7} {'start s':>7} {'tail s':>6} "
        f"{'traj/s':>7} {'eff':>5} {'router ms':>9} {'assign ms':>9} {'rtr CPU ms':>10} "
        f"{'srv CPU ms':>10} {'step ms':>7} {'fill':>5}"
    )
    for row in rows:
        print(
            f"{row['replicas']:>3} {row['trajectories']:>5} {row['wall_s']:>7.3f} "
            f"{row['ideal_s']:>7.3f} {row['start_lag_s']:>7.3f} {row['tail_s']:>6.3f} "
            f"{row['throughput']:>7.1f} {efficiency[row['replicas']]:>5.3f} "
            f"{row['router_ms']:>9.3f} {row['assign_ms']:>9.4f} {row['router_cpu_ms']:>10.3f} "
            f"{row['server_cpu_ms']:>10.3f} {row['step_ms']:>7.2f} {row['batch_fill']:>5.3f}"
        )
    print(
        "start s: until the last replica began decoding; tail s: from the last decode step to "
        "the last trajectory back; router ms: the router's coroutines' time on the event loop "
        "per trajectory (dispatch, grpc reading and parsing the reply, from_proto); assign ms: "
        "of that, _assign; rtr / srv CPU ms: the router's / the replicas' process CPU per "
        "trajectory; step ms: the stand-in engines' mean decode step as measured; fill: their "
        "mean batch occupancy / batch"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="1,2,4,8,16,32,64", help="comma-separated N")
    parser.add_argument("--step-ms", type=float, default=20.0, help="cost of one decode step")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per trajectory")
    parser.add_argument(
        "--prompt-tokens", type=int, default=128, help="prompt length of every trajectory"
    )
    parser.add_argument("--batch", type=int, default=16, help="trajectories decoding at once")
    parser.add_argument("--samples", type=int, default=8, help="trajectories per prompt group")
    parser.add_argument("--waves", type=int, default=4, help="batches of work per replica")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each N; medians")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the child's role
    args = parser.parse_args()
    if args.serve:
        await serve_replicas(args.serve, args)
        return
    if args.batch * args.waves % args.samples:
        parser.error(f"batch x waves ({args.batch * args.waves}) is not a multiple of --samples")
    counts = [int(n) for n in args.replicas.split(",")]

    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve", str(max(counts)), "--step-ms", str(args.step_ms),
        "--tokens", str(args.tokens), "--batch", str(args.batch),
        "--prompt-tokens", str(args.prompt_tokens),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        line = (await child.stdout.readline()).decode().strip()
        if not line:
            raise RuntimeError("the stand-in replicas did not start")
        addresses = line.split(",")
        await measure(addresses, args)  # warm-up: first calls on both sides
        runs: dict[int, list[Run]] = {n: [] for n in counts}
        for repeat in range(args.repeats):
            for n in counts:
                run = await measure(addresses[:n], args)
                runs[n].append(run)
                print(f"run {repeat + 1}, N={n}: {run.wall_seconds:.3f} s", flush=True)
    finally:
        child.stdin.close()
        await child.wait()

    rows = [summarize(runs[n], args) for n in counts]
    single = rows[0]["throughput"] / rows[0]["replicas"]
    efficiency = {row["replicas"]: row["throughput"] / (row["replicas"] * single) for row in rows}
    print(
        f"stand-in replica: batch {args.batch}, {args.tokens} steps of {args.step_ms:g} ms a "
        f"trajectory ({args.prompt_tokens} + {args.tokens} tokens), ideally "
        f"{args.batch / (args.tokens * args.step_ms / 1000):.1f} trajectories/s"
    )
    print_table(rows, efficiency)
    figures = {
        "efficiency_16": round(efficiency[16], 3) if 16 in efficiency else None,
        "overhead_ms": round(max(row["router_ms"] for row in rows), 4),
        "overhead_measure": "router coroutines' event-loop time per trajectory, largest over N",
        "throughput": {row["replicas"]: round(row["throughput"], 1) for row in rows},
        "efficiency": {n: round(e, 3) for n, e in efficiency.items()},
        "router_ms": {row["replicas"]: round(row["router_ms"], 4) for row in rows},
        "router_cpu_ms": {row["replicas"]: round(row["router_cpu_ms"], 4) for row in rows},
        "step_ms": args.step_ms,
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "batch": args.batch,
        "samples": args.samples,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
