"""`python -m <name>_svc`'s command line (turnrl.service_main): a service reads its own section
of the config file with its overrides, refuses what is not its own, and starts without the
wiring package above it."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tool_svc.config import ToolConfig
from turnrl import service_main
from turnrl.errors import ConfigError, UnavailableError


@pytest.fixture(autouse=True)
def asyncio_log_level():
    """load_config quiets asyncio's logger, as a service process does; not for later tests."""
    logger = logging.getLogger("asyncio")
    level = logger.level
    yield
    logger.setLevel(level)


def write_config(folder: Path) -> Path:
    path = folder / "config.yaml"
    path.write_text(
        "tool:\n  server: {port: 7001, shutdown_grace_seconds: 2}\n"
        "rollout: {engine: not-checked-by-the-tool-service}\n"
    )
    return path


def test_reads_its_own_section_with_overrides_and_host_and_port(tmp_path):
    argv = ["--config", str(write_config(tmp_path)), "tool.server.max_concurrent_rpcs=8"]
    config = service_main.load_config("tool", ToolConfig, [*argv, "--host", "0.0.0.0"])
    assert isinstance(config, ToolConfig)
    assert (config.server.host, config.server.port) == ("0.0.0.0", 7001)
    assert config.server.shutdown_grace_seconds == 2
    assert config.server.max_concurrent_rpcs == 8
    config = service_main.load_config("tool", ToolConfig, [*argv, "--port", "0"])
    assert config.server.port == 0


def test_no_file_gives_the_defaults():
    assert service_main.load_config("tool", ToolConfig, []) == ToolConfig()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["tool.server.prot=1"],
            "override 'tool.server.prot=1': unknown key 'tool.server.prot'; known keys here: [",
        ),
        (["rollout.engine=hf"], "overrides ['rollout.engine=hf'] are not in the tool section"),
        (["--config", "/nonexistent/config.yaml"], "cannot read config file"),
        (["--port", "-1"], "tool.server.port: Input should be greater than or equal to 0"),
    ],
)
def test_a_bad_config_exits_2_saying_why(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        service_main.load_config("tool", ToolConfig, argv)
    assert exit_info.value.code == service_main.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_a_bad_key_in_the_file_names_the_file(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text("tool:\n  servr: {}\n")
    with pytest.raises(SystemExit):
        service_main.load_config("tool", ToolConfig, ["--config", str(path)])
    assert f"python -m tool_svc: invalid config:\n  {path}: unknown key 'tool.servr'" in (
        capsys.readouterr().err
    )


def test_a_service_that_cannot_start_or_serve_exits_1_and_a_config_error_2(capsys):
    async def port_taken(config: ToolConfig) -> None:
        raise OSError("cannot bind ToolService to 127.0.0.1:7001")

    async def no_model(config: ToolConfig) -> None:
        raise ConfigError("rollout.model_path is null")

    async def engine_died(config: ToolConfig) -> None:
        raise UnavailableError("the hf engine's worker failed")

    with pytest.raises(SystemExit) as exit_info:
        service_main.run("tool", port_taken, ToolConfig())
    assert exit_info.value.code == service_main.EXIT_FAILED
    assert "python -m tool_svc: cannot bind ToolService" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        service_main.run("tool", engine_died, ToolConfig())
    assert exit_info.value.code == service_main.EXIT_FAILED
    assert "python -m tool_svc: the hf engine's worker failed" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        service_main.run("tool", no_model, ToolConfig())
    assert exit_info.value.code == service_main.EXIT_USAGE
    assert "python -m tool_svc: rollout.model_path is null" in capsys.readouterr().err


def test_the_services_load_without_the_wiring_package():
    code = (
        "import sys, tool_svc.server, reward_svc.server, rollout_svc.server, trainer_svc.server; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('turnrl_cli', 'turnrl_demo')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert loaded.strip() == "[]"
