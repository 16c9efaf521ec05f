"""The agent runner (rollout_svc/agent_runner.py) with real processes: the agents are the
functions of tests/rollout_svc/agents_for_tests.py, forked by a real fork server
(rollout_svc/agent_zygote.py), and small command lines."""

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout_svc.agent_runner import AgentConfig, AgentOutcome, AgentRunner
from turnrl.failures import AgentFailure

AGENTS = "tests.rollout_svc.agents_for_tests"
BASE_URL = "http://127.0.0.1:9/sessions/s1/v1"  # a session's base URL; only calls_http calls one
API_KEY = "key-of-session-s1"
# Longest wait for a child process to report or end; reached only when a test fails.
WAIT_SECONDS = 60.0


@contextlib.asynccontextmanager
async def agent_runner(name: str, **config) -> AsyncIterator[AgentRunner]:
    """A runner of the test agent `name`, closed on exit."""
    runner = AgentRunner(AgentConfig(callable=f"{AGENTS}:{name}", **config))
    try:
        yield runner
    finally:
        await runner.close()


async def run_agent(name: str, prompt: dict | None = None, **config) -> AgentOutcome:
    """Runs the test agent `name` once on `prompt`."""
    async with agent_runner(name, **config) as runner:
        return await runner.run(prompt or {"question": "2+2"}, BASE_URL, API_KEY)


@dataclass
class Beacon:
    """A TCP server the agents report to: each connection's first JSON line, with its writer."""

    port: int
    messages: asyncio.Queue

    async def next(self) -> tuple[dict, asyncio.StreamWriter]:
        async with asyncio.timeout(WAIT_SECONDS):
            return await self.messages.get()


