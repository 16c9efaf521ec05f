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

A call that fails on one rank (out of memory on its share, say) fails on every rank with that
error, at once: the others may be waiting for it in a collective, which gloo would leave them
in until the process group's timeout. So each rank reports the end of each call in the store
the ranks met at (the first failure, or that all are done), and each waits for that verdict
rather than for its own computation. The rank that failed shuts its process groups'
connections, which ends the others' collectives with an error at once (gloo has no call that
does so while the models still hold the group). Then every rank drops the run's models and
forms the process groups again; the run fails with the error, and the next run builds its
models on the new groups.
"""

import asyncio
import contextlib
import datetime
import logging
import os
import queue
import socket
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Concatenate, Literal, NoReturn, ParamSpec, TypeVar

import torch.distributed as dist

from trainer_svc.batch import Batch
from trainer_svc.checkpoint import (
    model_checkpoint_state,
    read_checkpoint_state,
    restore_model,
    save_shards,
)
from trainer_svc.config import LoraSettings
from trainer_svc.critic import FsdpCritic
from trainer_svc.fsdp import FsdpModel, FsdpPolicy, distributed_backend
from turnrl.errors import ConfigError
from turnrl.weights import BucketedWeights, LoraAdapter

logger = logging.getLogger(__name__)
# The other ranks wait for rank 0's next call for as long as the service waits for a run.
FOLLOW_TIMEOUT = datetime.timedelta(days=365)
# The verdict of a call in the store when no rank failed.
ALL_DONE = "all done"
# How long a rank waits for its own computation to end once another rank failed: a gloo
# collective ends at once (the failed rank shut its connections); a computation still running
# after this (a collective on nccl) is left behind on its thread.
LEAVE_BEHIND_SECONDS = 10.0
# A LoRA run's exported model with its adapters merged in, inside the exported adapter folder.
MERGED_MODEL = "merged"
# A co-trained judge's own model, inside the exported model's folder.
JUDGE_MODEL = "judge"
P = ParamSpec("P")
T = TypeVar("T")


# The models a run pushes to rollout replicas: its policy, and a co-trained judge of its own.
Role = Literal["policy", "judge"]


@dataclass
class Models:
    """The models of the current run on this rank."""

    policy: FsdpPolicy
    reference: FsdpPolicy | None = None  # the frozen policy of a KL term
    critic: FsdpCritic | None = None  # PPO's value model (advantage_estimator gae or turn_gae)
    # A co-trained judge that is a model of its own (trainer.judge_training.model_path).
    judge: FsdpPolicy | None = None
    # Each role's last push's weights, laid out for a push (rank 0): the next gather reuses
    # their memory.
    push_weights: dict[Role, BucketedWeights | None] = field(default_factory=dict)
    # With pushed LoRA adapters, the frozen base weights they apply to (rank 0), gathered once.
    base_weights: BucketedWeights | None = None
    # The checkpoint being written in the background (trainer.checkpoint.async_save), and the
    # gloo group of such saves' collectives.
    checkpoint_save: Future | None = None
    checkpoint_group: dist.ProcessGroup | None = None

    def trained(self, role: Role) -> FsdpPolicy:
        """The model that plays `role`."""
        model = self.judge if role == "judge" else self.policy
        assert model is not None, f"the run has no {role} model of its own"
        return model


class RankFailedError(RuntimeError):
    """A call failed on another trainer rank; the message names the rank and its error."""


class Ranks:
    """This trainer process's place among the service's ranks, and the current run's models.
    Rank 0 builds and runs; the others `follow`."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1
        self._store: dist.Store | None = None  # where the ranks met, and report their calls
        self._groups_formed = 0  # times the process groups were formed, 1 + failed calls
        self._calls_made = 0  # in the current groups
        self._calls = None
        self._verdicts: dist.Store | None = None
        self._group_sockets: set[int] = set()  # file descriptors of the groups' connections
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            self._store, self.rank, self.world_size = next(dist.rendezvous("env://"))
            # Its own client: a store client serves one call at a time, and this one waits
            # for each verdict while the compute thread reports on the other.
            self._verdicts = self._store.clone()
            self._form_groups()
        self.models: Models | None = None
        # Every model computation runs on this one thread: torch keeps per-thread state (the
        # OpenMP thread team, kernel caches), and a step on a thread new to it took 1.6 times
        # as long (benchmarks/vs_trl.py).
        self._compute_thread = ComputeThread()

    async def build(self, factory: Callable[P, Models], *args: P.args) -> Models:
        """Makes the run's models with `factory(*args)` on every rank; returns rank 0's."""
        return await self._everywhere("build", factory, args)

    async def run(self, function: Callable[Concatenate[Models, P], T], *args: P.args) -> T:
        """`function(models, *args)` on every rank; rank 0's result. Raises the error of a rank
        where it failed (RankFailedError for another rank's)."""
        return await self._everywhere("run", function, args)

    async def _everywhere(self, kind: str, function: Callable, args: tuple) -> Any:
        if self._calls is None:
            return await asyncio.wrap_future(
                self._compute_thread.submit(self._compute, kind, function, args)
            )
        return await asyncio.to_thread(self._send_and_apply, (kind, function, args))

    async def close(self) -> None:
        """Ends the other ranks' `follow` (rank 0, when the service stops)."""
        if self._calls is not None:
            await asyncio.to_thread(self._send, None)
            self._calls = None

    def follow(self) -> None:
        """The loop of every rank but 0: runs each call rank 0 sends, until `close`. A call that
        fails fails on rank 0 too, where it fails the run; this rank logs it and waits for the
        next run's calls."""
        while (call := self._receive()) is not None:
            try:
                self._apply(*call)
            except Exception:
                logger.exception("rank %d: %s failed", self.rank, call[1].__qualname__)

    def _send_and_apply(self, call: tuple) -> Any:
        self._send(call)
        return self._apply(*call)

    def _apply(self, kind: str, function: Callable, args: tuple) -> Any:
        """Runs the call on the compute thread and waits for every rank's verdict on it."""
        self._calls_made += 1
        key = f"turnrl/ranks/{self._groups_formed}/call{self._calls_made}"
        computing = self._compute_thread.submit(self._compute_and_report, key, kind, function, args)
        self._verdicts.wait([f"{key}/verdict"], FOLLOW_TIMEOUT)
        verdict = self._verdicts.get(f"{key}/verdict").decode()
        if verdict == ALL_DONE:
            return computing.result()
        futures.wait([computing], timeout=LEAVE_BEHIND_SECONDS)
        if not computing.done():  # waiting in a collective for the rank that failed
            logger.error("rank %d: %s left running: %s", self.rank, function.__qualname__, verdict)
            self._compute_thread.close()
            self._compute_thread = ComputeThread()
        self._form_groups_again()
        if verdict.startswith(f"rank {self.rank} "):
            raise computing.exception()
        raise RankFailedError(f"trainer {verdict}")

    def _compute_and_report(self, key: str, kind: str, function: Callable, args: tuple) -> Any:
        """The call on this rank; then its verdict, when it is this rank's to give: the first
        failure, or ALL_DONE from the last rank to finish."""
        try:
            result = self._compute(kind, function, args)
        except Exception as error:
            failure = f"rank {self.rank} failed: {type(error).__name__}: {error}"
            if self._store.compare_set(f"{key}/verdict", "", failure).decode() == failure:
                self._shut_group_connections()
            raise
        if self._store.add(f"{key}/done", 1) == self.world_size:
            self._store.compare_set(f"{key}/verdict", "", ALL_DONE)
        return result

    def _compute(self, kind: str, function: Callable, args: tuple) -> Any:
        if kind == "build":
            self.models = function(*args)
            return self.models
        return function(self.models, *args)

    def _form_groups(self) -> None:
        """Forms the process groups of this generation on the store the ranks met at: the
        default one, which the models compute on, and the gloo group of rank 0's calls."""
        store = dist.PrefixStore(f"turnrl/ranks/{self._groups_formed}/groups", self._store)
        sockets_before = _open_sockets()
        dist.init_process_group(
            distributed_backend(), store=store, rank=self.rank, world_size=self.world_size
        )
        self._calls = dist.new_group(backend="gloo", timeout=FOLLOW_TIMEOUT)
        self._group_sockets = _open_sockets() - sockets_before
        self._groups_formed += 1
        self._calls_made = 0

    def _form_groups_again(self) -> None:
        """After a failed call: the run's models and the groups they computed on, which a rank
        may have left mid-collective, are dropped, and new groups formed."""
        self.models = None
        dist.destroy_process_group()
        self._form_groups()

    def _shut_group_connections(self) -> None:
        """Shuts (without closing: gloo still owns them) the groups' connections to the other
        ranks, so that a collective waiting for this rank fails there at once; their listening
        sockets are left alone."""
        for fd in self._group_sockets:
            with socket.socket(fileno=os.dup(fd)) as connection:
                try:
                    connection.getpeername()
                except OSError:  # a listening socket, or closed already
                    continue
                connection.shutdown(socket.SHUT_RDWR)

    def _send(self, call: tuple | None) -> None:
        dist.broadcast_object_list([call], src=0, group=self._calls)

    def _receive(self) -> tuple | None:
        call = [None]
        dist.broadcast_object_list(call, src=0, group=self._calls)
        return call[0]


