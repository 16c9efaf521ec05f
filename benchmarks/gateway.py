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
from dataclasses import dataclass

import httpx
import openai
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
    for a concurrent round, the engine's busy seconds and prefill forwards in it too."""

    seconds: float
    model_ids: list[list[int]]
    engine_busy_seconds: float = 0.0
    prefill_forwards: float = 0.0


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

    async def session(
        self, http: httpx.AsyncClient, session_id: str, max_tokens: int
    ) -> tuple[Timed, Timed]:
        """One session of one call on `http`: (the completion call, the call and the end)."""
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
        return Timed(called - started, [model_ids]), Timed(done - started, [model_ids])

    async def sessions(self, prefix: str, count: int, max_tokens: int) -> Timed:
        """`count` sessions at once, each a call and its end: the wall time of all of them."""
        async with contextlib.AsyncExitStack() as clients:
            https = [await clients.enter_async_context(http_client()) for _ in range(count)]
            started = time.perf_counter()
            done = await asyncio.gather(
                *(self.session(http, f"{prefix}-{i}", max_tokens) for i, http in enumerate(https))
            )
            seconds = time.perf_counter() - started
        return Timed(seconds, [ids for _, with_end in done for ids in with_end.model_ids])


async def batch_one(stub, gateway: Gateway, args: argparse.Namespace) -> dict[str, list[Timed]]:
    """Single calls of each path one after the other, alternating which goes first."""
    timed: dict[str, list[Timed]] = {"generate": [], "gateway": [], "gateway_with_end": []}
    for call in range(args.warmup + args.calls):
        async with http_client() as http:
            generated = generate(stub, 1, args.max_tokens)
            chatted = gateway.session(http, f"single-{call}", args.max_tokens)
            if call % 2:
                one_session = await chatted
                generated = await generated
            else:
                generated = await generated
                one_session = await chatted
        if call >= args.warmup:
            timed["generate"].append(generated)
            timed["gateway"].append(one_session[0])
            timed["gateway_with_end"].append(one_session[1])
    return timed


async def generate_calls(stub, count: int, max_tokens: int) -> Timed:
    """`count` Generate calls of one prompt at once: the wall time of all of them."""
    started = time.perf_counter()
    done = await asyncio.gather(*(generate(stub, 1, max_tokens) for _ in range(count)))
    seconds = time.perf_counter() - started
    return Timed(seconds, [ids for call in done for ids in call.model_ids])


async def concurrent(stub, gateway: Gateway, args: argparse.Namespace) -> dict[str, list[Timed]]:
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
        order = list(paths)[round_index % 3 :] + list(paths)[: round_index % 3]
        for path in order:
            before = await engine_metrics(stub)
            run = await paths[path](round_index)
            after = await engine_metrics(stub)
            timed[path].append(
                dataclasses.replace(
                    run,
                    engine_busy_seconds=after["busy_seconds"] - before["busy_seconds"],
                    prefill_forwards=after["prefill_forwards"] - before["prefill_forwards"],
                )
            )
    return timed


async def engine_metrics(stub) -> dict[str, float]:
    reply = await stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=TIMEOUT_SECONDS)
    return dict(reply.metrics)


def check_tokens(timed: dict[str, list[Timed]], max_tokens: int) -> int:
    """Raises unless every generation made `max_tokens` tokens; the number of distinct token
    sequences (1 when batching changes no greedy choice)."""
    sequences = {tuple(ids) for runs in timed.values() for run in runs for ids in run.model_ids}
    lengths = sorted({len(ids) for ids in sequences})
    if lengths != [max_tokens]:
        raise RuntimeError(f"generations of {lengths} tokens; every one must be {max_tokens}")
    return len(sequences)


def median_ms(runs: list[Timed]) -> float:
    return 1000 * statistics.median(run.seconds for run in runs)


def median_round(runs: list[Timed]) -> Timed:
    return sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30, help="timed single calls of each path")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls of each path first")
    parser.add_argument("--sessions", type=int, default=64, help="concurrent gateway sessions")
    parser.add_argument("--rounds", type=int, default=3, help="concurrent rounds of each path")
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
        f"rollout.max_concurrent_trajectories={max(args.sessions, 1)}",
        f"rollout.engine_options.max_batch_size={max(args.sessions, 1)}",
        printed_before=printed,
        env={**os.environ, "OMP_NUM_THREADS": str(args.torch_threads)},
    )
    async with (
        rollout as (_, address),
        rpc.open_channel(ClientConfig(address=address)) as channel,
        http_client() as http,
    ):
        url = next(line for line in printed if line.startswith("gateway of ")).split()[-1]
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        gateway = Gateway(url, model)
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        single = await batch_one(stub, gateway, args)
        many = await concurrent(stub, gateway, args)
    report(args, single, many)


def report(
    args: argparse.Namespace, single: dict[str, list[Timed]], many: dict[str, list[Timed]]
) -> None:
    """The table, then the JSON headline as the last line."""
    distinct = check_tokens(single | {f"many_{k}": v for k, v in many.items()}, args.max_tokens)
    batch1_ms = {path: median_ms(runs) for path, runs in single.items()}
    rounds = {path: median_round(runs) for path, runs in many.items()}
    calls_per_s = {path: args.sessions / run.seconds for path, run in rounds.items()}
    print(
        f"{args.max_tokens} tokens per generation (all of them), {distinct} distinct token "
        f"sequence(s); batch 1: median of {args.calls} calls; {args.sessions} at once: the "
        f"median of {args.rounds} rounds, with the engine's busy seconds and prefill forwards"
    )
    print(
        f"{'path':<40} {'batch 1 ms':>10} {'calls/s':>8} {'tokens/s':>8} {'busy s':>7} {'fills':>5}"
    )
    rows = [
        ("Generate", "generate", "generate"),
        (f"  {args.sessions} concurrent calls of 1 prompt", None, "generate_calls"),
        ("gateway: completion call", "gateway", "gateway"),
        ("  + the session's end", "gateway_with_end", None),
    ]
    for name, single_path, many_path in rows:
        ms = f"{batch1_ms[single_path]:>10.1f}" if single_path else " " * 10
        rates = ""
        if many_path:
            run = rounds[many_path]
            rates = (
                f" {calls_per_s[many_path]:>8.1f} {calls_per_s[many_path] * args.max_tokens:>8.0f}"
                f" {run.engine_busy_seconds:>7.2f} {run.prefill_forwards:>5.0f}"
            )
        print(f"{name:<40} {ms}{rates}")
    figures = {
        "batch1_ratio": batch1_ms["gateway"] / batch1_ms["generate"],
        "batch1_with_end_ratio": batch1_ms["gateway_with_end"] / batch1_ms["generate"],
        "batch1_gateway_ms": batch1_ms["gateway"],
        "batch1_gateway_with_end_ms": batch1_ms["gateway_with_end"],
        "batch1_generate_ms": batch1_ms["generate"],
        "concurrent_throughput_ratio": calls_per_s["gateway"] / calls_per_s["generate"],
        "vs_concurrent_calls_ratio": calls_per_s["gateway"] / calls_per_s["generate_calls"],
        **{f"{path}_calls_per_s": rate for path, rate in calls_per_s.items()},
        **{f"{path}_tokens_per_s": rate * args.max_tokens for path, rate in calls_per_s.items()},
        **{f"{path}_engine_busy_s": run.engine_busy_seconds for path, run in rounds.items()},
        **{f"{path}_prefill_forwards": run.prefill_forwards for path, run in rounds.items()},
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
