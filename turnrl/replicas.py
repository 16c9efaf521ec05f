"""Client-side load balancing over the replicas of one service.

`ClientConfig.address` may name several replicas of a service (`host1:p1,host2:p2`); a
`ReplicaSet` holds one channel and stub per replica and picks one for each call: the one with
the fewest calls in flight, ties taken in turn. A call that belongs to a replica (a tool
session lives on the replica that created it) is pinned to it by a key. A replica that answered
UNAVAILABLE is passed over for a short cooldown while another is up, then tried again, so a
dead replica stops taking calls and one that restarts gets them back. No retries here: a failed
call fails as with a single service, and its caller decides what that means.
"""

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.errors import UnavailableError

S = TypeVar("S")
R = TypeVar("R")
# Tries of `call_with_retries`: with `rpc.call_idempotent`'s back-off (at most 2 s apart) enough
# to ride out a service restarted by its launcher (seconds to tens of seconds), always within
# the caller's deadline.
RETRY_ATTEMPTS = 40
# How long a replica that answered UNAVAILABLE is passed over, in seconds: long enough that a
# dead replica costs one failed call per cooldown, short enough that a restarted one is soon
# back in use.
DOWN_COOLDOWN_SECONDS = 5.0


@dataclass
class Replica(Generic[S]):
    """One replica: its address, the stub on its channel, and what the chooser needs."""

    address: str
    stub: S
    in_flight: int = 0
    down_until: float = 0.0  # time.monotonic(); passed over until then


class ReplicaSet(Generic[S]):
    """The replicas of one service (`config.addresses()`), each behind its own channel.

    `with replicas.call(key) as replica: await replica.stub.Method(request, timeout=...)`.
    """

    def __init__(
        self,
        config: ClientConfig,
        stub_class: Callable[[Any], S],
        cooldown_seconds: float = DOWN_COOLDOWN_SECONDS,
    ) -> None:
        addresses = config.addresses()
        self._channels = [rpc.open_channel(config.for_address(address)) for address in addresses]
        self.replicas = [
            Replica(address, stub_class(channel))
            for address, channel in zip(addresses, self._channels, strict=True)
        ]
        self._cooldown_seconds = cooldown_seconds
        # Calls any replica answered UNAVAILABLE (tries of a retried call each count): how
        # often the service was down or restarting, as its callers saw it.
        self.unavailable_answers = 0
        self._pinned: dict[str, Replica[S]] = {}
        self._next = 0  # where the round-robin tie break starts

    @contextlib.contextmanager
    def call(self, key: str = "") -> Iterator[Replica[S]]:
        """The replica for one call, counted in flight until the block ends: the one `key` is
        pinned to, up or not (what the key names lives there), else the one with the fewest
        calls in flight among those up (all of them when none is), ties going round-robin.
        An UnavailableError out of the block starts the replica's cooldown; a block that ends
        without error ends it."""
        replica = self._pinned.get(key) or self._choose()
        replica.in_flight += 1
        try:
            yield replica
        except UnavailableError:
            replica.down_until = time.monotonic() + self._cooldown_seconds
            self.unavailable_answers += 1
            raise
        else:
            replica.down_until = 0.0
        finally:
            replica.in_flight -= 1

    async def call_with_retries(
        self,
        method: Callable[[S], Callable[..., Awaitable[R]]],
        request: Any,
        *,
        timeout_seconds: float,
        key: str = "",
    ) -> R:
        """`method(stub)(request)` on the replica `call(key)` chooses, retried on UNAVAILABLE
        (each try choosing again: another replica, or this one restarted) until
        `timeout_seconds` is spent. Only for calls that are safe to repeat."""

        async def attempt(request: Any, timeout: float) -> R:  # noqa: ASYNC109 (a stub's signature)
            with self.call(key) as replica:
                return await method(replica.stub)(request, timeout=timeout)

        return await rpc.call_idempotent(
            attempt, request, timeout_seconds=timeout_seconds, max_attempts=RETRY_ATTEMPTS
        )

    def _choose(self) -> Replica[S]:
        now = time.monotonic()
        rotated = self.replicas[self._next :] + self.replicas[: self._next]
        up = [replica for replica in rotated if replica.down_until <= now] or rotated
        chosen = min(up, key=lambda replica: replica.in_flight)  # the first of equals
        self._next = (self.replicas.index(chosen) + 1) % len(self.replicas)
        return chosen

    def pin(self, key: str, replica: Replica[S]) -> None:
        """Sends every later call with `key` to `replica`, until `unpin(key)`."""
        self._pinned[key] = replica

    def unpin(self, key: str) -> None:
        """Ends `pin(key, ...)`; nothing when `key` is not pinned."""
        self._pinned.pop(key, None)

    async def close(self) -> None:
        """Closes every replica's channel."""
        for channel in self._channels:
            await channel.close()
