"""The trainer's end of a weight-sync group, in a process of its own: torch registers a group's
name once per process, so the two ends of one group cannot share a test's process. Run as
`python -m tests.rollout_svc.weight_sender --group G [--layout L --bucket-size B --updates K
--join-delay S --die-after-buckets D] NAME:DTYPE:SHAPE...`, it hosts the group's store and
prints its port, joins as rank 0 (S seconds late: a slow trainer), broadcasts K updates of the
tensors the specs name (`sent_tensors`: seeded, so a test knows them) as the trainer does, in
layout L, leaves and exits 0; or, with D, dies with exit code DIED after D buckets of the
first update, as a trainer that crashes mid-push."""

import argparse
import datetime
import os
import time

import torch

from turnrl.weight_group import broadcast, form_group, host_store, leave_group
from turnrl.weights import LAYOUTS, BucketedWeights

TIMEOUT = datetime.timedelta(seconds=30)
DIED = 3


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
    join_delay_seconds: float = 0.0,
    die_after_buckets: int | None = None,
) -> list[str]:
    """The arguments of `python -m tests.rollout_svc.weight_sender` (a group of two)."""
    dying = [] if die_after_buckets is None else ["--die-after-buckets", str(die_after_buckets)]
    return ["-m", "tests.rollout_svc.weight_sender", "--group", group, "--layout", layout,
            "--bucket-size", str(bucket_size), "--updates", str(updates),
            "--join-delay", str(join_delay_seconds), *dying, *specs]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--layout", choices=list(LAYOUTS), default="per_tensor")
    parser.add_argument("--bucket-size", type=int, default=1 << 20)
    parser.add_argument("--updates", type=int, default=1)
    parser.add_argument("--join-delay", type=float, default=0.0)
    parser.add_argument("--die-after-buckets", type=int)
    parser.add_argument("specs", nargs="+")
    args = parser.parse_args()
    store = host_store("127.0.0.1", 0, 2, TIMEOUT)
    print(store.port, flush=True)
    time.sleep(args.join_delay)  # a trainer that comes late, not a synchronization
    group = form_group(store, 0, 2, "gloo", args.group, TIMEOUT)
    for update in range(args.updates):
        tensors = sent_tensors(args.specs, update)
        weights = BucketedWeights.pack(tensors.items(), args.bucket_size)
        for bucket in range(len(weights.buckets)):
            if bucket == args.die_after_buckets:
                os._exit(DIED)  # no goodbye: the receivers see the connection drop
            for piece in weights.broadcast_pieces(bucket, args.layout):
                broadcast(group, piece)
    leave_group(group)


if __name__ == "__main__":
    main()
