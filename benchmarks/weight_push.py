"""Weight push: WeightPusher into a real rollout service, against a raw gloo broadcast.

Builds a random Qwen3 of about 64M parameters (width 512, 12 layers, MLP 2048, vocabulary
32000, tied embeddings: 243 MiB of fp32) and starts `turnrl serve rollout` on it as its own
process (hf engine, fp32). From this process, a WeightPusher (gloo, one replica) pushes random
fp32 tensors of the model's parameter shapes `--pushes` times after one warm-up. A timed push
is what the trainer does for each push once it has gathered its weights: `BucketedWeights.pack`
into the last push's memory, then the whole of `WeightPusher.push` (Pause, UpdateWeights with
the bucketed broadcast, the engine's load, Resume); pack copies bucket k + 1 while bucket k is
sent. The warm-up push is the one in which the engine moves its parameters into the push
layout. The pause alone (Pause to Resume) and the copy alone (pack, waited for) are timed too,
and one gRPC-fallback push (PushWeights stream). The reference is a raw gloo broadcast of one
flat buffer of the same size from this process to a second one (buffers allocated once, each
broadcast followed by a barrier), timed just before each push, so that both see the same
machine: the figures are medians of the pairs. Each pipelined push is followed by a push of
an update copied in beforehand (the push machinery alone, against a raw broadcast of its own).

With `--engine vllm` the rollout service runs on a vLLM server of the model that it launches
from `--engine-python` (vLLM's environment, `make engine-env ENGINE=vllm`; the CPU build here,
fp32), and the pushes land in turnrl's worker extension inside that server.

    .venv/bin/python benchmarks/weight_push.py [--pushes 9] [--bucket-mib 100] [--layers 12]
    .venv/bin/python benchmarks/weight_push.py --engine vllm --engine-python .venv-vllm/bin/python

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import smoke_mode
import torch
import torch.distributed as dist
from child_processes import served
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from trainer_svc.config import WeightSyncConfig
from trainer_svc.weight_push import WeightPusher
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.subprocesses import die_with_parent
from turnrl.v1 import rollout_pb2_grpc
from turnrl.weights import BucketedWeights
from turnrl_demo.tiny_model import build_tiny_model

# Qwen3Config keyword arguments of the pushed model (--layers, --vocab-size change two).
MODEL_SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2048,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
GIB = 2**30
RAW_TIMEOUT = datetime.timedelta(seconds=120)


async def time_pushes(address: str, tensors: dict, args: argparse.Namespace) -> dict:
    """Median seconds of `--pushes` packs and broadcast pushes after a warm-up, each just
    after a raw broadcast of the same size, of their pauses alone, and of one gRPC push."""
    bucket_size_bytes = args.bucket_mib * 1024 * 1024
    weights = BucketedWeights.pack(tensors.items(), bucket_size_bytes)
    weights.wait_packed()
    raw = await asyncio.to_thread(RawBroadcast, weights.nbytes, 2 * (args.pushes + 1))
    async with rpc.open_channel(ClientConfig(address=address)) as channel:
        stubs = [rollout_pb2_grpc.RolloutServiceStub(channel)]
        pusher = await WeightPusher.connect(stubs, timeout_seconds=60)
        assert pusher.mode == "broadcast", "the weight-sync group did not form"
        try:
            push_seconds, pause_seconds, raw_seconds = [], [], []
            prepacked_seconds, prepacked_raw_seconds = [], []
            for push in range(args.pushes + 1):
                raw_seconds.append(await asyncio.to_thread(raw.once))
                started = time.perf_counter()
                weights = BucketedWeights.pack(
                    tensors.items(), bucket_size_bytes, reuse=weights.data
                )
                pause_seconds.append((await pusher.push(weights, 2 * push + 1)).seconds)
                push_seconds.append(time.perf_counter() - started)
                # The same push of an update copied in beforehand: the push machinery alone.
                prepacked_raw_seconds.append(await asyncio.to_thread(raw.once))
                weights = BucketedWeights.pack(
                    tensors.items(), bucket_size_bytes, reuse=weights.data
                )
                await asyncio.to_thread(weights.wait_packed)
                started = time.perf_counter()
                await pusher.push(weights, 2 * push + 2)
                prepacked_seconds.append(time.perf_counter() - started)
        finally:
            pusher.close()
            raw.close()
        print("pack + push, seconds each:   ", " ".join(f"{s:.3f}" for s in push_seconds))
        print("raw broadcasts, seconds each:", " ".join(f"{s:.3f}" for s in raw_seconds))
        print("prepacked push, seconds each:", " ".join(f"{s:.3f}" for s in prepacked_seconds))
        fallback = await WeightPusher.connect(stubs, mode="grpc")
        grpc_result = await fallback.push(weights, 2 * args.pushes + 3)
    return {
        "push_s": statistics.median(push_seconds[1:]),
        "pause_s": statistics.median(pause_seconds[1:]),
        "raw_s": statistics.median(raw_seconds[1:]),
        "fraction_of_raw": paired_fraction(raw_seconds[1:], push_seconds[1:]),
        "prepacked_push_s": statistics.median(prepacked_seconds[1:]),
        "prepacked_fraction_of_raw": paired_fraction(
            prepacked_raw_seconds[1:], prepacked_seconds[1:]
        ),
        "warmup_s": push_seconds[0],
        "grpc_s": grpc_result.seconds,
    }


def paired_fraction(raw_seconds: list[float], push_seconds: list[float]) -> float:
    """The median of raw / push over pairs timed one just after the other."""
    return statistics.median(r / p for r, p in zip(raw_seconds, push_seconds, strict=True))


def time_packing(tensors: dict, bucket_size_bytes: int, repeats: int) -> float:
    """Median seconds to copy the tensors into the push layout, into memory kept from the last
    time, as the trainer does before every push (the trainer side's one copy), alone."""
    weights = BucketedWeights.pack(tensors.items(), bucket_size_bytes)
    weights.wait_packed()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        weights = BucketedWeights.pack(tensors.items(), bucket_size_bytes, reuse=weights.data)
        weights.wait_packed()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


class RawBroadcast:
    """The reference: rank 0 of a plain gloo group with a child process (rank 1), broadcasting
    one flat buffer allocated once; `once` times one broadcast and the barrier after it. The
    child receives `repeats` broadcasts and exits."""

    def __init__(self, size_bytes: int, repeats: int) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        receiver = [sys.executable, __file__, "--raw-receiver", f"{size_bytes},{repeats},{port}"]
        self._child = subprocess.Popen(receiver, preexec_fn=die_with_parent)
        try:
            self._group, self._buffer = raw_group(size_bytes, 0, port)
        except BaseException:
            self._child.kill()
            raise

    def once(self) -> float:
        return broadcast_and_barrier(self._group, self._buffer)

    def close(self) -> None:
        """Waits for the child to receive its broadcasts, or kills it (a push failed midway)."""
        try:
            self._child.wait(timeout=RAW_TIMEOUT.total_seconds())
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
        self._group.shutdown()


def raw_group(size_bytes: int, rank: int, port: int) -> tuple[dist.ProcessGroup, torch.Tensor]:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, RAW_TIMEOUT, wait_for_workers=False)
    group = dist.ProcessGroupGloo(store, rank, 2, RAW_TIMEOUT)
    fill = torch.ones if rank == 0 else torch.empty
    return group, fill(size_bytes, dtype=torch.uint8)


