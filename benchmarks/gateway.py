"""The OpenAI-compatible gateway against Generate: what a chat-completions call adds over the same
generation through the rollout service's gRPC call.

Starts `turnrl serve rollout` as its own process with the gateway on (hf engine, the tiny
calculator model, which runs on the CPU) and sends it the same single-turn, tool-free
generation both ways: a user message after which the model, greedy, writes past
`--max-tokens` without stopping, so that every call generates exactly `--max-tokens` tokens
(checked, with the token ids of both paths compared).

- Generate: one `Generate` call (n 1, max_turns 1, enable_scoring false, temperature 0) on one
  gRPC channel, streaming back the trajectory;
- gateway: `chat.completions.create` of the real `openai.AsyncOpenAI` client (temperature 0,
  `max_tokens`), one new session per call, then `POST /sessions/{id}/end`, which returns the
  session's trajectory. Each session has an HTTP client of its own, as each agent would,
  opened before it is timed (one pool shared by 64 sessions costs the client ~15 ms of CPU a
  call: httpcore scans every pooled connection on every request event).

(1) batch 1: `--calls` calls of each path one after the other, alternating which goes first,
    after `--warmup` of each; the medians in ms. The gateway's headline is the completion call
    alone (what an agent waits for each turn); with the session's end it is reported beside.
(2) concurrency: `--sessions` gateway sessions at once (each a call, then its end) against one
    Generate call of `--sessions` prompts (the trainer's way; the headline ratio) and against
    `--sessions` concurrent Generate calls of one prompt each (callers as independent as the
    agents), `--rounds` times in turn; calls/s and generated tokens/s of the median round,
    with the engine's busy seconds and prefill forwards in it (GetStats): requests that
    arrive one by one join the running batch one by one, in more prefills and decode steps.

Around every call and round the CPU seconds of the service's process (psutil, in 10 ms ticks)
and of this one (the client) are read too: on two cores both share, the client's CPU is time
the service does not get, and CPU seconds vary less than wall time on a loaded machine.

The service runs torch on `--torch-threads` (OMP_NUM_THREADS): with two threads on two cores
beside this process, rounds took 0.3 to 14 s.

    .venv/bin/python benchmarks/gateway.py [--calls 30] [--sessions 64] [--max-tokens 64]

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import openai
import psutil
import smoke_mode
from child_processes import served

from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.messages import dict_to_message
from turnrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

# After this message the tiny model, greedy, writes at least 128 tokens without an end of turn.
USER_MESSAGE = {"role": "user", "content": "aaaa aaaa aaaa aaaa"}
# Nothing listens here: neither path calls a tool or the reward service.
NOWHERE = "127.0.0.1:9"
TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class Timed:
    """One timed piece of work: its seconds and the model token ids of each generation in it;
    then what `Meter.measured` adds: the engine's busy seconds and prefill forwards, and the CPU
    seconds of the service's process and of this one (the client) during it."""

    seconds: float
    model_ids: list[list[int]]
    # A gateway session of one call: its end, after the call (not in `seconds`).
    end_seconds: float = 0.0
    engine_busy_seconds: float = 0.0
    prefill_forwards: float = 0.0
    service_cpu_seconds: float = 0.0
    client_cpu_seconds: float = 0.0


class Meter:
    """Reads the engine's counters (GetStats) and the service's and this process's CPU time
    around a piece of work."""

    def __init__(self, stub, service_pid: int) -> None:
        self._stub = stub
        self._service = psutil.Process(service_pid)

    async def measured(self, work: Awaitable[Timed]) -> Timed:
        before = await self._read()
        run = await work
        after = await self._read()
        spent = {name: after[name] - before[name] for name in before}
        return dataclasses.replace(run, **spent)

    async def _read(self) -> dict[str, float]:
        stats = await self._stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=TIMEOUT_SECONDS)
        service = self._service.cpu_times()
        return {
            "engine_busy_seconds": stats.metrics["busy_seconds"],
            "prefill_forwards": stats.metrics["prefill_forwards"],
            "service_cpu_seconds": service.user + service.system,
            "client_cpu_seconds": time.process_time(),
        }


