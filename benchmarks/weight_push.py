"""Weight push: WeightPusher into a real rollout service, against a raw gloo broadcast.

Builds a random Qwen3 of about 64M parameters (width 512, 12 layers, MLP 2048, vocabulary
32000, tied embeddings: 243 MiB of fp32) and starts `turnrl serve rollout` on it as its own
process (hf engine, fp32). From this process, a WeightPusher (gloo, one replica) pushes random
fp32 tensors of the model's parameter shapes `--pushes` times after one warm-up; a push is the
whole of `WeightPusher.push`: Pause, UpdateWeights with the bucketed broadcast, the engine's
load, Resume. One gRPC-fallback push (PushWeights stream) is timed as well. The reference is a
raw gloo broadcast of one flat buffer of the same size between this process and a second one
(buffers allocated once, each broadcast followed by a barrier). For reference, the time to copy
the same tensors into same-shaped ones, which the engine's load does after the broadcast.

    .venv/bin/python benchmarks/weight_push.py [--pushes 5] [--bucket-mib 100]

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import datetime
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer_svc.weight_push import WeightPusher
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.tiny_model import build_tiny_model
from turnrl.v1 import rollout_pb2_grpc

MODEL_CONFIG = Qwen3Config(
    vocab_size=32000,
    hidden_size=512,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2048,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
GIB = 2**30
RAW_TIMEOUT = datetime.timedelta(seconds=120)


async def start_rollout(model_dir: str) -> tuple[asyncio.subprocess.Process, str]:
    nowhere = "127.0.0.1:1"  # a weight push calls no tool or reward service
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "turnrl", "--log-level", "WARNING", "serve", "rollout", "--port", "0",
        f"rollout.model_path={model_dir}", f"rollout.tokenizer_path={build_tiny_model()}",
        f"rollout.tool_service.address={nowhere}", f"rollout.reward_service.address={nowhere}",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    while line := (await process.stdout.readline()).decode():
        if line.startswith("serving "):
            return process, line.split()[-1]
    raise RuntimeError("rollout service did not start")


async def time_pushes(address: str, tensors: dict, args: argparse.Namespace) -> dict:
    """Median broadcast-push seconds over `--pushes` after a warm-up, and one gRPC push."""
    bucket_size_bytes = args.bucket_mib * 1024 * 1024
    async with rpc.open_channel(ClientConfig(address=address)) as channel:
        stubs = [rollout_pb2_grpc.RolloutServiceStub(channel)]
        pusher = await WeightPusher.connect(stubs, timeout_seconds=60)
        assert pusher.mode == "broadcast", "the weight-sync group did not form"
        try:
            seconds = []
            for version in range(1, args.pushes + 2):
                result = await pusher.push(tensors, version, bucket_size_bytes=bucket_size_bytes)
                seconds.append(result.seconds)
        finally:
            pusher.close()
        print("broadcast pushes, seconds each:", " ".join(f"{s:.3f}" for s in seconds))
        fallback = await WeightPusher.connect(stubs, mode="grpc")
        grpc_result = await fallback.push(tensors, args.pushes + 2)
    return {"push_s": statistics.median(seconds[1:]), "grpc_s": grpc_result.seconds}


def time_copy(tensors: dict, repeats: int) -> float:
    """Median seconds to copy the tensors into same-shaped ones, as the engine's load does
    (the receiving end's last step, after the broadcast), measured in this process."""
    targets = [torch.empty_like(t) for t in tensors.values()]
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        for target, tensor in zip(targets, tensors.values(), strict=True):
            target.copy_(tensor)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[1:])


def raw_broadcast(size_bytes: int, repeats: int, rank: int, port: int) -> list[float]:
    """Seconds per broadcast of one flat buffer from rank 0 to rank 1, each with a barrier."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, RAW_TIMEOUT, wait_for_workers=False)
    group = dist.ProcessGroupGloo(store, rank, 2, RAW_TIMEOUT)
    buffer = (
        torch.ones(size_bytes, dtype=torch.uint8)
        if rank == 0
        else torch.empty(size_bytes, dtype=torch.uint8)
    )
    options = dist.BroadcastOptions()
    options.rootRank = 0
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        group.broadcast([buffer], options).wait()
        group.barrier().wait()
        seconds.append(time.perf_counter() - started)
    group.shutdown()
    return seconds


def time_raw(size_bytes: int, repeats: int) -> float:
    """Median seconds of a raw broadcast, this process sending to a child process."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    receiver = subprocess.Popen(
        [sys.executable, __file__, "--raw-receiver", f"{size_bytes},{repeats},{port}"]
    )
    try:
        seconds = raw_broadcast(size_bytes, repeats, 0, port)
    finally:
        receiver.wait(timeout=120)
    return statistics.median(seconds[1:])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes after one warm-up")
    parser.add_argument("--bucket-mib", type=int, default=100, help="broadcast bucket size")
    parser.add_argument("--raw-receiver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_receiver:
        size_bytes, repeats, port = map(int, args.raw_receiver.split(","))
        raw_broadcast(size_bytes, repeats, 1, port)
        return

    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(MODEL_CONFIG)
        model.save_pretrained(model_dir)
        tensors = {name: torch.randn_like(p) for name, p in model.named_parameters()}
        del model
        size_bytes = sum(t.nbytes for t in tensors.values())
        print(f"{size_bytes / 1e6 / 4:.1f}M parameters, {size_bytes / 2**20:.0f} MiB of fp32")
        process, address = await start_rollout(model_dir)
        try:
            timed = await time_pushes(address, tensors, args)
        finally:
            process.terminate()
            await process.wait()
    raw_s = await asyncio.to_thread(time_raw, size_bytes, args.pushes + 1)
    push_gib_s, raw_gib_s = size_bytes / GIB / timed["push_s"], size_bytes / GIB / raw_s
    grpc_gib_s = size_bytes / GIB / timed["grpc_s"]
    copy_s = time_copy(tensors, args.pushes + 1)
    print(f"{'path':<34} {'seconds':>8} {'GiB/s':>7}")
    print(
        f"{'push (broadcast, bucket ' + str(args.bucket_mib) + ' MiB)':<34} {timed['push_s']:>8.3f} {push_gib_s:>7.2f}"
    )
    print(f"{'push (gRPC fallback)':<34} {timed['grpc_s']:>8.3f} {grpc_gib_s:>7.2f}")
    print(f"{'raw gloo broadcast, one buffer':<34} {raw_s:>8.3f} {raw_gib_s:>7.2f}")
    print(
        f"{'copy into parameters (the load)':<34} {copy_s:>8.3f} {size_bytes / GIB / copy_s:>7.2f}"
    )
    figures = {
        "push_gib_s": round(push_gib_s, 3),
        "raw_gib_s": round(raw_gib_s, 3),
        "fraction_of_raw": round(push_gib_s / raw_gib_s, 3),
        "grpc_gib_s": round(grpc_gib_s, 3),
        "push_s": round(timed["push_s"], 4),
        "raw_s": round(raw_s, 4),
        "load_copy_s": round(copy_s, 4),
        "bytes": size_bytes,
        "bucket_size_bytes": args.bucket_mib * 1024 * 1024,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
