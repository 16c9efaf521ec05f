"""The vLLM engine's weight path: the server's workers, which hold the weights, join the
trainer's weight-sync group themselves and receive each update there, through turnrl's worker
extension inside vLLM (`turnrl.vllm_worker_extension`, which the server must be started with),
called over the dev-mode endpoint `POST /collective_rpc`; without a group (PushWeights), an
update goes as a safetensors folder on the disk both share, which the extension loads. Names
and shapes are checked against the model's checkpoint first (`server_weights`: the same
checkpoint rules hold for both servers), and each completed update names its
`policy_version` as vLLM's weight version (`POST /update_weight_version`), which the server
stamps on the tokens it generates after it. The prefix cache is emptied after each update
(`POST /reset_prefix_cache`): its KV was computed by the old weights.

The extension receives turnrl's own aligned buckets (the fewest broadcasts, sent from where
they lie), and any other layout a group travels in. A collective_rpc call blocks vLLM's engine
core until it returns: joining returns once every rank joined, receiving once the update is
loaded, so the trainer must join and send at the same time.

A weight call that fails may leave the weights unknown: they count as incomplete
(`VllmServerWeights.incomplete_update`) from an update's first call until one that completes an
update succeeds, and the engine refuses to generate meanwhile.
"""

import asyncio
import logging
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from pydantic import BaseModel

from rollout_svc.engines.engine_http import EngineHttp
from rollout_svc.engines.server_weights import (
    CheckpointShapes,
    check_not_older,
    write_update,
)
from turnrl.errors import FailedPreconditionError, InvalidArgumentError, TurnrlError
from turnrl.weights import LAYOUTS, TensorMeta

log = logging.getLogger(__name__)

# Seconds a collective_rpc's HTTP call waits beyond the deadline the workers get, so that a
# worker's own timeout is what reports.
RPC_MARGIN_SECONDS = 10.0


class CollectiveRpcReply(BaseModel):
    """The answer of POST /collective_rpc: one result per worker (the extension's dicts)."""

    results: list[dict]


class ResetReply(BaseModel):
    """The answer of POST /reset_prefix_cache."""

    success: bool


