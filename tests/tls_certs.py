"""A throwaway CA and one certificate for every internal service, made with the openssl CLI (tests only)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path

    def env(self) -> dict[str, str]:
        return {
            "KVRELAY_INTERNAL_TLS__CA_FILE": str(self.ca),
            "KVRELAY_INTERNAL_TLS__CERT_FILE": str(self.cert),
            "KVRELAY_INTERNAL_TLS__KEY_FILE": str(self.key),
        }


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(directory: Path, name: str = "service", san: str = "IP:127.0.0.1,DNS:localhost") -> Certs:
    """A CA, and a certificate for `san` (127.0.0.1/localhost) usable as server and client."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=kvrelay-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=directory,
    )
    (directory / f"{name}.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=directory,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.pem",
        cwd=directory,
    )
    return Certs(directory / "ca.pem", directory / f"{name}.pem", directory / f"{name}.key")
