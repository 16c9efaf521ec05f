"""Trainer memory: each rank's peak memory while it loads, trains and checkpoints a model of
about 110M parameters on 2 CPU ranks (gloo), the way the trainer did before sharded loading
and sharded checkpoints, and the way it does now; as a ratio to the model's fp32 size.

    before  every rank loads the whole model (`from_pretrained`), then shards it (`apply_fsdp`);
            a checkpoint gathers the model and Adam's state, whole, on rank 0 and writes them
            from there (`get_state_dict` full, `torch.save`)
    after   `FsdpPolicy`: each rank reads its rows of the files into its shards
            (trainer_svc/sharded_load.py); a checkpoint has each rank write its own shards
            (trainer_svc/checkpoint.py); the final export gathers one tensor at a time
            (trainer_svc/hf_export.py)

A phase's peak is the most resident memory (VmHWM, reset through /proc/self/clear_refs) above
what the process held as it began the phase (glibc's mmap threshold fixed, so that memory a
phase frees goes back to the system rather than hiding the next phase's peak). The model is a random Qwen3 (width 768, 12
layers, MLP 2048, vocabulary 32000, tied embeddings) saved in fp32; a train step is one AdamW
step on `--rows` sequences of `--seq-len` tokens per rank.

    .venv/bin/python benchmarks/trainer_memory.py [--rows 2] [--seq-len 128]

The last line printed is one JSON object with the headline figures.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import smoke_mode
import torch
import torch.distributed as dist
from child_processes import child
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trainer_svc.batch import Batch
from trainer_svc.config import TrainSettings
from trainer_svc.fsdp import FULL_ON_CPU, FsdpPolicy, apply_fsdp, init_distributed
from trainer_svc.ranks import Models, save_checkpoint_shards

RESULT_PREFIX = "RESULT "
# Each rank's phases, in order; each figure is a peak above the phase's start, x the model.
PHASES = ("load", "train", "checkpoint", "background", "export")
MODEL_SIZES = {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 2048}
SMOKE_MODEL_SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
# Packed against padded: a narrow model whose logits (vocabulary 32000) weigh, on a batch of
# one long row and seven short ones, as agent trajectories of very different turn counts are.
PACKING_MODEL_SIZES = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768}
HEAVY_TAILED = [1024, 48, 64, 80, 96, 112, 128, 144]
SMOKE_HEAVY_TAILED = [64, 4, 6, 8]


def model_config(sizes: dict[str, int]) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=512 if sizes == SMOKE_MODEL_SIZES else 32000,
        num_attention_heads=max(1, sizes["hidden_size"] // 64),
        num_key_value_heads=max(1, sizes["hidden_size"] // 192),
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **sizes,
    )


def status_bytes(field: str) -> int:
    """A memory figure of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def phase_peak(work: Callable[[], object]) -> tuple[object, int]:
    """`work()`'s result, and the most resident memory above the start's while it ran."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
    start = status_bytes("VmRSS")
    result = work()
    return result, status_bytes("VmHWM") - start


def policy_gradient_loss(micro: Batch, logprobs: torch.Tensor, entropy: torch.Tensor | None):
    per_token = -logprobs * micro.extras["advantages"] * micro.loss_mask
    return per_token.sum() / micro.global_token_count, {}


def train_batch(vocab_size: int, rows: int, seq_len: int, rank: int) -> Batch:
    generator = torch.Generator().manual_seed(rank)
    token_ids = torch.randint(vocab_size, (rows, seq_len), generator=generator)
    advantages = torch.randn(rows, 1, generator=generator).expand(-1, seq_len)
    return Batch.from_sequences(
        token_ids.tolist(), [[True] * seq_len] * rows, {"advantages": advantages.tolist()}
    )


def run_rank(model_dir: str, way: str, rows: int, seq_len: int, out_dir: str) -> None:
    """One rank's three phases the `way` (before, after) says; rank 0 prints a RESULT line
    with its peaks, and rank 1 its own."""
    settings = TrainSettings(micro_batch_tokens=rows * seq_len)
    rank, world_size = init_distributed()
    if way == "before":

        def load() -> torch.nn.Module:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            apply_fsdp(model, init_device_mesh("cpu", (world_size,)), settings)
            return model

        model, load_peak = phase_peak(load)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step() -> None:  # Adam's state for the checkpoint to hold
            batch = train_batch(model.config.vocab_size, rows, seq_len, rank)
            logits = model(input_ids=batch.input_ids).logits
            logits.float().logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def checkpoint() -> None:
            state = get_state_dict(model, optimizer, options=FULL_ON_CPU)
            if rank == 0:
                torch.save(state, Path(out_dir) / "whole.pt")

        def background_checkpoint() -> None:  # there was none
            pass

        def export() -> None:
            state = get_model_state_dict(model, options=FULL_ON_CPU)
            if rank == 0:
                model.save_pretrained(Path(out_dir) / "export", state_dict=state)

    else:
        policy, load_peak = phase_peak(lambda: FsdpPolicy(model_dir, settings))
        model = policy.model

        def step() -> None:
            batch = train_batch(model.config.vocab_size, rows, seq_len, rank)
            policy.train_step(batch, policy_gradient_loss)

        def checkpoint() -> None:
            save_checkpoint_shards(Models(policy), Path(out_dir) / "sharded", False)

        def background_checkpoint() -> None:  # the copy, written as training would go on
            _, writing = save_checkpoint_shards(Models(policy), Path(out_dir) / "async", True)
            writing.result()

        def export() -> None:
            policy.save_merged(Path(out_dir) / "export")

    _, train_peak = phase_peak(step)
    _, checkpoint_peak = phase_peak(checkpoint)
    _, background_peak = phase_peak(background_checkpoint)
    _, export_peak = phase_peak(export)
    peaks = {
        "load": load_peak,
        "train": train_peak,
        "checkpoint": checkpoint_peak,
        "background": background_peak,
        "export": export_peak,
    }
    print(RESULT_PREFIX + json.dumps({"rank": rank, **peaks}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_packing(model_dir: str, packed: bool, lengths: list[int], steps: int) -> None:
    """One process's train steps on rows of `lengths`, packed or padded into one micro-batch;
    prints a RESULT line with the first step's peak and the seconds of each step after."""
    budget = sum(lengths) if packed else len(lengths) * max(lengths)
    settings = TrainSettings(micro_batch_tokens=budget, pack_sequences=packed)
    policy = FsdpPolicy(model_dir, settings)
    generator = torch.Generator().manual_seed(0)
    vocab_size = policy.model.config.vocab_size
    token_ids = [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in lengths]
    advantages = [[float(torch.randn(1, generator=generator))] * n for n in lengths]
    batch = Batch.from_sequences(
        token_ids, [[True] * n for n in lengths], {"advantages": advantages}
    )
    _, peak = phase_peak(lambda: policy.train_step(batch, policy_gradient_loss))
    started = time.perf_counter()
    for _ in range(steps):
        policy.train_step(batch, policy_gradient_loss)
    seconds = (time.perf_counter() - started) / steps
    print(RESULT_PREFIX + json.dumps({"peak": peak, "s_per_step": seconds}), flush=True)


