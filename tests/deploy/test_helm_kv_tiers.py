"""The KV tiers in the chart (kvTiers, docs/deploy.md "KV tiers"): off by default, with nothing of them
rendered; on, a cache Redis of its own role (allkeys-lru under maxmemory, persistence off, a password from a
kept Secret, TLS as an option) that only worker pods reach and that reaches no one, and every worker
container given each kv_tiers key, the password from the Secret (never in a URL or the config) and the disk
tier's directory; an external cache Redis instead; and what the chart refuses. test_helm_kv_cache_redis.py
runs the rendered cache Redis.
"""

from __future__ import annotations

import base64
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.config import KvTiersConfig, load_config
from tests.deploy import chart
from tests.deploy.chart import (
    CRD_KINDS,
    KUBE_VERSION,
    MIN_KUBE_VERSION,
    NAMESPACE,
    arg_value,
    container,
    containers_of,
    deployment,
    effective_config_env,
    env_of,
    find,
    fullname,
    one,
    pod_spec,
    render,
    render_notes,
    secret_env,
)
from tests.deploy.netpol import allowed, egress_allowed, outside, reachable, rendered_pods

EXTERNAL_URL = "rediss://kv-cache.example.com:6380/0"
COMBOS: dict[str, dict[str, Any]] = {
    "default": {},
    "on": {"kvTiers": {"enabled": True}},
    # every setting away from its default, paired pods beside the stages, the cache Redis on TLS only
    "paired-tls": {
        "gpu": {"enabled": False},
        "paired": {"enabled": True},
        "config": {"disaggregation": {"transport": "ipc"}, "engine": {"block_size": 32}},
        "internalTls": {
            "enabled": True,
            "certManager": {"enabled": True, "issuerRef": {"name": "kvrelay-ca"}},
        },
        "kvTiers": {
            "enabled": True,
            "segmentTokens": 512,
            "ttlSeconds": 3_600_000,
            "timeoutMs": 150,
            "fetchDeadlineMs": 800,
            "writeMbPerS": 64.5,
            "hostCapacityMb": 2048,
            "tenantCapacityMb": 512,
            "writeThrough": "requested",
            "disk": {"hostPath": "", "capacityMb": 4096},
            "cacheRedis": {"maxMemory": "6gb", "tls": {"enabled": True}, "auth": {"existingSecret": "kv-pw"}},
        },
    },
    "external": {
        "kvTiers": {
            "enabled": True,
            "disk": {"enabled": False},
            "cacheRedis": {
                "enabled": False,
                "external": {"url": EXTERNAL_URL, "existingSecret": "kv-cache-pw", "key": "pw"},
            },
        }
    },
}
# kv_tiers key -> the chart value that sets it, as each combo sets it
EXPECTED = {
    "on": {
        "disk_path": "/var/lib/kvrelay/kv-tiers",
        "disk_capacity_mb": 10240,
        "shared_url": f"redis://{fullname('kv-cache')}:6379/0",
        "segment_tokens": 256,
        "ttl_s": 86400,
        "timeout_ms": 200,
        "fetch_deadline_ms": 1000,
        "write_mb_per_s": 256.0,
        "host_capacity_mb": 0,
        "tenant_capacity_mb": 0,
        "write_through": "always",
    },
    "paired-tls": {
        "disk_path": "/var/lib/kvrelay/kv-tiers",
        "disk_capacity_mb": 4096,
        "shared_url": f"rediss://{fullname('kv-cache')}:6379/0?ssl_ca_certs=/etc/kvrelay/kv-cache-tls/ca.crt",
        "segment_tokens": 512,
        "ttl_s": 3_600_000,
        "timeout_ms": 150,
        "fetch_deadline_ms": 800,
        "write_mb_per_s": 64.5,
        "host_capacity_mb": 2048,
        "tenant_capacity_mb": 512,
        "write_through": "requested",
    },
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(values) for name, values in COMBOS.items()}


def worker_containers(objects: list[dict]) -> list[tuple[str, dict]]:
    """(stage, container) of every worker container: prefill, decode, and a paired pod's two."""
    return [
        (stage, ctr)
        for d in find(objects, "Deployment")
        if (stage := d["metadata"]["labels"]["app.kubernetes.io/component"])
        in ("prefill", "decode", "paired")
        for ctr in d["spec"]["template"]["spec"]["containers"]
    ]


