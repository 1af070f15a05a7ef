"""The chart secure by default: no render without API keys (or auth.allowOpen said out loud), the bundled
Redis behind a password from a kept Secret and optionally TLS only, stored Responses in a database and
under a key prefix of their own, and internal mutual TLS mounted into every kvrelay container (its
certificate from a Secret or a cert-manager Certificate, its gRPC probes speaking TLS).

Two checks run what the chart renders: the bundled Redis's command line (password and TLS) as a local
redis-server, reached through the codec's rendered URLs with redis-py; and a worker's TLS probe command
against a local gRPC health server that requires client certificates. The rest inspect rendered objects
(tests/deploy/chart.py); test_helm_render.py validates the "secure" combo's every object.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.config import load_config
from services.common.grpc_tls import is_enabled
from tests.deploy import chart, local_redis
from tests.deploy.chart import (
    container,
    effective_config_env,
    env_of,
    find,
    fullname,
    helm_error,
    one,
    pod_spec,
    render,
    render_notes,
    secret_env,
)
from tests.deploy.local_redis import secret_dir
from tests.stack_helpers import REPO_ROOT
from tests.tls_certs import Certs, make_certs

TLS_SECRET = "kvrelay-internal-tls"
INTERNAL_TLS = {"internalTls": {"enabled": True, "existingSecret": TLS_SECRET}}
CERT_MANAGER = {
    "internalTls": {
        "enabled": True,
        "certManager": {"enabled": True, "issuerRef": {"name": "kvrelay-ca", "kind": "ClusterIssuer"}},
    },
    "paired": {"enabled": True},
    "gpu": {"enabled": False},
}
REDIS_TLS = {"redis": {"tls": {"enabled": True, "existingSecret": "kvrelay-redis-tls"}}}


def redis_container(objects: list[dict]) -> dict:
    return container(objects, "redis")


def server_containers(objects: list[dict]) -> list[tuple[str, dict]]:
    """(stage, container) of every kvrelay server container rendered, a paired pod's two included."""
    out = []
    for d in find(objects, "Deployment"):
        stage = d["metadata"]["labels"]["app.kubernetes.io/component"]
        if stage != "redis":
            out += [(stage, c) for c in d["spec"]["template"]["spec"]["containers"]]
    return out


# -- API keys or an explicit open mode ---------------------------------------------------------------------


def test_default_render_fails_naming_both_ways_out() -> None:
    """`helm template` with the chart's own values: no API keys, so no render."""
    with pytest.raises(helm_error()) as refused:
        render(base=False)
    assert "auth.existingSecret" in str(refused.value) and "auth.allowOpen" in str(refused.value)
    render({"auth": {"existingSecret": "keys"}}, base=False)
    render({"auth": {"allowOpen": True}}, base=False)


def test_open_mode_is_said_in_the_config_and_the_notes(tmp_path: Path) -> None:
    objects = render({"auth": {"allowOpen": True}})
    path = tmp_path / "config.yaml"
    path.write_text(chart.config_yaml(objects))
    cfg = load_config(path, effective_config_env(container(objects, "codec")))
    assert cfg.auth.allow_open is True and cfg.auth.keys_file is None
    assert "api-keys" not in {v["name"] for v in pod_spec(objects, "codec")["volumes"]}
    assert "open mode" in render_notes({"auth": {"allowOpen": True}})
    assert "open mode" not in render_notes()


def test_keys_win_over_allow_open(tmp_path: Path) -> None:
    objects = render({"auth": {"existingSecret": "keys", "allowOpen": True}})
    auth = yaml.safe_load(chart.config_yaml(objects))["auth"]
    assert auth == {"keys_file": "/etc/kvrelay/keys/keys.yaml"}  # no allow_open beside a keys file


# -- the bundled Redis: a password from a kept Secret ------------------------------------------------------


