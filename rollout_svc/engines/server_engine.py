"""What the engines that run in a server of their own (SGLang, vLLM) share around their own
generation calls: the server process and its connections, the pause a weight update needs, the
weight path, which each engine's weights object drives (`ServerWeightPath`), the broken-push
rule, and the counts `stats` reports.

A weight call that fails leaves the server's weights partly updated (or, for vLLM, marked so):
the engine then refuses to generate (`broken_push_error`) until an update completes; each
engine's `resume` aborts the requests that were in flight.
"""

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from rollout_svc.engines.base import FinishReason, GenerateOutput, broken_push_error
from rollout_svc.engines.engine_http import EngineHttp
from rollout_svc.engines.server_engine_options import ServerEngineOptions
from rollout_svc.engines.server_process import stop_process_group
from rollout_svc.engines.server_weights import check_not_older, write_adapter
from turnrl.errors import FailedPreconditionError, TurnrlError, UnavailableError
from turnrl.weights import BucketedWeights, LoraAdapter, TensorMeta

log = logging.getLogger(__name__)


class ServerWeightPath(Protocol):
    """The weights a server holds, as its engine drives them (`sglang_weight_sync`,
    `vllm_weight_sync`)."""

    ranks: int  # the ranks the server joins a weight-sync group with
    layout: str  # the layout it receives best besides per_tensor
    policy_version: int  # of the weights loaded
    incomplete_update: int | None  # the Engine's `broken_push_version` while not paused

    async def join(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        group_name: str,
        timeout_seconds: float,
    ) -> None: ...

    async def receive(
        self,
        group_name: str,
        metas: Sequence[TensorMeta],
        bucket_size_bytes: int,
        layout: str,
        policy_version: int,
    ) -> None: ...

    def check(self, metas: Sequence[TensorMeta]) -> None: ...

    async def update_from_tensors(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None: ...


def token_policy_versions(adapter: tuple[str, int] | None, server_versions: list[int]) -> list[int]:
    """The policy version of each output token of a request generated with `adapter` (the
    engine's `adapter` when it was sent): the adapter's, as the versions the server reports
    (`server_versions`, one a token) count whole-weight updates only; the server's without."""
    return server_versions if adapter is None else [adapter[1]] * len(server_versions)


class ServerEngine:
    """The parts of the `Engine` protocol the SGLang and vLLM engines share. A subclass builds
    its `EngineHttp` and weights object, calls this `__init__`, keeps the requests it has
    running in `_running` (by the caller's request id), names its server's adapter routes, and
    generates with `adapter` once one is set."""

    LOAD_ADAPTER_PATH: str  # takes {"lora_name", "lora_path"}
    UNLOAD_ADAPTER_PATH: str  # takes {"lora_name"}

    def __init__(
        self,
        http: EngineHttp,
        weights: ServerWeightPath,
        options: ServerEngineOptions,
        model_path: str,
        max_model_len: int,
        process: asyncio.subprocess.Process | None,
    ) -> None:
        self._http = http
        self.url = http.url
        self.weights = weights
        self._options = options
        self._max_model_len = max_model_len
        self._process = process
        self._model_path = model_path
        self._running: dict[str, str] | set[str] = set()
        self._paused = False
        self._totals = {"requests": 0, "generated_tokens": 0, "aborted": 0}
        # The LoRA adapter requests are generated with, as (name, policy version), once one
        # was pushed; its folder and earlier ones' live under `_adapter_folders`.
        self.adapter: tuple[str, int] | None = None
        self._adapter_folders = tempfile.TemporaryDirectory(prefix="turnrl-lora-")
        self._unloading: set[asyncio.Task] = set()

    @property
    def policy_version(self) -> int:
        """Version of the weights now loaded; 0 for weights no push has named."""
        return self.weights.policy_version

    @property
    def broken_push_version(self) -> int | None:
        """The version of a weight update that began and did not complete before the engine
        resumed; None while the server's weights are one version or an update is under way
        (paused). See the `Engine` protocol."""
        return None if self._paused else self.weights.incomplete_update

    # The weight path: the engine's weights object checks and sends the calls.

    @property
    def weight_sync_ranks(self) -> int:
        """The ranks the server joins a weight-sync group with: its workers (tensor-parallel
        ranks)."""
        return self.weights.ranks

    @property
    def weight_layout(self) -> str:
        """The layout the server receives best."""
        return self.weights.layout

    async def join_weight_sync(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        group_name: str,
        timeout_seconds: float,
    ) -> None:
        """Has the server join the trainer's weight-sync group; returns once every rank
        joined, so the trainer must join at the same time."""
        await self.weights.join(
            master_address, master_port, world_size, rank_offset, backend, group_name,
            timeout_seconds,
        )  # fmt: skip

    async def receive_weights(
        self,
        group_name: str,
        metas: Sequence[TensorMeta],
        bucket_size_bytes: int,
        layout: str,
        policy_version: int,
    ) -> None:
        """Has the server receive an update broadcast on the group; the whole weights replace
        the LoRA adapter applied so far too. Raises FailedPreconditionError when the engine is
        not paused, and as the weights object does."""
        self._check_paused()
        await self.weights.receive(group_name, metas, bucket_size_bytes, layout, policy_version)
        self._stop_applying_adapter()

    def check_weights(self, metas: Sequence[TensorMeta]) -> None:
        """Raises InvalidArgumentError for a tensor the server's model checkpoint lacks or has
        in another shape."""
        self.weights.check(metas)

    async def begin_weight_update(self, policy_version: int) -> None:
        """Marks the weights incomplete until an update takes `policy_version` or a newer one
        (receive_weights does this itself)."""
        self.weights.incomplete_update = policy_version

    async def weight_buffer(
        self, metas: Sequence[TensorMeta], bucket_size_bytes: int
    ) -> BucketedWeights | None:
        """None: the server holds the weights, not this process."""
        return None

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], policy_version: int
    ) -> None:
        """Loads weights sent over gRPC (PushWeights, when no weight-sync group formed) as a
        safetensors folder the server reads, so the server must share this machine's disk, as
        a launched one does; the whole weights replace the LoRA adapter applied so far too.
        Raises FailedPreconditionError when the engine is not paused, and as the weights object
        does."""
        self._check_paused()
        await self.weights.update_from_tensors(named_tensors, policy_version)
        self._stop_applying_adapter()

    # LoRA adapters: written as peft folders the server loads by name.

    @property
    def lora_adapters_refusal(self) -> str:
        """Why the server does not load LoRA adapters (no `engine_options.lora`); empty when
        it does."""
        if self._options.lora is not None:
            return ""
        return (
            f"the {self._http.name} server was not started with LoRA; set the rollout "
            "config's engine_options.lora (a launched server gets the flags; start one given "
            "by url with them), or push merged weights (trainer.lora.push: merged)"
        )

    async def load_lora_adapter(
        self,
        adapter: LoraAdapter,
        named_tensors: list[tuple[str, torch.Tensor]],
        policy_version: int,
    ) -> None:
        """Writes the adapter as a peft folder under this engine's own temporary folder, has the
        server load it as "turnrl-v{policy_version}", generates with it from then on, and takes
        `policy_version`. The adapter applied before is unloaded in the background: the server
        unloads one only when no request uses it, and the requests retracted by the pause
        finish under the adapter they started with (a server fixes a request's adapter).
        Raises FailedPreconditionError when the engine is not paused, the server was not
        started with LoRA, or the adapter's rank or target modules pass what it was started
        with; the server's refusal as its error."""
        self._check_paused()
        check_not_older(policy_version, self.weights.policy_version)
        lora = self._options.lora
        if lora is None:
            raise FailedPreconditionError(self.lora_adapters_refusal)
        unknown = sorted(set(adapter.target_modules) - set(lora.target_modules))
        if adapter.rank > lora.max_rank or unknown:
            raise FailedPreconditionError(
                f"adapter of rank {adapter.rank} on {list(adapter.target_modules)}: the "
                f"{self._http.name} server takes rank {lora.max_rank} at most, on "
                f"{lora.target_modules}; raise engine_options.lora to match and restart it"
            )
        name = f"turnrl-v{policy_version}"
        folder = Path(self._adapter_folders.name) / name
        folder.mkdir()
        write_adapter(named_tensors, adapter, self._model_path, folder)
        await self._http.call(
            "POST", self.LOAD_ADAPTER_PATH, {"lora_name": name, "lora_path": str(folder)}
        )
        self._stop_applying_adapter()
        self.adapter = (name, policy_version)
        self.weights.policy_version = policy_version

    def _stop_applying_adapter(self) -> None:
        """Generates without the adapter applied so far from now on and unloads it in the
        background (see load_lora_adapter); nothing when none is applied."""
        if self.adapter is None:
            return
        task = asyncio.create_task(self._unload_adapter(self.adapter[0]))
        self._unloading.add(task)
        task.add_done_callback(self._unloading.discard)
        self.adapter = None

    async def _unload_adapter(self, name: str) -> None:
        """Unloads an adapter no longer applied and deletes its folder; a failure is logged,
        as the adapter only takes room on the server."""
        try:
            await self._http.call("POST", self.UNLOAD_ADAPTER_PATH, {"lora_name": name})
        except TurnrlError as e:
            log.warning("could not unload LoRA adapter %r: %s", name, e)
            return
        shutil.rmtree(Path(self._adapter_folders.name) / name, ignore_errors=True)

    async def watch(self) -> None:
        """Waits while the server this engine launched runs; raises UnavailableError once its
        process exits. A server given by `url` is another's to supervise: this waits forever,
        and its failures reach callers as the errors of their requests."""
        if self._process is None:
            await asyncio.Event().wait()
        returncode = await self._process.wait()
        raise UnavailableError(
            f"{self._http.name}: process {self._process.pid} exited with code {returncode}; "
            "its log is above"
        )

    def stats(self) -> dict[str, float]:
        """Counts kept by this client: requests running now, finished, aborted, tokens made;
        whether the engine is paused and its weights incomplete (0/1), and their version."""
        return {
            "running_requests": float(len(self._running)),
            "paused": float(self._paused),
            "policy_version": float(self.weights.policy_version),
            "weights_incomplete": float(self.weights.incomplete_update is not None),
            "requests_total": float(self._totals["requests"]),
            "generated_tokens_total": float(self._totals["generated_tokens"]),
            "aborted_total": float(self._totals["aborted"]),
        }

    async def close(self) -> None:
        """Closes the connections and stops the server this engine launched: SIGTERM to its
        process group, SIGKILL after `shutdown_timeout_seconds`. A server given by `url` keeps
        running."""
        await self._http.close()
        self._adapter_folders.cleanup()
        if self._process is not None and self._options.launch is not None:
            await stop_process_group(self._process, self._options.launch.shutdown_timeout_seconds)

    def _count(self, output: GenerateOutput) -> GenerateOutput:
        """Adds a finished generate() call to the totals `stats` reports; returns `output`."""
        self._totals["requests"] += 1
        self._totals["generated_tokens"] += len(output.output_ids)
        self._totals["aborted"] += output.finish_reason is FinishReason.ABORT
        return output

    def _check_paused(self) -> None:
        if not self._paused:
            raise FailedPreconditionError(
                "pause() the engine before updating its weights: requests running during an "
                "update would sample from a mix of two versions"
            )

    def _check_weights_complete(self) -> None:
        if self.broken_push_version is not None:
            raise broken_push_error(self.broken_push_version)
