"""`kvrelay up` before it starts anything: ports, the thread split, child command lines, argument checks."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from services.cli import up
from services.cli.probes import LIVENESS_SERVICE, GrpcHealthCheck, HttpReadyCheck
from services.cli.supervisor import Role
from services.common.errors import ConfigError, ModelNotFoundError

TOKEN = "s3cret-token"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["up", *argv])


def no_free_ports(count: int) -> list[int]:
    raise AssertionError("a fixed base port must not ask for free ports")


def test_ports_derive_from_the_base_codec_router_then_workers() -> None:
    ports = up.derive_ports(8000, 3, no_free_ports)
    assert (ports.codec, ports.router, ports.workers) == (8000, 8001, (8002, 8003, 8004))
    assert ports.all() == [("worker-0", 8002), ("worker-1", 8003), ("worker-2", 8004), ("router", 8001),
                           ("codec", 8000)]  # fmt: skip


def test_port_zero_takes_a_distinct_free_port_for_every_service() -> None:
    ports = up.derive_ports(0, 2, up.free_ports)
    every = [ports.codec, ports.router, *ports.workers]
    assert len(set(every)) == 4 and 0 not in every


def test_a_base_port_without_room_for_every_service_is_rejected() -> None:
    assert up.derive_ports(65532, 2, no_free_ports).workers == (65534, 65535)
    with pytest.raises(up.UpError, match="no room"):
        up.derive_ports(65533, 2, no_free_ports)
    with pytest.raises(up.UpError, match="--workers"):
        up.derive_ports(8000, 0, no_free_ports)


@pytest.mark.parametrize(
    ("num_cores", "num_workers", "expected"), [(16, 1, 16), (16, 3, 5), (2, 2, 1), (2, 4, 1), (1, 1, 1)]
)
def test_threads_split_the_cores_evenly_and_never_drop_below_one(
    num_cores: int, num_workers: int, expected: int
) -> None:
    threads = up.threads_per_worker(num_cores, num_workers)
    assert threads == expected
    assert threads * num_workers <= num_cores or threads == 1


def plan(tmp_path: Path, host: str = "127.0.0.1") -> up.StackPlan:
    return up.StackPlan(
        host=host,
        ports=up.derive_ports(9000, 2, no_free_ports),
        config_path=tmp_path / "config.yaml",
        model_dir=tmp_path / "model",
        threads_per_worker=4,
        env=up.child_env({"PATH": "/bin", up.TOKEN_FILE_ENV: "/old/token"}, TOKEN),
    )


def test_children_get_exact_flags_and_the_token_only_through_their_environment(tmp_path: Path) -> None:
    specs = up.build_specs(plan(tmp_path), python="py")
    by_name = {spec.name: spec for spec in specs}
    cfg, model = str(tmp_path / "config.yaml"), str(tmp_path / "model")
    assert list(by_name["worker-1"].argv) == [
        "py", "-m", "services.cli.main", "worker", "--config", cfg, "--model", model, "--role", "colocated",
        "--host", "127.0.0.1", "--port", "9003", "--threads", "4", "--name", "worker-1",
    ]  # fmt: skip
    assert list(by_name["router"].argv) == [
        "py", "-m", "services.cli.main", "router", "--config", cfg, "--host", "127.0.0.1", "--port", "9001",
        "--workers", "127.0.0.1:9002,127.0.0.1:9003",
    ]  # fmt: skip
    assert list(by_name["codec"].argv) == [
        "py", "-m", "services.cli.main", "codec", "--config", cfg, "--model", model,
        "--router", "127.0.0.1:9001", "--host", "127.0.0.1", "--port", "9000",
    ]  # fmt: skip
    assert [s.role for s in specs] == [Role.WORKER, Role.WORKER, Role.ROUTER, Role.CODEC]
    for spec in specs:
        assert not any(TOKEN in part for part in spec.argv)
        assert spec.env[up.TOKEN_ENV] == TOKEN and up.TOKEN_FILE_ENV not in spec.env
    assert by_name["worker-0"].health == GrpcHealthCheck("127.0.0.1:9002")
    assert by_name["worker-0"].liveness == GrpcHealthCheck("127.0.0.1:9002", 2.0, LIVENESS_SERVICE)
    assert by_name["router"].liveness is None and by_name["codec"].liveness is None
    assert by_name["router"].health == GrpcHealthCheck("127.0.0.1:9001")
    assert by_name["codec"].health == HttpReadyCheck("http://127.0.0.1:9000/ready")


def test_a_wildcard_public_host_is_probed_through_loopback(tmp_path: Path) -> None:
    codec = up.build_specs(plan(tmp_path, host="0.0.0.0"))[-1]
    assert codec.argv[-4:] == ["--host", "0.0.0.0", "--port", "9000"]
    assert codec.health == HttpReadyCheck("http://127.0.0.1:9000/ready")


@pytest.fixture
def no_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing may start when the arguments are invalid")

    monkeypatch.setattr(up, "Supervisor", refuse)


@pytest.mark.usefixtures("no_supervisor")
def test_modes_other_than_colocated_are_rejected_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(up.UpError, match="--mode disaggregated is not available yet: only colocated"):
        up.run(parse(["--mode", "disaggregated", "--model", str(tmp_path)]))


@pytest.mark.usefixtures("no_supervisor")
def test_a_missing_model_directory_fails_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        up.run(parse(["--model", str(tmp_path / "missing"), "--port", "0"]))


@pytest.mark.usefixtures("no_supervisor")
def test_an_invalid_config_fails_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  block_size: 3\n")
    with pytest.raises(ConfigError, match="block_size"):
        up.run(parse(["--config", str(bad), "--model", str(tmp_path)]))


@pytest.mark.usefixtures("no_supervisor")
def test_a_busy_port_fails_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        router_port = busy.getsockname()[1]
        # Names the first busy port it finds: ours (the router's), unless another process on this machine
        # happens to hold the codec's or the worker's port next to it.
        with pytest.raises(
            up.UpError, match=r"port \d+ \((codec|router|worker-0)\) on 127\.0\.0\.1 is not free"
        ):
            up.run(parse(["--model", str(tmp_path), "--port", str(router_port - 1)]))


def test_the_public_grpc_port_reaches_the_codec_only_when_asked(tmp_path: Path) -> None:
    import dataclasses

    def codec_argv(p: up.StackPlan) -> list[str]:
        return next(s.argv for s in up.build_specs(p, python="py") if s.name == "codec")

    assert "--grpc-port" not in codec_argv(plan(tmp_path))
    argv = codec_argv(dataclasses.replace(plan(tmp_path), grpc_port=9100))
    assert argv[argv.index("--grpc-port") + 1] == "9100"
