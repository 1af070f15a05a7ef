"""Entry TLS in the chart (codec.tls, docs/deploy.md "Entry TLS"): the codec gets server.tls from a mounted
kubernetes.io/tls Secret (a directory, so a renewal reaches it) and its probes speak HTTPS; ingress-nginx
re-encrypts to it (backend-protocol HTTPS, GRPCS for the gRPC Ingress) or passes the client's TLS through;
without a Secret, or with config.server.tls, the chart refuses to render."""

from __future__ import annotations

import pytest

from tests.deploy import chart
from tests.deploy.chart import container, env_of, fullname, one, render

TLS = {"codec": {"tls": {"enabled": True, "existingSecret": "api-tls"}}}
INGRESS = {"enabled": True, "grpc": {"enabled": True, "tls": [{"secretName": "x", "hosts": ["g"]}]}}
PREFIX = "nginx.ingress.kubernetes.io/"


def test_the_codec_serves_tls_from_the_mounted_secret_and_probes_over_https() -> None:
    objects = render(TLS)
    codec = container(objects, "codec")
    env = env_of(codec)
    assert env["KVRELAY_SERVER__TLS__CERT_FILE"]["value"] == "/etc/kvrelay/entry-tls/tls.crt"
    assert env["KVRELAY_SERVER__TLS__KEY_FILE"]["value"] == "/etc/kvrelay/entry-tls/tls.key"
    assert env["KVRELAY_SERVER__TLS__RELOAD_INTERVAL_S"]["value"] == "10"
    mount = next(m for m in codec["volumeMounts"] if m["name"] == "entry-tls")
    assert mount == {"name": "entry-tls", "mountPath": "/etc/kvrelay/entry-tls", "readOnly": True}
    volume = next(v for v in chart.pod_spec(objects, "codec")["volumes"] if v["name"] == "entry-tls")
    assert volume["secret"]["secretName"] == "api-tls" and "items" not in volume["secret"]  # a directory
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert codec[probe]["httpGet"]["scheme"] == "HTTPS", probe
    for obj in objects:
        if obj["kind"] in ("Deployment", "Ingress"):
            assert chart.validation_errors(obj) == [], obj["metadata"]["name"]
    plain = container(render({}), "codec")
    assert "KVRELAY_SERVER__TLS__CERT_FILE" not in env_of(plain)
    assert "scheme" not in plain["readinessProbe"]["httpGet"]


@pytest.mark.parametrize("mode", ["reencrypt", "passthrough"])
def test_ingress_nginx_reencrypts_or_passes_through(mode: str) -> None:
    objects = render({**TLS, "ingress": {**INGRESS, "backendTls": mode}})
    http = one(objects, "Ingress", fullname("codec"))["metadata"]["annotations"]
    grpc = one(objects, "Ingress", f"{fullname('codec')}-grpc")["metadata"]["annotations"]
    assert http[PREFIX + "proxy-buffering"] == "off"  # the defaults stay
    if mode == "reencrypt":
        assert http[PREFIX + "backend-protocol"] == "HTTPS" and grpc[PREFIX + "backend-protocol"] == "GRPCS"
        assert PREFIX + "ssl-passthrough" not in http
    else:
        assert http[PREFIX + "ssl-passthrough"] == grpc[PREFIX + "ssl-passthrough"] == "true"
        assert PREFIX + "backend-protocol" not in grpc
    paths = one(objects, "Ingress", fullname("codec"))["spec"]["rules"][0]["http"]["paths"]
    assert [p["path"] for p in paths] == (["/"] if mode == "passthrough" else ["/v1"])  # nginx: only "/"
    for obj in chart.find(objects, "Ingress"):
        assert chart.validation_errors(obj) == []
    plain = render({"ingress": INGRESS})
    assert (
        one(plain, "Ingress", f"{fullname('codec')}-grpc")["metadata"]["annotations"][
            PREFIX + "backend-protocol"
        ]
        == "GRPC"
    )


def test_tls_without_a_secret_or_set_in_config_or_unworkable_is_refused() -> None:
    passthrough_canary = {
        **TLS,
        "ingress": {"enabled": True, "backendTls": "passthrough", "canary": {"enabled": True}},
    }
    with pytest.raises(chart.helm_error(), match=r"ingress\.canary with ingress\.backendTls passthrough"):
        render(passthrough_canary)
    with pytest.raises(chart.helm_error(), match=r"codec\.tls with codec\.metricsPort 0"):
        render(
            {"codec": {**TLS["codec"], "metricsPort": 0}, "metrics": {"serviceMonitor": {"enabled": True}}}
        )
    with pytest.raises(chart.helm_error(), match=r"codec\.tls\.existingSecret"):
        render({"codec": {"tls": {"enabled": True}}})
    with pytest.raises(chart.helm_error(), match=r"config\.server\.tls: the chart sets it; set codec\.tls"):
        render({"config": {"server": {"tls": {"cert_file": "/x"}}}})
