"""The trainer service on several ranks (started by torchrun, or one by one by a launcher that
sets the env:// variables: `init_distributed`): rank 0 serves the TrainerService and runs the
run's loop; every other rank follows it, running each model computation rank 0 runs, in
the same order, so that FSDP2's collectives line up across the ranks.

A run's loop builds its models and computes with them only through `Ranks`: `build` makes the
run's `Models` on every rank, `run(function, *args)` calls `function(models, *args)` on every
rank and returns rank 0's result. On several ranks rank 0 first broadcasts the call (the
function, by reference, and its arguments, pickled) on a gloo group of its own, which `follow`
receives on the other ranks; `close` ends their loop. With one rank a call is just the function.

A function decides what each rank computes: the train steps split every batch's rows across
the ranks (`share_of`); forward passes for logprobs and values take the whole batch on every
rank, split its rows the same way and gather the results (`FsdpModel._per_token`).
"""

import asyncio
import datetime
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch.distributed as dist

from trainer_svc.checkpoint import load_latest_checkpoint
from trainer_svc.critic import FsdpCritic
from trainer_svc.fsdp import Batch, FsdpPolicy, init_distributed
from turnrl.errors import ConfigError
from turnrl.weights import BucketedWeights

logger = logging.getLogger(__name__)
# The other ranks wait for rank 0's next call for as long as the service waits for a run.
FOLLOW_TIMEOUT = datetime.timedelta(days=365)
P = ParamSpec("P")
T = TypeVar("T")


@dataclass
class Models:
    """The models of the current run on this rank."""

    policy: FsdpPolicy
    reference: FsdpPolicy | None = None  # the frozen policy of a KL term
    critic: FsdpCritic | None = None  # PPO's value model (advantage_estimator gae)
    # The last push's weights, laid out for a push (rank 0): the next gather reuses the memory.
    push_weights: BucketedWeights | None = None


class Ranks:
    """This trainer process's place among the service's ranks, and the current run's models.
    Rank 0 builds and runs; the others `follow`."""

    def __init__(self) -> None:
        self.rank, self.world_size = init_distributed()
        self._calls = None
        if self.world_size > 1:
            self._calls = dist.new_group(backend="gloo", timeout=FOLLOW_TIMEOUT)
        self.models: Models | None = None
        # Every model computation runs on this one thread: torch keeps per-thread state (the
        # OpenMP thread team, kernel caches), and a step on a thread new to it took 1.6 times
        # as long (benchmarks/vs_trl.py).
        self._compute_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")

    async def build(self, factory: Callable[P, Models], *args: P.args) -> Models:
        """Makes the run's models with `factory(*args)` on every rank; returns rank 0's."""
        return await self._on_compute_thread(self._everywhere, "build", factory, args)

    async def run(self, function: Callable[Concatenate[Models, P], T], *args: P.args) -> T:
        """`function(models, *args)` on every rank; rank 0's result."""
        return await self._on_compute_thread(self._everywhere, "run", function, args)

    async def _on_compute_thread(self, function: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._compute_thread, functools.partial(function, *args))

    async def close(self) -> None:
        """Ends the other ranks' `follow` (rank 0, when the service stops)."""
        if self._calls is not None:
            await asyncio.to_thread(self._send, None)
            self._calls = None

    def follow(self) -> None:
        """The loop of every rank but 0: runs each call rank 0 sends, until `close`. A call that
        fails here fails on rank 0 too (the same computation on the same inputs), where it
        fails the run; this rank logs it and waits for the next run's calls."""
        while (call := self._receive()) is not None:
            try:
                self._apply(*call)
            except Exception:
                logger.exception("rank %d: %s failed", self.rank, call[1].__qualname__)

    def _everywhere(self, kind: str, function: Callable, args: tuple) -> Any:
        if self._calls is not None:
            self._send((kind, function, args))
        return self._apply(kind, function, args)

    def _apply(self, kind: str, function: Callable, args: tuple) -> Any:
        if kind == "build":
            self.models = function(*args)
            return self.models
        return function(self.models, *args)

    def _send(self, call: tuple | None) -> None:
        dist.broadcast_object_list([call], src=0, group=self._calls)

    def _receive(self) -> tuple | None:
        call = [None]
        dist.broadcast_object_list(call, src=0, group=self._calls)
        return call[0]


def share_of(models: Models, batch: Batch, rows: list[int]) -> Batch:
    """This rank's share of `batch`'s `rows`, on the policy's device: every world_size-th row
    from its rank. Where rows are fewer than ranks and none is left for it, the first row with
    its loss mask cleared: a filler that lets its train step join the others' collectives and
    adds nothing to the loss."""
    policy = models.policy
    mine = rows[policy.rank :: policy.world_size]
    share = batch.select(mine or rows[:1], policy.device)
    if not mine:
        share.loss_mask.zero_()
    return share


def restore(models: Models, run_dir: Path) -> dict[str, Any] | None:
    """Loads the run's latest checkpoint into the models (every rank reads the file); the
    checkpoint's state, or None when there is none. Raises ConfigError when the run has a
    critic and the checkpoint none."""
    state = load_latest_checkpoint(run_dir)
    if state is None:
        return None
    if models.critic is not None and "critic" not in state:
        raise ConfigError(
            f"the checkpoint of step {state['step']} in {run_dir} holds no critic (its run did "
            "not use advantage_estimator gae); resume with the run's own algorithm"
        )
    models.policy.load_checkpoint_state(state["policy"])
    if models.critic is not None:
        models.critic.load_checkpoint_state(state["critic"])
    return state


def checkpoint_state(models: Models) -> dict[str, Any]:
    """The models' state for a checkpoint (filled on rank 0)."""
    state = {"policy": models.policy.state_dict_for_checkpoint()}
    if models.critic is not None:
        state["critic"] = models.critic.state_dict_for_checkpoint()
    return state


def gather_weights(models: Models, bucket_size_bytes: int) -> BucketedWeights | None:
    """The policy's full weights laid out for a push, in the last push's memory (rank 0; None
    on the others)."""
    models.push_weights = models.policy.full_weights(bucket_size_bytes, models.push_weights)
    return models.push_weights


def save_pretrained(models: Models, folder: Path, tokenizer_dir: str) -> None:
    """The policy in Hugging Face format, written by rank 0."""
    models.policy.save_pretrained(folder, tokenizer_dir)