def tier_env(ctr: dict) -> dict[str, dict]:
    return {name: e for name, e in env_of(ctr).items() if name.startswith("KVRELAY_KV_TIERS")}


def loaded_tiers(objects: list[dict], ctr: dict, tmp_path: Path) -> KvTiersConfig:
    path = tmp_path / "config.yaml"
    path.write_text(chart.config_yaml(objects))
    return load_config(path, effective_config_env(ctr)).kv_tiers


def volume_at(objects: list[dict], stage: str, ctr: dict, path: str) -> tuple[dict, dict]:
    """(mount, pod volume) of the mount at `path` in `ctr`."""
    mount = next(m for m in ctr["volumeMounts"] if m["mountPath"] == path)
    return mount, next(v for v in pod_spec(objects, stage)["volumes"] if v["name"] == mount["name"])


# -- off by default ----------------------------------------------------------------------------------------


def test_default_render_has_nothing_of_the_tiers(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["default"]
    assert not [o for o in objects if "kv-cache" in o["metadata"]["name"]]
    for d in find(objects, "Deployment"):
        for ctr in containers_of(d):
            assert not tier_env(ctr), ctr["name"]
        assert "kv-tiers-disk" not in {v["name"] for v in d["spec"]["template"]["spec"]["volumes"]}
    assert "kv_tiers" not in yaml.safe_load(chart.config_yaml(objects))


@pytest.mark.parametrize("combo", ["on", "paired-tls", "external"])
@pytest.mark.parametrize("version", [KUBE_VERSION, MIN_KUBE_VERSION])
def test_every_object_validates(rendered: dict[str, list[dict]], combo: str, version: str) -> None:
    problems = [
        f"{o['kind']}/{o['metadata']['name']}: {e}"
        for o in rendered[combo]
        if (o["apiVersion"], o["kind"]) not in CRD_KINDS
        for e in chart.validation_errors(o, version)
    ]
    assert not problems, "\n".join(problems)


def test_helm_lint_finds_nothing_to_warn_about() -> None:
    import helm_python as helm

    for combo in ("on", "paired-tls", "external"):
        report = helm.lint(
            chart.CHART_DIR, chart.with_base(COMBOS[combo]), strict=True, kube_version=f"v{KUBE_VERSION}"
        )
        assert not report["errors"], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


# -- the cache Redis: a role of its own --------------------------------------------------------------------


def test_cache_redis_evicts_any_key_under_maxmemory_and_keeps_nothing(
    rendered: dict[str, list[dict]],
) -> None:
    objects = rendered["on"]
    redis = container(objects, "kv-cache")
    args = redis["args"]
    assert redis["command"] == ["redis-server"]
    assert arg_value(args, "--maxmemory") == "3gb"
    assert arg_value(args, "--maxmemory-policy") == "allkeys-lru"  # segments carry no TTL to rank by
    assert (arg_value(args, "--save"), arg_value(args, "--appendonly")) == ("", "no")
    assert arg_value(args, "--requirepass") == "$(REDIS_PASSWORD)"
    assert secret_env(redis, "REDIS_PASSWORD") == {"name": fullname("kv-cache-auth"), "key": "password"}
    secret = one(objects, "Secret", fullname("kv-cache-auth"))
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # reused on upgrade
    assert re.fullmatch(r"[A-Za-z0-9]{32}", base64.b64decode(secret["data"]["password"]).decode())
    assert redis["resources"]["limits"]["memory"] == "4Gi"
    service = one(objects, "Service", fullname("kv-cache"))
    assert service["spec"]["ports"] == [
        {"name": "redis", "port": 6379, "targetPort": "redis", "protocol": "TCP"}
    ]
    # never the quotas/Responses Redis, which stays as it was
    quotas = container(objects, "redis")
    assert arg_value(quotas["args"], "--maxmemory-policy") == "volatile-lru"
    assert secret_env(quotas, "REDIS_PASSWORD")["name"] == fullname("redis-auth")
    assert "kv-cache" not in str(container(objects, "codec"))


def test_cache_redis_serves_tls_only_with_the_internal_certificate(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["paired-tls"]
    args = container(objects, "kv-cache")["args"]
    assert arg_value(args, "--port") == "0" and arg_value(args, "--tls-port") == "6379"
    tls = next(v for v in pod_spec(objects, "kv-cache")["volumes"] if v["name"] == "tls")
    assert tls["secret"]["secretName"] == fullname("internal-tls")
    assert not find(objects, "Secret", fullname("kv-cache-auth"))  # auth.existingSecret: referenced only
    assert secret_env(container(objects, "kv-cache"), "REDIS_PASSWORD") == {
        "name": "kv-pw",
        "key": "password",
    }
    (cert,) = find(objects, "Certificate")
    assert {fullname("kv-cache"), f"{fullname('kv-cache')}.{NAMESPACE}.svc"} <= set(cert["spec"]["dnsNames"])


# -- the workers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("combo", ["on", "paired-tls"])
def test_every_worker_gets_every_key_and_the_password_from_the_secret(
    rendered: dict[str, list[dict]], combo: str, tmp_path: Path
) -> None:
    objects = rendered[combo]
    expected = EXPECTED[combo]
    assert set(expected) == set(KvTiersConfig.model_fields)  # a key the config gains must reach the chart
    secret = "kv-pw" if combo == "paired-tls" else fullname("kv-cache-auth")
    workers = worker_containers(objects)
    assert {stage for stage, _ in workers} == (
        {"prefill", "decode", "paired"} if combo == "paired-tls" else {"prefill", "decode"}
    )
    for stage, ctr in workers:
        env = tier_env(ctr)
        assert set(env) == {f"KVRELAY_KV_TIERS__{key.upper()}" for key in expected} | {
            "KVRELAY_KV_TIERS_PASSWORD"
        }
        assert secret_env(ctr, "KVRELAY_KV_TIERS_PASSWORD") == {"name": secret, "key": "password"}
        tiers = loaded_tiers(objects, ctr, tmp_path)  # what the worker loads (ConfigError on a refusal)
        assert tiers.model_dump() == expected, (stage, ctr["name"])
        assert "@" not in str(tiers.shared_url)  # the password never rides in the URL
        mount, volume = volume_at(objects, stage, ctr, str(tiers.disk_path))
        assert not mount.get("readOnly")
        if combo == "on":  # the node's directory, shared by its workers and kept across their restarts
            assert volume["hostPath"] == {"path": "/var/lib/kvrelay/kv-tiers", "type": "DirectoryOrCreate"}
        else:  # hostPath "": one per pod, room above the tier's capacity so trimming never evicts the pod
            assert volume["emptyDir"] == {"sizeLimit": "5120Mi"}
    assert "kv_tiers" not in chart.config_yaml(objects)  # the env only: the password is never in a file


def test_workers_check_the_cache_redis_certificate_against_its_ca(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["paired-tls"]
    for stage, ctr in worker_containers(objects):
        mount, volume = volume_at(objects, stage, ctr, "/etc/kvrelay/kv-cache-tls")
        assert mount["readOnly"] is True
        assert volume["secret"] == {
            "secretName": fullname("internal-tls"),
            "defaultMode": 0o440,
            "items": [{"key": "ca.crt", "path": "ca.crt"}],  # the CA only, not the server's key
        }


def test_codec_and_router_are_untouched(rendered: dict[str, list[dict]]) -> None:
    """The tiers reach the workers through their env alone: the ConfigMap, and so the codec's and router's
    pods (checksum/config), stay as they were."""
    for stage in ("codec", "router"):
        assert not tier_env(container(rendered["on"], stage))
        annotations = [
            deployment(rendered[combo], stage)["spec"]["template"]["metadata"]["annotations"]
            for combo in ("default", "on")
        ]
        assert annotations[0]["checksum/config"] == annotations[1]["checksum/config"]


def test_external_cache_redis(rendered: dict[str, list[dict]], tmp_path: Path) -> None:
    objects = rendered["external"]
    assert not [o for o in objects if "kv-cache" in o["metadata"]["name"]]
    for _, ctr in worker_containers(objects):
        tiers = loaded_tiers(objects, ctr, tmp_path)
        assert (tiers.shared_url, tiers.disk_path) == (EXTERNAL_URL, None)
        assert secret_env(ctr, "KVRELAY_KV_TIERS_PASSWORD") == {"name": "kv-cache-pw", "key": "pw"}
        assert "kv-tiers-disk" not in {m["name"] for m in ctr["volumeMounts"]}
    notes = render_notes(COMBOS["external"])
    assert "networkPolicy.extraEgress.workers" in notes and "gets no password" not in notes
    no_password = {
        "kvTiers": {
            **COMBOS["external"]["kvTiers"],
            "cacheRedis": {"enabled": False, "external": {"url": EXTERNAL_URL}},
        }
    }
    assert "KVRELAY_KV_TIERS_PASSWORD" not in env_of(container(render(no_password), "decode"))
    assert "gets no password" in render_notes(no_password)


# -- NetworkPolicies ---------------------------------------------------------------------------------------


def flows(objects: list[dict]) -> set[tuple[str, str, str]]:
    """Every (source, target, port name) between the release's pods that both ends let through."""
    policies, pods = find(objects, "NetworkPolicy"), rendered_pods(objects, NAMESPACE)
    present = [
        name
        for name in ("codec", "router", "prefill", "decode", "paired", "redis", "kv-cache")
        if name in pods
    ]
    return {
        (src, dst, port)
        for src, dst in itertools.product(present, present)
        for port in pods[dst].ports
        if reachable(policies, pods[src], pods[dst], port)
    }


@pytest.mark.parametrize(
    ("combo", "workers"), [("on", ("prefill", "decode")), ("paired-tls", ("prefill", "decode", "paired"))]
)
def test_only_workers_reach_the_cache_redis_and_it_reaches_no_one(
    rendered: dict[str, list[dict]], combo: str, workers: tuple[str, ...]
) -> None:
    without = render({k: v for k, v in COMBOS[combo].items() if k != "kvTiers"})
    assert flows(rendered[combo]) == flows(without) | {(w, "kv-cache", "redis") for w in workers}
    policies, pods = find(rendered[combo], "NetworkPolicy"), rendered_pods(rendered[combo], NAMESPACE)
    for src in ("stranger", "other-namespace", "prometheus"):
        assert not allowed(policies, pods[src], pods["kv-cache"], "redis"), src
    for w in workers:  # its port only
        assert not allowed(policies, pods[w], pods["kv-cache"], 16379), w
    for dst, port in (("kube-dns", 53), ("internet", 443), ("codec", "http")):
        assert not egress_allowed(policies, pods["kv-cache"], pods[dst], port), dst


def test_workers_reach_an_external_cache_redis_only_where_allowed(rendered: dict[str, list[dict]]) -> None:
    cache = outside("10.7.0.9")
    policies, pods = (
        find(rendered["external"], "NetworkPolicy"),
        rendered_pods(rendered["external"], NAMESPACE),
    )
    assert not egress_allowed(policies, pods["decode"], cache, 6380)
    extra = {"workers": [{"to": [{"ipBlock": {"cidr": "10.7.0.9/32"}}], "ports": [{"port": 6380}]}]}
    objects = render({**COMBOS["external"], "networkPolicy": {"extraEgress": extra}})
    policies, pods = find(objects, "NetworkPolicy"), rendered_pods(objects, NAMESPACE)
    assert egress_allowed(policies, pods["decode"], cache, 6380)
    assert "extraEgress.workers allows it" not in render_notes(
        {**COMBOS["external"], "networkPolicy": {"extraEgress": extra}}
    )


# -- what the chart refuses --------------------------------------------------------------------------------


def with_tiers(**kv_tiers: Any) -> dict[str, Any]:
    return {"kvTiers": {"enabled": True, **kv_tiers}}


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (
            with_tiers(disk={"enabled": False}, cacheRedis={"enabled": False}),
            r"kvTiers\.enabled needs a tier",
        ),
        (
            with_tiers(segmentTokens=100),
            r"kvTiers\.segmentTokens \(100\) is not a multiple of config\.engine\.block_size \(16\)",
        ),
        ({**with_tiers(segmentTokens=48), "config": {"engine": {"block_size": 32}}}, r"block_size \(32\)"),
        (
            with_tiers(cacheRedis={"external": {"url": EXTERNAL_URL}}),
            r"external\.url is for an external cache Redis",
        ),
        (
            with_tiers(cacheRedis={"enabled": False, "external": {"url": "redis://:hunter2@cache:6379/0"}}),
            r"carries a password.*KVRELAY_KV_TIERS_PASSWORD",
        ),
        (
            with_tiers(cacheRedis={"enabled": False, "external": {"existingSecret": "pw"}}),
            r"its address goes in kvTiers\.cacheRedis\.external\.url",
        ),
        (
            with_tiers(
                cacheRedis={"enabled": False, "tls": {"enabled": True}, "external": {"url": EXTERNAL_URL}}
            ),
            r"give a rediss:// URL",
        ),
        (
            with_tiers(cacheRedis={"tls": {"enabled": True}}),
            r"kvTiers\.cacheRedis\.tls\.existingSecret.*internalTls\.enabled",
        ),
        (
            {"config": {"kv_tiers": {"disk_path": "/d", "shared_url": "redis://r:6379/0"}}},
            r"config\.kv_tiers \(disk_path, shared_url\).*kvTiers",
        ),
        # values.schema.json: a password has no place in values, and what is malformed is named
        (with_tiers(cacheRedis={"auth": {"password": "hunter2"}}), "password"),
        (with_tiers(disk={"hostPath": "var/lib/kv"}), "hostPath"),
        (with_tiers(cacheRedis={"maxMemory": "lots"}), "maxMemory"),
        (with_tiers(cacheRedis={"enabled": False, "external": {"url": "http://cache:6379"}}), "url"),
        (with_tiers(segmentTokens=0), "segmentTokens"),
        # the exact-result cache needs a Redis: the shared tier's, or its own
        ({"config": {"result_cache": {"tenants": ["*"]}}}, r"config\.result_cache\.tenants needs a Redis"),
        (
            {**with_tiers(cacheRedis={"enabled": False}), "config": {"result_cache": {"tenants": ["a"]}}},
            r"config\.result_cache\.tenants needs a Redis",
        ),
    ],
)
def test_refuses_what_would_not_work_or_would_leak(values: dict[str, Any], complaint: str) -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmError, match=complaint):
        render(values)


