"""Batches in the chart (batches.enabled, docs/batches.md): the batch store, PostgreSQL, bundled (a
Deployment on a kept PersistentVolumeClaim, a random password in a kept Secret) or external (the URL from a
Secret of the operator's); the codec and the drainers pointed at it; network policies that let only those
two reach it; every object valid Kubernetes; the refusals that name what to set."""

from __future__ import annotations

import itertools
import re

import pytest

from tests.deploy import chart
from tests.deploy.chart import (
    NAMESPACE,
    container,
    deployment,
    env_of,
    find,
    fullname,
    helm_error,
    one,
    render,
)
from tests.deploy.netpol import reachable, rendered_pods

ON = {"queue": {"enabled": True}, "batches": {"enabled": True, "maxLines": 1000}}


def test_off_by_default_nothing_of_it_renders() -> None:
    objects = render({})
    names = {o["metadata"]["name"] for o in objects}
    assert not {fullname("batch-store"), fullname("batch-store-data"), fullname("batch-store-auth")} & names
    assert "KVRELAY_BATCHES__STORE_URL" not in env_of(container(objects, "codec"))


def test_the_bundled_store_keeps_its_data_and_every_codec_pod_finds_it() -> None:
    objects = render(ON)
    volumes = {
        v["name"]: v for v in deployment(objects, "batch-store")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == fullname("batch-store-data")
    claim = one(objects, "PersistentVolumeClaim", fullname("batch-store-data"))
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    secret = one(objects, "Secret", fullname("batch-store-auth"))
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    store_env = env_of(container(objects, "batch-store"))
    assert store_env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == fullname("batch-store-auth")
    url = f"postgresql://kvrelay:$(BATCH_STORE_PASSWORD)@{fullname('batch-store')}:5432/kvrelay"
    for name in ("codec", "drainer"):
        ctr = container(objects, name)
        env = env_of(ctr)
        assert env["KVRELAY_BATCHES__STORE_URL"]["value"] == url
        assert env["KVRELAY_BATCHES__MAX_LINES"]["value"] == "1000"
        order = [e["name"] for e in ctr["env"]]  # the kubelet expands only variables defined before
        assert order.index("BATCH_STORE_PASSWORD") < order.index("KVRELAY_BATCHES__STORE_URL")
    problems = [
        f"{obj['kind']}/{obj['metadata']['name']}: {e}"
        for obj in objects
        if (obj["apiVersion"], obj["kind"]) not in chart.CRD_KINDS
        for e in chart.validation_errors(obj)
    ]
    assert not problems, "\n".join(problems)


def test_an_external_store_comes_from_the_operators_secret() -> None:
    values = {
        **ON,
        "batches": {"enabled": True, "store": {"bundled": False, "external": {"existingSecret": "pg"}}},
    }
    objects = render(values)
    assert not [o for o in objects if o["metadata"]["name"].startswith(fullname("batch-store"))]
    ref = env_of(container(objects, "codec"))["KVRELAY_BATCHES__STORE_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "pg", "key": "url"}


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"batches": {"enabled": True}}, "queue.enabled"),
        ({**ON, "batches": {"enabled": True, "store": {"bundled": False}}}, "external.existingSecret"),
        ({**ON, "config": {"batches": {"store_url": "postgresql://x/y"}}}, "batches.store"),
    ],
)
def test_what_cannot_work_is_refused_naming_the_value(values: dict, named: str) -> None:
    with pytest.raises(helm_error(), match=re.escape(named)):
        render(values)


def test_only_the_codec_and_the_drainers_reach_the_store() -> None:
    objects = render(ON)
    policies, pods = find(objects, "NetworkPolicy"), rendered_pods(objects, NAMESPACE)
    names = ("codec", "drainer", "router", "prefill", "decode", "redis", "queue", "batch-store")
    flows = {
        (src, dst, port)
        for src, dst in itertools.product(names, names)
        for port in pods[dst].ports
        if reachable(policies, pods[src], pods[dst], port)
    }
    assert {("codec", "batch-store", "postgres"), ("drainer", "batch-store", "postgres")} <= flows
    assert not {f for f in flows if f[1] == "batch-store" and f[0] not in ("codec", "drainer")}
    assert not {f for f in flows if f[0] == "batch-store"}  # it talks to no one