async def generate(stub, prompts: int, max_tokens: int) -> Timed:
    """One Generate call of `prompts` copies of the message, one sample each."""
    request = rollout_pb2.GenerateRequest(
        prompts=[
            rollout_pb2.RolloutPrompt(prompt_id=f"p{i}", messages=[dict_to_message(USER_MESSAGE)])
            for i in range(prompts)
        ],
        n=1,
        sampling=common_pb2.SamplingParams(temperature=0.0),
        limits=common_pb2.LengthLimits(max_new_tokens=max_tokens),
        max_turns=1,
        enable_scoring=False,
    )
    started = time.perf_counter()
    trajectories = [
        reply.trajectory async for reply in stub.Generate(request, timeout=TIMEOUT_SECONDS)
    ]
    seconds = time.perf_counter() - started
    model = common_pb2.SEGMENT_SOURCE_MODEL
    return Timed(
        seconds,
        [[i for s in t.segments if s.source == model for i in s.token_ids] for t in trajectories],
    )


def http_client() -> httpx.AsyncClient:
    """A client of the gateway, which speaks plain HTTP on loopback: `verify=False` skips
    loading the CA bundle, 29 ms of CPU a client here, which plain HTTP never uses."""
    return httpx.AsyncClient(timeout=TIMEOUT_SECONDS, verify=False)


@dataclass(frozen=True)
class Gateway:
    """The gateway's base URL and its model's name."""

    url: str
    model: str

    async def session(self, http: httpx.AsyncClient, session_id: str, max_tokens: int) -> Timed:
        """One session of one call on `http`: the call's seconds, then its end's."""
        started = time.perf_counter()
        chat = openai.AsyncOpenAI(
            base_url=f"{self.url}/sessions/{session_id}/v1",
            api_key="unused",
            max_retries=0,
            http_client=http,
        )
        reply = await chat.chat.completions.create(
            model=self.model, messages=[USER_MESSAGE], temperature=0, max_tokens=max_tokens
        )
        called = time.perf_counter()
        ended = await http.post(f"{self.url}/sessions/{session_id}/end")
        ended.raise_for_status()
        done = time.perf_counter()
        segments = ended.json()["segments"]
        model_ids = [i for s in segments if s["source"] == "model" for i in s["token_ids"]]
        assert reply.usage.completion_tokens == len(model_ids), (reply.usage, model_ids)
        return Timed(called - started, [model_ids], end_seconds=done - called)

    async def sessions(self, prefix: str, count: int, max_tokens: int) -> Timed:
        """`count` sessions at once, each a call and its end: the wall time of all of them."""
        async with contextlib.AsyncExitStack() as clients:
            https = [await clients.enter_async_context(http_client()) for _ in range(count)]
            started = time.perf_counter()
            done = await asyncio.gather(
                *(self.session(http, f"{prefix}-{i}", max_tokens) for i, http in enumerate(https))
            )
            seconds = time.perf_counter() - started
        return Timed(seconds, [ids for session in done for ids in session.model_ids])


async def batch_one(stub, gateway: Gateway, meter: Meter, args) -> dict[str, list[Timed]]:
    """Single calls of each path one after the other, alternating which goes first."""
    timed: dict[str, list[Timed]] = {"generate": [], "gateway": []}
    for call in range(args.warmup + args.calls):
        async with http_client() as http:
            works = {
                "generate": generate(stub, 1, args.max_tokens),
                "gateway": gateway.session(http, f"single-{call}", args.max_tokens),
            }
            for path in list(works)[:: 1 if call % 2 == 0 else -1]:
                run = await meter.measured(works[path])
                if call >= args.warmup:
                    timed[path].append(run)
    return timed


