"""When `turnrl up`/`run` make a bearer token for their launch (turnrl_cli.launch_token), and
what they hand it to; `test_up.py` drives a launch with it end to end, `test_ray_launcher.py`
one on Ray."""

import os

import pytest

from tests.conftest import FREE_PORTS
from turnrl.config import ServerConfig, is_loopback
from turnrl.errors import ConfigError
from turnrl_cli.launch_token import (
    LAUNCH_TOKEN_ENV,
    launch_token_overrides,
    needs_launch_token,
)
from turnrl_cli.project_config import load_project_config


@pytest.mark.parametrize(
    ("overrides", "needed"),
    [
        ([], False),  # every service on 127.0.0.1
        (["launcher.auth_token=generate"], True),
        (["tool.server.host=0.0.0.0"], True),
        (["tool.server.host=10.1.2.3", "tool.server.allow_insecure=true"], False),
        (["tool.server.host=0.0.0.0", "tool.server.auth_token_env=MY_TOKEN"], False),
        (["tool.server.host=0.0.0.0", "launcher.auth_token=none"], False),
        (["launcher.kind=ray"], True),  # each service binds its node's address
        # The tool service is elsewhere: not this launch's to guard.
        (["tool.server.host=0.0.0.0", "rollout.tool_service.address=10.0.0.9:50051"], False),
    ],
)
def test_a_token_is_made_when_a_started_service_is_exposed(overrides, needed):
    assert needs_launch_token(load_project_config(None, [*FREE_PORTS, *overrides])) is needed


# Whether the token's variable was set when these tests began (it is not, unless exported).
TOKEN_SET_BEFORE = LAUNCH_TOKEN_ENV in os.environ


def test_the_token_goes_to_the_services_without_one(monkeypatch):
    # setenv, not delenv: monkeypatch undoes only what it did, and delenv of an unset
    # variable does nothing to undo, which would leave the token made here to later tests.
    monkeypatch.setenv(LAUNCH_TOKEN_ENV, "a token from before this launch")
    project = load_project_config(
        None,
        [*FREE_PORTS, "launcher.auth_token=generate", "reward.server.auth_token_env=MY_TOKEN"],
    )
    overrides = launch_token_overrides(project)
    token = os.environ[LAUNCH_TOKEN_ENV]
    assert len(token) >= 32
    assert sorted(overrides) == [
        f"{name}.server.auth_token_env={LAUNCH_TOKEN_ENV}"
        for name in ("rollout", "tool", "trainer")
    ]  # the reward service keeps its own token
    assert not any(token in override for override in overrides)
    launch_token_overrides(project)
    assert os.environ[LAUNCH_TOKEN_ENV] != token  # one per launch


def test_no_launch_token_is_left_to_later_tests():
    # Runs after the test above (pytest keeps a file's order), which makes tokens.
    assert (LAUNCH_TOKEN_ENV in os.environ) is TOKEN_SET_BEFORE


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.0.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.4", False),
        ("node-3.cluster", False),
    ],
)
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


def test_an_exposed_server_needs_tls_a_token_or_allow_insecure():
    with pytest.raises(ConfigError, match=r"'0\.0\.0\.0' is reachable from other machines") as info:
        ServerConfig(port=0, host="0.0.0.0").check_exposure()
    assert "server.allow_insecure: true" in str(info.value)
    ServerConfig(port=0, host="0.0.0.0", auth_token_env="T").check_exposure()
    ServerConfig(port=0, host="0.0.0.0", allow_insecure=True).check_exposure()
    ServerConfig(port=0, host="127.0.0.1").check_exposure()
    # Another listener of the service (the rollout gateway) is held to its server's settings.
    with pytest.raises(ConfigError, match=r"gateway\.host '0\.0\.0\.0' is reachable"):
        ServerConfig(port=0).check_exposure("0.0.0.0", setting="gateway.host")
    ServerConfig(port=0, auth_token_env="T").check_exposure("0.0.0.0", setting="gateway.host")