def test_bundled_redis_password_comes_from_a_kept_secret() -> None:
    objects = render()
    secret = one(objects, "Secret", fullname("redis-auth"))
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # reused on upgrade
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)  # goes into URLs as it is
    redis = redis_container(objects)
    assert redis["command"] == ["redis-server"]
    assert chart.arg_value(redis["args"], "--requirepass") == "$(REDIS_PASSWORD)"
    assert secret_env(redis, "REDIS_PASSWORD") == {"name": fullname("redis-auth"), "key": "password"}
    assert env_of(redis)["REDISCLI_AUTH"]["value"] == "$(REDIS_PASSWORD)"  # the probe's redis-cli
    codec = container(objects, "codec")
    names = [e["name"] for e in codec["env"]]
    assert secret_env(codec, "REDIS_PASSWORD") == {"name": fullname("redis-auth"), "key": "password"}
    for url_name in ("KVRELAY_QUOTAS__REDIS_URL", "KVRELAY_RESPONSES__REDIS_URL"):
        # the kubelet expands $(VAR) only from variables defined before it
        assert names.index("REDIS_PASSWORD") < names.index(url_name)
        assert env_of(codec)[url_name]["value"].startswith("redis://:$(REDIS_PASSWORD)@")


def test_bundled_redis_password_from_an_existing_secret() -> None:
    objects = render({"redis": {"auth": {"existingSecret": "my-redis", "key": "pw"}}})
    assert not find(objects, "Secret", fullname("redis-auth"))
    for ctr in (redis_container(objects), container(objects, "codec")):
        assert secret_env(ctr, "REDIS_PASSWORD") == {"name": "my-redis", "key": "pw"}


def test_responses_have_their_own_database_and_key_prefix() -> None:
    objects = render({"redis": {"responsesKeyPrefix": "team-a:responses:"}})
    env = env_of(container(objects, "codec"))
    assert env["KVRELAY_QUOTAS__REDIS_URL"]["value"].endswith(":6379/0")
    assert env["KVRELAY_RESPONSES__REDIS_URL"]["value"].endswith(":6379/1")
    assert yaml.safe_load(chart.config_yaml(objects))["responses"] == {"key_prefix": "team-a:responses:"}
    external = {"enabled": False, "external": {"url": "redis://r:6379/0", "responsesUrl": "redis://r:6379/5"}}
    env = env_of(container(render({"redis": external}), "codec"))
    assert env["KVRELAY_RESPONSES__REDIS_URL"]["value"] == "redis://r:6379/5"
    assert env["KVRELAY_QUOTAS__REDIS_URL"]["value"] == "redis://r:6379/0"
    external = {"enabled": False, "external": {"existingSecret": "urls", "responsesKey": "responses"}}
    codec = container(render({"redis": external}), "codec")
    assert secret_env(codec, "KVRELAY_RESPONSES__REDIS_URL") == {"name": "urls", "key": "responses"}
    assert secret_env(codec, "KVRELAY_QUOTAS__REDIS_URL") == {"name": "urls", "key": "url"}


def test_redis_tls_serves_tls_only_and_the_codec_checks_its_certificate() -> None:
    objects = render(REDIS_TLS)
    args = redis_container(objects)["args"]
    assert chart.arg_value(args, "--port") == "0" and chart.arg_value(args, "--tls-port") == "6379"
    tls_dir = "/etc/redis/tls"
    assert chart.arg_value(args, "--tls-cert-file") == f"{tls_dir}/tls.crt"
    tls_volume = next(v for v in pod_spec(objects, "redis")["volumes"] if v["name"] == "tls")
    assert tls_volume["secret"]["secretName"] == "kvrelay-redis-tls"
    codec = container(objects, "codec")
    url = env_of(codec)["KVRELAY_QUOTAS__REDIS_URL"]["value"]
    assert (
        url
        == f"rediss://:$(REDIS_PASSWORD)@{fullname('redis')}:6379/0?ssl_ca_certs=/etc/kvrelay/redis-tls/ca.crt"
    )
    volume = next(v for v in pod_spec(objects, "codec")["volumes"] if v["name"] == "redis-tls")
    assert volume["secret"] == {
        "secretName": "kvrelay-redis-tls",
        "defaultMode": 0o440,
        "items": [{"key": "ca.crt", "path": "ca.crt"}],  # the CA only, not Redis's key
    }
    # without a Secret of its own, Redis serves the internal TLS certificate (which names it)
    both = render({**INTERNAL_TLS, "redis": {"tls": {"enabled": True}}})
    tls_volume = next(v for v in pod_spec(both, "redis")["volumes"] if v["name"] == "tls")
    assert tls_volume["secret"]["secretName"] == TLS_SECRET


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    # what the chart's certificate carries: the services' names (here localhost), 127.0.0.1 for the
    # probes, and internalTls.serverName, which clients check instead of the pod IP they dial
    return make_certs(tmp_path_factory.mktemp("certs"), san="IP:127.0.0.1,DNS:localhost,DNS:kvrelay-internal")


