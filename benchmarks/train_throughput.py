"""Trainer throughput: FsdpPolicy training tokens per second on this machine, 1 and 2 ranks.

Builds a random Qwen3 of about 4M parameters (width 256, 4 layers, MLP 768, vocabulary 4096,
tied embeddings), then for each of fp32 and bf16 times `--steps` train steps, after one warm-up
step, on `--rows` sequences of `--seq-len` tokens split over the ranks (one micro-batch per
rank). One rank runs plain in a subprocess; two run under torchrun (gloo on CPU). Each rank
gets `--threads-per-rank` CPU threads (default 1): on a busy machine, more threads than free
cores make every OpenMP thread wait for the slowest, which hides the scaling being measured.

    .venv/bin/python benchmarks/train_throughput.py [--steps 3] [--rows 8] [--seq-len 512] [--threads-per-rank 1]

The last line printed is one JSON object with the headline figures.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import smoke_mode
import torch
from child_processes import child
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer_svc.batch import Batch
from trainer_svc.config import TrainSettings
from trainer_svc.fsdp import FsdpPolicy

RESULT_PREFIX = "RESULT "
MODEL_CONFIG = Qwen3Config(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=768,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def policy_gradient_loss(micro: Batch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
    per_token = -logprobs * micro.extras["advantages"] * micro.loss_mask
    return per_token.sum() / micro.global_token_count, {}


def run_rank(model_dir: str, dtype: str, steps: int, rows: int, seq_len: int) -> None:
    """One rank's timing; rank 0 prints a RESULT line with its seconds per step."""
    policy = FsdpPolicy(model_dir, TrainSettings(dtype=dtype, micro_batch_tokens=rows * seq_len))
    generator = torch.Generator().manual_seed(policy.rank)
    local_rows = rows // policy.world_size
    token_ids = torch.randint(MODEL_CONFIG.vocab_size, (local_rows, seq_len), generator=generator)
    advantages = torch.randn(local_rows, 1, generator=generator).expand(-1, seq_len)
    batch = Batch.from_sequences(
        token_ids.tolist(), [[True] * seq_len] * local_rows, {"advantages": advantages.tolist()}
    )
    policy.train_step(batch, policy_gradient_loss)
    started = time.perf_counter()
    for _ in range(steps):
        policy.train_step(batch, policy_gradient_loss)
    if policy.rank == 0:
        print(RESULT_PREFIX + json.dumps({"s_per_step": (time.perf_counter() - started) / steps}))
    policy.close()


def launch(args: argparse.Namespace, model_dir: str, ranks: int, dtype: str) -> float:
    """Seconds per step of a run on `ranks` ranks, each in its own process."""
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command = [
        *launcher, __file__, "--rank-of", model_dir, "--dtype", dtype, "--steps", str(args.steps),
        "--rows", str(args.rows), "--seq-len", str(args.seq_len),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_rank)}
    with child(command, env=env, stdout=subprocess.PIPE, text=True) as process:
        output, _ = process.communicate()
    if process.returncode:
        raise RuntimeError(f"{command} exited with code {process.returncode}")
    result = next(line for line in output.splitlines() if line.startswith(RESULT_PREFIX))
    return json.loads(result.removeprefix(RESULT_PREFIX))["s_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--rows", type=int, default=8, help="sequences per step, all ranks")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--rank-of", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="runs of each")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    # Smoke: the two-rank run alone, the path through torchrun and FSDP.
    smoke = {"steps": 1, "rows": 2, "seq_len": 32, "dtypes": ["float32"], "ranks": [2]}
    args = smoke_mode.parse_args(parser, smoke)
    if args.rank_of:
        run_rank(args.rank_of, args.dtype, args.steps, args.rows, args.seq_len)
        return

    tokens_per_step = args.rows * args.seq_len
    headline = {}
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(MODEL_CONFIG)
        parameters = sum(parameter.numel() for parameter in model.parameters())
        model.save_pretrained(model_dir)
        print(f"{parameters / 1e6:.1f}M parameters, {tokens_per_step} tokens per step")
        print(f"{'ranks':>5} {'dtype':>9} {'s/step':>8} {'tokens/s':>9}")
        for ranks in args.ranks:
            for dtype in args.dtypes:
                s_per_step = launch(args, model_dir, ranks, dtype)
                print(
                    f"{ranks:>5} {dtype:>9} {s_per_step:>8.3f} {tokens_per_step / s_per_step:>9.0f}"
                )
                short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
                headline[f"tokens_per_s_{ranks}rank_{short}"] = round(tokens_per_step / s_per_step)
                headline[f"s_per_step_{ranks}rank_{short}"] = round(s_per_step, 3)
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
