"""The SGLang engine's weight path: the server, which holds the weights, joins the trainer's
weight-sync group itself (SGLang's `init_weights_update_group`, with its tensor-parallel
ranks) and receives each update on it, tensor by tensor (one `update_weights_from_distributed`
call per bucket) or in flattened buckets where the server takes them; without a group
(PushWeights), an update goes as a safetensors folder (`update_weights_from_disk`). Names and
shapes are checked against the model's checkpoint first (`server_weights`), and each update
names its `policy_version` as SGLang's `weight_version`. (Paths below: the SGLang 0.5.23
wheel's, under `sglang/srt/`.)

Since SGLang 0.5.21 a distributed update runs inside a weight-update session: the server
answers `update_weights_from_distributed` with success=false, before it receives anything,
unless `/begin_weight_update` opened one (`managers/scheduler_components/weight_updater.py`
update_weights_from_distributed), and the trainer's broadcast of that bucket would then wait
for a receiver that never comes. So every update opens a session before its first bucket and
closes it (`/end_weight_update`) after its last, and after a failure too: a failed bucket
leaves the session open, and the server refuses to open another while one is. A server
without the session routes (HTTP 404: a release before 0.5.21, which needs none) gets its
updates without.

The server's group has no timeout of turnrl's: `/init_weights_update_group` takes none
(`managers/io_struct.py` InitWeightsUpdateGroupReqInput; unknown keys are dropped) and forms the
group with torch's 30-minute default (`model_executor/model_runner_components/
weight_updater.py` init_weights_update_group). A bucket the trainer never sends holds the
server's scheduler that long; the engine gives up after `weight_sync_timeout_seconds`, the
weights count as incomplete, and the next join destroys the group first.

A weight call that fails may have loaded part of its tensors (SGLang: "the full weights of
the ModelRunner are partially updated. Please discard the whole weights."): the weights count
as incomplete (`ServerWeights.incomplete_update`) from an update's first call until one that
completes an update succeeds, and the engine refuses to generate meanwhile.
"""

import asyncio
import logging
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import httpx
import torch

from rollout_svc.engines.engine_http import EngineHttp
from rollout_svc.engines.server_weights import (
    CheckpointShapes,
    check_not_older,
    write_update,
)
from rollout_svc.engines.sglang_api import WeightSyncReply, dtype_name
from turnrl.errors import FailedPreconditionError, InvalidArgumentError, TurnrlError
from turnrl.weights import TensorMeta, bucket_indices, dtype_runs

log = logging.getLogger(__name__)