def broadcast_and_barrier(group: dist.ProcessGroup, buffer: torch.Tensor) -> float:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    started = time.perf_counter()
    group.broadcast([buffer], options).wait()
    group.barrier().wait()
    return time.perf_counter() - started


def engine_overrides(args: argparse.Namespace) -> list[str]:
    """The rollout service's engine: hf in its own process, or a vLLM server it launches."""
    if args.engine == "hf":
        return []
    launch = "rollout.engine_options.launch"
    return [
        "rollout.engine=vllm", "rollout.engine_options.cpu_kv_cache_space_gib=1",
        f"{launch}.python={args.engine_python}", f"{launch}.port=0",
        f"{launch}.extra_args=[--dtype, float32]",  # as pushed: vLLM's auto would be bf16
    ]  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pushes", type=int, default=9, help="timed pushes after one warm-up")
    parser.add_argument(
        "--bucket-mib",
        type=int,
        default=WeightSyncConfig().bucket_size_mb,
        help="broadcast bucket size (default: the trainer's)",
    )
    parser.add_argument("--layers", type=int, default=MODEL_SHAPE["num_hidden_layers"])
    parser.add_argument("--vocab-size", type=int, default=MODEL_SHAPE["vocab_size"])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument(
        "--engine-python",
        default=".venv-vllm/bin/python",
        help="vllm: the interpreter of vLLM's environment, which launches its server",
    )
    parser.add_argument("--raw-receiver", help=argparse.SUPPRESS)
    args = smoke_mode.parse_args(parser, {"pushes": 1, "layers": 1, "vocab_size": 1024})
    if args.raw_receiver:
        size_bytes, repeats, port = map(int, args.raw_receiver.split(","))
        group, buffer = raw_group(size_bytes, 1, port)
        for _ in range(repeats):
            broadcast_and_barrier(group, buffer)
        group.shutdown()
        return

    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        shape = {"num_hidden_layers": args.layers, "vocab_size": args.vocab_size}
        model = Qwen3ForCausalLM(Qwen3Config(**(MODEL_SHAPE | shape)))
        model.save_pretrained(model_dir)
        tensors = {name: torch.randn_like(p) for name, p in model.named_parameters()}
        del model
        size_bytes = sum(t.nbytes for t in tensors.values())
        print(f"{size_bytes / 1e6 / 4:.1f}M parameters, {size_bytes / 2**20:.0f} MiB of fp32")
        bucket_size_bytes = args.bucket_mib * 1024 * 1024
        nowhere = "127.0.0.1:1"  # a weight push calls no tool or reward service
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
        tokenizer.save_pretrained(model_dir)  # a vLLM server loads it from the model's folder
        rollout = served(
            "rollout", f"rollout.model_path={model_dir}",
            f"rollout.tool_service.address={nowhere}", f"rollout.reward_service.address={nowhere}",
            *engine_overrides(args),
        )  # fmt: skip
        async with rollout as (_, address):
            timed = await time_pushes(address, tensors, args)
    raw_s = timed["raw_s"]
    push_gib_s, raw_gib_s = size_bytes / GIB / timed["push_s"], size_bytes / GIB / raw_s
    grpc_gib_s = size_bytes / GIB / timed["grpc_s"]
    pack_s = time_packing(tensors, bucket_size_bytes, args.pushes)
    rows = [
        (f"pack + push (broadcast, bucket {args.bucket_mib} MiB)", timed["push_s"]),
        ("  of which paused (Pause to Resume)", timed["pause_s"]),
        ("push of an update packed beforehand", timed["prepacked_push_s"]),
        ("push (gRPC fallback)", timed["grpc_s"]),
        ("raw gloo broadcast, one buffer", raw_s),
        ("pack alone (trainer)", pack_s),
    ]
    print(f"{'path':<42} {'seconds':>8} {'GiB/s':>7}")
    for name, seconds in rows:
        print(f"{name:<42} {seconds:>8.3f} {size_bytes / GIB / seconds:>7.2f}")
    figures = {
        "engine": args.engine,
        "push_gib_s": round(push_gib_s, 3),
        "raw_gib_s": round(raw_gib_s, 3),
        "fraction_of_raw": round(timed["fraction_of_raw"], 3),
        "prepacked_fraction_of_raw": round(timed["prepacked_fraction_of_raw"], 3),
        "grpc_gib_s": round(grpc_gib_s, 3),
        "push_s": round(timed["push_s"], 4),
        "pause_s": round(timed["pause_s"], 4),
        "prepacked_push_s": round(timed["prepacked_push_s"], 4),
        "raw_s": round(raw_s, 4),
        "warmup_push_s": round(timed["warmup_s"], 4),
        "pack_s": round(pack_s, 4),
        "bytes": size_bytes,
        "bucket_size_bytes": bucket_size_bytes,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
    # The figures are out. Leave without the interpreter's teardown: a gloo thread of the groups
    # shut down above was once still alive at its end and aborted the process (SIGABRT,
    # "terminate called without an active exception", one smoke run in three on 2 cores).
    sys.stdout.flush()
    os._exit(0)
