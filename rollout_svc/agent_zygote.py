"""The fork server ("zygote") of a callable agent: one process per `AgentRunner`, started by
rollout_svc/agent_fork_server.py as `python -m rollout_svc.agent_zygote package.module:function`,
that imports the agent's module once and forks a process per episode, so an episode costs a
fork, not a Python start-up plus the agent's imports.

Wire (JSON lines): the runner writes one request per episode on its stdin,
  {"episode": int, "prompt": {...}, "base_url": str, "api_key": str,
   "result_path": str, "stderr_path": str}
and reads on its stdout, per episode, {"episode", "pid"} once the episode's process is forked
(or {"episode", "error"} when it could not be), then {"episode", "returncode"} once that process
is reaped (negative: killed by that signal). End of stdin stops it; running episodes are killed.

An episode's process calls `os.setsid()` (a process group of its own, which a timeout kills with
everything the agent started), dies with the zygote, reads nothing (stdin is /dev/null), and
writes the agent's prints, and its children's, to `stderr_path`. It calls
`function(prompt, base_url, api_key)` with OPENAI_BASE_URL and OPENAI_API_KEY set (a coroutine
runs with `asyncio.run`) and writes one JSON line to `result_path`:
  {"result": <what the function returned>}          exit code 0
  {"unserializable": "<type name>"}                 exit code 0: the result is not JSON
  {"raised": "<the traceback's last line>"}         exit code 1: the function (or the module's
                                                    import) raised; the traceback is in stderr
A module that fails to import is reported this way for every episode, so it is imported once.

The zygote is single-threaded (it waits on stdin and on pidfds with poll, no thread and no
signal handler), so a forked episode finds no lock held. Its stdout, the runner's channel, is a
descriptor the episodes close; what the agent's module prints while imported goes to its stderr.
What a fork shares with its siblings is the module's state at import: an agent should build its
clients (and seed numpy) per call. `random` is reseeded in each fork by Python itself.
"""

import asyncio
import contextlib
import importlib
import json
import os
import select
import signal
import sys
import traceback
from collections.abc import Callable, Collection
from typing import Any

from turnrl.subprocesses import die_with_parent

Agent = Callable[[dict, str, str], Any]


def main(target: str) -> None:
    """Imports the agent `target` ("package.module:function") and serves episodes until stdin
    ends."""
    runner_fd = os.dup(1)  # the runner's channel; 1 becomes stderr for the module's prints
    os.dup2(2, 1)
    try:
        module_name, _, name = target.partition(":")
        agent: Agent | Exception = getattr(importlib.import_module(module_name), name)
    except Exception as e:
        agent = e
    _serve(agent, runner_fd)


def _serve(agent: Agent | Exception, runner_fd: int) -> None:
    """Forks an episode per request line on stdin and reports its pid and end on `runner_fd`."""
    poll = select.poll()
    poll.register(0, select.POLLIN)
    running: dict[int, tuple[int, int]] = {}  # pidfd -> (episode, pid)
    pending = b""
    while True:
        for fd, _ in poll.poll():
            if fd != 0:
                episode, pid = running.pop(fd)
                _, status = os.waitpid(pid, 0)
                poll.unregister(fd)
                os.close(fd)
                _report(runner_fd, episode=episode, returncode=os.waitstatus_to_exitcode(status))
                continue
            received = os.read(0, 1 << 16)
            if not received:  # the runner is closing: no episode outlives its zygote
                _stop(running.values())
                return
            *lines, pending = (pending + received).split(b"\n")
            for line in lines:
                request = json.loads(line)
                sys.stdout.flush()  # a fork must not write what its parent buffered
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as e:
                    _report(runner_fd, episode=request["episode"], error=f"fork failed: {e}")
                    continue
                if pid == 0:
                    _play_episode(agent, request, [runner_fd, *running])
                pidfd = os.pidfd_open(pid)  # a zombie's pidfd is readable at once
                poll.register(pidfd, select.POLLIN)
                running[pidfd] = (request["episode"], pid)
                _report(runner_fd, episode=request["episode"], pid=pid)


def _report(runner_fd: int, **message: Any) -> None:
    os.write(runner_fd, (json.dumps(message) + "\n").encode())


def _stop(running: Collection[tuple[int, int]]) -> None:
    """Kills the running episodes (and their groups) and reaps them."""
    for _, pid in running:
        for kill in (os.killpg, os.kill):  # os.kill: one that has not called setsid yet
            with contextlib.suppress(ProcessLookupError, PermissionError):  # it ended already
                kill(pid, signal.SIGKILL)
    for _, pid in running:
        os.waitpid(pid, 0)


def _play_episode(agent: Agent | Exception, request: dict, zygote_fds: list[int]) -> None:
    """The forked episode process: plays `request` and exits, never returning to the zygote's
    loop."""
    code = 1
    try:
        zygote = os.getppid()
        os.setsid()
        die_with_parent()
        if os.getppid() != zygote:  # it died before the line above could arrange this
            return
        for fd in zygote_fds:
            os.close(fd)
        stdin = os.open(os.devnull, os.O_RDONLY)
        output = os.open(request["stderr_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for target_fd, source_fd in ((0, stdin), (1, output), (2, output)):
            os.dup2(source_fd, target_fd)
        os.close(stdin)
        os.close(output)
        os.environ["OPENAI_BASE_URL"] = request["base_url"]
        os.environ["OPENAI_API_KEY"] = request["api_key"]
        line, code = _call(agent, request)
        sys.stdout.flush()
        with open(request["result_path"], "w") as result:
            result.write(line + "\n")
    except SystemExit as e:  # the agent's sys.exit: its exit code, as a process of its own
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            # A stream the agent closed or broke: nothing more to save.
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _call(agent: Agent | Exception, request: dict) -> tuple[str, int]:
    """Runs the agent on `request`: its result line and exit code (the wire above)."""
    try:
        if isinstance(agent, Exception):  # the module's import failed
            raise agent
        result = agent(request["prompt"], request["base_url"], request["api_key"])
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
    except Exception as e:
        traceback.print_exc()
        return json.dumps({"raised": traceback.format_exception_only(e)[-1].strip()}), 1
    try:
        return json.dumps({"result": result}), 0
    except (TypeError, ValueError):
        return json.dumps({"unserializable": type(result).__name__}), 0


if __name__ == "__main__":
    main(sys.argv[1])