async def generate_calls(stub, count: int, max_tokens: int) -> Timed:
    """`count` Generate calls of one prompt at once: the wall time of all of them."""
    started = time.perf_counter()
    done = await asyncio.gather(*(generate(stub, 1, max_tokens) for _ in range(count)))
    seconds = time.perf_counter() - started
    return Timed(seconds, [ids for call in done for ids in call.model_ids])


async def concurrent(stub, gateway: Gateway, meter: Meter, args) -> dict[str, list[Timed]]:
    """`--rounds` of each concurrent path, the order rotated each round."""
    paths = {
        "generate": lambda round_index: generate(stub, args.sessions, args.max_tokens),
        "generate_calls": lambda round_index: generate_calls(stub, args.sessions, args.max_tokens),
        "gateway": lambda round_index: gateway.sessions(
            f"round{round_index}", args.sessions, args.max_tokens
        ),
    }
    timed: dict[str, list[Timed]] = {path: [] for path in paths}
    for round_index in range(args.rounds):
        turn = round_index % len(paths)
        order = list(paths)[turn:] + list(paths)[:turn]
        for path in order:
            timed[path].append(await meter.measured(paths[path](round_index)))
    return timed


def check_tokens(timed: dict[str, list[Timed]], max_tokens: int) -> int:
    """Raises unless every generation made `max_tokens` tokens; the number of distinct token
    sequences (1 when batching changes no greedy choice)."""
    sequences = {tuple(ids) for runs in timed.values() for run in runs for ids in run.model_ids}
    lengths = sorted({len(ids) for ids in sequences})
    if lengths != [max_tokens]:
        raise RuntimeError(f"generations of {lengths} tokens; every one must be {max_tokens}")
    return len(sequences)


def median(runs: list[Timed], value: Callable[[Timed], float]) -> float:
    return statistics.median(value(run) for run in runs)


def median_round(runs: list[Timed]) -> Timed:
    return sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30, help="timed single calls of each path")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls of each path first")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent gateway sessions")
    parser.add_argument("--rounds", type=int, default=5, help="concurrent rounds of each path")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of every generation")
    parser.add_argument("--torch-threads", type=int, default=1, help="the service's torch threads")
    smoke = {"calls": 2, "warmup": 1, "sessions": 4, "rounds": 1, "max_tokens": 8}
    args = smoke_mode.parse_args(parser, smoke)
    printed: list[str] = []
    rollout = served(
        "rollout",
        "rollout.gateway.enabled=true",
        f"rollout.tool_service.address={NOWHERE}",
        f"rollout.reward_service.address={NOWHERE}",
        printed_before=printed,
        env={**os.environ, "OMP_NUM_THREADS": str(args.torch_threads)},
    )
    async with (
        rollout as (process, address),
        rpc.open_channel(ClientConfig(address=address)) as channel,
        http_client() as http,
    ):
        url = next(line for line in printed if line.startswith("gateway of ")).split()[-1]
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        gateway = Gateway(url, model)
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        meter = Meter(stub, process.pid)
        single = await batch_one(stub, gateway, meter, args)
        many = await concurrent(stub, gateway, meter, args)
    report(args, single, many)


