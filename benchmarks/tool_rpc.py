"""Tool service round trips through gRPC on loopback.

Starts `turnrl serve tool` (calculator and python) as a separate process, then measures from
this process: calculator latency with 1 client (p50/p99), calculator throughput with 64
concurrent clients, and the python sandbox's latency for a trivial program (p50/p99).

    .venv/bin/python benchmarks/tool_rpc.py [--seconds 5] [--sandbox-calls 60]

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import json
import statistics
import time

import smoke_mode
from child_processes import served

from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.v1 import tool_pb2, tool_pb2_grpc

TOOLS_OVERRIDE = "tool.tools=[{class_name: calculator}, {class_name: python}]"
CALCULATOR = tool_pb2.ExecuteRequest(
    tool_name="calculator", arguments='{"expression": "(3 + 4.5) * 2"}'
)
SANDBOX = tool_pb2.ExecuteRequest(tool_name="python", arguments='{"code": "print(6 * 7)"}')


async def latencies(stub, request, calls: int) -> list[float]:
    """Seconds per call of `calls` sequential calls, after a short warm-up."""
    for _ in range(min(20, calls)):
        await stub.Execute(request, timeout=30)
    timings = []
    for _ in range(calls):
        started = time.perf_counter()
        reply = await stub.Execute(request, timeout=30)
        timings.append(time.perf_counter() - started)
        assert not reply.result.HasField("error"), reply.result.text
    return timings


async def throughput(stubs, request, clients: int, seconds: float) -> float:
    """Calls per second completed by `clients` concurrent callers over `seconds`."""
    stop = time.perf_counter() + seconds
    done = 0

    async def client(stub) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await stub.Execute(request, timeout=30)
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(stubs[i % len(stubs)]) for i in range(clients)))
    return done / (time.perf_counter() - started)


def percentile_ms(timings: list[float], q: int) -> float:
    return round(statistics.quantiles(timings, n=100)[q - 1] * 1000, 3)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="throughput window")
    parser.add_argument("--calculator-calls", type=int, default=2000)
    parser.add_argument("--sandbox-calls", type=int, default=60)
    args = smoke_mode.parse_args(
        parser, {"seconds": 0.5, "calculator_calls": 100, "sandbox_calls": 5}
    )
    # The tool's concurrency cap lifted: this measures the service, not the cap.
    async with served("tool", TOOLS_OVERRIDE, "tool.default_limits.max_concurrency=0") as (
        _,
        address,
    ):
        channels = [rpc.open_channel(ClientConfig(address=address)) for _ in range(4)]
        stubs = [tool_pb2_grpc.ToolServiceStub(channel) for channel in channels]
        try:
            calculator = await latencies(stubs[0], CALCULATOR, args.calculator_calls)
            single = await throughput(stubs[:1], CALCULATOR, 1, args.seconds)
            concurrent = await throughput(stubs, CALCULATOR, 64, args.seconds)
            sandbox = await latencies(stubs[0], SANDBOX, args.sandbox_calls)
        finally:
            for channel in channels:
                await channel.close()
    figures = {
        "calculator_p50_ms": percentile_ms(calculator, 50),
        "calculator_p99_ms": percentile_ms(calculator, 99),
        "calculator_calls_per_s_1_client": round(single),
        "calculator_calls_per_s": round(concurrent),
        "python_p50_ms": percentile_ms(sandbox, 50),
        "python_p99_ms": percentile_ms(sandbox, 99),
    }
    print(
        f"calculator, 1 client: p50 {figures['calculator_p50_ms']} ms, p99 {figures['calculator_p99_ms']} ms, {single:.0f} calls/s"
    )
    print(f"calculator, 64 clients: {concurrent:.0f} calls/s")
    print(
        f"python sandbox, print(6 * 7): p50 {figures['python_p50_ms']} ms, p99 {figures['python_p99_ms']} ms"
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