class ServerWeights:
    """The weights an SGLang server holds, as the engine drives them (module docstring)."""

    def __init__(
        self,
        http: EngineHttp,
        model_path: str,
        layout: str,
        weight_sync_timeout_seconds: float,
        control_timeout_seconds: float,
    ) -> None:
        self._http = http
        self._model_path = model_path
        self.layout = layout  # the layout the server receives best besides per_tensor
        self._weight_sync_timeout_seconds = weight_sync_timeout_seconds
        self._control_timeout_seconds = control_timeout_seconds
        self.ranks = 1  # the server's tensor-parallel size, read at start
        self.data_parallel_size = 1
        self.policy_version = 0  # of the weights loaded; the server's own at start
        self.incomplete_update: int | None = None  # the Engine's `broken_push_version`
        self._group = ""  # the weight-sync group the server is in
        # The server's weight-update session: "open" (ours), "closed", "unknown" (one may be
        # open: left by a close that failed, or by an earlier client), or "unsupported" (the
        # server has no session routes).
        self._session: Literal["open", "closed", "unknown", "unsupported"] = "unknown"
        self._checkpoint = CheckpointShapes(model_path)

    async def join(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        group_name: str,
        timeout_seconds: float,
    ) -> None:
        """Has the server join the group, its ranks from `rank_offset` on, leaving the group
        it was in; returns once every rank joined.

        Raises FailedPreconditionError when the server cannot join (wrong address, a server of
        several data-parallel replicas, whose ranks would collide) and DeadlineExceededError
        after `timeout_seconds`. The group counts as joined even then: the server may form it
        after answering, so the next join (a retry) destroys it first.
        """
        if self.data_parallel_size > 1:
            raise FailedPreconditionError(
                f"SGLang server at {self._http.url!r} runs dp_size={self.data_parallel_size}: "
                "each data-parallel replica would join the weight-sync group with the same "
                "ranks; serve one replica per server (rollout.replicas) instead"
            )
        await self._leave()
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        self._group = group_name
        await self._weight_call("/init_weights_update_group", body, timeout_seconds)

    async def receive(
        self,
        group_name: str,
        metas: Sequence[TensorMeta],
        bucket_size_bytes: int,
        layout: str,
        policy_version: int,
    ) -> None:
        """Has the server receive an update broadcast on the group in `layout`: tensor by
        tensor, one `update_weights_from_distributed` call per bucket of `bucket_size_bytes`,
        or in flattened buckets, one call per run of one dtype in each bucket (load_format
        flattened_bucket); the cache is flushed after the last call, which takes
        `policy_version`.

        Raises InvalidArgumentError, before the server receives anything, for a layout it does
        not take and for a tensor its model's checkpoint lacks or has in another shape;
        FailedPreconditionError when not in `group_name` or the server fails (the weights are
        incomplete then).
        """
        if layout not in ("per_tensor", self.layout):
            raise InvalidArgumentError(
                f"the SGLang server takes per_tensor or {self.layout} updates, not {layout} "
                "(engine_options.weight_layout)"
            )
        self.check(metas)
        if group_name != self._group:
            raise FailedPreconditionError(
                f"the SGLang server is not in weight-sync group {group_name!r}; call "
                "InitWeightSync first"
            )
        calls = bucket_indices(metas, bucket_size_bytes)
        if layout == "flattened_buckets":
            calls = [run for bucket in calls for run in dtype_runs(metas, bucket)]
        self.incomplete_update = policy_version
        await self._open_session()
        try:
            for index, call in enumerate(calls):
                last = index == len(calls) - 1
                await self.update_from_distributed(
                    [metas[i].name for i in call],
                    [metas[i].dtype for i in call],
                    [metas[i].shape for i in call],
                    policy_version if last else self.policy_version,
                    group_name=group_name,
                    flush_cache=last,
                    flattened=layout == "flattened_buckets",
                )
        finally:
            await self._close_session()

    async def update_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str | torch.dtype],
        shapes: Sequence[Sequence[int]],
        policy_version: int,
        *,
        group_name: str,
        flush_cache: bool = True,
        flattened: bool = False,
    ) -> None:
        """Has the server receive one bucket that the trainer broadcasts on the group, one
        broadcast per tensor in the order of `names` (or, `flattened`, one of them all end to
        end, one dtype), and take `policy_version`. The last call of an update flushes the
        cache (`flush_cache`) and completes the update. A weight-update session is opened
        before the first call of an update and closed after its last, or after a failure.

        Raises InvalidArgumentError when the three lists differ in length or a dtype is not a
        torch dtype, FailedPreconditionError when the version is older than the loaded one or
        the server fails to load the bucket (the weights are incomplete then).
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise InvalidArgumentError(
                f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, "
                f"{len(shapes)}"
            )
        check_not_older(policy_version, self.policy_version)
        body = {
            "names": list(names),
            "dtypes": [dtype_name(dtype) for dtype in dtypes],
            "shapes": [list(shape) for shape in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": str(policy_version),
        }
        if flattened:  # servers before the field reject it
            body["load_format"] = "flattened_bucket"
        await self._open_session()
        try:
            await self._change(
                "/update_weights_from_distributed", body, policy_version, flush_cache
            )
        except BaseException:
            await self._close_session()
            raise
        if flush_cache:
            await self._close_session()

    async def update_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Has the server load the tensors from a safetensors folder written for it (so it
        must share this machine's disk) and take `policy_version`. Raises
        InvalidArgumentError, before the server sees them, for a tensor its checkpoint lacks
        or has in another shape, FailedPreconditionError when the version is older than the
        loaded one or the server fails to load them (the weights are incomplete then)."""
        check_not_older(policy_version, self.policy_version)
        named_tensors = list(named_tensors)
        self.check([TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in named_tensors])
        with tempfile.TemporaryDirectory(prefix="turnrl-weights-") as folder:
            await asyncio.to_thread(write_update, named_tensors, self._model_path, Path(folder))
            body = {
                "model_path": folder,
                "flush_cache": True,
                "weight_version": str(policy_version),
            }
            await self._change("/update_weights_from_disk", body, policy_version, True)

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """Raises InvalidArgumentError naming the first tensor the server's model checkpoint
        lacks or has in another shape (`CheckpointShapes.check`)."""
        self._checkpoint.check(metas)

    async def _open_session(self) -> None:
        """Opens a weight-update session unless ours is open, after closing one that may be
        open (SGLang opens no second one). A server without the route needs none."""
        if self._session in ("open", "unsupported"):
            return
        if self._session == "unknown":
            await self._weight_call(
                "/end_weight_update", {}, self._control_timeout_seconds, refusal_ok=True
            )
        response = await self._weight_call(
            "/begin_weight_update", {}, self._control_timeout_seconds, refusal_ok=True
        )
        if response.status_code == 404:
            log.warning(
                "%s has no /begin_weight_update (SGLang before 0.5.21): updating without "
                "weight-update sessions",
                self._http.name,
            )
            self._session = "unsupported"
            return
        self._check_success(response)  # refused: another's session is open
        self._session = "open"

    async def _close_session(self) -> None:
        """Closes our weight-update session, if one is open. A failure is logged, not raised
        (it must not hide the error of the update it follows); the next update closes the
        session before it opens its own."""
        if self._session != "open":
            return
        self._session = "unknown"
        try:
            await self._weight_call("/end_weight_update", {}, self._control_timeout_seconds)
        except TurnrlError as e:
            log.warning("could not close the weight-update session on %s: %s", self._http.name, e)
            return
        self._session = "closed"

    async def _change(self, path: str, body: dict, policy_version: int, completes: bool) -> None:
        """Has the server change its weights; takes `policy_version` once it did. The weights
        are incomplete from the call until one that `completes` an update succeeds."""
        if self.incomplete_update is None:
            self.incomplete_update = policy_version
        await self._weight_call(path, body, self._weight_sync_timeout_seconds)
        self.policy_version = policy_version
        if completes and policy_version >= self.incomplete_update:
            self.incomplete_update = None

    async def _weight_call(
        self, path: str, body: dict, timeout_seconds: float, refusal_ok: bool = False
    ) -> httpx.Response:
        """POSTs to one of the weight endpoints, which answer {success, message}; raises
        FailedPreconditionError, with the server's message, when it failed, unless
        `refusal_ok`: then a refusal (HTTP 400, or 404 for a route the server lacks) is
        returned for the caller to read."""
        response = await self._http.call(
            "POST", path, body, timeout_seconds=timeout_seconds,
            rejected_error=FailedPreconditionError,
            answered_statuses=(400, 404) if refusal_ok else (),
        )  # fmt: skip
        if not refusal_ok:
            self._check_success(response)
        return response

    def _check_success(self, response: httpx.Response) -> None:
        reply = self._http.parse(response, WeightSyncReply)
        if not reply.success:
            raise FailedPreconditionError(
                f"{self._http.name} failed POST {response.request.url.path}: {reply.message!r}"
            )

    async def _leave(self) -> None:
        """Has the server leave its weight-sync group, if any, so its name and its
        communicators are free; a server without `/destroy_weights_update_group` keeps it."""
        if not self._group:
            return
        try:
            await self._weight_call(
                "/destroy_weights_update_group",
                {"group_name": self._group},
                self._control_timeout_seconds,
            )
        except TurnrlError as e:
            log.warning("the SGLang server kept weight-sync group %r: %s", self._group, e)
        self._group = ""