def report(
    args: argparse.Namespace, single: dict[str, list[Timed]], many: dict[str, list[Timed]]
) -> None:
    """Two tables, then the JSON headline as the last line."""
    distinct = check_tokens(single | {f"many_{k}": v for k, v in many.items()}, args.max_tokens)
    print(
        f"{args.max_tokens} tokens per generation (all of them), {distinct} distinct token "
        f"sequence(s). Batch 1, the median of {args.calls} calls (CPU: ms of the service's "
        "process and of the client, this process):"
    )
    batch1 = {
        "Generate": (single["generate"], lambda run: run.seconds),
        "gateway: completion call": (single["gateway"], lambda run: run.seconds),
        "  + the session's end": (single["gateway"], lambda run: run.seconds + run.end_seconds),
    }
    batch1_ms = {name: 1000 * median(runs, value) for name, (runs, value) in batch1.items()}
    print(f"{'path':<30} {'ms':>7} {'service CPU':>11} {'client CPU':>10}")
    for name, (runs, _) in batch1.items():
        service_ms = 1000 * median(runs, lambda run: run.service_cpu_seconds)
        client_ms = 1000 * median(runs, lambda run: run.client_cpu_seconds)
        cpu = f"{service_ms:>11.1f} {client_ms:>10.1f}" if name != "  + the session's end" else ""
        print(f"{name:<30} {batch1_ms[name]:>7.1f} {cpu}")
    print(
        f"{args.sessions} at once, the median of {args.rounds} rounds (the engine's busy seconds "
        "and prefill forwards, CPU seconds of the service and of the client):"
    )
    rounds = {path: median_round(runs) for path, runs in many.items()}
    calls_per_s = {path: args.sessions / run.seconds for path, run in rounds.items()}
    names = {
        "generate": f"one Generate call of {args.sessions}",
        "generate_calls": f"{args.sessions} Generate calls of 1",
        "gateway": f"{args.sessions} gateway sessions",
    }
    print(
        f"{'path':<30} {'calls/s':>7} {'tokens/s':>8} {'busy s':>6} {'fills':>5} "
        f"{'service CPU':>11} {'client CPU':>10}"
    )
    for path, run in rounds.items():
        print(
            f"{names[path]:<30} {calls_per_s[path]:>7.1f} {calls_per_s[path] * args.max_tokens:>8.0f}"
            f" {run.engine_busy_seconds:>6.2f} {run.prefill_forwards:>5.0f}"
            f" {run.service_cpu_seconds:>11.2f} {run.client_cpu_seconds:>10.2f}"
        )
    generate_ms, gateway_ms = batch1_ms["Generate"], batch1_ms["gateway: completion call"]
    with_end_ms = batch1_ms["  + the session's end"]
    figures = {
        "batch1_ratio": gateway_ms / generate_ms,
        "batch1_with_end_ratio": with_end_ms / generate_ms,
        "batch1_gateway_ms": gateway_ms,
        "batch1_gateway_with_end_ms": with_end_ms,
        "batch1_generate_ms": generate_ms,
        **{
            f"batch1_{path}_service_cpu_ms": 1000 * median(runs, lambda r: r.service_cpu_seconds)
            for path, runs in single.items()
        },
        "concurrent_throughput_ratio": calls_per_s["gateway"] / calls_per_s["generate"],
        "vs_concurrent_calls_ratio": calls_per_s["gateway"] / calls_per_s["generate_calls"],
        **{f"{path}_calls_per_s": rate for path, rate in calls_per_s.items()},
        **{f"{path}_tokens_per_s": rate * args.max_tokens for path, rate in calls_per_s.items()},
        **{f"{path}_engine_busy_s": run.engine_busy_seconds for path, run in rounds.items()},
        **{f"{path}_prefill_forwards": run.prefill_forwards for path, run in rounds.items()},
        **{f"{path}_service_cpu_s": run.service_cpu_seconds for path, run in rounds.items()},
        **{f"{path}_client_cpu_s": run.client_cpu_seconds for path, run in rounds.items()},
        "sessions": args.sessions,
        "max_tokens": args.max_tokens,
        "distinct_token_sequences": distinct,
    }
    print(
        f"gateway / Generate: batch 1 {figures['batch1_ratio']:.2f}x the time (target <= 1.2); "
        f"{args.sessions} at once {figures['concurrent_throughput_ratio']:.2f}x the throughput "
        f"of one call (target >= 0.9), {figures['vs_concurrent_calls_ratio']:.2f}x that of "
        f"{args.sessions} calls"
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    asyncio.run(main())
