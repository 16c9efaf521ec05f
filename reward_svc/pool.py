"""A pool of scorer worker processes with a per-item timeout.

`concurrent.futures.ProcessPoolExecutor` cannot stop one hung task: its worker stays busy
forever. Here each worker is a process of its own with a pipe; an item that runs past its
timeout gets its worker killed and replaced, and only that item fails. Scorers are named by
`ScorerRef` (a module or a file, and a function), which the worker imports once and caches,
so user plugins loaded from a file work in workers as well as built-ins.
"""

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
from collections.abc import Callable
from typing import Any

from reward_svc.scorers.base import Score, ScorerRef, ScoringRequest

log = logging.getLogger(__name__)
# Workers are spawned, not forked: the parent runs gRPC threads, which a fork would copy broken.
START_METHOD = "spawn"
# Smaller messages fit an empty pipe and are written from the loop without blocking it.
PIPE_BUFFER_BYTES = 64 * 1024


class ScorerFailedError(Exception):
    """The scorer raised, timed out, or its process died; the message says which."""


class _Worker:
    def __init__(
        self, context: multiprocessing.context.BaseContext, preload: tuple["ScorerRef", ...]
    ) -> None:
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, preload), daemon=True)
        self.process.start()
        child.close()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join()
        self.connection.close()


class ScorerPool:
    """`workers` scorer processes; `await pool.score(ref, request, timeout_seconds)` runs one item.

    Each worker imports the `preload` scorers when it starts, so heavy imports (math-verify,
    sympy) are not charged to the first item's timeout.
    """

    def __init__(self, workers: int, preload: tuple[ScorerRef, ...] = ()) -> None:
        self._context = multiprocessing.get_context(START_METHOD)
        self._preload = preload
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._starting: set[asyncio.Task] = set()
        for _ in range(workers):
            self._add_worker()

    async def score(self, ref: ScorerRef, request: ScoringRequest, timeout_seconds: float) -> Score:
        """Runs the scorer `ref` on `request` in a worker, within `timeout_seconds` of running.

        Raises ScorerFailedError when the scorer raises, runs too long, or kills its process.
        """
        worker = await self._idle.get()
        healthy = False
        try:
            result = await self._run(worker, ref, request, timeout_seconds)
            healthy = True
        finally:
            if healthy:
                self._idle.put_nowait(worker)
            else:  # hung, dead, or cancelled mid-item: its state is unknown, so replace it
                self._replace(worker)
        status, payload = result
        if status == "error":
            raise ScorerFailedError(payload)
        return payload

    async def close(self) -> None:
        """Stops every worker."""
        for task in self._starting:
            task.cancel()
        for worker in list(self._all):
            with contextlib.suppress(OSError, BrokenPipeError):
                worker.connection.send(None)
        await asyncio.to_thread(self._join_all)

    async def _run(
        self, worker: _Worker, ref: ScorerRef, request: ScoringRequest, timeout_seconds: float
    ) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        message = pickle.dumps((ref, request))
        if len(message) < PIPE_BUFFER_BYTES:
            worker.connection.send_bytes(message)
        else:  # a large request (a 10 MB response) fills the pipe: send from a thread
            await asyncio.to_thread(worker.connection.send_bytes, message)
        readable = loop.create_future()
        fd = worker.connection.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            async with asyncio.timeout(timeout_seconds):
                await readable
        except TimeoutError:
            raise ScorerFailedError(
                f"scorer ran past its {timeout_seconds:g}s limit and was stopped"
            ) from None
        finally:
            loop.remove_reader(fd)
        try:
            return worker.connection.recv()
        except (EOFError, OSError):
            # The pipe closes a moment before the process is reaped: wait for its exit code.
            await asyncio.to_thread(worker.process.join, 5.0)
            code = worker.process.exitcode
            raise ScorerFailedError(f"scorer process died (exit code {code})") from None

    def _add_worker(self) -> None:
        """Starts a worker; it takes items once it has imported its scorers, so start-up time
        never counts against an item's timeout."""
        worker = _Worker(self._context, self._preload)
        self._all.add(worker)
        task = asyncio.create_task(self._when_ready(worker))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _when_ready(self, worker: _Worker) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = worker.connection.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        try:
            worker.connection.recv()  # the worker's "ready"
        except (EOFError, OSError):
            await asyncio.to_thread(worker.process.join, 5.0)
            log.error("a scorer worker died while starting (exit code %s)", worker.process.exitcode)
            self._all.discard(worker)
            return
        self._idle.put_nowait(worker)

    def _replace(self, worker: _Worker) -> None:
        self._all.discard(worker)
        worker.kill()
        self._add_worker()

    def _join_all(self) -> None:
        for worker in list(self._all):
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.kill()
        self._all.clear()


def _worker_main(
    connection: multiprocessing.connection.Connection, preload: tuple[ScorerRef, ...]
) -> None:
    """A worker's loop: receive (ref, request), score, send ("ok", Score) or ("error", text)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the service, which stops us
    cache: dict[ScorerRef, Callable[[ScoringRequest], Score]] = {ref: ref.load() for ref in preload}
    connection.send("ready")
    while (item := connection.recv()) is not None:
        ref, request = item
        try:
            if ref not in cache:
                cache[ref] = ref.load()
            score = cache[ref](request)
            if not isinstance(score, Score):
                raise TypeError(f"scorer returned {type(score).__name__}, not Score")
            reply: tuple[str, Any] = ("ok", score)
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}")
        connection.send(reply)
    sys.exit(0)