def results_of(command: list[str]) -> list[dict]:
    """The RESULT lines `command` prints, run with one thread a process."""
    # A fixed mmap threshold: glibc otherwise raises it as large blocks are freed, keeps later
    # ones in its heap, and a phase after one that freed memory would reuse it unseen.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    with child(command, env=env, stdout=subprocess.PIPE, text=True) as process:
        output, _ = process.communicate()
    if process.returncode:
        raise RuntimeError(f"{command} exited with code {process.returncode}")
    return [
        json.loads(line.removeprefix(RESULT_PREFIX))
        for line in output.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]


def launch(model_dir: str, way: str, args: argparse.Namespace, out_dir: str) -> list[dict]:
    """Each rank's peaks of a 2-rank run the `way` says."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        __file__, "--rank-of", model_dir, "--way", way, "--rows", str(args.rows),
        "--seq-len", str(args.seq_len), "--out-dir", out_dir,
    ]  # fmt: skip
    return sorted(results_of(command), key=lambda result: result["rank"])


def run_packing_process(model_dir: str, way: str, args: argparse.Namespace) -> dict:
    """`run_packing`'s result in a process of its own, `way` packed or padded."""
    command = [
        sys.executable, __file__, "--packing-of", model_dir, "--packed", str(int(way == "packed")),
        "--packing-steps", str(args.packing_steps), *(["--small"] if args.small else []),
    ]  # fmt: skip
    (result,) = results_of(command)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2, help="sequences per rank in the step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--packing-steps", type=int, default=2, help="timed packed/padded steps")
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--packing-of", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--packed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank-of", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=["before", "after"], help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    smoke = {"rows": 1, "seq_len": 16, "small": True, "packing_steps": 1}
    args = smoke_mode.parse_args(parser, smoke)
    lengths = SMOKE_HEAVY_TAILED if args.small else HEAVY_TAILED
    if args.rank_of:
        run_rank(args.rank_of, args.way, args.rows, args.seq_len, args.out_dir)
        return
    if args.packing_of:
        run_packing(args.packing_of, bool(args.packed), lengths, args.packing_steps)
        return

    with tempfile.TemporaryDirectory() as folder:
        model_dir = str(Path(folder) / "model")
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(model_config(SMOKE_MODEL_SIZES if args.small else MODEL_SIZES))
        parameters = sum(parameter.numel() for parameter in model.parameters())
        model_bytes = parameters * 4
        model.save_pretrained(model_dir)
        del model
        print(f"{parameters / 1e6:.1f}M parameters, {model_bytes / 2**20:.0f} MiB in fp32")
        print(f"{'way':>7} {'rank':>4} " + " ".join(f"{phase:>10}" for phase in PHASES))
        ratios = {}
        for way in ("before", "after"):
            out_dir = tempfile.mkdtemp(dir=folder)
            for result in launch(model_dir, way, args, out_dir):
                row = {phase: result[phase] / model_bytes for phase in PHASES}
                figures = " ".join(f"{row[phase]:>10.2f}" for phase in PHASES)
                print(f"{way:>7} {result['rank']:>4} {figures}")
                ratios[way, result["rank"]] = row
        packing_dir = str(Path(folder) / "packing_model")
        torch.manual_seed(0)
        sizes = SMOKE_MODEL_SIZES if args.small else PACKING_MODEL_SIZES
        Qwen3ForCausalLM(model_config(sizes)).save_pretrained(packing_dir)
        packing = {way: run_packing_process(packing_dir, way, args) for way in ("padded", "packed")}
    real_tokens = sum(lengths)
    print(
        f"packing: {len(lengths)} rows, {real_tokens} tokens, padded to "
        f"{len(lengths) * max(lengths)}; one micro-batch"
    )
    for way, result in packing.items():
        print(
            f"{way:>7}: {real_tokens / result['s_per_step']:>7.0f} tokens/s, first step's peak "
            f"{result['peak'] / 2**20:.0f} MiB"
        )
    headline = {"parameters_m": round(parameters / 1e6, 1)}
    for way in ("before", "after"):
        headline[f"load_peak_ratio_{way}"] = round(
            max(ratios[way, rank]["load"] for rank in (0, 1)), 3
        )
        headline[f"checkpoint_peak_ratio_rank0_{way}"] = round(ratios[way, 0]["checkpoint"], 3)
        headline[f"export_peak_ratio_rank0_{way}"] = round(ratios[way, 0]["export"], 3)
    # The train step is the trainer's own only after (before: a bare AdamW step on the model).
    headline["train_peak_ratio"] = round(max(ratios["after", rank]["train"] for rank in (0, 1)), 3)
    background = ratios["after", 0]["background"]
    headline["background_checkpoint_peak_ratio_rank0"] = round(background, 3)
    for way, result in packing.items():
        headline[f"{way}_tokens_per_s"] = round(real_tokens / result["s_per_step"])
        headline[f"{way}_peak_mib"] = round(result["peak"] / 2**20)
    headline["packed_speedup"] = round(
        packing["padded"]["s_per_step"] / packing["packed"]["s_per_step"], 2
    )
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
