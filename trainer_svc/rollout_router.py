"""The trainer's rollout router (DESIGN "Scale-out"): one Generate request spread over the
rollout replicas of `trainer.rollout_service` (its `address` lists them, comma-separated).

    dispatch    each prompt group goes to the live replica with the fewest trajectories in
                flight from this router (ties: the next replica after the last choice); the
                groups one replica gets travel as one Generate call, so all n samples and all
                turns of a group run there (the agent loop runs on the replica: a trajectory's
                KV and prefix cache stay where its first turn put them)
    failure     a call that fails because its replica is gone (UNAVAILABLE: the process died,
                or stopped answering gRPC keepalive pings; CANCELLED by the server as it shut
                down) marks the replica lost; the groups of that call that had not come back
                whole are dispatched again to the live replicas, as new groups (their partial
                trajectories are dropped), and the request goes on. Any other error is the
                request's own and is raised. When no replica is live the request fails: a run
                never trains on nothing.
    rejoin      a lost replica is asked again at each weight push (`members_for_push`): when it
                answers it is a member of the next weight-sync group and takes groups again.
                With no replica live, a request waits for a lost one to answer (its launcher
                restarts it at its address), has it brought the current weights (`catch_up`)
                and goes on; after REPLICA_RETURN_SECONDS, or at the request's own deadline
                if that comes first, it fails.

Load is counted by the router itself (trajectories dispatched and not yet back), not polled
from GetStats: it is exact for the trainer's own calls and costs no call. A call gives back
its whole load as it ends, whatever came back, so a replica lost mid-group holds none.
"""

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tenacity import AsyncRetrying, retry_if_result, wait_fixed

from turnrl import errors, rpc
from turnrl.config import ClientConfig
from turnrl.trajectory import Trajectory
from turnrl.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

# Statuses of a Generate call whose replica is gone rather than refusing the request.
REPLICA_LOST_STATUSES = ("UNAVAILABLE", "CANCELLED")
# How long a request waits for a lost replica to come back when none is live: a launcher's
# restart (back-off, process start, model load) takes seconds to tens of seconds.
REPLICA_RETURN_SECONDS = 180.0
# Deadline of the GetStats that asks whether a replica is there.
REJOIN_PROBE_TIMEOUT_SECONDS = 5.0
# Pause between two rounds of asking the lost replicas whether they are back.
REJOIN_PROBE_INTERVAL_SECONDS = 1.0


@dataclass(eq=False)
class RolloutReplica:
    """One rollout service replica, as the router sees it."""

    index: int  # place in `trainer.rollout_service.address`
    address: str
    stub: rollout_pb2_grpc.RolloutServiceStub
    in_flight: int = 0  # trajectories dispatched here and not yet back
    live: bool = True
    lost_calls: int = 0  # calls that failed because this replica was gone
    # Times it was lost: a replica back at its address is another process, which holds none
    # of the weight-sync groups its earlier self joined.
    losses: int = 0
    trajectories: int = 0  # trajectories it returned


@dataclass
class _CallResult:
    trajectories: list[Trajectory] = field(default_factory=list)
    unfinished: list[rollout_pb2.RolloutPrompt] = field(default_factory=list)


