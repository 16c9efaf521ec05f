"""TLS credentials of servers (`ServerConfig.tls`, mTLS with `client_ca_file`) and channels
(`ClientConfig.tls_*`), from PEM files."""

from pathlib import Path

import grpc

from turnrl import errors
from turnrl.config import ClientConfig, ServerConfig


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials:
    """The server's certificate and key; with `client_ca_file`, client certificates required."""
    assert config.tls is not None
    client_ca = config.tls.client_ca_file
    return grpc.ssl_server_credentials(
        [(_read_pem(config.tls.key_file), _read_pem(config.tls.cert_file))],
        root_certificates=_read_pem(client_ca) if client_ca else None,
        require_client_auth=client_ca is not None,
    )


def channel_credentials(config: ClientConfig) -> grpc.ChannelCredentials:
    """The CA to verify the server with, and the client certificate for mTLS when set."""
    assert config.tls_ca_file is not None
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(config.tls_ca_file),
        private_key=_read_pem(config.tls_key_file) if config.tls_key_file else None,
        certificate_chain=_read_pem(config.tls_cert_file) if config.tls_cert_file else None,
    )


def _read_pem(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise errors.ConfigError(f"cannot read TLS file {str(path)!r}: {e.strerror}") from e
