"""The entry's reloading certificate (services/common/entry_tls.py) without a server: a pair that does not
match refuses to start; a half-written swap (the new certificate, the old key) is left out and the current
pair keeps serving; the whole new pair is taken once, handed to gRPC's fetcher once, and to new HTTPS
handshakes through the listening context's callback."""

from __future__ import annotations

import contextlib
import shutil
import ssl
from pathlib import Path

import pytest

from services.common.config import EntryTlsConfig
from services.common.entry_tls import ReloadingCertificate
from services.common.errors import ConfigError
from tests.tls_certs import Certs, make_certs


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Certs, Certs]:
    root = tmp_path_factory.mktemp("pairs")
    return make_certs(root / "a"), make_certs(root / "b")


def install(directory: Path, cert: Path, key: Path) -> EntryTlsConfig:
    directory.mkdir(exist_ok=True)
    shutil.copyfile(cert, directory / "tls.crt")
    shutil.copyfile(key, directory / "tls.key")
    return EntryTlsConfig(cert_file=str(directory / "tls.crt"), key_file=str(directory / "tls.key"))


def test_a_mismatched_or_missing_pair_is_a_config_error(tmp_path: Path, pairs: tuple[Certs, Certs]) -> None:
    a, b = pairs
    with pytest.raises(ConfigError, match="cannot load"):
        ReloadingCertificate(install(tmp_path / "mixed", a.cert, b.key))
    with pytest.raises(ConfigError, match="cannot load"):
        ReloadingCertificate(
            EntryTlsConfig(cert_file=str(tmp_path / "no.crt"), key_file=str(tmp_path / "no.key"))
        )
    with pytest.raises(ValueError, match="both cert_file and key_file"):
        EntryTlsConfig(cert_file=str(a.cert))


def test_a_half_written_swap_is_left_out_and_the_whole_pair_taken_once(
    tmp_path: Path, pairs: tuple[Certs, Certs]
) -> None:
    a, b = pairs
    certificate = ReloadingCertificate(install(tmp_path, a.cert, a.key))
    first = certificate.fingerprint
    listening = certificate.server_context()
    assert certificate.check() is False and certificate._fetch_for_grpc() is None  # nothing changed
    shutil.copyfile(b.cert, tmp_path / "tls.crt")  # the certificate written, the key not yet
    assert certificate.check() is False and certificate.fingerprint == first
    shutil.copyfile(b.key, tmp_path / "tls.key")
    assert certificate.check() is True and certificate.fingerprint != first
    assert certificate.generation == 1
    assert certificate._fetch_for_grpc() is not None and certificate._fetch_for_grpc() is None
    assert listening.sni_callback is not None  # each handshake takes the current pair's context
    client = ssl.create_default_context(cafile=str(b.ca))
    assert handshake(listening, client) == b.cert.read_text().strip()


def handshake(server_context: ssl.SSLContext, client_context: ssl.SSLContext) -> str:
    """One in-memory TLS handshake; the PEM of the certificate the client was shown."""
    server_in, server_out, client_in, client_out = (ssl.MemoryBIO() for _ in range(4))
    server = server_context.wrap_bio(server_in, server_out, server_side=True)
    client = client_context.wrap_bio(client_in, client_out, server_hostname="localhost")
    for _ in range(10):
        for side in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        server_in.write(client_out.read())
        client_in.write(server_out.read())
    der = client.getpeercert(binary_form=True)
    assert der is not None
    return ssl.DER_cert_to_PEM_cert(der).strip()
