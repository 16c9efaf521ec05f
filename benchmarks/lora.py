"""LoRA against full fine-tuning on the trainer: peak memory, seconds per train step, and bytes
one weight push moves, side by side for each model.

Models: the demo's tiny calculator model (examples/calculator/config.yaml, 0.67M parameters)
and a random Qwen3 of about 60M parameters (width 512, 12 layers, vocabulary 32000, tied
embeddings). Each (model, full or LoRA) runs in a process of its own, so its peak resident
memory (`ru_maxrss`, less what the process held before loading the model) is its own: load,
`--steps` timed train steps after one warm-up on `--rows` sequences of `--seq-len` tokens, then
the push's bytes (all weights for full fine-tuning, the adapters alone for LoRA, as
`trainer.lora.push: adapter` sends them).

    .venv/bin/python benchmarks/lora.py [--rank 8] [--steps 3] [--rows 4] [--seq-len 256]

The last line printed is one JSON object with the headline figures.
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import smoke_mode
import torch
from child_processes import child
from train_throughput import policy_gradient_loss
from transformers import Qwen3Config, Qwen3ForCausalLM
from weight_push import MODEL_SHAPE

from trainer_svc.batch import Batch
from trainer_svc.config import LoraSettings, TrainSettings
from trainer_svc.fsdp import FsdpPolicy
from turnrl.config import REPO_ROOT
from turnrl_cli.project_config import load_project_config
from turnrl_demo.tiny_model import build_tiny_model

RESULT_PREFIX = "RESULT "


def measure(model_dir: str, rank: int, steps: int, rows: int, seq_len: int) -> dict[str, float]:
    """This process's figures for one model: LoRA of `rank`, or full fine-tuning when 0. Memory
    is the peak resident set above what the process held before loading the model (Python,
    torch), which would otherwise hide the demo model's few MiB."""
    before_mib = resident_mib()
    lora = LoraSettings(rank=rank, alpha=2 * rank) if rank else None
    policy = FsdpPolicy(model_dir, TrainSettings(micro_batch_tokens=rows * seq_len), lora)
    vocab_size = policy.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(vocab_size, (rows, seq_len), generator=generator)
    advantages = torch.randn(rows, 1, generator=generator).expand(-1, seq_len)
    batch = Batch.from_sequences(
        token_ids.tolist(), [[True] * seq_len] * rows, {"advantages": advantages.tolist()}
    )
    policy.train_step(batch, policy_gradient_loss)
    started = time.perf_counter()
    for _ in range(steps):
        policy.train_step(batch, policy_gradient_loss)
    s_per_step = (time.perf_counter() - started) / steps
    if lora:
        push_bytes = sum(t.numel() * t.element_size() for t in policy.adapter_state_dict().values())
    else:
        weights = policy.full_weights(bucket_size_bytes=100 * 2**20)
        weights.wait_packed()  # its copy thread must end before the interpreter does
        push_bytes = weights.nbytes
    trained = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    return {
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before_mib,
        "s_per_step": s_per_step,
        "push_bytes": push_bytes,
        "trained_parameters": trained,
    }


def resident_mib() -> float:
    """This process's resident set now, from /proc (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def launch(args: argparse.Namespace, model_dir: Path, rank: int) -> dict[str, float]:
    command = [
        sys.executable, __file__, "--measure", str(model_dir), "--rank", str(rank),
        "--steps", str(args.steps), "--rows", str(args.rows), "--seq-len", str(args.seq_len),
    ]  # fmt: skip
    with child(command, stdout=subprocess.PIPE, text=True) as process:
        output, _ = process.communicate()
    if process.returncode:
        raise RuntimeError(f"{command} exited with code {process.returncode}")
    result = next(line for line in output.splitlines() if line.startswith(RESULT_PREFIX))
    return json.loads(result.removeprefix(RESULT_PREFIX))


def larger_model(folder: Path, layers: int) -> Path:
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**{**MODEL_SHAPE, "num_hidden_layers": layers})).save_pretrained(
        folder
    )
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--rows", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--larger-layers", type=int, default=12, help="layers of the larger model")
    parser.add_argument("--measure", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    smoke = {"steps": 1, "rows": 2, "seq_len": 32, "larger_layers": 1}
    args = smoke_mode.parse_args(parser, smoke)
    if args.measure:
        figures = measure(args.measure, args.rank, args.steps, args.rows, args.seq_len)
        print(RESULT_PREFIX + json.dumps(figures))
        return

    demo = load_project_config(REPO_ROOT / "examples" / "calculator" / "config.yaml")
    headline = {}
    print(f"LoRA rank {args.rank} against full fine-tuning, {args.rows}x{args.seq_len} tokens")
    print(
        f"{'model':>7} {'run':>5} {'trained':>11} {'peak MiB':>9} {'s/step':>7} {'push bytes':>11}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        models = {
            "demo": build_tiny_model(settings=demo.tiny_model),
            "larger": larger_model(Path(scratch) / "larger", args.larger_layers),
        }
        for model, model_dir in models.items():
            runs = {"full": launch(args, model_dir, 0), "lora": launch(args, model_dir, args.rank)}
            for run, figures in runs.items():
                print(
                    f"{model:>7} {run:>5} {figures['trained_parameters']:>11,} "
                    f"{figures['peak_mib']:>9.0f} {figures['s_per_step']:>7.3f} "
                    f"{figures['push_bytes']:>11,}"
                )
            full, lora = runs["full"], runs["lora"]
            headline[f"{model}_push_bytes_ratio"] = round(
                lora["push_bytes"] / full["push_bytes"], 4
            )
            headline[f"{model}_peak_memory_ratio"] = round(lora["peak_mib"] / full["peak_mib"], 3)
            headline[f"{model}_step_time_ratio"] = round(lora["s_per_step"] / full["s_per_step"], 3)
            headline[f"{model}_lora_peak_mib"] = round(lora["peak_mib"])
            headline[f"{model}_full_peak_mib"] = round(full["peak_mib"])
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
