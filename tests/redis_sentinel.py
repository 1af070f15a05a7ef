"""A Redis primary, one replica and one Sentinel on free loopback ports, as real redis-server processes of the
test's own (the machine's Redis is never touched): the shape of the chart's HA Redis, small enough for a
test. `kill_primary` SIGKILLs the primary; `promoted` says when the Sentinel names the replica instead."""

from __future__ import annotations

import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.ports import free_port
from tests.stack_helpers import wait_until

SERVICE = "kvrelay"
DOWN_AFTER_MS = 1000  # the Sentinel's subjective-down delay: failover starts about a second after a kill


@dataclass
class SentinelSet:
    directory: Path
    primary_port: int = field(default_factory=free_port)
    replica_port: int = field(default_factory=free_port)
    sentinel_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """The clients' URL for database 0 (redis_url.py's Sentinel form)."""
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}"

    def start(self) -> SentinelSet:
        server = shutil.which("redis-server")
        assert server, "the HA Redis test runs redis-server: install it (apt redis-server)"
        self.directory.mkdir(parents=True, exist_ok=True)
        # Each in the test's directory: a replica writes the RDB it syncs as dump.rdb in its working
        # directory, which any later redis-server started there would load.
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        self._run("primary", [server, "--port", str(self.primary_port), *common])
        replica = [server, "--port", str(self.replica_port), *common]
        self._run("replica", [*replica, "--replicaof", "127.0.0.1", str(self.primary_port)])
        conf = self.directory / "sentinel.conf"  # the Sentinel rewrites its file: a private copy
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
        )
        self._run("sentinel", [server, str(conf), "--sentinel"])
        wait_until(self._replica_in_sync, 30, "the replica in sync and known to the Sentinel")
        return self

    def _run(self, name: str, argv: list[str]) -> None:
        log = open(self.directory / f"{name}.log", "wb")  # noqa: SIM115 (lives as long as the process)
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory)

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0)

    def _replica_in_sync(self) -> bool:
        try:
            info = self._client(self.replica_port).info("replication")
            replicas = self._client(self.sentinel_port).sentinel_slaves(SERVICE)
        except redis.RedisError:
            return False
        return info.get("master_link_status") == "up" and any(
            r["port"] == self.replica_port and not r["is_odown"] and not r["is_sdown"] for r in replicas
        )

    def primary_address(self) -> tuple[str, int] | None:
        try:
            found = self._client(self.sentinel_port).sentinel_get_master_addr_by_name(SERVICE)
        except redis.RedisError:
            return None
        return (
            (found[0].decode() if isinstance(found[0], bytes) else found[0], int(found[1])) if found else None
        )

    def primary(self) -> redis.Redis:
        """A plain client of whichever server is primary now."""
        address = self.primary_address()
        assert address is not None
        return self._client(address[1])

    def kill_primary(self) -> None:
        self.procs["primary"].send_signal(signal.SIGKILL)
        self.procs["primary"].wait(timeout=10)

    def promoted(self) -> bool:
        return self.primary_address() == ("127.0.0.1", self.replica_port) and self._is_primary(
            self.replica_port
        )

    def _is_primary(self, port: int) -> bool:
        try:
            return self._client(port).info("replication").get("role") == "master"
        except redis.RedisError:
            return False

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