class RolloutRouter:
    """Spreads Generate requests over the rollout replicas of one ClientConfig."""

    def __init__(
        self,
        config: ClientConfig,
        catch_up: Callable[[RolloutReplica], Awaitable[None]],
        return_seconds: float = REPLICA_RETURN_SECONDS,
    ) -> None:
        """`catch_up(replica)` brings a replica back from the lost the policy the others
        serve, before it takes groups again."""
        addresses = config.addresses()
        self._channels = [rpc.open_channel(config.for_address(address)) for address in addresses]
        self.replicas = [
            RolloutReplica(index, address, rollout_pb2_grpc.RolloutServiceStub(channel))
            for index, (address, channel) in enumerate(zip(addresses, self._channels, strict=True))
        ]
        self._next = itertools.cycle(range(len(self.replicas)))
        self._catch_up = catch_up
        self._return_seconds = return_seconds
        self._returning = asyncio.Lock()  # one request at a time brings a replica back
        self.redispatched_groups = 0  # since the router was made

    def live(self) -> list[RolloutReplica]:
        return [replica for replica in self.replicas if replica.live]

    async def generate(
        self, request: rollout_pb2.GenerateRequest, *, timeout_seconds: float
    ) -> list[Trajectory]:
        """The trajectories of every prompt of `request` (samples `request.n` each), in the
        order they came back, within `timeout_seconds` in all (groups dispatched again after a
        lost replica included). Raises UnavailableError when no replica is live and none comes
        back within `return_seconds`, DeadlineExceededError when the deadline passes first;
        the error of a call that failed for any other reason than a lost replica."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        pending = list(request.prompts)
        trajectories: list[Trajectory] = []
        attempt = 0
        while True:
            if not self.live():
                await self._wait_for_return(request.request_id, timeout_seconds, deadline)
            plan = self._assign(pending, request.n)
            remaining = deadline - loop.time()
            calls = [
                asyncio.ensure_future(self._call(replica, request, prompts, attempt, remaining))
                for replica, prompts in plan.items()
            ]
            try:
                results = await asyncio.gather(*calls)
            except Exception:  # the request's own error: the other calls are of no use
                for call in calls:
                    call.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
                raise
            pending = [prompt for result in results for prompt in result.unfinished]
            trajectories += [t for result in results for t in result.trajectories]
            if not pending:
                return trajectories
            self.redispatched_groups += len(pending)
            log.warning(
                "request %s: %d prompt groups dispatched again after losing a rollout replica",
                request.request_id,
                len(pending),
            )
            attempt += 1

    def _assign(
        self, prompts: Sequence[rollout_pb2.RolloutPrompt], n: int
    ) -> dict[RolloutReplica, list[rollout_pb2.RolloutPrompt]]:
        """Each prompt group to the least-loaded live replica (there is one), counting the
        groups assigned before it; the load is taken at once (released as the call ends)."""
        live = self.live()
        plan: dict[RolloutReplica, list[rollout_pb2.RolloutPrompt]] = {}
        for prompt in prompts:
            start = next(self._next)
            # The least loaded; among equals, the first at or after `start` (round-robin).
            replica = min(live, key=lambda r: (r.in_flight, (r.index - start) % len(self.replicas)))
            replica.in_flight += n
            plan.setdefault(replica, []).append(prompt)
        return plan

    async def _call(
        self,
        replica: RolloutReplica,
        request: rollout_pb2.GenerateRequest,
        prompts: list[rollout_pb2.RolloutPrompt],
        attempt: int,
        timeout_seconds: float,
    ) -> _CallResult:
        """One Generate call of `prompts` on `replica`. A lost replica's call returns the
        groups that came back whole and the prompts of the others as unfinished."""
        call_request = rollout_pb2.GenerateRequest()
        call_request.CopyFrom(request)
        del call_request.prompts[:]
        call_request.prompts.extend(prompts)
        if attempt:  # request ids are unique per replica; a retry may land where one runs
            call_request.request_id = f"{request.request_id}/again{attempt}"
        result = _CallResult()
        # Its load is taken in `_assign`; given back one by one as trajectories come back, and
        # the rest as the call ends, so that each trajectory is given back once.
        load = len(prompts) * request.n
        try:
            replies = replica.stub.Generate(call_request, timeout=timeout_seconds)
            async for reply in replies:
                result.trajectories.append(Trajectory.from_proto(reply.trajectory))
                replica.in_flight -= 1
                load -= 1
        except errors.RpcError as e:
            # A replica that still answers sent the error itself (its tool service is down,
            # say): the request's failure, not a lost replica.
            if e.status not in REPLICA_LOST_STATUSES or await self._answers(replica):
                raise
            self._lose(replica, e)
            whole = _whole_groups(result.trajectories, request.n)
            result.trajectories = [t for t in result.trajectories if t.group_id in whole]
            result.unfinished = [p for p in prompts if p.prompt_id not in whole]
        finally:
            replica.in_flight -= load
            replica.trajectories += len(result.trajectories)
            assert replica.in_flight >= 0, f"{replica.address} in_flight {replica.in_flight}"
        return result

    def _lose(self, replica: RolloutReplica, error: errors.RpcError) -> None:
        replica.lost_calls += 1
        if replica.live:
            log.error("rollout replica %s lost: %s", replica.address, error)
            replica.losses += 1
        replica.live = False

    def lose(self, address: str, error: errors.RpcError) -> bool:
        """Marks the replica at `address` lost after a failed call outside `generate` (a
        weight push); False when no replica has that address."""
        for replica in self.replicas:
            if replica.address == address:
                self._lose(replica, error)
                return True
        return False

    async def _wait_for_return(
        self, request_id: str, timeout_seconds: float, deadline: float
    ) -> None:
        """Waits for a lost replica to answer, brings it the current weights and marks it
        live; raises UnavailableError, naming the replicas, after `return_seconds`, or
        DeadlineExceededError at `deadline` (the request's, of `timeout_seconds` in all) if
        that comes first."""
        loop = asyncio.get_running_loop()
        return_at = loop.time() + self._return_seconds
        try:
            async with asyncio.timeout_at(min(return_at, deadline)), self._returning:
                await self._bring_one_back()
        except TimeoutError:
            replicas = ", ".join(f"{r.address} ({r.lost_calls} lost calls)" for r in self.replicas)
            if deadline < return_at:
                raise errors.DeadlineExceededError(
                    f"request {request_id!r} reached its deadline of {timeout_seconds:.0f}s "
                    f"waiting for a rollout replica to come back: {replicas}"
                ) from None
            raise errors.UnavailableError(
                f"no rollout replica is live, and none came back in "
                f"{self._return_seconds:.0f}s: {replicas}"
            ) from None

    async def _bring_one_back(self) -> None:
        """Asks the replicas every REJOIN_PROBE_INTERVAL_SECONDS until one answers (or another
        request has brought one back), then brings it the policy and marks it live."""
        retrying = AsyncRetrying(
            retry=retry_if_result(lambda back: back is None),
            wait=wait_fixed(REJOIN_PROBE_INTERVAL_SECONDS),
        )
        replica = await retrying(self._first_back)
        if replica.live:  # another request brought it back
            return
        log.info("rollout replica %s is back; bringing it the policy", replica.address)
        await self._catch_up(replica)
        replica.live = True

    async def _first_back(self) -> RolloutReplica | None:
        """A live replica, else the first lost one that answers; None when none is back."""
        if live := self.live():
            return live[0]
        for replica in self.replicas:
            if await self._answers(replica):
                return replica
        return None

    async def _answers(self, replica: RolloutReplica) -> bool:
        """Whether `replica` answers GetStats within REJOIN_PROBE_TIMEOUT_SECONDS."""
        try:
            await replica.stub.GetStats(
                rollout_pb2.GetStatsRequest(), timeout=REJOIN_PROBE_TIMEOUT_SECONDS
            )
        except errors.RpcError:
            return False
        return True

    async def members_for_push(self) -> list[RolloutReplica]:
        """The replicas the next weight push goes to: the live ones, and each lost one that
        answers GetStats again (it rejoins: the push brings it the current policy)."""
        lost = [replica for replica in self.replicas if not replica.live]
        answers = await asyncio.gather(*(self._answers(replica) for replica in lost))
        for replica, answer in zip(lost, answers, strict=True):
            if answer:
                log.info("rollout replica %s is back; it rejoins at this push", replica.address)
                replica.live = True
        return self.live()

    async def pause(self, *, timeout_seconds: float) -> None:
        """Pauses every live replica until the next push resumes it; one that is gone is
        marked lost (the push then leaves it out)."""
        await self._on_live(
            lambda stub: stub.Pause(rollout_pb2.PauseRequest(), timeout=timeout_seconds)
        )

    async def stats(self) -> list[rollout_pb2.GetStatsResponse]:
        """GetStats of every live replica, in replica order; one that is gone is marked lost
        and left out."""
        return await self._on_live(
            lambda stub: stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=30)
        )

    async def _on_live(self, call: Callable[[rollout_pb2_grpc.RolloutServiceStub], Any]) -> list:
        """`call(stub)` on every live replica at once; the replies of those that answered. A
        replica gone meanwhile is marked lost; any other failure is raised."""
        live = self.live()
        results = await asyncio.gather(*(call(r.stub) for r in live), return_exceptions=True)
        replies = []
        for replica, result in zip(live, results, strict=True):
            if isinstance(result, errors.RpcError) and result.status in REPLICA_LOST_STATUSES:
                self._lose(replica, result)
            elif isinstance(result, BaseException):
                raise result
            else:
                replies.append(result)
        return replies

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def engine_metrics(stats: list[rollout_pb2.GetStatsResponse]) -> dict[str, float]:
    """The replicas' engine gauges and running totals as `engine/*` metrics: summed over the
    replicas (tokens, busy seconds, requests waiting), except the policy version and the
    paused flag, which take the largest."""
    metrics: dict[str, float] = {}
    for reply in stats:
        for name, value in reply.metrics.items():
            combine = max if name in ("policy_version", "paused") else sum
            metrics[f"engine/{name}"] = combine((metrics.get(f"engine/{name}", 0.0), value))
    return metrics


def _whole_groups(trajectories: list[Trajectory], n: int) -> set[str]:
    """The group ids of which all `n` trajectories are in `trajectories`."""
    counts: dict[str, int] = {}
    for trajectory in trajectories:
        counts[trajectory.group_id] = counts.get(trajectory.group_id, 0) + 1
    return {group for group, count in counts.items() if count == n}