@pytest.fixture
def redis_tls(certs: Certs, tmp_path: Path) -> Iterator[tuple[list[dict], int, Path, str]]:
    """The rendered bundled Redis (password, TLS) running here: objects, port, local CA dir, password."""
    objects = render(REDIS_TLS)
    password = base64.b64decode(one(objects, "Secret", fullname("redis-auth"))["data"]["password"]).decode()
    local_tls = secret_dir(certs, tmp_path / "tls")
    with local_redis.running(redis_container(objects), password, local_tls, tmp_path) as port:
        yield objects, port, local_tls, password


def test_bundled_redis_runs_with_password_and_tls(redis_tls: tuple[list[dict], int, Path, str]) -> None:
    import redis

    objects, port, local_tls, password = redis_tls
    env = env_of(container(objects, "codec"))

    def local(url: str, with_password: str = password) -> str:
        url = url.replace("$(REDIS_PASSWORD)", with_password)
        return url.replace(f"{fullname('redis')}:6379", f"127.0.0.1:{port}").replace(
            "/etc/kvrelay/redis-tls", str(local_tls)
        )

    quotas = redis.Redis.from_url(local(env["KVRELAY_QUOTAS__REDIS_URL"]["value"]))
    responses = redis.Redis.from_url(local(env["KVRELAY_RESPONSES__REDIS_URL"]["value"]))
    responses.set("kvrelay:responses:resp_1", "stored")
    assert responses.get("kvrelay:responses:resp_1") == b"stored"
    assert quotas.get("kvrelay:responses:resp_1") is None  # another database
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(local(env["KVRELAY_QUOTAS__REDIS_URL"]["value"], "wrong")).ping()
    with pytest.raises(redis.ConnectionError):  # no plaintext port
        redis.Redis.from_url(f"redis://:{password}@127.0.0.1:{port}/0", socket_timeout=1).ping()
    # the readiness probe, as the kubelet runs it in the container
    result = local_redis.readiness_probe(redis_container(objects), port, password, local_tls)
    assert result.returncode == 0 and result.stdout.strip() == "PONG", result


# -- internal mutual TLS -----------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [INTERNAL_TLS, CERT_MANAGER], ids=["existing-secret", "cert-manager"])
def test_internal_tls_reaches_every_kvrelay_container(values: dict[str, Any], tmp_path: Path) -> None:
    objects = render(values)
    secret = TLS_SECRET if values is INTERNAL_TLS else fullname("internal-tls")
    path = tmp_path / "config.yaml"
    path.write_text(chart.config_yaml(objects))
    seen = set()
    for stage, ctr in server_containers(objects):
        tls = load_config(path, effective_config_env(ctr)).internal_tls
        assert is_enabled(tls), (stage, ctr["name"])
        assert tls.server_name == "kvrelay-internal"  # pod IPs are dialled: the shared name is checked
        for file in (tls.cert_file, tls.key_file, tls.ca_file):
            assert file is not None
            mount = next(m for m in ctr["volumeMounts"] if file.startswith(m["mountPath"] + "/"))
            volume = next(v for v in pod_spec(objects, stage)["volumes"] if v["name"] == mount["name"])
            assert volume["secret"]["secretName"] == secret and mount["readOnly"] is True
        seen.add(stage)
    assert seen >= {"codec", "router", "prefill", "decode"} | (
        {"paired"} if values is CERT_MANAGER else set()
    )
    assert "internal_tls" not in chart.config_yaml(objects)  # through the env only


def test_without_internal_tls_nothing_is_mounted() -> None:
    objects = render()
    for _, ctr in server_containers(objects):
        assert not [n for n in env_of(ctr) if n.startswith("KVRELAY_INTERNAL_TLS__")]
    assert not find(objects, "Certificate")


