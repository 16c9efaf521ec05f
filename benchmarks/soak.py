"""Load and soak of the tool service and the reward service, each a process of its own.

Phases, driven from this process:
- calculator: `turnrl serve tool` with its configured limits (16 calls of a tool at once,
  1,024 waiting) and 256 concurrent clients (--clients) calling `calculator` for --seconds;
- python: the same service, 256 clients calling the `python` sandbox for --sandbox-seconds
  (most of them wait in the tool's queue);
- python_queue_64: a second tool service, `tool.default_limits.max_queue=64`, 256 clients
  calling `python`: a call past 16 running and 64 waiting must come back RESOURCE_EXHAUSTED at
  once, not as a deadline error; its client pauses (--rejected-pause-seconds) and calls again;
- reward: `turnrl serve reward` with its defaults (2 workers) and 32 concurrent streams
  (--reward-streams), each scoring batches of 64 GSM8K gold solutions through ScoreBatch, one
  call per batch.

Each phase runs --warmup-seconds before its measured window; latencies are of the calls
started in the window. Beside the load, one probe client makes a cheap call (ListTools,
ListScorers) every PROBE_INTERVAL_SECONDS: what any call waits for on the loaded service and
client, to set the time to a rejection against. The service's resident memory (VmRSS of its
process and, apart, of its descendants: the reward workers, the sandboxes of calls in flight)
is sampled every second. Nothing is asserted: the script prints whether growth stayed within
RSS_GROWTH_BOUND_FRACTION.

    .venv/bin/python benchmarks/soak.py [--seconds 60] [--sandbox-seconds 20]

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import json
import os
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import smoke_mode
from child_processes import served
from reward_throughput import gsm8k_items
from tool_rpc import CALCULATOR, SANDBOX, TOOLS_OVERRIDE, percentile_ms

from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.errors import RpcError
from turnrl.v1 import reward_pb2, reward_pb2_grpc, tool_pb2, tool_pb2_grpc

BATCH_ITEMS = 64
CHANNELS = 8  # the clients share them round-robin, as callers in a few processes would
CALL_TIMEOUT_SECONDS = 30.0
SMALL_QUEUE = 64
# A rejected client's pause before its next call is jittered by +-50%: without the jitter the
# rejected clients retry in step and each rejection waits behind the whole herd's.
REJECTED_PAUSE_JITTER = 0.5
PROBE_INTERVAL_SECONDS = 0.1
# Growth of RSS from the end of warm-up to the end of the phase that still counts as flat.
# Relative, since a Python process's resident size is mostly its imports and allocator arenas;
# 10% of the tool service's ~150 MiB over a minute of ~3,000 calls/s is about 85 bytes a call,
# so a small dict kept per call would exceed it.
RSS_GROWTH_BOUND_FRACTION = 0.10
MIB = 1024 * 1024

Call = Callable[[int], Awaitable[str]]  # a client's index -> outcome: OK, a status, a tool error


@dataclass(frozen=True)
class Outcome:
    """One call: when it started and ended (loop.time()), how (OK, a status code's name, a
    tool error's kind), and whether it was its client's first (all clients make it at once)."""

    started: float
    ended: float
    outcome: str
    first: bool


@dataclass(frozen=True)
class MemorySample:
    """Resident memory in bytes of the service process ("service") and of its descendants
    together ("children")."""

    at: float  # loop.time()
    rss_bytes: dict[str, int]


def resident_bytes(pid: int) -> tuple[int, int]:
    """VmRSS of `pid`, and the sum over its descendants, from /proc."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    # The command name in parentheses may hold spaces; ppid follows the state.
                    parents[int(entry.name)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:  # it exited meanwhile
                continue
    descendants, generation = [], {pid}
    while generation:
        generation = {child for child, parent in parents.items() if parent in generation}
        descendants += generation
    return vm_rss_bytes(pid), sum(vm_rss_bytes(child) for child in descendants)


def vm_rss_bytes(pid: int) -> int:
    """VmRSS of `pid` in bytes; 0 for a process that exited meanwhile, or a zombie."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


async def sample_memory(pid: int, samples: list[MemorySample]) -> None:
    """Appends a sample now and every second after, until cancelled."""
    loop = asyncio.get_running_loop()
    at = loop.time()
    while True:
        service_bytes, children_bytes = await asyncio.to_thread(resident_bytes, pid)
        samples.append(MemorySample(at, {"service": service_bytes, "children": children_bytes}))
        at += 1.0
        await asyncio.sleep(max(at - loop.time(), 0.0))


async def drive(clients: int, call: Call, stop: float, rejected_pause: float) -> list[Outcome]:
    """`clients` callers, each calling `call(its index)` back to back until `stop`, but for a
    pause of about `rejected_pause` seconds after a RESOURCE_EXHAUSTED."""
    loop = asyncio.get_running_loop()
    outcomes: list[Outcome] = []

    async def client(index: int) -> None:
        first = True
        while (started := loop.time()) < stop:
            outcome = await call(index)
            outcomes.append(Outcome(started, loop.time(), outcome, first))
            first = False
            if outcome == "RESOURCE_EXHAUSTED":
                jitter = random.uniform(-REJECTED_PAUSE_JITTER, REJECTED_PAUSE_JITTER)
                await asyncio.sleep(rejected_pause * (1 + jitter))

    async with asyncio.TaskGroup() as group:
        for index in range(clients):
            group.create_task(client(index))
    return outcomes


async def probe_latencies(probe: Callable[[], Awaitable[object]], stop: float) -> list[float]:
    """Seconds per call of `probe`, one call every PROBE_INTERVAL_SECONDS until `stop`."""
    loop = asyncio.get_running_loop()
    latencies = []
    while (started := loop.time()) < stop:
        await probe()
        latencies.append(loop.time() - started)
        await asyncio.sleep(PROBE_INTERVAL_SECONDS)
    return latencies


async def execute(stub: tool_pb2_grpc.ToolServiceStub, request: tool_pb2.ExecuteRequest) -> str:
    """One Execute call's outcome: OK, its status code's name, or its tool error's kind."""
    try:
        reply = await stub.Execute(request, timeout=CALL_TIMEOUT_SECONDS)
    except RpcError as e:
        return e.status
    if reply.result.HasField("error"):
        return tool_pb2.ToolError.Kind.Name(reply.result.error.kind)
    return "OK"


async def score_batch(
    stub: reward_pb2_grpc.RewardServiceStub, items: list[reward_pb2.ScoringInput]
) -> str:
    """One ScoreBatch call; ITEM_ERROR when a scorer failed on an item (or an item came back
    missing), WRONG_SCORE when a gold solution scored below 1."""

    async def requests():
        for i, item in enumerate(items):
            yield reward_pb2.ScoreBatchRequest(item_id=str(i), input=item)

    try:
        call = stub.ScoreBatch(requests(), timeout=CALL_TIMEOUT_SECONDS)
        results = [response.result async for response in call]
    except RpcError as e:
        return e.status
    if len(results) != len(items) or any(result.reward.error for result in results):
        return "ITEM_ERROR"
    return "OK" if all(result.reward.score == 1.0 for result in results) else "WRONG_SCORE"


async def run_phase(
    name: str,
    pid: int,
    clients: int,
    call: Call,
    probe: Callable[[], Awaitable[object]],
    seconds: float,
    args: argparse.Namespace,
    bounded_parts: tuple[str, ...],
) -> dict:
    """Drives one phase, prints its figures and returns them. `bounded_parts`: the parts of
    the RSS that must stay flat ("service", "children"), and so get a verdict."""
    loop = asyncio.get_running_loop()
    samples: list[MemorySample] = []
    sampler = asyncio.create_task(sample_memory(pid, samples))
    warmed_up = loop.time() + args.warmup_seconds
    stop = warmed_up + seconds
    try:
        async with asyncio.TaskGroup() as group:
            load = group.create_task(drive(clients, call, stop, args.rejected_pause_seconds))
            await asyncio.sleep(args.warmup_seconds)
            probes = group.create_task(probe_latencies(probe, stop))
    finally:
        sampler.cancel()
    outcomes = load.result()
    window = [o for o in outcomes if warmed_up <= o.started < stop]
    finished = [o for o in outcomes if warmed_up <= o.ended < stop and o.outcome == "OK"]
    figures = {"calls_per_s": round(len(finished) / seconds, 1)}
    figures |= latency_figures(window, [o for o in outcomes if o.first], probes.result())
    figures |= memory_figures(samples, warmed_up, stop, bounded_parts)
    print(describe(f"{name}, {clients} clients, {seconds:g} s", figures, samples), flush=True)
    return figures


def latency_figures(window: list[Outcome], first: list[Outcome], probes: list[float]) -> dict:
    """Latency in ms (p50, p99, max) of the window's OK calls and rejected ones
    (RESOURCE_EXHAUSTED), of the rejected first calls (the burst at the start), and of the
    probe; the window's calls that were not OK counted by outcome."""
    ok = [o.ended - o.started for o in window if o.outcome == "OK"]
    rejected = [o.ended - o.started for o in window if o.outcome == "RESOURCE_EXHAUSTED"]
    burst = [o.ended - o.started for o in first if o.outcome == "RESOURCE_EXHAUSTED"]
    figures: dict = {
        "errors": dict(sorted(Counter(o.outcome for o in window if o.outcome != "OK").items())),
        "burst_rejected": len(burst),
    }
    kinds = (("", ok), ("rejection_", rejected), ("burst_rejection_", burst), ("probe_", probes))
    for prefix, latencies in kinds:
        enough = len(latencies) > 1  # statistics.quantiles needs two
        figures[f"{prefix}p50_ms"] = percentile_ms(latencies, 50) if enough else None
        figures[f"{prefix}p99_ms"] = percentile_ms(latencies, 99) if enough else None
        figures[f"{prefix}max_ms"] = round(max(latencies) * 1000, 3) if latencies else None
    return figures


def memory_figures(
    samples: list[MemorySample], warmed_up: float, stop: float, bounded_parts: tuple[str, ...]
) -> dict:
    """RSS in MiB of each part: at the start, at the end of warm-up, at the end of the window
    (its last sample) and the peak; growth from the end of warm-up to the end of the window;
    for the bounded parts, whether that growth stayed within the bound."""
    after_warmup = next(s for s in samples if s.at >= warmed_up)
    end = [s for s in samples if s.at <= stop][-1]
    figures = {}
    for part in ("service", "children"):
        at_warmup, at_end = after_warmup.rss_bytes[part] / MIB, end.rss_bytes[part] / MIB
        figures[f"{part}_rss_mib"] = {
            "start": round(samples[0].rss_bytes[part] / MIB, 1),
            "after_warmup": round(at_warmup, 1),
            "end": round(at_end, 1),
            "peak": round(max(s.rss_bytes[part] for s in samples) / MIB, 1),
        }
        figures[f"{part}_rss_growth_mib"] = round(at_end - at_warmup, 1)
        if part in bounded_parts:
            within = at_end - at_warmup <= RSS_GROWTH_BOUND_FRACTION * at_warmup
            figures[f"{part}_rss_within_bound"] = within
    return figures


def describe(title: str, f: dict, samples: list[MemorySample]) -> str:
    lines = [
        f"{title}: {f['calls_per_s']:,} calls/s, p50 {f['p50_ms']} ms, p99 {f['p99_ms']} ms; "
        f"errors: {f['errors'] or 'none'}"
    ]
    if f["burst_rejected"]:
        lines.append(
            f"  first calls, all at once: {f['burst_rejected']} RESOURCE_EXHAUSTED after p50 "
            f"{f['burst_rejection_p50_ms']} ms, max {f['burst_rejection_max_ms']} ms"
        )
    if f["rejection_max_ms"] is not None:
        lines.append(
            f"  RESOURCE_EXHAUSTED after p50 {f['rejection_p50_ms']} ms, p99 "
            f"{f['rejection_p99_ms']} ms, max {f['rejection_max_ms']} ms"
        )
    lines.append(f"  probe call meanwhile: p50 {f['probe_p50_ms']} ms, p99 {f['probe_p99_ms']} ms")
    for part in ("service", "children"):
        rss = f[f"{part}_rss_mib"]
        bound = f"the bound of {RSS_GROWTH_BOUND_FRACTION:.0%}"
        verdict = {True: f"within {bound}", False: f"OVER {bound}", None: "no bound"}[
            f.get(f"{part}_rss_within_bound")
        ]
        lines.append(
            f"  {part} RSS {rss['start']} / {rss['after_warmup']} / {rss['end']} MiB (start / "
            f"after warm-up / end; peak {rss['peak']}): growth {f[f'{part}_rss_growth_mib']} "
            f"MiB, {verdict}"
        )
    series = " ".join(f"{s.rss_bytes['service'] / MIB:.1f}" for s in samples[::10])
    lines.append(f"  service RSS every 10 s (MiB): {series}")
    return "\n".join(lines)


async def tool_phases(
    args: argparse.Namespace,
    phases: list[tuple[str, tool_pb2.ExecuteRequest, float]],
    *overrides: str,
) -> dict[str, dict]:
    """The (name, request, seconds) phases in turn against one tool service."""
    async with served("tool", TOOLS_OVERRIDE, *overrides) as (process, address):
        channels = [rpc.open_channel(ClientConfig(address=address)) for _ in range(CHANNELS + 1)]
        stubs = [tool_pb2_grpc.ToolServiceStub(channel) for channel in channels]

        def probe():  # on a channel of its own
            return stubs[CHANNELS].ListTools(
                tool_pb2.ListToolsRequest(), timeout=CALL_TIMEOUT_SECONDS
            )

        figures = {}
        try:
            for name, request, seconds in phases:

                def call(index: int, request=request) -> Awaitable[str]:
                    return execute(stubs[index % CHANNELS], request)

                # Its children are the sandboxes of the calls in flight: how many varies.
                figures[name] = await run_phase(
                    name, process.pid, args.clients, call, probe, seconds, args, bounded_parts=("service",)
                )  # fmt: skip
        finally:
            for channel in channels:
                await channel.close()
    return figures


async def reward_phase(args: argparse.Namespace) -> dict:
    """--reward-streams streams of ScoreBatch calls, each of its own 64 items, against one
    reward service."""
    async with served("reward") as (process, address):
        items = gsm8k_items(args.reward_streams * BATCH_ITEMS)
        channels = [rpc.open_channel(ClientConfig(address=address)) for _ in range(CHANNELS + 1)]
        stubs = [reward_pb2_grpc.RewardServiceStub(channel) for channel in channels]

        def call(index: int) -> Awaitable[str]:
            batch = items[index * BATCH_ITEMS : (index + 1) * BATCH_ITEMS]
            return score_batch(stubs[index % CHANNELS], batch)

        def probe():
            request = reward_pb2.ListScorersRequest()
            return stubs[CHANNELS].ListScorers(request, timeout=CALL_TIMEOUT_SECONDS)

        try:
            title = f"reward, ScoreBatch of {BATCH_ITEMS} GSM8K items"
            figures = await run_phase(
                title, process.pid, args.reward_streams, call, probe, args.seconds, args,
                bounded_parts=("service", "children"),  # the scorer workers live as long as it
            )  # fmt: skip
        finally:
            for channel in channels:
                await channel.close()
    figures["items_per_s"] = round(figures["calls_per_s"] * BATCH_ITEMS)
    print(f"  {figures['items_per_s']:,} items/s", flush=True)
    return figures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="calculator, reward window")
    parser.add_argument("--sandbox-seconds", type=float, default=20.0, help="each python window")
    parser.add_argument("--warmup-seconds", type=float, default=5.0, help="before each window")
    parser.add_argument(
        "--rejected-pause-seconds",
        type=float,
        default=1.0,
        help="a rejected client's pause before its next call: the rollout service does not "
        "retry RESOURCE_EXHAUSTED, so a trajectory's next call follows its next model turn",
    )
    parser.add_argument("--clients", type=int, default=256, help="of each tool phase")
    parser.add_argument("--reward-streams", type=int, default=32)
    smoke = {"seconds": 1.5, "sandbox_seconds": 1.0, "warmup_seconds": 2.0, "clients": 8}
    args = smoke_mode.parse_args(parser, smoke | {"reward_streams": 2})
    phases = await tool_phases(
        args, [("calculator", CALCULATOR, args.seconds), ("python", SANDBOX, args.sandbox_seconds)]
    )
    small_queue = f"python_queue_{SMALL_QUEUE}"
    phases |= await tool_phases(
        args,
        [(small_queue, SANDBOX, args.sandbox_seconds)],
        f"tool.default_limits.max_queue={SMALL_QUEUE}",
    )
    phases["reward"] = await reward_phase(args)
    headline = {}
    for name, f in phases.items():
        for key in ("calls_per_s", "p50_ms", "p99_ms", "errors"):
            headline[f"{name}_{key}"] = f[key]
    headline["reward_items_per_s"] = phases["reward"]["items_per_s"]
    for key in (
        "rejection_p50_ms", "rejection_p99_ms", "rejection_max_ms", "probe_p50_ms",
        "burst_rejected", "burst_rejection_p50_ms", "burst_rejection_max_ms",
    ):  # fmt: skip
        headline[f"{small_queue}_{key}"] = phases[small_queue][key]
    headline["rss_growth_mib"] = {name: f["service_rss_growth_mib"] for name, f in phases.items()}
    headline["reward_workers_rss_growth_mib"] = phases["reward"]["children_rss_growth_mib"]
    headline["rss_within_bound"] = {
        **{name: f["service_rss_within_bound"] for name, f in phases.items()},
        "reward_workers": phases["reward"]["children_rss_within_bound"],
    }
    print(json.dumps(headline))


if __name__ == "__main__":
    asyncio.run(main())