@pytest_asyncio.fixture
async def beacon() -> AsyncIterator[Beacon]:
    messages: asyncio.Queue = asyncio.Queue()
    writers = []

    async def report(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await messages.put((json.loads(await reader.readline()), writer))

    server = await asyncio.start_server(report, "127.0.0.1", 0)
    try:
        yield Beacon(server.sockets[0].getsockname()[1], messages)
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


async def exited(pidfd: int, seconds: float = WAIT_SECONDS) -> bool:
    """Whether the process of `pidfd` ends (dies, or is a zombie) within `seconds`; closes
    `pidfd`."""
    readable, _, _ = await asyncio.to_thread(select.select, [pidfd], [], [], seconds)
    os.close(pidfd)
    return bool(readable)


def open_files(pid: int | str = "self") -> set[str]:
    """What the descriptors of process `pid` refer to, e.g. 'pipe:[1234]'."""
    files = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone
            files.add(os.readlink(fd))
    return files


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def children(parent: int) -> list[int]:
    """The pids of the processes whose parent is `parent` now."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # it ended while we looked
            if parent_of(int(stat.name)) == parent:
                pids.append(int(stat.name))
    return pids


def zygotes() -> list[int]:
    """The pids of this process's agent fork servers (rollout_svc.agent_zygote)."""
    return [
        pid
        for pid in children(os.getpid())
        if b"rollout_svc.agent_zygote" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def test_config_takes_exactly_one_agent_and_names_a_bad_field():
    with pytest.raises(ValidationError, match="exactly one of `callable` and `command`"):
        AgentConfig()
    with pytest.raises(ValidationError, match=r"command=\['run-agent'\]"):
        AgentConfig(callable="agents:solve", command=["run-agent"])
    with pytest.raises(ValidationError, match=r"callable\n.*input_value='agents\.solve'"):
        AgentConfig(callable="agents.solve")
    with pytest.raises(ValidationError, match=r"command\n.*input_value=\[\]"):
        AgentConfig(command=[])
    with pytest.raises(ValidationError, match=r"max_concurrent\n.*input_value=0"):
        AgentConfig(callable="agents:solve", max_concurrent=0)
    with pytest.raises(ValidationError, match=r"timeout_seconds\n.*input_value=0"):
        AgentConfig(callable="agents:solve", timeout_seconds=0)
    with pytest.raises(ValidationError, match="extra_forbidden"):
        AgentConfig(callable="agents:solve", timeout=3)
    config = AgentConfig(callable="agents:solve")
    assert (config.max_concurrent, config.timeout_seconds, config.env) == (8, 300.0, {})


async def test_an_agent_returns_its_answer_and_its_prints_go_to_stderr():
    outcome = await run_agent("answer")
    assert outcome.answer == "answer to 2+2"
    assert (outcome.reward, outcome.failure, outcome.error_message) == (None, None, "")
    assert "a line an agent prints is not its result" in outcome.stderr_tail
    assert outcome.seconds > 0


async def test_an_agent_returns_a_reward():
    outcome = await run_agent("reward")
    assert (outcome.answer, outcome.reward, outcome.failure) == (None, 0.75, None)


async def test_an_async_agent_returns_an_answer_and_a_reward():
    outcome = await run_agent("async_answer")
    assert (outcome.answer, outcome.reward) == ("async answer to 2+2", 1.0)
    assert isinstance(outcome.reward, float) and outcome.failure is None


async def test_an_agent_that_raises_is_a_system_failure_with_its_exception():
    outcome = await run_agent("raises")
    assert outcome.failure is AgentFailure.RAISED
    assert outcome.error_message == "the agent raised ValueError: the agent broke on '2+2'"
    assert (outcome.answer, outcome.reward) == (None, None)
    assert "Traceback (most recent call last)" in outcome.stderr_tail


async def test_an_agent_that_cannot_be_imported_raised():
    outcome = await run_agent("no_such_agent")
    assert outcome.failure is AgentFailure.RAISED
    assert "AttributeError" in outcome.error_message
    assert "no_such_agent" in outcome.error_message


async def test_a_module_that_fails_to_import_raised_in_every_episode_of_one_zygote():
    runner = AgentRunner(AgentConfig(callable="tests.rollout_svc.no_such_module:solve"))
    try:
        started = []
        for _ in range(3):
            outcome = await runner.run({}, BASE_URL, API_KEY)
            assert outcome.failure is AgentFailure.RAISED
            assert outcome.error_message == (
                "the agent raised ModuleNotFoundError: "
                "No module named 'tests.rollout_svc.no_such_module'"
            )
            assert "Traceback (most recent call last)" in outcome.stderr_tail
            started += zygotes()
        assert len(set(started)) == 1  # imported once, not restarted per episode
    finally:
        await runner.close()
    assert zygotes() == []


async def test_episodes_are_forks_of_one_zygote():
    async with agent_runner("family", max_concurrent=4) as runner:
        outcomes = await asyncio.gather(*(runner.run({}, BASE_URL, API_KEY) for _ in range(12)))
        [zygote] = zygotes()
    pids, parents = zip(*(outcome.answer.split() for outcome in outcomes), strict=True)
    assert len(set(pids)) == 12
    assert set(parents) == {str(zygote)}
    assert zygotes() == []  # closed with its runner


async def test_a_killed_zygote_crashes_its_episode_and_the_next_episode_gets_a_new_one(
    beacon, tmp_path
):
    async with agent_runner("held", timeout_seconds=WAIT_SECONDS) as runner:
        prompt = {"index": 0, "beacon": beacon.port, "times_dir": str(tmp_path)}
        running = asyncio.create_task(runner.run(prompt, BASE_URL, API_KEY))
        message, _ = await beacon.next()
        episode = os.pidfd_open(message["pid"])
        killed = parent_of(message["pid"])
        os.kill(killed, signal.SIGKILL)
        outcome = await running
        assert outcome.failure is AgentFailure.CRASHED
        assert outcome.error_message == "the agent's fork server died: it was killed by SIGKILL"
        assert await exited(episode)  # its group was killed with it
        running = asyncio.create_task(runner.run({**prompt, "index": 1}, BASE_URL, API_KEY))
        message, writer = await beacon.next()
        assert parent_of(message["pid"]) != killed
        writer.write(b"go\n")
        assert (await running).answer == "episode 1"


async def test_an_agent_that_exits_non_zero_crashed():
    outcome = await run_agent("exits")
    assert outcome.failure is AgentFailure.CRASHED
    assert outcome.error_message == (
        "the agent process exited with code 3; its stderr ends with 'exiting with code 3'"
    )
    assert (outcome.answer, outcome.reward) == (None, None)


async def test_an_agent_killed_by_a_signal_crashed():
    outcome = await run_agent("killed")
    assert outcome.failure is AgentFailure.CRASHED
    assert outcome.error_message == "the agent process was killed by SIGKILL"
    assert (outcome.answer, outcome.reward) == (None, None)


@pytest.mark.parametrize(
    ("agent", "described"),
    [("returns_list", "a list: [1, 2]"), ("returns_nothing", "a NoneType: None")],
)
async def test_an_agent_returning_another_type_is_a_bad_result(agent, described):
    outcome = await run_agent(agent)
    assert outcome.failure is AgentFailure.BAD_RESULT
    assert outcome.error_message.startswith(f"the agent returned {described}; expected a str")
    assert (outcome.answer, outcome.reward) == (None, None)


async def test_an_agent_returning_what_json_cannot_hold_is_a_bad_result():
    outcome = await run_agent("returns_object")
    assert outcome.failure is AgentFailure.BAD_RESULT
    assert outcome.error_message.startswith("the agent returned a object, which is not JSON")


async def test_a_timed_out_agent_is_killed_with_the_processes_it_started(beacon):
    running = asyncio.create_task(run_agent("hangs", {"beacon": beacon.port}, timeout_seconds=5.0))
    message, _ = await beacon.next()
    pidfds = [os.pidfd_open(message["pid"]), os.pidfd_open(message["grandchild_pid"])]
    outcome = await running
    assert outcome.failure is AgentFailure.TIMED_OUT
    assert outcome.error_message == (
        "the agent ran past timeout_seconds=5.0; its process group was killed"
    )
    assert (outcome.answer, outcome.reward) == (None, None)
    assert [await exited(pidfd) for pidfd in pidfds] == [True, True]


async def test_an_episode_forked_after_its_timeout_is_killed(tmp_path):
    # Its timeout passes while the zygote still imports the module, before it forks.
    (tmp_path / "slow_import.py").write_text(
        "import time\ntime.sleep(2)\n\ndef solve(prompt, base_url, api_key):\n    time.sleep(3600)\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    runner = AgentRunner(AgentConfig(callable="slow_import:solve", timeout_seconds=0.1, env=env))
    try:
        outcome = await runner.run({}, BASE_URL, API_KEY)
        assert outcome.failure is AgentFailure.TIMED_OUT
        [zygote] = zygotes()
        assert children(zygote) == []  # killed once forked, and reaped
    finally:
        await runner.close()


async def test_a_cancelled_run_kills_the_agent_and_the_processes_it_started(beacon):
    running = asyncio.create_task(run_agent("hangs", {"beacon": beacon.port}))
    message, _ = await beacon.next()
    pidfds = [os.pidfd_open(message["pid"]), os.pidfd_open(message["grandchild_pid"])]
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert [await exited(pidfd) for pidfd in pidfds] == [True, True]


async def test_a_process_that_left_the_group_holds_up_neither_the_run_nor_the_runner(beacon):
    running = asyncio.create_task(
        run_agent("escapes", {"beacon": beacon.port}, timeout_seconds=WAIT_SECONDS)
    )
    message, _ = await beacon.next()
    escaped = os.pidfd_open(message["escaped_pid"])
    try:
        outcome = await running  # the runner closed too
        assert outcome.answer == "returned while a process it started runs on"
        assert not await exited(os.dup(escaped), seconds=0)  # it escaped the group kill
        held = open_files(message["escaped_pid"])
        assert any(name.endswith(".stderr (deleted)") for name in held)  # the agent's output
        assert not {name for name in held if name.startswith("pipe:")} & open_files()
    finally:
        signal.pidfd_send_signal(escaped, signal.SIGKILL)
        os.close(escaped)


async def test_at_most_max_concurrent_agents_run_at_once(beacon, tmp_path):
    async with agent_runner("held", max_concurrent=2) as runner:
        runs = [
            asyncio.create_task(
                runner.run(
                    {"index": i, "beacon": beacon.port, "times_dir": str(tmp_path)},
                    BASE_URL,
                    API_KEY,
                )
            )
            for i in range(5)
        ]
        held: list[tuple[dict, asyncio.StreamWriter]] = []
        for released in range(5):
            while len(held) < min(2, 5 - released):
                held.append(await beacon.next())
            # Every agent the runner started has reported: the rest wait, not even forked.
            [zygote] = zygotes()
            assert len(children(zygote)) == len(held)
            message, writer = held.pop(0)
            writer.write(b"go\n")
            await runs[message["index"]]
    outcomes = [run.result() for run in runs]
    assert [outcome.answer for outcome in outcomes] == [f"episode {i}" for i in range(5)]
    times = {
        i: (
            float((tmp_path / f"{i}.start").read_text()),
            float((tmp_path / f"{i}.end").read_text()),
        )
        for i in range(5)
    }
    overlaps = [
        sum(start <= moment < end for start, end in times.values()) for moment, _ in times.values()
    ]
    assert max(overlaps) == 2


def command_runner(tmp_path: Path, script: str, **config) -> AgentRunner:
    """A runner of `script` as a command-form agent."""
    path = tmp_path / "agent.py"
    path.write_text(script)
    return AgentRunner(AgentConfig(command=[sys.executable, str(path)], **config))


async def test_a_command_agent_reads_its_environment_and_prints_its_result_last(tmp_path):
    script = (
        "import json, os\n"
        "prompt = json.loads(os.environ['TURNRL_PROMPT'])\n"
        "print('a line before the result')\n"
        "print(json.dumps({'answer': prompt['question'] + ' at ' + os.environ['OPENAI_BASE_URL']"
        " + ' with ' + os.environ['OPENAI_API_KEY'] + ', ' + os.environ['AGENT_SETTING']}))\n"
    )
    runner = command_runner(tmp_path, script, env={"AGENT_SETTING": "tuned"})
    outcome = await runner.run({"question": "2+2"}, BASE_URL, API_KEY)
    assert outcome.answer == f"2+2 at {BASE_URL} with {API_KEY}, tuned"
    assert (outcome.reward, outcome.failure) == (None, None)


@pytest.mark.parametrize(
    ("last_line", "answer", "reward", "message"),
    [
        ('"the answer"', "the answer", None, ""),
        ("0.5", None, 0.5, ""),
        ('{"reward": 2}', None, 2.0, ""),
        ("junk", None, None, "the agent's last stdout line is not JSON: 'junk'"),
        ("", None, None, "the agent printed no result: its stdout is empty"),
        ("true", None, None, "the agent returned a bool: True; expected a str"),
        ("NaN", None, None, "the agent returned a float: nan; expected a str"),
        ('{"answer": "a", "score": 1}', None, None, "the agent returned a dict: {'answer'"),
    ],
)
async def test_a_command_agents_last_line_is_its_result(
    tmp_path, last_line, answer, reward, message
):
    # Lines before the last are ignored; a stdout of blank lines holds no result.
    before = "print('progress')" if last_line else "print()"
    runner = command_runner(tmp_path, f"{before}\nprint({last_line!r})\n")
    outcome = await runner.run({}, BASE_URL, API_KEY)
    assert (outcome.answer, outcome.reward) == (answer, reward)
    assert outcome.failure is (AgentFailure.BAD_RESULT if message else None)
    assert outcome.error_message.startswith(message)


async def test_a_command_that_fails_crashed_with_its_stderr(tmp_path):
    runner = command_runner(tmp_path, "raise SystemExit('no model configured')\n")
    outcome = await runner.run({}, BASE_URL, API_KEY)
    assert outcome.failure is AgentFailure.CRASHED
    assert outcome.error_message == (
        "the agent process exited with code 1; its stderr ends with 'no model configured'"
    )


async def test_a_command_that_cannot_start_is_a_system_failure(tmp_path):
    runner = AgentRunner(AgentConfig(command=[str(tmp_path / "missing-agent")]))
    outcome = await runner.run({}, BASE_URL, API_KEY)
    assert outcome.failure is AgentFailure.COULD_NOT_START
    assert outcome.error_message.startswith(f"could not start {str(tmp_path / 'missing-agent')!r}")


@pytest_asyncio.fixture
async def chat_server() -> AsyncIterator[str]:
    """A one-route chat-completions stand-in on a free loopback port; yields its address. It
    answers only the bearer token API_KEY, with the session id of the path in the reply."""

    async def chat_completions(request: Request) -> JSONResponse:
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        question = (await request.json())["messages"][-1]["content"]
        content = f"session {request.path_params['session_id']} heard {question}"
        return JSONResponse({"choices": [{"message": {"role": "assistant", "content": content}}]})

    app = Starlette(
        routes=[
            Route("/sessions/{session_id}/v1/chat/completions", chat_completions, methods=["POST"])
        ]
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()  # the agent may connect at once; uvicorn answers once started
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await serving
        sock.close()


async def test_an_agent_calls_its_base_url_with_its_api_key(chat_server):
    async with agent_runner("calls_http") as runner:
        url = f"{chat_server}/sessions/s7/v1"
        outcome = await runner.run({"question": "2+2"}, url, API_KEY)
        wrong_key = await runner.run({"question": "2+2"}, url, "other")
    assert (outcome.answer, outcome.failure) == ("session s7 heard 2+2", None)
    assert wrong_key.failure is AgentFailure.RAISED
    assert "401 Unauthorized" in wrong_key.error_message
