"""TLS of one launch (`launcher.tls`): a certificate authority made by `turnrl up` or `run` for
this launch alone, and a server certificate from it for each node address the services run at,
so that the launch's bearer token and all gRPC traffic between nodes are encrypted.

The files live in one directory per launch, at the same path on every node
(LAUNCH_TLS_DIR_ENV names it; 0700, each file 0600): `ca.pem`, the CA's certificate, which
every caller verifies the services with; `server.pem` and `server-key.pem`, the certificate of
the node's own address (and loopback) and its key, which every service on that node serves
with. Only the launcher's machine holds the CA's key (`ca-key.pem`); a Ray actor gets its
node's files in its start arguments and writes them there. The launcher removes its
directory when the launch ends, each Ray actor its node's. The certificates themselves are
`certificates`'s, imported only by a launch that makes them (it needs `cryptography`).
"""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

from turnrl.config import ServerConfig
from turnrl.errors import ConfigError
from turnrl_cli.project_config import ProjectConfig

LAUNCH_TLS_DIR_ENV = "TURNRL_LAUNCH_TLS_DIR"
CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
SERVER_CERT = "server.pem"
SERVER_KEY = "server-key.pem"
LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")


def needs_launch_tls(project: ProjectConfig) -> bool:
    """Whether this launch serves TLS with certificates of its own, as `launcher.tls` says
    (on/true, off/false); for `auto`, on Ray (every service binds its node's address) when a
    service it starts has no `server.tls` of its own."""
    mode = project.launcher.tls
    if mode != "auto":
        return mode
    return project.launcher.kind == "ray" and any(
        project.server(name).tls is None for name in project.services_to_start()
    )


def launch_tls_overrides(project: ProjectConfig) -> list[str]:
    """Makes this launch's CA and directory, when it needs them (its children inherit
    LAUNCH_TLS_DIR_ENV; Ray actors are handed it), with this machine's server certificate
    for the local launcher; returns the overrides that make each service it starts without
    TLS of its own serve with its node's certificate."""
    if not needs_launch_tls(project):
        return []
    certificates = _certificates()
    directory = Path(tempfile.mkdtemp(prefix="turnrl-tls-"))
    ca_cert, ca_key = certificates.make_ca()
    _write(directory, {CA_CERT: ca_cert, CA_KEY: ca_key})
    os.environ[LAUNCH_TLS_DIR_ENV] = str(directory)
    started = project.services_to_start()
    if project.launcher.kind == "local":
        hosts = [project.server(name).host for name in started]
        _write(directory, node_files([*LOOPBACK_NAMES, *hosts]))
    return [
        override
        for name in started
        if project.server(name).tls is None
        for override in (
            f"{name}.server.tls.cert_file={directory / SERVER_CERT}",
            f"{name}.server.tls.key_file={directory / SERVER_KEY}",
        )
    ]


def launch_tls_dir() -> Path | None:
    """This launch's TLS directory; None when it serves no TLS of its own."""
    directory = os.environ.get(LAUNCH_TLS_DIR_ENV)
    return Path(directory) if directory else None


def trusted_ca_file(server: ServerConfig) -> Path | None:
    """The CA file a caller verifies `server` with: this launch's CA for a server with its
    certificate, else the server's own certificate (`server.tls` set by hand: self-signed);
    None for a server of plaintext."""
    if server.tls is None:
        return None
    directory = launch_tls_dir()
    if directory is not None and Path(server.tls.cert_file) == directory / SERVER_CERT:
        return directory / CA_CERT
    return server.tls.cert_file


def node_files(hosts: list[str]) -> dict[str, bytes]:
    """The files of a node whose services are reached at `hosts` (names or IP addresses;
    wildcard addresses are left out): the CA's certificate, and a server certificate for
    `hosts` issued by this launch's CA, with its key. Only on the launcher's machine."""
    directory = launch_tls_dir()
    assert directory is not None, "node_files needs this launch's TLS directory"
    ca_cert = (directory / CA_CERT).read_bytes()
    hosts = [host for host in hosts if not _is_wildcard(host)]
    cert, key = _certificates().server_certificate(
        ca_cert, (directory / CA_KEY).read_bytes(), hosts
    )
    return {CA_CERT: ca_cert, SERVER_CERT: cert, SERVER_KEY: key}


def write_node_files(directory: Path, files: dict[str, bytes]) -> None:
    """Writes a node's files (`node_files`) into the launch's `directory` on this node."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write(directory, files)


def remove_launch_tls_files() -> None:
    """Removes this launch's TLS directory from this machine, when it has one."""
    if (directory := launch_tls_dir()) is not None:
        shutil.rmtree(directory, ignore_errors=True)


def _write(directory: Path, files: dict[str, bytes]) -> None:
    """Each file readable by its owner only, replaced whole: services of one node that start
    while another actor there writes the same files never read half of one."""
    for name, content in files.items():
        descriptor, partial = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        try:
            with os.fdopen(descriptor, "wb") as out:
                out.write(content)
            os.replace(partial, directory / name)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            raise


def _is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::")


def _certificates() -> ModuleType:
    """`certificates`, imported only by a launch that makes TLS: it needs `cryptography`."""
    try:
        from turnrl_cli import certificates
    except ImportError as e:
        raise ConfigError(
            f"launcher.tls needs the cryptography package: pip install cryptography ({e}); "
            "or set launcher.tls: off (plaintext, for a private network)"
        ) from None
    return certificates
