"""Rollout router scale-out: throughput against the number of rollout replicas, how close the
router's dispatch comes to the best balance of uneven work, and the router's own time per
trajectory.

The replicas are stand-ins (`stand_in_replicas.py`): they speak the real RolloutService
protocol, all hosted by one child process, and their engines only keep time: at most `--batch`
trajectories decode at once, a decode step costs `--step-ms` of waiting whatever the batch
holds. A finished trajectory streams back as a valid Trajectory proto: a prompt segment of
`--prompt-tokens` tokens, a model segment of `--tokens` tokens with logprobs, masks, messages,
a reward (the same reply whatever the trajectory's length).

For each N in `--replicas`, a RolloutRouter over the first N replicas gets N x batch x
`--waves` trajectories as groups of `--samples`, one `generate` call per group and all in
flight at once (the async trainer loop's shape). Two workloads, each on its own replicas:
  even    every trajectory `--tokens` steps, every replica the same speed: all replicas get
          the same work, so what is lost measures the router's overhead alone;
  uneven  heavy-tailed lengths (lognormal, median `--tokens`, sigma `--length-sigma`, capped
          at 8x) and replicas of unequal speed (every second replica's step `--slow-factor`
          times as long): what is lost also measures dispatch.
Figures, named for what they measure:
  scaling          even work: throughput(N) / (N x throughput(1)); below 1 by the router's
                   overhead (and the stand-ins' process falling behind);
  best_over_wall   best wall time / measured wall time. The best wall time is a lower bound
                   on any dispatch of the same work to the same replicas: the larger of the
                   whole work (decode steps of all trajectories) over the replicas' summed
                   capacity (batch / step time each), and the longest trajectory at the
                   fastest replica's step. On uneven work, how close dispatch comes to the
                   best balance.
The router's time is measured two ways: the time its coroutines (`generate` and each replica's
call) spend running on the event loop, which is its dispatch, grpc's Python side of reading and
parsing each reply and `Trajectory.from_proto`; and the whole router process's CPU time (grpc's
C threads and the event loop included). Where the wall time goes past the best shows in three
figures: the start (until the last replica began decoding), the tail (from the last replica's
last decode step to the last trajectory back), and the decode step as the replicas measured it
(their one process falls behind when it has more to do than a step's time allows). Each N runs
`--repeats` times, interleaved; the figures are medians.

    .venv/bin/python benchmarks/router_scale.py [--replicas 1,2,4,8,16,32,64] [--step-ms 20]
        [--tokens 32] [--batch 16] [--samples 8] [--length-sigma 1] [--slow-factor 2]  # ~5 min

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass

import smoke_mode
from child_processes import async_child
from stand_in_replicas import QUESTION, replica_step_seconds, serve_replicas, trajectory_steps

from trainer_svc.rollout_router import RolloutRouter
from turnrl.config import ClientConfig
from turnrl.v1 import common_pb2, rollout_pb2

RUN_TIMEOUT_SECONDS = 300.0
STAND_INS_STOP_SECONDS = 10.0


class TimedRouter(RolloutRouter):
    """A RolloutRouter that adds up the time its coroutines spend running, and `_assign`'s."""

    def __init__(self, config: ClientConfig, **kwargs) -> None:
        super().__init__(config, **kwargs)
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
    best_seconds: float  # a lower bound on any dispatch's wall time (module docstring)
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


def best_seconds(prompt_ids: list[str], replicas: int, args: argparse.Namespace) -> float:
    """The lower bound on the wall time of the groups `prompt_ids` on the first `replicas`:
    all their decode steps at the replicas' summed capacity, or the longest trajectory at
    the fastest replica's step, whichever is longer."""
    steps = [trajectory_steps(p, i, args) for p in prompt_ids for i in range(args.samples)]
    step_seconds = [replica_step_seconds(i, args) for i in range(replicas)]
    capacity = sum(args.batch / s for s in step_seconds)  # decode steps a second
    return max(sum(steps) / capacity, max(steps) * min(step_seconds))


