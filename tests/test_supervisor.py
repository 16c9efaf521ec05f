"""The launcher's supervisor (`turnrl_cli.processes.supervise`) with a service whose restart
hangs: it never reports SERVING. `test_up.py` covers restarts that come back."""

import asyncio
import os
import signal
import sys

from rich.console import Console

from turnrl.config import ServerConfig
from turnrl_cli.processes import ServiceProcess, supervise
from turnrl_cli.project_config import RestartPolicies, RestartPolicy

# A process that starts and then never says it serves, as a service stuck loading.
HANGING = [sys.executable, "-c", "import time; time.sleep(3600)"]


async def test_a_restart_that_never_serves_is_killed_and_retried_until_the_policy_gives_up():
    service = ServiceProcess(
        "tool",
        ServerConfig(port=0, shutdown_grace_seconds=0.5),
        list(HANGING),
        None,
        address="127.0.0.1:1",
        startup_timeout_seconds=0.5,
    )
    await service.start()
    os.kill(service.process.pid, signal.SIGKILL)  # it crashes; each restart then hangs
    policy = RestartPolicy(max_restarts=2, backoff_seconds=0)
    try:
        async with asyncio.timeout(60):
            code = await supervise(
                [service], RestartPolicies(tool=policy), asyncio.Event(), Console(quiet=True)
            )
    finally:
        if service.process.returncode is None:
            service.process.kill()
            await service.process.wait()
    assert code == 1
    assert service.restarts == 2
    assert service.process.returncode == -signal.SIGKILL  # the hung restart was killed
    assert "did not report SERVING within 0.5s" in service.exit_description()


# A crash whose last line, as gRPC's own log lines do, reads like rich markup.
CRASHING = [
    sys.executable,
    "-c",
    "import sys; sys.stderr.write('call failed [/turnrl.v1.RolloutService/GetStats] [red]\\n');"
    " sys.exit(3)",
]


async def test_a_service_whose_last_output_looks_like_markup_is_reported_as_written(capsys):
    service = ServiceProcess(
        "rollout", ServerConfig(port=0), list(CRASHING), None, address="127.0.0.1:1"
    )
    await service.start()
    policy = RestartPolicy(max_restarts=1, backoff_seconds=0)
    async with asyncio.timeout(60):
        code = await supervise(
            [service], RestartPolicies(rollout=policy), asyncio.Event(), Console(quiet=True)
        )
    assert code == 1
    reported = capsys.readouterr().err
    assert "restarting it in 0.0s" in reported
    assert "call failed [/turnrl.v1.RolloutService/GetStats] [red]" in reported
