"""The codec's metrics on a port of their own (scraped there, open to the scrapers only), a log level for
every stage, and quotas that, with Redis down, fall back to each codec's share of the limits unless told
to fail closed, dividing by the most codec replicas there can be."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest

from services.common.config import KvrelayConfig, load_config
from tests.deploy import chart
from tests.deploy.chart import (
    NAMESPACE,
    container,
    container_port,
    effective_config_env,
    env_of,
    find,
    fullname,
    one,
    paired_container,
    render,
)
from tests.deploy.netpol import allowed, rendered_pods

PAIRED_CPU = {"gpu": {"enabled": False}, "paired": {"enabled": True}}


def loaded(objects: list[dict], ctr: dict, tmp_path: Path) -> KvrelayConfig:
    """The config `ctr`'s process loads: the ConfigMap plus its env."""
    path = tmp_path / "config.yaml"
    path.write_text(chart.config_yaml(objects))
    return load_config(path, effective_config_env(ctr))


# -- the codec's metrics port ------------------------------------------------------------------------------


def test_codec_serves_metrics_on_their_own_port(tmp_path: Path) -> None:
    objects = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    codec = container(objects, "codec")
    cfg = loaded(objects, codec, tmp_path)
    assert cfg.server.metrics_port == container_port(codec, "metrics") == 9090
    assert cfg.server.metrics_port != int(chart.arg_value(codec["args"], "--port"))
    svc = one(objects, "Service", fullname("codec"))
    assert {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"} in svc["spec"][
        "ports"
    ]
    (monitor,) = find(objects, "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]  # not the API port
    policies, pods = find(objects, "NetworkPolicy"), rendered_pods(objects, NAMESPACE)
    assert allowed(policies, pods["prometheus"], pods["codec"], "metrics")  # networkPolicy.metricsFrom
    for src in ("stranger", "other-namespace"):  # who may call the API may not scrape
        assert allowed(policies, pods[src], pods["codec"], "http")
        assert not allowed(policies, pods[src], pods["codec"], "metrics"), src


def test_codec_metrics_port_zero_keeps_them_on_the_api_port(tmp_path: Path) -> None:
    objects = render({"codec": {"metricsPort": 0}, "metrics": {"serviceMonitor": {"enabled": True}}})
    codec = container(objects, "codec")
    assert loaded(objects, codec, tmp_path).server.metrics_port is None
    assert "metrics" not in {p["name"] for p in codec["ports"]}
    (monitor,) = find(objects, "ServiceMonitor")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http", "metrics"]


# -- log levels --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (
            {},
            dict.fromkeys(
                ("codec", "router", "prefill", "decode", "paired-prefill", "paired-decode"), "info"
            ),
        ),
        (
            {
                "logLevel": "warning",
                "decode": {"logLevel": "debug"},
                "paired": {"enabled": True, "logLevel": "error"},
            },
            {
                "codec": "warning",
                "router": "warning",
                "prefill": "warning",
                "decode": "debug",
                "paired-prefill": "error",
                "paired-decode": "error",
            },
        ),
    ],
)
def test_every_stage_gets_its_log_level(
    values: dict[str, Any], expected: dict[str, str], tmp_path: Path
) -> None:
    objects = render({**PAIRED_CPU, **values})
    containers = {stage: container(objects, stage) for stage in chart.STAGES}
    containers |= {f"paired-{role}": paired_container(objects, role) for role in ("prefill", "decode")}
    levels = {}
    for name, ctr in containers.items():
        service: Literal["codec", "router", "worker"] = (
            "codec" if name == "codec" else "router" if name == "router" else "worker"
        )
        levels[name] = loaded(objects, ctr, tmp_path).logging.for_service(service)
        assert env_of(ctr)["KVRELAY_LOGGING__LEVEL"]["value"] == levels[name]
    assert levels == expected


@pytest.mark.parametrize(
    ("values", "complaint"),
    [({"logLevel": "verbose"}, "logLevel"), ({"router": {"logLevel": "trace"}}, "logLevel")],
)
def test_values_schema_refuses_unknown_log_levels(values: dict[str, Any], complaint: str) -> None:
    import helm_python as helm

    with helm.Chart.load(chart.CHART_DIR) as loaded_chart, pytest.raises(helm.HelmError, match=complaint):
        loaded_chart.validate_schema(loaded_chart.merge_values(values))


# -- quotas with Redis down ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "fallback_replicas"),
    [
        ({}, 8),  # the codec's autoscaler may run up to 8
        ({"codec": {"autoscaling": {"enabled": True, "maxReplicas": 20}}}, 20),
        ({"codec": {"autoscaling": {"enabled": False}, "replicas": 3}}, 3),
    ],
)
def test_quotas_fall_back_to_each_codecs_share_by_the_most_replicas(
    values: dict[str, Any], fallback_replicas: int, tmp_path: Path
) -> None:
    objects = render(values)
    quotas = loaded(objects, container(objects, "codec"), tmp_path).quotas
    assert quotas.backend == "redis"
    assert quotas.fail_open is True  # Redis down: each codec's share of the limits, unless chosen otherwise
    assert quotas.fallback_replicas == fallback_replicas


def test_quota_choices_in_config_are_kept(tmp_path: Path) -> None:
    values = {"config": {"quotas": {"fail_open": False, "fallback_replicas": 5}}}
    objects = render(values)
    quotas = loaded(objects, container(objects, "codec"), tmp_path).quotas
    assert (quotas.fail_open, quotas.fallback_replicas) == (False, 5)
    assert "refuse requests with 503" in chart.render_notes(values)
    assert "fall back to each codec's memory" in chart.render_notes()


def test_server_settings_in_config_are_kept(tmp_path: Path) -> None:
    """The chart sets the codec's address and metrics port; the connection limit stays the user's."""
    objects = render({"config": {"server": {"max_connections": 256}}})
    server = loaded(objects, container(objects, "codec"), tmp_path).server
    assert (server.host, server.port, server.max_connections) == ("0.0.0.0", 8000, 256)