def test_cert_manager_certificate_names_every_internal_service() -> None:
    objects = render(CERT_MANAGER)
    (cert,) = find(objects, "Certificate")
    spec = cert["spec"]
    assert cert["apiVersion"] == "cert-manager.io/v1"
    assert spec["secretName"] == fullname("internal-tls")
    assert spec["issuerRef"] == {"name": "kvrelay-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert spec["ipAddresses"] == ["127.0.0.1"]  # the probes dial the pod's own loopback
    internal = {s["metadata"]["name"] for s in find(objects, "Service")} - {fullname("codec")}
    assert internal == {
        fullname(s) for s in ("router", "prefill", "decode", "paired-prefill", "paired-decode", "redis")
    }
    for service in internal:
        for name in (
            service,
            f"{service}.{chart.NAMESPACE}.svc",
            f"{service}.{chart.NAMESPACE}.svc.cluster.local",
        ):
            assert name in spec["dnsNames"]
    assert "kvrelay-internal" in spec["dnsNames"]  # internalTls.serverName, which clients check


@pytest.fixture(scope="module")
def mtls_health_server(certs: Certs) -> Iterator[int]:
    """A gRPC health server that, like every kvrelay server under internal TLS, requires a client
    certificate signed by the CA; "" and kvrelay.liveness SERVING."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    for service in ("", "kvrelay.liveness"):
        servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [(certs.key.read_bytes(), certs.cert.read_bytes())],
        root_certificates=certs.ca.read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield port
    finally:
        server.stop(None)


def run_probe(ctr: dict, kind: str, port: int, tls_dir: Path | None) -> subprocess.CompletedProcess[str]:
    """The container's exec probe as the kubelet runs it, this Python as the image's, our port as its own;
    the container's internal TLS env pointing at `tls_dir` (None: left out)."""
    command = ctr[kind]["exec"]["command"]
    assert command[0] == "python"
    args = [re.sub(r"^127\.0\.0\.1:\d+$", f"127.0.0.1:{port}", a) for a in command[1:]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    if tls_dir is not None:
        for name, item in env_of(ctr).items():
            if name.startswith("KVRELAY_INTERNAL_TLS__"):
                env[name] = item["value"].replace("/etc/kvrelay/internal-tls", str(tls_dir))
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
    )


def test_grpc_probes_speak_mutual_tls(mtls_health_server: int, certs: Certs, tmp_path: Path) -> None:
    """Kubernetes' grpc probe speaks plaintext, which a server requiring client certificates refuses: with
    internal TLS the probes run the health check in the container, with the pod's certificate."""
    objects = render(INTERNAL_TLS)
    tls_dir = secret_dir(certs, tmp_path / "tls")
    decode = container(objects, "decode")
    assert decode["startupProbe"]["exec"] == decode["readinessProbe"]["exec"]
    for kind in ("readinessProbe", "livenessProbe"):
        assert "grpc" not in decode[kind]
        result = run_probe(decode, kind, mtls_health_server, tls_dir)
        assert result.returncode == 0, (kind, result.stderr)
    assert "kvrelay.liveness" in decode["livenessProbe"]["exec"]["command"]
    router = container(objects, "router")
    assert run_probe(router, "readinessProbe", mtls_health_server, tls_dir).returncode == 0
    # without the pod's certificate the server refuses the check: the probe is what carries TLS
    assert run_probe(decode, "readinessProbe", mtls_health_server, None).returncode == 1


# -- what the chart refuses --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"internalTls": {"enabled": True}}, r"internalTls\.existingSecret.*internalTls\.certManager"),
        (
            {"internalTls": {"enabled": True, "certManager": {"enabled": True}}},
            r"internalTls\.certManager\.issuerRef\.name",
        ),
        ({"redis": {"enabled": False, "tls": {"enabled": True}}}, r"redis\.tls applies to the bundled Redis"),
        ({"redis": {"tls": {"enabled": True}}}, r"redis\.tls\.existingSecret.*internalTls\.enabled"),
        ({"config": {"logging": {"level": "debug"}}}, r"config\.logging \(level\).*set logLevel"),
        (
            {"config": {"responses": {"key_prefix": "x:"}}},
            r"config\.responses\.key_prefix.*redis\.responsesKeyPrefix",
        ),
        ({"config": {"responses": {"redis_url": "redis://x:6379/1"}}}, r"config\.responses\.redis_url"),
        ({"config": {"quotas": {"redis_url": "redis://x:6379/0"}}}, r"config\.quotas\.redis_url"),
        ({"config": {"server": {"metrics_port": 9100}}}, r"config\.server\.metrics_port.*codec\.metricsPort"),
        ({"config": {"internal_tls": {"ca_file": "/ca.pem"}}}, r"config\.internal_tls\.ca_file.*internalTls"),
        ({"config": {"auth": {"allow_open": True}}}, r"config\.auth\.allow_open.*auth\.allowOpen"),
    ],
)
def test_refuses_incomplete_or_shadowed_settings(values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm_error(), match=complaint):
        render(values)
