"""The async lane in the chart (queue.enabled, docs/async.md): a queue Redis of its own role (noeviction, the
append-only file with fsync always on a PersistentVolumeClaim), the codec and a drainer Deployment (the
codec's pod with --drain) pointed at it, and network policies that let only those two reach it. The
rendered queue Redis is run here (tests/deploy/local_redis.py) and the codec's own queue client, built
from the rendered URL and password, finds it fit for the role, queues a job and takes it back."""

from __future__ import annotations

import base64
import itertools
from pathlib import Path

from services.codec.lane.queue import Job, JobQueue, new_job_id
from tests.deploy import local_redis
from tests.deploy.chart import (
    NAMESPACE,
    arg_value,
    container,
    deployment,
    env_of,
    find,
    fullname,
    one,
    render,
)
from tests.deploy.netpol import reachable, rendered_pods

ON = {"queue": {"enabled": True, "drainer": {"replicas": 3, "concurrency": 2}}}


def test_off_by_default_nothing_of_it_renders() -> None:
    objects = render({})
    names = {o["metadata"]["name"] for o in objects}
    assert not {fullname("queue"), fullname("drainer"), fullname("queue-data")} & names
    assert "KVRELAY_QUEUE__URL" not in env_of(container(objects, "codec"))


def test_the_queue_redis_keeps_every_job_on_a_volume() -> None:
    objects = render(ON)
    redis = container(objects, "queue")
    args = redis["args"]
    assert arg_value(args, "--maxmemory-policy") == "noeviction"
    assert arg_value(args, "--appendonly") == "yes" and arg_value(args, "--appendfsync") == "always"
    volumes = {v["name"]: v for v in deployment(objects, "queue")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"]["claimName"] == fullname("queue-data")
    claim = one(objects, "PersistentVolumeClaim", fullname("queue-data"))
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"


def test_the_drainers_run_the_codec_with_drain_and_scale_apart() -> None:
    objects = render(ON)
    drainer, codec = container(objects, "drainer"), container(objects, "codec")
    assert drainer["args"][0] == "codec" and "--drain" in drainer["args"] and "--drain" not in codec["args"]
    assert drainer["image"] == codec["image"]
    assert deployment(objects, "drainer")["spec"]["replicas"] == 3
    env, codec_env = env_of(drainer), env_of(codec)
    assert env["KVRELAY_QUEUE__DRAIN_CONCURRENCY"]["value"] == "2"
    for each in (env, codec_env):
        assert each["KVRELAY_QUEUE__URL"]["value"] == f"redis://:$(QUEUE_PASSWORD)@{fullname('queue')}:6379/0"
        assert each["QUEUE_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == fullname("queue-auth")
    assert not [s for s in find(objects, "Service") if s["metadata"]["name"] == fullname("drainer")]


def test_only_the_codec_and_the_drainers_reach_the_queue() -> None:
    objects = render(ON)
    policies, pods = find(objects, "NetworkPolicy"), rendered_pods(objects, NAMESPACE)
    names = ("codec", "drainer", "router", "prefill", "decode", "redis", "queue")
    flows = {
        (src, dst, port)
        for src, dst in itertools.product(names, names)
        for port in pods[dst].ports
        if reachable(policies, pods[src], pods[dst], port)
    }
    assert {
        ("codec", "queue", "redis"),
        ("drainer", "queue", "redis"),
        ("drainer", "router", "grpc"),
    } <= flows
    assert ("drainer", "redis", "redis") in flows  # the quotas it charges
    assert not {f for f in flows if f[1] == "queue" and f[0] not in ("codec", "drainer")}
    assert not {f for f in flows if f[0] == "queue"}  # it talks to no one
    assert not {f for f in flows if f[1] == "drainer" and f[2] != "metrics"}  # no client reaches a drainer


def test_the_rendered_queue_redis_takes_and_gives_back_a_job(tmp_path: Path) -> None:
    import asyncio

    objects = render(ON)
    secret = one(objects, "Secret", fullname("queue-auth"))
    password = base64.b64decode(secret["data"]["password"]).decode()
    url = env_of(container(objects, "codec"))["KVRELAY_QUEUE__URL"]["value"]
    with local_redis.running(container(objects, "queue"), password, tmp_path, tmp_path) as port:
        local = url.replace("$(QUEUE_PASSWORD)", password).replace(
            f"{fullname('queue')}:6379", f"127.0.0.1:{port}"
        )

        async def round_trip() -> None:
            queue = JobQueue.from_url(local, "fp-chart")
            try:
                assert await queue.check_server() == []
                job = Job(new_job_id(), "acme", "test", {"n": 1})
                await queue.enqueue(job, max_jobs=None, max_tokens=None)
                taken = await queue.take("drainer-0")
                assert taken is not None and taken.job_id == job.job_id
                assert await queue.finish(taken, "done")
            finally:
                await queue.aclose()

        asyncio.run(round_trip())
        assert (
            local_redis.readiness_probe(container(objects, "queue"), port, password, tmp_path).returncode == 0
        )
