"""The bundled Redis made highly available (redis.ha, docs/deploy.md "Redis that survives a pod"): a
StatefulSet of three Redis pods, each with a Sentinel, behind a headless Service (pod names) and the
Sentinels' Service; the codec's URLs turn redis+sentinel:// at that Service; the policies let the codec and
drainers reach both ports, the pods reach each other, and nothing else in; the start script is valid sh; the
quota fallback (fail open at each codec's share) is the chart's default, with or without HA."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from services.common.redis_url import parse_sentinel_url
from tests.deploy import chart
from tests.deploy.chart import CHART_DIR, NAMESPACE, container, env_of, find, fullname, one, render
from tests.deploy.netpol import Pod, reachable, rendered_pods

HA = {"redis": {"ha": {"enabled": True}}, "queue": {"enabled": True}}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render(HA)


def test_three_pods_with_sentinels_and_the_codec_asks_the_sentinels(objects: list[dict]) -> None:
    stateful = one(objects, "StatefulSet", fullname("redis"))
    assert stateful["spec"]["replicas"] == 3 and stateful["spec"]["serviceName"] == fullname("redis-headless")
    pod = stateful["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["redis", "sentinel"]
    env = env_of(pod["containers"][1])
    headless = f"{fullname('redis-headless')}.{NAMESPACE}.svc"
    pods = [f"{fullname('redis')}-{i}.{headless}" for i in range(3)]
    assert env["QUORUM"]["value"] == "2" and env["SENTINELS"]["value"].split() == pods
    assert env["HEADLESS"]["value"] == headless
    assert one(objects, "Service", fullname("redis-headless"))["spec"]["publishNotReadyAddresses"] is True
    assert not find(objects, "Deployment", fullname("redis")), "no single Redis beside the set"
    redis = pod["containers"][0]
    assert redis["lifecycle"]["preStop"]["exec"]["command"][-1] == "prestop"  # hands the primary over
    assert one(objects, "PodDisruptionBudget", fullname("redis"))["spec"]["maxUnavailable"] == 1
    codec = env_of(container(objects, "codec"))
    for variable, db in (("KVRELAY_QUOTAS__REDIS_URL", 0), ("KVRELAY_RESPONSES__REDIS_URL", 1)):
        target = parse_sentinel_url(codec[variable]["value"].replace("$(REDIS_PASSWORD)", "pw"))
        assert target.sentinels == [(p, 26379) for p in pods]  # every Sentinel, not one Service
        assert (target.service, target.db, target.password, target.sentinel_password) == (
            "kvrelay",
            db,
            "pw",
            "pw",
        )
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) not in chart.CRD_KINDS:
            assert chart.validation_errors(obj) == [], (obj["kind"], obj["metadata"]["name"])


def test_the_policies_let_clients_and_peers_in_and_no_one_else(objects: list[dict]) -> None:
    policies, pods = find(objects, "NetworkPolicy"), rendered_pods(objects, NAMESPACE)
    template = one(objects, "StatefulSet", fullname("redis"))["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
    redis = Pod(NAMESPACE, template["metadata"]["labels"], pods["codec"].namespace_labels, ports)
    for port in ("redis", "sentinel"):
        for client in ("codec", "drainer"):
            assert reachable(policies, pods[client], redis, port), (client, port)
        assert reachable(policies, redis, redis, port), f"pod to pod on {port}"
        for stranger in ("router", "decode", "stranger"):
            assert not reachable(policies, pods[stranger], redis, port), (stranger, port)
    assert reachable(policies, redis, pods["kube-dns"], 53, "UDP")  # the Sentinels resolve pod names
    assert not reachable(policies, redis, pods["internet"], 443)


def test_the_start_script_is_valid_sh_and_the_refusals() -> None:
    shell = shutil.which("sh")
    assert shell is not None
    checked = subprocess.run(
        [shell, "-n", str(CHART_DIR / "files" / "redis-ha-start.sh")], capture_output=True
    )
    assert checked.returncode == 0, checked.stderr
    with pytest.raises(chart.helm_error(), match=r"redis\.ha and redis\.tls together"):
        render({"redis": {"ha": {"enabled": True}, "tls": {"enabled": True, "existingSecret": "x"}}})
    with pytest.raises(chart.helm_error()):
        render({"redis": {"ha": {"enabled": True, "replicas": 2}}})  # no majority outlives a pod


@pytest.mark.parametrize("values", [{}, HA])
def test_quotas_fall_back_to_each_codecs_share_by_default(values: dict) -> None:
    quotas = chart.yaml.safe_load(chart.config_yaml(render(values)))["quotas"]
    assert quotas["backend"] == "redis" and quotas["fail_open"] is True
    pinned = render({**values, "config": {"quotas": {"fail_open": False}}})
    assert chart.yaml.safe_load(chart.config_yaml(pinned))["quotas"]["fail_open"] is False


def test_the_queue_can_use_an_external_redis_that_fails_over() -> None:
    external = {"queue": {"enabled": True, "redis": {"external": {"existingSecret": "queue-url"}}}}
    objects = render(external)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for kind, name in (
        ("Deployment", "queue"),
        ("PersistentVolumeClaim", "queue-data"),
        ("Secret", "queue-auth"),
    ):
        assert (kind, fullname(name)) not in names, (kind, name)
    assert ("NetworkPolicy", fullname("queue")) not in names
    for stage in ("codec", "drainer"):
        env = env_of(container(objects, stage))
        assert env["KVRELAY_QUEUE__URL"]["valueFrom"]["secretKeyRef"] == {"name": "queue-url", "key": "url"}
        assert "QUEUE_PASSWORD" not in env
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) not in chart.CRD_KINDS:
            assert chart.validation_errors(obj) == [], (obj["kind"], obj["metadata"]["name"])