def exit_without_finalizing(code: int = 0) -> NoReturn:
    """Ends a process that joined process groups with `code` at once, its output flushed.
    Finalizing the interpreter could abort it instead: a gloo thread that drops a finished
    collective's tensors takes the GIL to, and Python 3.11 ends a thread that takes it while
    the interpreter finalizes, inside that C++ destructor, which aborts the process
    ("terminate called without an active exception", at one exit in 20 on 2 ranks)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ComputeThread:
    """One daemon thread that runs the functions given to it in turn. A daemon: one left
    waiting in a collective for a rank that failed does not hold the process at its exit."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="compute", daemon=True).start()

    def submit(self, function: Callable[..., T], *args: Any) -> Future:
        future: Future = Future()
        self._work.put((future, function, args))
        return future

    def close(self) -> None:
        """Ends the thread once its current function returns."""
        self._work.put(None)

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            future, function, args = work
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(*args))
                except BaseException as error:  # the caller's to handle, with the result
                    future.set_exception(error)


def _open_sockets() -> set[int]:
    """The file descriptors of this process's open sockets (Linux)."""
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since it was listed
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                sockets.add(int(fd))
    return sockets


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


def restore(models: Models, folder: Path) -> dict[str, Any]:
    """Loads the checkpoint in `folder` into the models, each rank its rows of them; returns
    the checkpoint's state. Raises ConfigError when the run has a critic or a judge of its own
    and the checkpoint none."""
    state = read_checkpoint_state(folder)
    trained = checkpointed_models(models)
    if "critic" in trained and "critic" not in state:
        raise ConfigError(
            f"the checkpoint {folder} holds no critic (its run did not use "
            "advantage_estimator gae or turn_gae); resume with the run's own algorithm"
        )
    if "judge" in trained and "judge" not in state:
        raise ConfigError(
            f"the checkpoint {folder} holds no judge model (its run had none of its own: "
            "trainer.judge_training.model_path); resume with the run's own judge_training"
        )
    for role, model in trained.items():
        restore_model(model, folder, role, state[role])
    return state