class VllmServerWeights:
    """The weights a vLLM server holds, as the engine drives them (module docstring)."""

    def __init__(
        self,
        http: EngineHttp,
        model_path: str,
        weight_sync_timeout_seconds: float,
        control_timeout_seconds: float,
    ) -> None:
        self._http = http
        self._model_path = model_path
        self._weight_sync_timeout_seconds = weight_sync_timeout_seconds
        self._control_timeout_seconds = control_timeout_seconds
        self.ranks = 1  # the server's tensor-parallel size, read at start
        self.layout = "aligned_buckets"  # the extension receives turnrl's own buckets
        self.policy_version = 0  # of the weights loaded
        self.incomplete_update: int | None = None  # the Engine's `broken_push_version`
        self._group = ""  # the weight-sync group the workers are in
        self._checkpoint = CheckpointShapes(model_path)
        self.last_update_seconds: dict[str, float] = {}  # the workers' receive/load times

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
        """Has every worker join the group as rank `rank_offset` + its tensor-parallel rank,
        leaving the group it was in; returns once every rank joined.

        Raises FailedPreconditionError when a worker cannot join (wrong address, the others
        did not join within `timeout_seconds`) or the server lacks the extension,
        DeadlineExceededError when the server does not answer in time.
        """
        await self._leave()
        kwargs = {
            "master_address": master_address,
            "master_port": master_port,
            "world_size": world_size,
            "rank_offset": rank_offset,
            "backend": backend,
            "group_name": group_name,
            "timeout_seconds": timeout_seconds,
        }
        await self._rpc("turnrl_join_weight_group", kwargs, timeout_seconds)
        self._group = group_name

    async def receive(
        self,
        group_name: str,
        metas: Sequence[TensorMeta],
        bucket_size_bytes: int,
        layout: str,
        policy_version: int,
    ) -> None:
        """Has every worker receive an update broadcast on the group in `layout`, in buckets
        of `bucket_size_bytes`, and load it; then takes `policy_version`.

        Raises InvalidArgumentError, before the server receives anything, for a layout that is
        not one of turnrl's and for a tensor its model's checkpoint lacks or has in another
        shape; FailedPreconditionError when not in `group_name`, when the version is older
        than the loaded one, or when the broadcast breaks off or the load fails (the weights
        are incomplete then).
        """
        if layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout {layout!r} is not one of {list(LAYOUTS)}")
        self.check(metas)
        check_not_older(policy_version, self.policy_version)
        if group_name != self._group:
            raise FailedPreconditionError(
                f"the vLLM server is not in weight-sync group {group_name!r}; call "
                "InitWeightSync first"
            )
        kwargs = {
            "group_name": group_name,
            "tensors": [
                [meta.name, str(meta.dtype).removeprefix("torch."), list(meta.shape)]
                for meta in metas
            ],
            "bucket_size_bytes": bucket_size_bytes,
            "layout": layout,
        }
        await self._change("turnrl_receive_weights", kwargs, policy_version)

    async def update_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Has the workers load the tensors from a safetensors folder written for them (so
        the server must share this machine's disk) and takes `policy_version`. Raises
        InvalidArgumentError, before the server sees them, for a tensor its checkpoint lacks
        or has in another shape, FailedPreconditionError when the version is older than the
        loaded one or the load fails (the weights are incomplete then)."""
        check_not_older(policy_version, self.policy_version)
        named_tensors = list(named_tensors)
        self.check([TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in named_tensors])
        with tempfile.TemporaryDirectory(prefix="turnrl-weights-") as folder:
            await asyncio.to_thread(write_update, named_tensors, self._model_path, Path(folder))
            await self._change(
                "turnrl_load_weights_from_folder", {"folder": folder}, policy_version
            )

    def check(self, metas: Sequence[TensorMeta]) -> None:
        """Raises InvalidArgumentError naming the first tensor the server's model checkpoint
        lacks or has in another shape (`CheckpointShapes.check`)."""
        self._checkpoint.check(metas)

    async def _change(self, method: str, kwargs: dict, policy_version: int) -> None:
        """Has the workers change their weights, then labels what the server generates from
        here on with `policy_version` and takes it. The weights are incomplete from the call
        until one such change succeeds."""
        if self.incomplete_update is None:
            self.incomplete_update = policy_version
        self.last_update_seconds = await self._rpc(
            method, kwargs, self._weight_sync_timeout_seconds
        )
        # The prefix cache holds KV computed by the old weights, which a new request that
        # shares a prefix would reuse. Requests in flight hold cache blocks too, so they are
        # moved back to the queue and prefilled again under the new weights on resume (the
        # SGLang engine's "retract"); vLLM refuses to reset while any block is held.
        response = await self._http.call(
            "POST",
            "/reset_prefix_cache?reset_running_requests=true",
            rejected_error=FailedPreconditionError,
        )
        if not self._http.parse(response, ResetReply).success:
            raise FailedPreconditionError(
                f"{self._http.name} could not empty its prefix cache after a weight update"
            )
        await self._http.call(
            "POST",
            "/update_weight_version",
            {"new_version": str(policy_version)},
            rejected_error=FailedPreconditionError,
        )
        self.policy_version = policy_version
        if policy_version >= self.incomplete_update:
            self.incomplete_update = None

    async def _rpc(self, method: str, kwargs: dict, timeout_seconds: float) -> dict[str, float]:
        """Runs an extension method in every worker; its answer (the first worker's). Raises
        FailedPreconditionError with a worker's error."""
        body = {"method": method, "kwargs": kwargs, "timeout": timeout_seconds}
        response = await self._http.call(
            "POST", "/collective_rpc", body,
            timeout_seconds=timeout_seconds + RPC_MARGIN_SECONDS,
            rejected_error=FailedPreconditionError,
        )  # fmt: skip
        results = self._http.parse(response, CollectiveRpcReply).results
        for rank, result in enumerate(results):
            if "error" in result:
                raise FailedPreconditionError(
                    f"{self._http.name}: {method} failed in worker {rank}: {result['error']}"
                )
        return results[0]

    async def _leave(self) -> None:
        """Has the workers leave their weight-sync group, if any, so its communicators are
        freed; a failure is logged (the next join leaves it again)."""
        if not self._group:
            return
        try:
            await self._rpc("turnrl_leave_weight_group", {}, self._control_timeout_seconds)
        except TurnrlError as e:
            log.warning("the vLLM server kept weight-sync group %r: %s", self._group, e)
        self._group = ""
