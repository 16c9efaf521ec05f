"""Reward service throughput through ScoreBatch on loopback.

Starts `turnrl serve reward` as a separate process, then streams scoring items from this
process: GSM8K gold solutions from the shared fixtures (each a real chat-length response), and
math answers that math-verify must parse and compare (distinct values, so no cache helps).

    .venv/bin/python benchmarks/reward_throughput.py [--gsm8k-items 20000] [--math-items 2000]

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import json
import time

import smoke_mode
from child_processes import served
from google.protobuf import json_format

from turnrl import rpc
from turnrl.config import ClientConfig, fixtures_dir
from turnrl.v1 import reward_pb2, reward_pb2_grpc


def gsm8k_items(count: int) -> list[reward_pb2.ScoringInput]:
    rows = [json.loads(line) for line in (fixtures_dir() / "gsm8k" / "test.jsonl").open()]
    items = []
    for i in range(count):
        row = rows[i % len(rows)]
        item = reward_pb2.ScoringInput(data_source="openai/gsm8k", response_text=row["answer"])
        json_format.ParseDict(row["answer"], item.ground_truth)
        items.append(item)
    return items


def math_items(count: int) -> list[reward_pb2.ScoringInput]:
    items = []
    for i in range(count):
        response = f"Adding the parts gives $\\boxed{{\\frac{{{i + 1}}}{{2}}}}$."
        item = reward_pb2.ScoringInput(data_source="lighteval/MATH", response_text=response)
        json_format.ParseDict(str((i + 1) / 2), item.ground_truth)
        items.append(item)
    return items


async def items_per_second(stub, items: list[reward_pb2.ScoringInput]) -> tuple[float, float]:
    """Streams every item through ScoreBatch; returns (items/s, mean score)."""

    async def requests():
        for i, item in enumerate(items):
            yield reward_pb2.ScoreBatchRequest(item_id=str(i), input=item)

    started = time.perf_counter()
    scores = [r.result.reward.score async for r in stub.ScoreBatch(requests(), timeout=600)]
    elapsed = time.perf_counter() - started
    assert len(scores) == len(items)
    return len(items) / elapsed, sum(scores) / len(scores)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gsm8k-items", type=int, default=20_000)
    parser.add_argument("--math-items", type=int, default=2_000)
    parser.add_argument("--workers", type=int, default=2, help="scorer worker processes")
    parser.add_argument("--warmup-items", type=int, default=200)
    args = smoke_mode.parse_args(
        parser, {"gsm8k_items": 100, "math_items": 20, "workers": 1, "warmup_items": 10}
    )
    overrides = [f"reward.workers={args.workers}", "reward.max_concurrency=512"]
    async with (
        served("reward", *overrides) as (_, address),
        rpc.open_channel(ClientConfig(address=address)) as channel,
    ):
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        await items_per_second(stub, gsm8k_items(args.warmup_items))
        gsm8k_rate, gsm8k_mean = await items_per_second(stub, gsm8k_items(args.gsm8k_items))
        math_rate, math_mean = await items_per_second(stub, math_items(args.math_items))
    assert gsm8k_mean == 1.0 and math_mean == 1.0, (gsm8k_mean, math_mean)
    print(f"gsm8k: {gsm8k_rate:.0f} items/s ({args.gsm8k_items} gold solutions, all scored 1.0)")
    print(f"math-verify: {math_rate:.0f} items/s ({args.math_items} distinct boxed fractions)")
    figures = {
        "gsm8k_items_per_s": round(gsm8k_rate),
        "math_items_per_s": round(math_rate),
        "workers": args.workers,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
