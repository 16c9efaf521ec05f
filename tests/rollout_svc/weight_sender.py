"""The trainer's end of a weight-sync group, in a process of its own: torch registers a group's
name once per process, so the two ends of one group cannot share a test's process. Run as
`python -m tests.rollout_svc.weight_sender --group G [--layout L --bucket-size B --updates K]
NAME:DTYPE:SHAPE...`, it hosts the group's store and prints its port, joins as rank 0,
broadcasts K updates of the tensors the specs name (`sent_tensors`: seeded, so a test knows
them) as the trainer does, in layout L, leaves and exits 0."""

import argparse
import datetime

import torch

from turnrl.weight_group import broadcast, form_group, host_store, leave_group
from turnrl.weights import LAYOUTS, BucketedWeights

TIMEOUT = datetime.timedelta(seconds=30)


def sent_tensors(specs: list[str], update: int = 0) -> dict[str, torch.Tensor]:
    """Update `update` of the tensors `specs` (NAME:DTYPE:D0xD1..., no dims for a scalar):
    seeded values, plus `update`."""
    generator = torch.Generator().manual_seed(len(specs))
    tensors = {}
    for spec in specs:
        name, dtype, shape = spec.split(":")
        sizes = [int(size) for size in shape.split("x") if size]
        values = torch.randn(sizes, generator=generator) + update
        tensors[name] = values.to(getattr(torch, dtype))
    return tensors


def command(
    group: str,
    specs: list[str],
    *,
    layout: str = "per_tensor",
    bucket_size: int = 1 << 20,
    updates: int = 1,
) -> list[str]:
    """The arguments of `python -m tests.rollout_svc.weight_sender` (a group of two)."""
    return ["-m", "tests.rollout_svc.weight_sender", "--group", group, "--layout", layout,
            "--bucket-size", str(bucket_size), "--updates", str(updates), *specs]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="per_tensor")
    parser.add_argument("--bucket-size", type=int, default=1 << 20)
    parser.add_argument("--updates", type=int, default=1)
    parser.add_argument("specs", nargs="+")
    args = parser.parse_args()
    store = host_store("127.0.0.1", 0, 2, TIMEOUT)
    print(store.port, flush=True)
    group = form_group(store, 0, 2, "gloo", args.group, TIMEOUT)
    for update in range(args.updates):
        tensors = sent_tensors(args.specs, update)
        weights = BucketedWeights.pack(tensors.items(), args.bucket_size)
        for bucket in range(len(weights.buckets)):
            for piece in weights.broadcast_pieces(bucket, args.layout):
                broadcast(group, piece)
    leave_group(group)


if __name__ == "__main__":
    main()
