"""TLS at the entry (issue 55, docs/deploy.md "Entry TLS"): a real codec process with server.tls in front of
the running stack's router, its certificate laid out as Kubernetes mounts a Secret (tls.crt and tls.key
linked through a `..data` symlink to a timestamped directory). The strict openai SDK over HTTPS and a gRPC
client over TLS, both trusting only the test CA, get answers; plaintext to either TLS port fails at once
and leaves the codec serving; a certificate of another CA swapped in as the kubelet swaps a Secret (one
atomic rename of `..data`) is served to new connections without a restart, and the old CA then fails."""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from openai import OpenAI

from services.proto_gen.kvrelay.v1 import public_pb2 as pb
from services.proto_gen.kvrelay.v1 import public_pb2_grpc
from tests.e2e.conftest import TOKEN, RunningStack
from tests.stack_helpers import Proc, free_port, stack_env, wait_until
from tests.tls_certs import Certs, make_certs

pytestmark = pytest.mark.model


@dataclass
class TlsCodec:
    https_url: str
    grpc_address: str
    mount: Path  # the Secret's mount: tls.crt, tls.key -> ..data/...
    proc: Proc


def mount_secret(mount: Path, certs: Certs, generation: int) -> None:
    """Lays `certs` out as the kubelet does: a timestamped directory, `..data` pointing at it (swapped by
    one rename), and tls.crt/tls.key linking through `..data`."""
    target = mount / f"..2026_12_07_{generation}"
    target.mkdir(parents=True)
    (target / "tls.crt").write_bytes(certs.cert.read_bytes())
    (target / "tls.key").write_bytes(certs.key.read_bytes())
    staging = mount / "..data_tmp"
    staging.symlink_to(target.name)
    os.replace(staging, mount / "..data")  # atomic, as the kubelet's swap
    for name in ("tls.crt", "tls.key"):
        if not (mount / name).is_symlink():
            (mount / name).symlink_to(f"..data/{name}")


@pytest.fixture(scope="module")
def cas(tmp_path_factory: pytest.TempPathFactory) -> tuple[Certs, Certs]:
    root = tmp_path_factory.mktemp("entry-ca")
    return make_certs(root / "first"), make_certs(root / "second")


@pytest.fixture(scope="module")
def codec(
    stack: RunningStack, model_dir: Path, cas: tuple[Certs, Certs], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TlsCodec]:
    mount = tmp_path_factory.mktemp("entry-tls") / "secret"
    mount.mkdir()
    mount_secret(mount, cas[0], 1)
    port, grpc_port = free_port(), free_port()
    env = stack_env(
        TOKEN,
        KVRELAY_SERVER__TLS__CERT_FILE=str(mount / "tls.crt"),
        KVRELAY_SERVER__TLS__KEY_FILE=str(mount / "tls.key"),
        KVRELAY_SERVER__TLS__RELOAD_INTERVAL_S="0.2",
    )
    command = ["codec", "--model", str(model_dir), "--router", stack.router_address]
    command += ["--port", str(port), "--grpc-port", str(grpc_port)]
    proc = Proc(command, env, mount.parent / "codec.log")
    url = f"https://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(url, cas[0]), 120, f"the codec over HTTPS:\n{proc.log()[-2000:]}")
        yield TlsCodec(url, f"127.0.0.1:{grpc_port}", mount, proc)
    finally:
        proc.stop()


def trusting(certs: Certs) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certs.ca))


def answers(url: str, certs: Certs) -> bool:
    """Whether a new connection trusting only `certs`' CA gets /ready's 200."""
    try:
        with httpx.Client(verify=trusting(certs), timeout=5.0) as client:
            return client.get(f"{url}/ready").status_code == 200
    except httpx.HTTPError:
        return False


def grpc_chat(address: str, certs: Certs) -> str:
    credentials = grpc.ssl_channel_credentials(certs.ca.read_bytes())
    with grpc.secure_channel(address, credentials) as channel:
        request = pb.ChatRequest(
            messages=[pb.ChatMessage(role="user", content="What is the capital of France?")],
            sampling=pb.SamplingOptions(max_tokens=4, temperature=0.0),
        )
        replies = list(public_pb2_grpc.InferenceStub(channel).Chat(request, timeout=60))
    return "".join(reply.text for reply in replies)


def grpc_answers(address: str, certs: Certs) -> bool:
    try:
        return bool(grpc_chat(address, certs))
    except grpc.RpcError:
        return False


def test_the_openai_sdk_over_https_and_grpc_over_tls(codec: TlsCodec, cas: tuple[Certs, Certs]) -> None:
    with httpx.Client(verify=trusting(cas[0])) as http_client:
        api = OpenAI(
            base_url=f"{codec.https_url}/v1",
            api_key="unused",
            max_retries=0,
            _strict_response_validation=True,
            http_client=http_client,
        )
        reply = api.chat.completions.create(
            model=api.models.list().data[0].id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=4,
            temperature=0,
        )
    assert reply.choices[0].message.content
    assert grpc_chat(codec.grpc_address, cas[0])
    assert not answers(codec.https_url, cas[1]), "a client trusting another CA must refuse it"


def test_plaintext_to_the_tls_ports_fails_at_once_and_the_codec_serves_on(
    codec: TlsCodec, cas: tuple[Certs, Certs]
) -> None:
    plain = codec.https_url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/ready", timeout=10.0)
    with grpc.insecure_channel(codec.grpc_address) as channel:
        stub = public_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")]), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert codec.proc.popen.poll() is None
    assert answers(codec.https_url, cas[0]) and grpc_answers(codec.grpc_address, cas[0])


def test_a_swapped_certificate_is_served_without_a_restart(codec: TlsCodec, cas: tuple[Certs, Certs]) -> None:
    pid = codec.proc.popen.pid
    mount_secret(codec.mount, cas[1], 2)
    wait_until(lambda: answers(codec.https_url, cas[1]), 30, "HTTPS with the new certificate")
    wait_until(lambda: grpc_answers(codec.grpc_address, cas[1]), 30, "gRPC with the new certificate")
    assert not answers(codec.https_url, cas[0]) and not grpc_answers(codec.grpc_address, cas[0])
    assert codec.proc.popen.pid == pid and codec.proc.popen.poll() is None
    assert "entry TLS: certificate reloaded" in codec.proc.log()
