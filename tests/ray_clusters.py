"""Ray clusters of the tests' own on this machine, kept apart from the user's Ray state: each
node is a `ray start --block` child of the test process, with a temp dir of its own (so
`ray.init()` elsewhere finds no address file) and Ray's token authentication on with a
token of its own in RAY_AUTH_TOKEN (so a token file that an earlier local cluster left in
~/.ray/auth_token neither turns it on for one node only nor is read). Ending the cluster
ends only its own processes: SIGTERM to each `ray start --block`, which stops what it started,
never `ray stop`, which ends every Ray process on the machine."""

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from ray._private.authentication_test_utils import reset_auth_token_state

from tests.conftest import free_port

RAY = str(Path(sys.executable).parent / "ray")
# What `ray start --block` prints once its node runs.
STARTED = "will now block forever"
START_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 60.0


@contextlib.contextmanager
def ray_cluster(nodes: Sequence[Sequence[str]]) -> Iterator[str]:
    """A cluster of one node per entry of `nodes` (the `ray start` flags of each; the first
    is the head); yields the head's address. While it runs, this process's environment
    holds its auth settings, which drivers (`ray.init`, `turnrl run` children) need."""
    port = free_port()
    # Short: Ray's socket paths under it must fit in 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    auth = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    address = f"127.0.0.1:{port}"
    started: list[subprocess.Popen] = []
    with pytest.MonkeyPatch.context() as environment:
        for name, value in auth.items():
            environment.setenv(name, value)
        environment.delenv("RAY_ADDRESS", raising=False)
        # This process read Ray's auth settings when it imported ray: have it read them again
        # for its own ray.init (Ray's own test helper), and again once they are restored.
        reset_auth_token_state()
        try:
            for index, flags in enumerate(nodes):
                where = (
                    ["--head", f"--port={port}", "--include-dashboard=false"]
                    if index == 0
                    else [f"--address={address}"]
                )
                started.append(_start_node([*where, f"--temp-dir={temp_dir}", *flags]))
            yield address
        finally:
            for node in reversed(started):
                _stop_node(node)
            environment.undo()
            reset_auth_token_state()
            shutil.rmtree(temp_dir, ignore_errors=True)


def _start_node(flags: list[str]) -> subprocess.Popen:
    """`ray start --block FLAGS`, returned once its node runs; RuntimeError with its output
    when it ends first."""
    node = subprocess.Popen(
        [RAY, "start", "--block", "--disable-usage-stats", *flags],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ.copy(),
    )
    output = []
    assert node.stdout is not None
    for line in node.stdout:
        output.append(line)
        if STARTED in line:
            # Ray keeps writing: drain it, so a full pipe never blocks the node.
            _drain(node)
            return node
    node.wait()
    raise RuntimeError(f"ray start {flags} exited {node.returncode}:\n{''.join(output)}")


def _drain(node: subprocess.Popen) -> None:
    threading.Thread(target=node.stdout.read, daemon=True).start()


def _stop_node(node: subprocess.Popen) -> None:
    node.terminate()
    try:
        node.wait(timeout=STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        node.kill()
        node.wait()
