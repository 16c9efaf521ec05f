"""A model the trainer trains and the rollout replicas that serve it (`ServedModel`): the router
its Generate calls go through, the weight-sync group its pushes go over, and the last version it
pushed. An RL run serves its policy; a co-trained judge that is a model of its own
(`trainer.judge_training.model_path`) is served by replicas of its own.

A push sends the model's weights as the next version no replica has seen, to every live replica
and each lost one that is back (the weight-sync group is formed again when they changed). A
replica lost during the push is left out and the push made again to the others. A replica that
comes back between pushes is caught up (`_catch_up`) with the last push's weights, as a gRPC
stream, and joins the group at the next push.
"""

import asyncio

from trainer_svc.config import LoraSettings, WeightSyncConfig
from trainer_svc.ranks import Ranks, Role, gather_weights, pushed_adapter
from trainer_svc.rollout_router import REPLICA_LOST_STATUSES, RolloutReplica, RolloutRouter
from trainer_svc.weight_push import PushResult, WeightPusher
from turnrl import errors
from turnrl.config import ClientConfig
from turnrl.v1 import rollout_pb2
from turnrl.weights import LoraAdapter

MIB = 1024 * 1024


class ServedModel:
    """One trained model's rollout replicas: Generate calls through `router`, weight pushes
    through `push`; `version` is the last weight version pushed."""

    def __init__(
        self,
        role: Role,
        ranks: Ranks,
        service: ClientConfig,
        weight_sync: WeightSyncConfig,
        group_prefix: str,
        lora: LoraSettings | None = None,
    ) -> None:
        """`role` names the model among the ranks' `Models`; `lora` is how the policy trains
        (`trainer.lora`: with `push: adapter` its pushes carry the adapters alone)."""
        self.role = role
        self.router = RolloutRouter(service, self._catch_up)
        self.version = 0
        self._ranks = ranks
        self._weight_sync = weight_sync
        self._group_prefix = group_prefix  # the weight-sync groups' names: this, then a number
        self._lora = lora
        # A push and a catch-up both read the last push's weights, which a push rewrites.
        self._push_lock = asyncio.Lock()
        self._pusher: WeightPusher | None = None
        # The members of the pusher's group, as (address, losses) of each.
        self._push_members: list[tuple[str, int]] = []
        self._pusher_groups = 0  # weight-sync groups formed
        self._base_version: int | None = None  # of the base weights pushed adapters apply to

    async def close(self) -> None:
        if self._pusher is not None:
            self._pusher.close()
        await self.router.close()

    async def push(self) -> PushResult:
        """Sends the model's weights as the next version to its replicas."""
        async with self._push_lock:
            return await self._push_to_members()

    async def _push_to_members(self) -> PushResult:
        bucket_size_bytes = self._weight_sync.bucket_size_mb * MIB
        adapter = self._adapter()
        weights = await self._ranks.run(
            gather_weights, self.role, bucket_size_bytes, adapter is not None
        )
        while True:
            members = await self.router.members_for_push()
            if self._pusher is None or _membership(members) != self._push_members:
                await self._connect_pusher(members)
            stats = await self.router.stats()
            if adapter is not None:
                check_loads_adapters(stats)
            self.version = max([self.version, *(s.policy_version for s in stats)]) + 1
            try:
                if adapter is not None and self._lacks_base(stats):
                    await self._pusher.push(self._ranks.models.base_weights, self.version)
                    self._base_version = self.version
                    self.version += 1
                return await self._pusher.push(weights, self.version, adapter=adapter)
            except errors.RpcError as e:
                if e.status not in REPLICA_LOST_STATUSES or not self.router.lose(e.address, e):
                    raise

    def _adapter(self) -> LoraAdapter | None:
        """The LoRA adapter a push carries alone, or None for whole weights."""
        if self.role != "policy":
            return None  # only the policy trains adapters
        return pushed_adapter(self._lora, self._ranks.models.policy)

    def _lacks_base(self, stats: list[rollout_pb2.GetStatsResponse]) -> bool:
        """Whether a replica of `stats` may apply pushed adapters to other base weights than
        this run's: none were pushed yet in this run (an engine keeps the last run's full
        weights, and one restarted loads its own model), or it took none since."""
        return self._base_version is None or any(
            s.policy_version < self._base_version for s in stats
        )

    async def _catch_up(self, replica: RolloutReplica) -> None:
        """Brings a rollout replica that came back (its launcher restarted it) the weights the
        others serve, the last push's weights and version (with pushed adapters, the base
        weights first when it lacks them), as a gRPC stream; it joins the weight-sync group
        at the next push."""
        async with self._push_lock:
            stats = await replica.stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=30)
            if stats.policy_version == self.version:
                return  # it never lost them
            adapter = self._adapter()
            if adapter is not None:
                check_loads_adapters([stats])
            pusher = await WeightPusher.connect([replica.stub], mode="grpc")
            models = self._ranks.models
            if adapter is not None and self._lacks_base([stats]):
                # Any version between its own and the adapters' will do.
                await pusher.push(models.base_weights, stats.policy_version + 1)
            await pusher.push(models.push_weights[self.role], self.version, adapter=adapter)

    async def _connect_pusher(self, members: list[RolloutReplica]) -> None:
        """Forms the weight-sync group with `members` (each time under a new name: the
        replicas leave the last group by joining the next)."""
        if self._pusher is not None:
            self._pusher.close()
        self._pusher_groups += 1
        sync = self._weight_sync
        self._pusher = await WeightPusher.connect(
            [member.stub for member in members],
            backend=sync.backend,
            master_address=sync.master_address,
            group_name=f"{self._group_prefix}-{self._pusher_groups}",
            timeout_seconds=sync.timeout_seconds,
            mode=sync.mode,
        )
        self._push_members = _membership(members)


def _membership(members: list[RolloutReplica]) -> list[tuple[str, int]]:
    """Who is in a weight-sync group: a replica lost since the group formed is a new process,
    not a member, even back at its address."""
    return [(member.address, member.losses) for member in members]


def check_loads_adapters(stats: list[rollout_pb2.GetStatsResponse]) -> None:
    """Raises FailedPreconditionError, before anything is pushed, when a rollout replica's
    engine does not load the LoRA adapters that `trainer.lora.push: adapter` sends it."""
    refusing = sorted({reply.engine for reply in stats if not reply.loads_lora_adapters})
    if refusing:
        raise errors.FailedPreconditionError(
            f"trainer.lora.push is 'adapter', but the rollout engine {', '.join(refusing)} does "
            "not load LoRA adapters (GetStats loads_lora_adapters is false); set "
            "trainer.lora.push: merged to push whole weights, or start the engine with LoRA "
            "enabled (rollout engine_options.lora for sglang and vllm)"
        )
