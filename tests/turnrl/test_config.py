"""Config loading: defaults, the example file, overrides, and errors that name the key."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from turnrl.config import DEFAULT_PORTS, ClientConfig, ServerConfig
from turnrl.errors import ConfigError
from turnrl_cli.project_config import ProjectConfig, load_project_config

from ..conftest import EXAMPLE_CONFIG


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_bind_loopback_on_default_ports():
    project = load_project_config(None)
    servers = {
        "tool": project.tool.server,
        "reward": project.reward.server,
        "rollout": project.rollout.server,
        "trainer": project.trainer.server,
    }
    assert {name: s.port for name, s in servers.items()} == DEFAULT_PORTS
    assert {s.host for s in servers.values()} == {"127.0.0.1"}
    assert all(s.tls is None and s.auth_token_env is None for s in servers.values())


def test_example_config_loads():
    project = load_project_config(EXAMPLE_CONFIG)
    assert project.rollout.server.port == DEFAULT_PORTS["rollout"]


def test_a_config_varies_its_base_file_key_by_key(tmp_path):
    async_example = EXAMPLE_CONFIG.parent / "async.yaml"
    project = load_project_config(async_example, ["trainer.async_loop.max_staleness=4"])
    base = load_project_config(EXAMPLE_CONFIG)
    assert project.trainer.loop == "async" and project.trainer.async_loop.max_staleness == 4
    assert project.trainer.algorithm.importance_sampling == "truncate"
    # What async.yaml leaves out is the base file's, down to keys beside those it sets.
    assert project.trainer.algorithm.mini_batches == base.trainer.algorithm.mini_batches == 2
    assert project.trainer.rollout == base.trainer.rollout and project.tool == base.tool
    assert project.trainer.run_name == "calculator-async"

    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle of config files"):
        load_project_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.yaml"):
        load_project_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("base: [a.yaml]\n")
    with pytest.raises(ConfigError, match="must name a config file"):
        load_project_config(tmp_path / "d.yaml")


def test_override_sets_typed_values():
    project = load_project_config(
        EXAMPLE_CONFIG, ["tool.server.port=0", "trainer.server.shutdown_grace_seconds=2.5"]
    )
    assert project.tool.server.port == 0
    assert project.trainer.server.shutdown_grace_seconds == 2.5


def test_unknown_key_in_file_names_key_file_and_known_keys(tmp_path):
    path = write(tmp_path, "tool:\n  server:\n    prot: 1\n")
    with pytest.raises(ConfigError) as info:
        load_project_config(path)
    message = str(info.value)
    assert str(path) in message
    assert "'tool.server.prot'" in message
    assert "'port'" in message  # the known keys are listed


def test_unknown_section_lists_sections(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'rewards'.*'reward'"):
        load_project_config(write(tmp_path, "rewards: {}\n"))


def test_bad_value_names_key_file_and_value(tmp_path):
    path = write(tmp_path, "reward:\n  server:\n    port: not-a-port\n")
    with pytest.raises(ConfigError) as info:
        load_project_config(path)
    message = str(info.value)
    assert str(path) in message and "reward.server.port" in message and "'not-a-port'" in message


def test_out_of_range_value_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"tool\.server\.port.*70000"):
        load_project_config(write(tmp_path, "tool: {server: {port: 70000}}\n"))


def test_bad_override_key_names_the_override(tmp_path):
    path = write(tmp_path, "tool: {server: {port: 1}}\n")
    with pytest.raises(ConfigError) as info:
        load_project_config(path, ["tool.server.hots=0.0.0.0"])
    message = str(info.value)
    assert "override 'tool.server.hots=0.0.0.0'" in message
    assert str(path) not in message


@pytest.mark.parametrize("override", ["no-equals-sign", "=1", "tool..port=1"])
def test_malformed_override_is_rejected(override):
    with pytest.raises(ConfigError, match="bad override"):
        load_project_config(None, [override])


def test_override_through_a_scalar_is_rejected():
    with pytest.raises(ConfigError, match=r"'tool.server.port' is 1, not a section"):
        load_project_config(None, ["tool.server.port=1", "tool.server.port.x=2"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("tool: [\n", "not valid YAML"), ("- 1\n- 2\n", "top level must be a mapping")],
)
def test_malformed_file_is_rejected(tmp_path, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_project_config(write(tmp_path, text))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config file .*nope\.yaml"):
        load_project_config(tmp_path / "nope.yaml")


def test_config_is_frozen():
    project = ProjectConfig()
    with pytest.raises(ValidationError):
        project.tool.server.port = 1


def test_auth_token_env_must_be_set(monkeypatch):
    monkeypatch.delenv("TURNRL_TEST_UNSET_TOKEN", raising=False)
    server = ServerConfig(port=1, auth_token_env="TURNRL_TEST_UNSET_TOKEN")
    with pytest.raises(ConfigError, match="TURNRL_TEST_UNSET_TOKEN"):
        server.auth_token()
    monkeypatch.setenv("TURNRL_TEST_UNSET_TOKEN", "s3cret")
    assert server.auth_token() == "s3cret"


def test_client_certificate_needs_key_and_ca(tmp_path):
    with pytest.raises(ValidationError, match="set together"):
        ClientConfig(address="x:1", tls_cert_file=tmp_path / "c.pem")
    with pytest.raises(ValidationError, match="needs tls_ca_file"):
        ClientConfig(address="x:1", tls_cert_file=tmp_path / "c", tls_key_file=tmp_path / "k")


@pytest.mark.parametrize(
    ("overrides", "started"),
    [
        ([], ["tool", "reward", "rollout", "trainer"]),
        (["rollout.tool_service.address=10.0.0.2:1"], ["reward", "rollout", "trainer"]),
        (["rollout.reward_service.address=10.0.0.3:1"], ["tool", "rollout", "trainer"]),
        # An external rollout service calls its own tool and reward services: none is started.
        (["trainer.rollout_service.address=10.0.0.4:1"], ["trainer"]),
        (["trainer_service.address=10.0.0.5:1", "trainer.rollout_service.address=10.0.0.4:1"], []),
        (["trainer.mode=sft"], ["trainer"]),
        (["trainer.mode=sft", "trainer_service.address=10.0.0.5:1"], []),
    ],
)
def test_services_to_start_are_those_the_config_does_not_point_at(overrides, started):
    assert load_project_config(None, overrides).services_to_start() == started


def test_an_external_trainer_calling_a_local_rollout_service_is_rejected():
    with pytest.raises(ConfigError, match=r"also set trainer\.rollout_service"):
        load_project_config(None, ["trainer_service.address=10.0.0.5:1"]).services_to_start()
    # The trainer no longer calls the tool service: the setting is gone, not ignored.
    with pytest.raises(ConfigError, match="tool_service"):
        load_project_config(None, ["trainer.tool_service.address=10.0.0.2:1"])