async def measure(addresses: list[str], args: argparse.Namespace) -> Run:
    """One workload of N x batch x waves trajectories through a fresh router over `addresses`
    (`args` holds the workload's lengths and speeds)."""
    router = TimedRouter(ClientConfig(address=",".join(addresses)), catch_up=never_lost)
    try:
        before = await router.stats()  # also opens every channel, outside the timing
        groups = len(addresses) * args.batch * args.waves // args.samples
        prompt_ids = [f"g{k}" for k in range(groups)]
        requests = [group_request(prompt_id, args.samples) for prompt_id in prompt_ids]
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
        best_seconds=best_seconds(prompt_ids, len(addresses), args),
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
    wall = statistics.median(r.wall_seconds for r in runs)
    trajectories = first.trajectories

    def per_trajectory_ms(seconds) -> float:
        return statistics.median(seconds(r) for r in runs) / trajectories * 1000

    return {
        "replicas": first.replicas,
        "trajectories": trajectories,
        "wall_s": wall,
        "best_s": first.best_seconds,
        "best_over_wall": first.best_seconds / wall,
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


def print_table(workload: str, rows: list[dict]) -> None:
    print(
        f"{workload} work:\n{'N':>3} {'traj':>5} {'wall s':>7} {'best s':>7} {'best/wall':>9} "
        f"{'start s':>7} {'tail s':>6} {'traj/s':>7} {'scaling':>7} {'router ms':>9} "
        f"{'assign ms':>9} {'rtr CPU ms':>10} {'srv CPU ms':>10} {'step ms':>7} {'fill':>5}"
    )
    for row in rows:
        print(
            f"{row['replicas']:>3} {row['trajectories']:>5} {row['wall_s']:>7.3f} "
            f"{row['best_s']:>7.3f} {row['best_over_wall']:>9.3f} {row['start_lag_s']:>7.3f} "
            f"{row['tail_s']:>6.3f} {row['throughput']:>7.1f} {row['scaling']:>7.3f} "
            f"{row['router_ms']:>9.3f} {row['assign_ms']:>9.4f} {row['router_cpu_ms']:>10.3f} "
            f"{row['server_cpu_ms']:>10.3f} {row['step_ms']:>7.2f} {row['batch_fill']:>5.3f}"
        )


LEGEND = (
    "best s: a lower bound on any dispatch's wall time; scaling: throughput over N x the "
    "first N's per replica (even work: the router's overhead); start s: until the last replica "
    "began decoding; tail s: from the last decode step to the last trajectory back; router ms: "
    "the router's coroutines' time on the event loop per trajectory (dispatch, grpc reading and "
    "parsing the reply, from_proto); assign ms: of that, _assign; rtr / srv CPU ms: the "
    "router's / the replicas' process CPU per trajectory; step ms: the stand-in engines' mean "
    "decode step as measured; fill: their mean batch occupancy / batch"
)


async def measure_workload(args: argparse.Namespace, counts: list[int]) -> list[dict]:
    """Every N of `counts`, `--repeats` times interleaved, on stand-ins started for `args`'
    workload; a row of medians for each N."""
    serve = [
        sys.executable, __file__, "--serve", str(max(counts)), "--step-ms", str(args.step_ms),
        "--tokens", str(args.tokens), "--batch", str(args.batch),
        "--prompt-tokens", str(args.prompt_tokens), "--samples", str(args.samples),
        "--length-sigma", str(args.length_sigma), "--slow-factor", str(args.slow_factor),
    ]  # fmt: skip
    # Closing stdin stops the stand-ins; async_child's signal is for a process that hangs.
    pipes = {"stdin": asyncio.subprocess.PIPE, "stdout": asyncio.subprocess.PIPE}
    async with async_child(*serve, **pipes) as child:
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
            with contextlib.suppress(TimeoutError):  # else async_child stops it
                await asyncio.wait_for(child.wait(), STAND_INS_STOP_SECONDS)
    rows = [summarize(runs[n], args) for n in counts]
    per_replica = rows[0]["throughput"] / rows[0]["replicas"]
    for row in rows:
        row["scaling"] = row["throughput"] / (row["replicas"] * per_replica)
    return rows


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
    parser.add_argument(
        "--length-sigma", type=float, default=1.0, help="uneven work: lognormal sigma of lengths"
    )
    parser.add_argument(
        "--slow-factor", type=float, default=2.0, help="uneven work: every second replica's step"
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the child's role
    smoke = {"replicas": "1,2,4", "step_ms": 5.0, "tokens": 8, "repeats": 1, "waves": 2}
    args = smoke_mode.parse_args(parser, smoke)
    if args.serve:
        await serve_replicas(args.serve, args)
        return
    if args.batch * args.waves % args.samples:
        parser.error(f"batch x waves ({args.batch * args.waves}) is not a multiple of --samples")
    counts = [int(n) for n in args.replicas.split(",")]
    workloads = {
        "even": argparse.Namespace(**{**vars(args), "length_sigma": 0.0, "slow_factor": 1.0}),
        "uneven": args,
    }
    rows = {name: await measure_workload(work, counts) for name, work in workloads.items()}
    print(
        f"stand-in replica: batch {args.batch}, {args.step_ms:g} ms a decode step (uneven: x"
        f"{args.slow_factor:g} on every second replica), {args.tokens} steps a trajectory "
        f"(uneven: lognormal median, sigma {args.length_sigma:g}), {args.prompt_tokens} prompt "
        "tokens"
    )
    for name, workload_rows in rows.items():
        print_table(name, workload_rows)
    print(LEGEND)

    def by_n(workload: str, key: str) -> dict[int, float]:
        return {row["replicas"]: round(row[key], 3) for row in rows[workload]}

    figures = {
        "even_scaling": by_n("even", "scaling"),
        "even_best_over_wall": by_n("even", "best_over_wall"),
        "uneven_best_over_wall": by_n("uneven", "best_over_wall"),
        "overhead_ms": round(max(row["router_ms"] for row in rows["even"]), 4),
        "overhead_measure": "router coroutines' event-loop time per trajectory, even work, "
        "largest over N",
        "even_throughput": by_n("even", "throughput"),
        "uneven_throughput": by_n("uneven", "throughput"),
        "router_ms": by_n("even", "router_ms"),
        "router_cpu_ms": by_n("even", "router_cpu_ms"),
        "step_ms": args.step_ms,
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "batch": args.batch,
        "samples": args.samples,
        "length_sigma": args.length_sigma,
        "slow_factor": args.slow_factor,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
