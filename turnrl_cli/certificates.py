"""X.509 certificates for a launch's TLS (`launch_tls`): a CA, and server certificates it
signs for a node's addresses; EC P-256 keys, PEM bytes in and out (the `cryptography`
package)."""

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# A CA signs certificates, nothing else.
_CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=False, content_commitment=False, key_encipherment=False,
    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
    encipher_only=False, decipher_only=False,
)  # fmt: skip
# Long enough for any run; the CA and its certificates die with the launch anyway.
VALID_DAYS = 365


def make_ca() -> tuple[bytes, bytes]:
    """A new CA of its own: its certificate and its key, PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "turnrl launch CA")])
    cert = (
        _valid_now(x509.CertificateBuilder())
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_KEY_USAGE, critical=True)
        .sign(key, hashes.SHA256())
    )
    return _pem(cert), _key_pem(key)


def server_certificate(
    ca_cert_pem: bytes, ca_key_pem: bytes, hosts: list[str]
) -> tuple[bytes, bytes]:
    """A server certificate for `hosts` (names or IP addresses, IPv6 with or without
    brackets) signed by the CA, and its key, PEM."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, None)
    key = ec.generate_private_key(ec.SECP256R1())
    names = [_subject_name(host) for host in dict.fromkeys(hosts)]
    cert = (
        _valid_now(x509.CertificateBuilder())
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "turnrl service")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _pem(cert), _key_pem(key)


def _valid_now(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    """From a few minutes ago (clocks of nodes differ a little) for VALID_DAYS."""
    now = datetime.datetime.now(datetime.UTC)
    return (
        builder.serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _subject_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
