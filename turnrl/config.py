"""Config building blocks shared by every service, the YAML loader, and the only env reads.

A turnrl config is one YAML file with a section per service (`tool`, `reward`, `rollout`,
`trainer`); each section is a pydantic model in that service's `config.py`, assembled in
`turnrl_cli.project_config`. `key.sub=value` overrides on the command line are applied on top of the
file. Every model here forbids unknown keys and is frozen; every field states its units.
"""

import ipaddress
import os
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from turnrl.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PORTS = {"tool": 50051, "reward": 50052, "rollout": 50053, "trainer": 50054}
# Environment variable the CLI's clients read a bearer token from, when set.
CLIENT_TOKEN_ENV = "TURNRL_AUTH_TOKEN"

ModelT = TypeVar("ModelT", bound=BaseModel)
# The top-level key of a config file that names the file it varies (`_read_config_file`).
BASE_KEY = "base"


class StrictModel(BaseModel):
    """Base of every config model: unknown keys and wrong types fail at start-up."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TlsConfig(StrictModel):
    """Server-side TLS. With `client_ca_file` set, clients must present a certificate (mTLS)."""

    cert_file: Path = Field(description="PEM certificate chain of this server.")
    key_file: Path = Field(description="PEM private key of `cert_file`.")
    client_ca_file: Path | None = Field(
        default=None,
        description="PEM CA bundle that client certificates must chain to; None: no mTLS.",
    )


class ServerConfig(StrictModel):
    """How a service listens: address, message limits, security, shutdown."""

    host: str = Field(
        default="127.0.0.1",
        description="Interface to bind. 127.0.0.1 keeps the service private to this machine; "
        "any other address exposes it, and needs `tls` or `auth_token_env` (or "
        "`allow_insecure`).",
    )
    port: int = Field(
        ge=0, le=65535, description="TCP port; 0 picks a free one (printed at start)."
    )
    max_message_bytes: int = Field(
        default=64 * 1024 * 1024, gt=0, description="Largest request or response message, in bytes."
    )
    max_concurrent_rpcs: int | None = Field(
        default=None, gt=0, description="RPCs served at once; more are refused. None: unlimited."
    )
    shutdown_grace_seconds: float = Field(
        default=10.0,
        ge=0,
        description="On SIGTERM/SIGINT, seconds in-flight RPCs get to finish before cancellation.",
    )
    tls: TlsConfig | None = Field(default=None, description="TLS settings; None serves plaintext.")
    auth_token_env: str | None = Field(
        default=None,
        description="Name of an environment variable holding the bearer token every RPC must "
        "carry (health checks excepted). None: no authentication.",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Port of the Prometheus /metrics HTTP endpoint, on `host`; 0 picks a free "
        "one (printed at start). None: no endpoint.",
    )
    allow_insecure: bool = Field(
        default=False,
        description="Serve an address other machines can reach with neither TLS nor a token: "
        "anyone who reaches it can run tools, push weights or start runs. Only for a network "
        "that is private already (a compose network published on loopback).",
    )

    def auth_token(self) -> str | None:
        """The bearer token this server requires, read from `auth_token_env`."""
        return read_secret_env(self.auth_token_env) if self.auth_token_env else None

    def check_exposure(self, host: str | None = None, setting: str = "server.host") -> None:
        """Raises ConfigError, saying why and what to do, when the server would listen where
        other machines reach it with neither TLS nor a token, unless `allow_insecure`.

        `host` and `setting` name another listener of the same service that serves with
        these settings (the rollout service's gateway: `gateway.host`); None: this server's."""
        host = self.host if host is None else host
        if is_loopback(host) or self.tls or self.auth_token_env or self.allow_insecure:
            return
        raise ConfigError(
            f"{setting} {host!r} is reachable from other machines, and the service "
            "would have neither TLS (server.tls) nor a bearer token (server.auth_token_env): "
            "anyone who reaches it could run code in its tools, push weights, start runs or "
            "sample from the policy. "
            "Set one of them (`turnrl up` and `run` make a token for the services they start: "
            "launcher.auth_token), bind 127.0.0.1, or set server.allow_insecure: true on a "
            "network that is private already"
        )


class HttpJsonServerConfig(ServerConfig):
    """How the tool or reward service listens: its gRPC server, and, with `http_port`, the
    same methods as JSON over HTTP beside it (turnrl.rpc.http_json), on `host`, with this
    server's TLS, token and message limit. The rollout and trainer services take a plain
    ServerConfig, which refuses `http_port` as an unknown key."""

    http_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Port of the HTTP/JSON transcoding of the service's methods (POST "
        "/v1/<Service>/<Method>, OpenAPI at /openapi.json), on `host`; 0 picks a free one "
        "(printed at start). None: gRPC only.",
    )


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address, IPv6 with or without brackets) is this
    machine's loopback, which no other machine reaches."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another name: it may resolve to anything
        return False


class ClientConfig(StrictModel):
    """How a service or the CLI calls another service."""

    address: str = Field(
        description="host:port of the service, or of several replicas of it, comma-separated "
        "(`host1:port1,host2:port2`): the caller spreads its calls over them "
        "(turnrl.replicas.ReplicaSet)."
    )
    timeout_seconds: float = Field(
        default=30.0, gt=0, description="Deadline of a unary call that sets none, in seconds."
    )
    max_attempts: int = Field(
        default=3, ge=1, description="Tries of an idempotent call that fails with UNAVAILABLE."
    )
    keepalive_seconds: float = Field(
        default=30.0, gt=0, description="Interval of HTTP/2 keepalive pings, in seconds."
    )
    max_message_bytes: int = Field(
        default=64 * 1024 * 1024, gt=0, description="Largest message sent or received, in bytes."
    )
    tls_ca_file: Path | None = Field(
        default=None, description="PEM CA bundle to verify the server with; None: plaintext."
    )
    tls_cert_file: Path | None = Field(
        default=None, description="PEM client certificate, for servers that require mTLS."
    )
    tls_key_file: Path | None = Field(default=None, description="PEM key of `tls_cert_file`.")
    tls_server_name: str | None = Field(
        default=None, description="Name to verify the server certificate against; None: the host."
    )
    auth_token_env: str | None = Field(
        default=None, description="Name of an environment variable holding the bearer token."
    )

    @field_validator("address")
    @classmethod
    def _addresses_well_formed(cls, address: str) -> str:
        entries = _split_addresses(address)
        if not all(entries):
            raise ValueError(
                f"address {address!r} has an empty entry; expected host:port, or several "
                "comma-separated"
            )
        repeated = sorted({entry for entry in entries if entries.count(entry) > 1})
        if repeated:
            raise ValueError(f"address {address!r} lists {repeated} more than once")
        return address

    @model_validator(mode="after")
    def _tls_files_consistent(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be set together")
        if self.tls_cert_file is not None and self.tls_ca_file is None:
            raise ValueError("a client certificate needs tls_ca_file (mTLS runs over TLS)")
        return self

    def addresses(self) -> list[str]:
        """The replicas `address` names, in its order: one for a single service."""
        return _split_addresses(self.address)

    def for_address(self, address: str) -> "ClientConfig":
        """This config naming one replica, `address`, alone."""
        return self.model_copy(update={"address": address})

    def auth_token(self) -> str | None:
        """The bearer token to send, read from `auth_token_env`."""
        return read_secret_env(self.auth_token_env) if self.auth_token_env else None


def _split_addresses(address: str) -> list[str]:
    return [entry.strip() for entry in address.split(",")]


def rubric_placeholders(rubric: str) -> set[str]:
    """The field names of a `str.format` template; ValueError when it is malformed."""
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(rubric)]
    except ValueError as e:
        raise ValueError(f"rubric is not a valid template ({e}); double literal braces") from None
    return {field for field in fields if field is not None}


def read_secret_env(name: str) -> str:
    """The value of environment variable `name`; ConfigError when it is unset or empty."""
    value = os.environ.get(name, "")
    if not value:
        raise ConfigError(f"environment variable {name!r} is unset or empty; it must hold a token")
    return value


def client_token_from_env() -> str | None:
    """The bearer token the CLI sends, from TURNRL_AUTH_TOKEN; None when unset."""
    return os.environ.get(CLIENT_TOKEN_ENV) or None


def fixtures_dir() -> Path:
    """Test fixtures (tokenizers, chat templates, datasets): $TURNRL_FIXTURES or ../shared/fixtures."""
    return Path(os.environ.get("TURNRL_FIXTURES", REPO_ROOT.parent / "shared" / "fixtures"))


def cache_dir() -> Path:
    """Where built artefacts (the tiny model, search indexes) are cached: $TURNRL_CACHE or
    ~/.cache/turnrl."""
    return Path(os.environ.get("TURNRL_CACHE", Path.home() / ".cache" / "turnrl"))


def load_config_data(path: Path | None, overrides: Sequence[str]) -> tuple[dict[str, Any], dict]:
    """Reads the YAML file (None: empty), over the file its `base:` key names, if any, and
    applies `key.sub=value` overrides.

    Returns the merged data and the overrides as {dotted key: original text}, which
    `validate_config` uses to say whether a bad key came from the file or the command line.
    """
    data = _read_config_file(Path(path), ()) if path is not None else {}
    applied: dict[str, str] = {}
    for override in overrides:
        key, value = _parse_override(override)
        _set_dotted(data, key, value, override)
        applied[key] = override
    return data, applied


def _read_config_file(path: Path, children: tuple[Path, ...]) -> dict[str, Any]:
    """A config file's mapping. A top-level `base: other.yaml` (relative to the file) makes it
    a variant of that file: its own keys are merged over the base's, mappings key by key, any
    other value replacing the base's."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
    data = loaded or {}
    if BASE_KEY not in data:
        return data
    base = data.pop(BASE_KEY)
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: `{BASE_KEY}` must name a config file, got {base!r}")
    base_path = path.parent / base
    if base_path.resolve() in {p.resolve() for p in (*children, path)}:
        raise ConfigError(f"{path}: `{BASE_KEY}: {base}` makes a cycle of config files")
    return _merged(_read_config_file(base_path, (*children, path)), data)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def validate_config(
    model: type[ModelT], data: Mapping[str, Any], *, path: Path | None, overrides: Mapping[str, str]
) -> ModelT:
    """`model` validated from `data`; ConfigError naming every bad key and where it was set."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = [_describe(model, err, path, overrides) for err in e.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems)) from None


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override {text!r}; expected key.sub=value, e.g. tool.server.port=0")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _set_dotted(data: dict[str, Any], key: str, value: Any, override: str) -> None:
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parents[: i + 1])
            raise ConfigError(f"override {override!r}: {where!r} is {child!r}, not a section")
        node = child
    node[leaf] = value


def _describe(
    model: type[BaseModel], err: Any, path: Path | None, overrides: Mapping[str, str]
) -> str:
    loc = [str(part) for part in err["loc"]]
    key = ".".join(loc)
    source = next(
        (
            f"override {text!r}"
            for k, text in overrides.items()
            if key == k or key.startswith(k + ".")
        ),
        str(path) if path is not None else "defaults",
    )
    if err["type"] == "extra_forbidden":
        known = _known_keys(model, loc[:-1])
        return f"{source}: unknown key {key!r}; known keys here: {known}"
    return f"{source}: {key}: {err['msg']} (got {err['input']!r})"


def _known_keys(model: type[BaseModel], loc: Sequence[str]) -> list[str]:
    for part in loc:
        field = model.model_fields.get(part)
        inner = _model_in(field.annotation) if field else None
        if inner is None:
            return []
        model = inner
    return sorted(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
