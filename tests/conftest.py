"""Shared test fixtures: real services as subprocesses on free loopback ports."""

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from google.protobuf.descriptor import ServiceDescriptor
from prometheus_client.parser import text_string_to_metric_families

from tests.fixture_files import FixturesUnavailableError, resolve_fixtures
from tests.tiny_vlm import save_zoom_caller
from turnrl import rpc
from turnrl.config import REPO_ROOT, ServerConfig
from turnrl_cli.project_config import SERVICE_NAMES, load_project_config
from turnrl_demo.tiny_model import build_tiny_model

# Asyncio debug mode in every test loop and child service: slow callbacks (>100 ms) are reported.
os.environ.setdefault("PYTHONASYNCIODEBUG", "1")

EXAMPLE_CONFIG = REPO_ROOT / "examples" / "calculator" / "config.yaml"

# Overrides that put every service on a free port.
FREE_PORTS = [f"{name}.server.port=0" for name in SERVICE_NAMES]
STARTUP_TIMEOUT_SECONDS = 60.0


def ledger_keys(run_dir: Path, outcome: str) -> list[str]:
    """The prompt keys the run's ledger (`ledger.jsonl`) records as `outcome` ("trained",
    "filtered", "unused"), over all its steps."""
    lines = (run_dir / "ledger.jsonl").read_text().splitlines()
    return [key for line in lines for key in json.loads(line).get(outcome, [])]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    """A loopback TCP port free now, for a server that must be started at a known port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def fixtures() -> Path:
    """The test fixtures folder: $TURNRL_FIXTURES (CI's ../shared/fixtures) when it exists, or
    else the files the Hugging Face Hub holds, downloaded at pinned revisions into the turnrl
    cache (tests/fixture_files.py)."""
    try:
        return resolve_fixtures()
    except FixturesUnavailableError as error:
        pytest.fail(str(error), pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tests' tiny Qwen3 calculator model (`turnrl_demo.tiny_model`'s default settings),
    which ships in turnrl_demo/models/. No service falls back to it: a test passes it as the
    model path (`example_on_tiny_model`, `rollout.model_path`, `trainer.model_path`)."""
    return build_tiny_model()


@pytest.fixture(scope="session")
def zoom_model_dir() -> Path:
    """The image demo's tiny Qwen2.5-VL (examples/zoom/config.yaml's `tiny_model`), which ships
    in turnrl_demo/models/."""
    project = load_project_config(REPO_ROOT / "examples" / "zoom" / "config.yaml")
    return build_tiny_model(settings=project.tiny_model)


@pytest.fixture(scope="session")
def zoom_caller_dir(
    tmp_path_factory: pytest.TempPathFactory, fixtures: Path, tiny_model_dir: Path
) -> Path:
    """A tiny random Qwen2.5-VL on the tiny model's vocabulary, taught by SFT to call
    image_zoom on a question about an image (tests/tiny_vlm.py)."""
    return save_zoom_caller(tmp_path_factory.mktemp("zoom-caller"), fixtures, tiny_model_dir)


@pytest.fixture(scope="session")
def example_on_tiny_model(tiny_model_dir) -> list[str]:
    """Overrides that run the example config on the tests' tiny model instead of the demo's
    own (twice as deep, so slower to run)."""
    return [f"rollout.model_path={tiny_model_dir}", f"trainer.model_path={tiny_model_dir}"]


@contextlib.asynccontextmanager
async def serve_in_process(
    config: ServerConfig,
    service: ServiceDescriptor,
    add_servicer: Callable[[grpc.aio.Server], None],
) -> AsyncIterator[str]:
    """A real gRPC server for `service` in this event loop; yields its 127.0.0.1 address."""
    running = await rpc.start_server(config, service, add_servicer)
    try:
        yield f"127.0.0.1:{running.port}"
    finally:
        await running.server.stop(None)


@dataclass
class ServedProcess:
    """A `turnrl serve` child process and the address it printed."""

    process: asyncio.subprocess.Process
    address: str
    metrics_url: str | None = None


async def spawn_turnrl(*args: str, env: dict[str, str] | None = None):
    """Starts `python -m turnrl_cli ARGS` with piped stdout and stderr."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "turnrl_cli",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )


async def run_turnrl(*args: str, env: dict[str, str] | None = None, timeout_seconds: float = 120.0):
    """Runs `python -m turnrl_cli ARGS` to completion; returns (exit code, stdout, stderr)."""
    process = await spawn_turnrl(*args, env=env)
    try:
        async with asyncio.timeout(timeout_seconds):
            stdout, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return process.returncode, stdout.decode(), stderr.decode()


async def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """The samples a Prometheus endpoint serves, by (name, sorted label pairs)."""
    async with httpx.AsyncClient() as client:
        reply = await client.get(url, timeout=10)
    reply.raise_for_status()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
    }


def children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return [int(child) for task in tasks for child in (task / "children").read_text().split()]


def kill_tree(pid: int) -> None:
    """kill -9 a process and all its descendants at once, as a crash would (torchrun's ranks
    and their children too, which a kill of torchrun alone leaves running)."""
    pids = [pid]
    for parent in pids:  # grows as children are found
        with contextlib.suppress(FileNotFoundError):
            pids += children(parent)
    for victim in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


@contextlib.asynccontextmanager
async def serve_subprocess(
    service: str, *overrides: str, env: dict[str, str] | None = None, port: int = 0
) -> AsyncIterator[ServedProcess]:
    """Starts `turnrl serve SERVICE --port PORT` (0: a free one) and yields it once it printed
    its address. Its output is read (and dropped) while it serves: a child that fills an
    unread pipe blocks."""
    process = await spawn_turnrl("serve", service, "--port", str(port), *overrides, env=env)
    drained = None
    try:
        metrics_url = None
        async with asyncio.timeout(STARTUP_TIMEOUT_SECONDS):
            while (line := (await process.stdout.readline()).decode()).startswith("metrics of "):
                metrics_url = line.rsplit(" ", 1)[-1].strip()
        if not line.startswith("serving "):
            _, stderr = await process.communicate()
            raise AssertionError(f"turnrl serve {service} did not start:\n{stderr.decode()}")
        drained = asyncio.gather(process.stdout.read(), process.stderr.read())
        address = line.strip().rsplit(" ", 1)[-1]
        yield ServedProcess(process=process, address=address, metrics_url=metrics_url)
    finally:
        if process.returncode is None:
            kill_tree(process.pid)
        await (drained if drained is not None else process.communicate())
        await process.wait()