def test_the_host_tier_alone_is_a_tier() -> None:
    objects = render(with_tiers(hostCapacityMb=1024, disk={"enabled": False}, cacheRedis={"enabled": False}))
    env = env_of(container(objects, "decode"))
    assert env["KVRELAY_KV_TIERS__HOST_CAPACITY_MB"]["value"] == "1024"
    assert "KVRELAY_KV_TIERS__SHARED_URL" not in env and "KVRELAY_KV_TIERS_PASSWORD" not in env


@pytest.mark.parametrize("combo", ["on", "paired-tls"])
def test_the_codec_keeping_results_in_the_shared_tier_reaches_it_and_only_it_more(combo: str) -> None:
    """config.result_cache.tenants with the shared tier: the codec gets its URL, password and CA, and one
    more flow, codec to the cache Redis; nothing else changes. Without tenants, or with a url of its own,
    the codec gets none of it."""
    values = {
        **COMBOS[combo],
        "config": {**COMBOS[combo].get("config", {}), "result_cache": {"tenants": ["*"]}},
    }
    objects = render(values)
    codec, decode = env_of(container(objects, "codec")), env_of(container(objects, "decode"))
    for name in ("KVRELAY_KV_TIERS__SHARED_URL", "KVRELAY_KV_TIERS_PASSWORD"):
        assert codec[name] == decode[name], name
    mounts = {m["name"]: m for m in container(objects, "codec")["volumeMounts"]}
    assert ("kv-cache-tls" in mounts) == (combo == "paired-tls")
    assert flows(objects) == flows(render(COMBOS[combo])) | {("codec", "kv-cache", "redis")}
    own = {**values, "config": {**values["config"], "result_cache": {"tenants": ["*"], "url": "redis://r/0"}}}
    assert not tier_env(container(render(own), "codec"))


def test_an_external_cache_redis_for_results_needs_the_codec_egress_the_notes_say() -> None:
    values = {**COMBOS["external"], "config": {"result_cache": {"tenants": ["*"]}}}
    codec = env_of(container(render(values), "codec"))
    assert codec["KVRELAY_KV_TIERS__SHARED_URL"]["value"] == EXTERNAL_URL
    assert codec["KVRELAY_KV_TIERS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "kv-cache-pw",
        "key": "pw",
    }
    egress = {"networkPolicy": {"enabled": True, "egress": {"enabled": True}}}
    assert "extraEgress.codec allows it" in render_notes({**values, **egress})
    allowed_codec = {"networkPolicy": {**egress["networkPolicy"], "extraEgress": {"codec": [{"to": []}]}}}
    assert "extraEgress.codec allows it" not in render_notes({**values, **allowed_codec})
