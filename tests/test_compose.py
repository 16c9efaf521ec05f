"""docker-compose.yml and the Dockerfile agree with the CPU example config and pyproject.toml.

No Docker engine is needed: the files are only parsed. tests/compose/compose_stack.sh (`make
test-compose`) builds and runs them on a real one.
"""

import functools
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml

from turnrl.config import REPO_ROOT
from turnrl_cli.project_config import ProjectConfig, load_project_config

SERVICES = ("tool", "reward", "rollout", "trainer")
# Where the Dockerfile puts the repository's files inside the image (its WORKDIR).
IMAGE_ROOT = PurePosixPath("/app")
DEPENDS_ON = {"rollout": {"tool", "reward"}, "trainer": {"rollout"}}


@dataclass(frozen=True)
class Files:
    compose: dict[str, Any]
    dockerfile: list[tuple[str, str]]  # (INSTRUCTION, arguments), continuations joined
    project: ProjectConfig


@functools.cache
def load_files() -> Files:
    """docker-compose.yml, the Dockerfile's instructions and the example config."""
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    project = load_project_config(REPO_ROOT / "examples/calculator/config.yaml")
    return Files(compose, _instructions((REPO_ROOT / "Dockerfile").read_text()), project)


def _instructions(text: str) -> list[tuple[str, str]]:
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    result = []
    for line in joined.splitlines():
        if line.strip():
            instruction, _, args = line.strip().partition(" ")
            result.append((instruction.upper(), " ".join(args.split())))
    return result


def _service(name: str) -> dict[str, Any]:
    return load_files().compose["services"][name]