def checkpointed_models(models: Models) -> dict[str, FsdpModel]:
    """The models a checkpoint holds, by role: the trained ones (no reference policy)."""
    trained = {"policy": models.policy, "critic": models.critic, "judge": models.judge}
    return {role: model for role, model in trained.items() if model is not None}


def save_checkpoint_shards(
    models: Models, folder: Path, in_background: bool
) -> tuple[dict[str, Any], Future | None]:
    """Writes each trained model's shards into the checkpoint folder `folder` (every rank its
    own); returns the rest of their state (`model_checkpoint_state`), by role, and in the
    background the save's future (`checkpoint.save_shards`). A save still running from the
    last checkpoint is waited for first."""
    shards, plain = {}, {}
    for role, model in checkpointed_models(models).items():
        shards[role], plain[role] = model_checkpoint_state(model)
    if models.checkpoint_save is not None:
        models.checkpoint_save.result()
    if in_background and dist.is_initialized() and models.checkpoint_group is None:
        # The background save's collectives run beside the models': a group of their own.
        models.checkpoint_group = dist.new_group(backend="gloo")
    group = models.checkpoint_group if in_background else None
    models.checkpoint_save = save_shards(folder, shards, group, in_background)
    return plain, models.checkpoint_save


def gather_weights(
    models: Models, role: Role, bucket_size_bytes: int, adapters: bool
) -> BucketedWeights | None:
    """What a push of the model playing `role` carries, laid out for it (rank 0; None on the
    others): the policy's LoRA adapters alone with `adapters` (`pushed_adapter`; the first call
    gathers the base weights they apply to as well, into `models.base_weights`), else the
    model's full weights (the adapters merged in, under LoRA) in its last push's memory."""
    model, last = models.trained(role), models.push_weights.get(role)
    if adapters:
        if models.base_weights is None:
            models.base_weights = model.full_weights(bucket_size_bytes, adapters_merged=False)
        state = model.adapter_state_dict()
        pushed = BucketedWeights.pack(state.items(), bucket_size_bytes) if state else None
    else:
        pushed = model.full_weights(bucket_size_bytes, last)
    models.push_weights[role] = pushed
    return pushed


def pushed_adapter(lora: LoraSettings | None, policy: FsdpPolicy) -> LoraAdapter | None:
    """The adapter a push of `policy`, trained with `lora` (`trainer.lora`), carries when
    `lora.push` is "adapter"; None when pushes carry full weights (full fine-tuning, or
    `push: merged`)."""
    if lora is None or lora.push != "adapter":
        return None
    return LoraAdapter(lora.rank, lora.alpha, tuple(policy.adapter_target_modules))


def save_pretrained(
    models: Models, folder: Path, tokenizer_dir: str, judge_tokenizer_dir: str | None = None
) -> None:
    """The policy in Hugging Face format, written by rank 0: with LoRA its adapters in peft's
    format, and with `trainer.lora.export_merged` the merged model in folder/merged too; a
    judge of its own in folder/judge, with its tokenizer from `judge_tokenizer_dir`."""
    policy = models.policy
    policy.save_pretrained(folder, tokenizer_dir)
    if policy.lora is not None and policy.lora.export_merged:
        policy.save_merged(folder / MERGED_MODEL, tokenizer_dir)
    if models.judge is not None:
        assert judge_tokenizer_dir is not None, "a judge model is saved with its tokenizer"
        models.judge.save_pretrained(folder / JUDGE_MODEL, judge_tokenizer_dir)
