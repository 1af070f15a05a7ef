"""The chart's HA Redis start script (deploy/helm/kvrelay/files/redis-ha-start.sh) run for real: three
"pods", each its script's redis-server and Sentinel on an address of its own (127.0.0.2-4, as three pod
IPs; SELF and BIND stand in for the pod's name), started in order as the StatefulSet starts them. A fresh
set makes pod 0 primary and the others its replicas. Then pod 0's Redis is SIGKILLed and its container
restarted at once, before the Sentinels have noticed: it must not come back as an empty primary for its
replicas to copy, but wait for the promotion and rejoin as a replica; the data written before is kept,
and there is one primary."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.deploy.chart import CHART_DIR
from tests.stack_helpers import wait_until

SCRIPT = CHART_DIR / "files" / "redis-ha-start.sh"
PODS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
PASSWORD = "test-ha-password"


class Pod:
    def __init__(self, address: str, directory: Path) -> None:
        self.address, self.directory = address, directory
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        directory.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "REDIS_PASSWORD": PASSWORD, "SELF": self.address, "BIND": self.address,
            "SENTINELS": " ".join(PODS), "QUORUM": "2", "DOWN_AFTER_MS": "1000",
            "FAILOVER_TIMEOUT_MS": "5000", "MAXMEMORY": "64mb", "DATA_DIR": str(self.directory),
        }  # fmt: skip

    def start(self, role: str) -> None:
        log = open(self.directory / f"{role}.log", "ab")  # noqa: SIM115 (lives as long as the process)
        self.procs[role] = subprocess.Popen(["sh", str(SCRIPT), role], env=self.env(), stdout=log, stderr=log)

    def ready(self, port: int) -> bool:
        check = subprocess.run(["sh", str(SCRIPT), "ready", str(port)], env=self.env(), capture_output=True)
        return check.returncode == 0

    def client(self) -> redis.Redis:
        return redis.Redis(host=self.address, password=PASSWORD, socket_timeout=1, socket_connect_timeout=1)

    def role(self) -> str | None:
        try:
            return str(self.client().info("replication")["role"])
        except redis.RedisError:
            return None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[list[Pod]]:
    assert shutil.which("redis-server") and shutil.which("redis-cli"), "install redis-server (apt)"
    made = [Pod(address, tmp_path / f"pod-{i}") for i, address in enumerate(PODS)]
    try:
        for pod in made:  # OrderedReady: each pod ready before the next starts
            pod.start("redis")
            pod.start("sentinel")
            wait_until(lambda p=pod: p.ready(6379) and p.ready(26379), 60, f"{pod.address} ready")
        yield made
    finally:
        for pod in made:
            pod.stop()


def test_a_fresh_set_then_a_primary_restarted_at_once_rejoins_as_a_replica(pods: list[Pod]) -> None:
    first, *others = pods
    assert first.role() == "master" and [p.role() for p in others] == ["slave", "slave"]
    first.client().set("kept", "yes")
    wait_until(lambda: all(p.client().get("kept") == b"yes" for p in others), 30, "replicated")

    first.procs["redis"].send_signal(signal.SIGKILL)
    first.procs["redis"].wait(timeout=10)
    first.start("redis")  # the kubelet restarts the container at once: the Sentinels still name it

    def settled() -> bool:
        roles = [p.role() for p in pods]
        return roles.count("master") == 1 and roles[0] == "slave"

    wait_until(settled, 60, "another pod promoted, the restarted one its replica")
    primary = next(p for p in pods if p.role() == "master")
    assert primary is not first and primary.client().get("kept") == b"yes", "nothing was wiped"
    wait_until(lambda: first.client().get("kept") == b"yes", 30, "the restarted pod caught up")
