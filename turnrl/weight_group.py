"""The weight-sync group: a torch.distributed process group of its own between the trainer's
rank 0 and every rollout engine rank, formed as SGLang's `init_weights_update_group` forms it
(its `init_custom_process_group`), so that turnrl's trainer, its hf replicas and SGLang servers
can share one group:

- a TCPStore at the trainer (rank 0), which the others reach at `master_address:master_port`;
- the group's keys under a PrefixStore named after the group;
- below that, the keys torch's own helper (`_new_process_group_helper`) gives a group of
  that name (`form_group`).

The default process group is never touched, so an engine or a trainer that has its own is
unaffected. Collectives block: callers run them in a worker thread.
"""

import datetime

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


def host_store(
    address: str, port: int, world_size: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    """The group's store, served from this process (rank 0) on `address:port` (0 picks a free
    port: read it from `.port`); returns at once, before the others connect."""
    return dist.TCPStore(address, port, world_size, True, timeout, wait_for_workers=False)


def join_store(
    address: str, port: int, world_size: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    """A client of the store that rank 0 hosts at `address:port`."""
    return dist.TCPStore(address, port, world_size, False, timeout)


def form_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    group_name: str,
    timeout: datetime.timedelta,
) -> dist.ProcessGroup:
    """Joins group `group_name` as `rank`; returns once every rank has (or raises after
    `timeout`).

    The group's keys are where SGLang's `init_custom_process_group` puts them: under the
    group's name (its PrefixStore), then `<name>/` and the device (`cpu/` for gloo, `cuda/`
    for NCCL), as torch's `_new_process_group_helper` nests them. Built here without that
    helper, the group is not registered under its name in this process, so one process may
    hold both ends of a group (tests) or a group of a name it held before (a new trainer).
    """
    device = "cpu" if backend == "gloo" else "cuda"
    nested = dist.PrefixStore(
        f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    )
    if backend == "gloo":
        return dist.ProcessGroupGloo(nested, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(nested, rank, world_size, options)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcasts `tensor` from rank 0 to every rank (its receivers' `tensor` is overwritten);
    blocks until it is done. (Not `dist.broadcast`, which wants a registered group.)"""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def leave_group(group: dist.ProcessGroup) -> None:
    """Shuts the group down."""
    group.shutdown()