def _duration_seconds(value: str) -> float:
    """A compose duration such as '15s' or '1m30s', in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"bad duration {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_services_are_the_four() -> None:
    names = set(load_files().compose.get("services", {}))
    assert names == set(SERVICES), f"compose services are {sorted(names)}, want {sorted(SERVICES)}"


@pytest.mark.parametrize("name", SERVICES)
def test_command_serves_the_example_config_on_all_interfaces(name: str) -> None:
    command = _service(name)["command"]
    assert command[:2] == ["serve", name], f"{name}: command {command} does not start serve {name}"
    assert "--config" in command, f"{name}: command {command} passes no --config"
    config = PurePosixPath(command[command.index("--config") + 1])
    assert config.is_relative_to(IMAGE_ROOT), f"{name}: --config {config} is not under {IMAGE_ROOT}"
    local = REPO_ROOT / config.relative_to(IMAGE_ROOT)
    assert local == REPO_ROOT / "examples/calculator/config.yaml", (
        f"{name}: --config {config} is not the CPU example config"
    )
    assert local.is_file(), f"{name}: --config {config} maps to {local}, which does not exist"
    assert "--host" in command, f"{name}: command {command} passes no --host"
    host = command[command.index("--host") + 1]
    assert host == "0.0.0.0", f"{name}: binds {host}; the port mapping needs 0.0.0.0"
    # Open on the stack's own network only: the next test checks it is published on loopback.
    assert f"{name}.server.allow_insecure=true" in command, f"{name}: 0.0.0.0 needs it to start"


@pytest.mark.parametrize("name", SERVICES)
def test_port_matches_config_and_is_published_on_loopback(name: str) -> None:
    port = getattr(load_files().project, name).server.port
    ports = _service(name).get("ports", [])
    assert len(ports) == 1, f"{name}: publishes {ports}, want exactly one port"
    host_ip, _, container_port = str(ports[0]).rpartition(":")
    host_ip, _, _host_port = host_ip.rpartition(":")
    assert container_port == str(port), (
        f"{name}: publishes container port {container_port}, config listens on {port}"
    )
    assert host_ip == "127.0.0.1", f"{name}: port {ports[0]!r} is not bound to host 127.0.0.1"


@pytest.mark.parametrize("name", SERVICES)
def test_healthcheck_asks_the_service_on_its_port(name: str) -> None:
    port = getattr(load_files().project, name).server.port
    healthcheck = _service(name).get("healthcheck", {})
    want = ["CMD", "turnrl", "health", "--addr", f"127.0.0.1:{port}"]
    assert healthcheck.get("test") == want, (
        f"{name}: healthcheck {healthcheck.get('test')}, want {want}"
    )
    for key in ("interval", "timeout", "retries", "start_period"):
        assert key in healthcheck, f"{name}: healthcheck sets no {key}"


@pytest.mark.parametrize("name", SERVICES)
def test_depends_on_healthy_upstreams(name: str) -> None:
    depends_on = _service(name).get("depends_on", {})
    assert set(depends_on) == DEPENDS_ON.get(name, set()), (
        f"{name}: depends on {sorted(depends_on)}, want {sorted(DEPENDS_ON.get(name, set()))}"
    )
    for upstream, condition in depends_on.items():
        assert condition == {"condition": "service_healthy"}, (
            f"{name}: depends on {upstream} with {condition}, want condition service_healthy"
        )


@pytest.mark.parametrize("name", SERVICES)
def test_stop_grace_outlasts_shutdown_grace(name: str) -> None:
    grace = getattr(load_files().project, name).server.shutdown_grace_seconds
    stop = _service(name).get("stop_grace_period")
    assert stop is not None, f"{name}: no stop_grace_period (Docker's default is 10s)"
    assert _duration_seconds(str(stop)) > grace, (
        f"{name}: stop_grace_period {stop} does not exceed shutdown_grace_seconds {grace}"
    )


def test_dockerfile_installs_with_constraints() -> None:
    runs = [args for instruction, args in load_files().dockerfile if instruction == "RUN"]
    installs = [args for args in runs if "pip install" in args]
    assert installs, "Dockerfile runs no pip install"
    for args in installs:
        assert "-c constraints.txt" in args, f"pip install without -c constraints.txt: {args}"
        assert "[dev]" not in args and " -e " not in args, f"dev or editable install: {args}"


def test_dockerfile_installs_bubblewrap() -> None:
    runs = [args for instruction, args in load_files().dockerfile if instruction == "RUN"]
    assert any("apt-get install" in args and "bubblewrap" in args for args in runs), (
        "Dockerfile does not apt-get install bubblewrap (the Python sandbox tool needs it)"
    )


def test_dockerfile_copies_every_package() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.rstrip("*").rstrip(".") for pattern in patterns}
    copied = set()
    for instruction, args in load_files().dockerfile:
        if instruction == "COPY":
            sources = [word for word in shlex.split(args) if not word.startswith("--")][:-1]
            copied |= {source.strip("/").removeprefix("./") for source in sources}
    missing = packages - copied
    assert not missing, f"Dockerfile does not COPY the packages {sorted(missing)}"


def test_dockerfile_entrypoint_is_turnrl() -> None:
    # The compose commands ("serve", ...) are arguments to this entrypoint.
    entrypoints = [
        args for instruction, args in load_files().dockerfile if instruction == "ENTRYPOINT"
    ]
    assert entrypoints[-1:] == ['["turnrl"]'], f'ENTRYPOINT is {entrypoints}, want ["turnrl"]'


def test_rollout_calls_tool_and_reward_by_service_name() -> None:
    project = load_files().project
    overrides = dict(word.split("=", 1) for word in _service("rollout")["command"] if "=" in word)
    addresses = {key: value for key, value in overrides.items() if key.endswith(".address")}
    assert addresses == {
        "rollout.tool_service.address": f"tool:{project.tool.server.port}",
        "rollout.reward_service.address": f"reward:{project.reward.server.port}",
    }


def test_trainer_writes_runs_to_a_host_folder() -> None:
    output_dir = IMAGE_ROOT / load_files().project.trainer.output_dir
    mounts = [str(volume).rsplit(":", 1) for volume in _service("trainer")["volumes"]]
    assert [target for _, target in mounts] == [str(output_dir)]
    assert _service("trainer")["user"] == "${TURNRL_UID:-10001}:${TURNRL_GID:-10001}"
