"""`kvrelay up` before it starts anything: ports, worker names and roles per mode, the thread split, child
command lines, argument checks (services/cli/up.py, over the plan it shares with the benchmarks,
services/common/local_stack.py)."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from services.cli import up
from services.common import local_stack
from services.common.errors import ConfigError, ModelNotFoundError
from services.common.probes import LIVENESS_SERVICE, GrpcHealthCheck, HttpReadyCheck
from services.common.supervisor import Role

TOKEN = "s3cret-token-0123456789"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["up", *argv])


def no_free_ports(count: int) -> list[int]:
    raise AssertionError("a fixed base port must not ask for free ports")


def test_ports_derive_from_the_base_codec_router_then_workers() -> None:
    ports = local_stack.derive_ports(8000, 3, no_free_ports)
    assert (ports.codec, ports.router, ports.workers) == (8000, 8001, (8002, 8003, 8004))
    assert ports.all() == [("worker-0", 8002), ("worker-1", 8003), ("worker-2", 8004), ("router", 8001),
                           ("codec", 8000)]  # fmt: skip


def test_port_zero_takes_a_distinct_free_port_for_every_service() -> None:
    ports = local_stack.derive_ports(0, 2, local_stack.free_ports)
    every = [ports.codec, ports.router, *ports.workers]
    assert len(set(every)) == 4 and 0 not in every


def test_a_base_port_without_room_for_every_service_is_rejected() -> None:
    assert local_stack.derive_ports(65532, 2, no_free_ports).workers == (65534, 65535)
    with pytest.raises(local_stack.UpError, match="no room"):
        local_stack.derive_ports(65533, 2, no_free_ports)
    with pytest.raises(local_stack.UpError, match="--workers"):
        local_stack.derive_ports(8000, 0, no_free_ports)


@pytest.mark.parametrize(
    ("num_cores", "num_workers", "expected"), [(16, 1, 16), (16, 3, 5), (2, 2, 1), (2, 4, 1), (1, 1, 1)]
)
def test_threads_split_the_cores_evenly_and_never_drop_below_one(
    num_cores: int, num_workers: int, expected: int
) -> None:
    threads = local_stack.threads_per_worker(num_cores, num_workers)
    assert threads == expected
    assert threads * num_workers <= num_cores or threads == 1


def plan(tmp_path: Path, host: str = "127.0.0.1") -> local_stack.StackPlan:
    return local_stack.StackPlan(
        host=host,
        ports=local_stack.derive_ports(9000, 2, no_free_ports),
        config_path=tmp_path / "config.yaml",
        model_dir=tmp_path / "model",
        threads_per_worker=4,
        env=local_stack.child_env({"PATH": "/bin", local_stack.TOKEN_FILE_ENV: "/old/token"}, TOKEN),
    )


def test_children_get_exact_flags_and_the_token_only_through_their_environment(tmp_path: Path) -> None:
    specs = local_stack.build_specs(plan(tmp_path), python="py")
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
        assert spec.env[local_stack.TOKEN_ENV] == TOKEN and local_stack.TOKEN_FILE_ENV not in spec.env
    assert by_name["worker-0"].health == GrpcHealthCheck("127.0.0.1:9002")
    assert by_name["worker-0"].liveness == GrpcHealthCheck("127.0.0.1:9002", 2.0, LIVENESS_SERVICE)
    assert by_name["router"].liveness is None and by_name["codec"].liveness is None
    assert by_name["router"].health == GrpcHealthCheck("127.0.0.1:9001")
    assert by_name["codec"].health == HttpReadyCheck("http://127.0.0.1:9000/ready")


def test_a_wildcard_public_host_is_probed_through_loopback(tmp_path: Path) -> None:
    codec = local_stack.build_specs(plan(tmp_path, host="0.0.0.0"))[-1]
    assert codec.argv[-4:] == ["--host", "0.0.0.0", "--port", "9000"]
    assert codec.health == HttpReadyCheck("http://127.0.0.1:9000/ready")


@pytest.fixture
def no_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing may start when the arguments are invalid")

    monkeypatch.setattr(up, "Supervisor", refuse)


@pytest.mark.usefixtures("no_supervisor")
def test_an_unknown_mode_is_rejected_with_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(
        local_stack.UpError, match=r"--mode split is not a deployment shape: pick colocated .* or disagg"
    ):
        up.run(parse(["--mode", "split", "--model", str(tmp_path)]))


def test_colocated_workers_are_named_worker_i_and_default_to_one() -> None:
    assert local_stack.plan_workers("colocated") == [("worker-0", "colocated")]
    assert local_stack.plan_workers("colocated", workers=3) == [
        ("worker-0", "colocated"), ("worker-1", "colocated"), ("worker-2", "colocated"),
    ]  # fmt: skip


def test_disaggregated_puts_the_prefill_workers_first_then_the_decode_ones() -> None:
    assert local_stack.plan_workers("disaggregated") == [("prefill-0", "prefill"), ("decode-0", "decode")]
    assert local_stack.plan_workers("disaggregated", prefill_replicas=2, decode_replicas=3) == [
        ("prefill-0", "prefill"), ("prefill-1", "prefill"),
        ("decode-0", "decode"), ("decode-1", "decode"), ("decode-2", "decode"),
    ]  # fmt: skip


def test_auto_colocates_below_four_cores_and_disaggregates_from_four() -> None:
    assert [local_stack.resolve_mode("auto", n) for n in (1, 2, 3)] == ["colocated"] * 3
    assert [local_stack.resolve_mode("auto", n) for n in (4, 16)] == ["disaggregated"] * 2
    assert local_stack.resolve_mode("disaggregated", 2) == "disaggregated"  # a named shape is kept
    assert local_stack.resolve_mode("colocated", 64) == "colocated"


@pytest.mark.parametrize(
    ("mode", "counts", "message"),
    [
        ("colocated", {"prefill_replicas": 1}, "--mode colocated does not take --prefill-replicas: "),
        ("colocated", {"decode_replicas": 2}, "--mode colocated does not take --decode-replicas: "),
        ("disaggregated", {"workers": 2}, "--mode disaggregated does not take --workers: "),
        ("colocated", {"workers": 0}, "--workers must be at least 1, got 0"),
        ("disaggregated", {"prefill_replicas": 0}, "--prefill-replicas must be at least 1, got 0"),
        ("disaggregated", {"decode_replicas": -1}, "--decode-replicas must be at least 1, got -1"),
    ],
)
def test_counts_of_the_other_mode_or_below_one_are_rejected(
    mode: str, counts: dict[str, int], message: str
) -> None:
    with pytest.raises(local_stack.UpError, match=message):
        local_stack.plan_workers(mode, **counts)


@pytest.mark.usefixtures("no_supervisor")
def test_mixing_a_count_flag_with_the_wrong_mode_fails_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(
        local_stack.UpError, match="--mode colocated does not take --prefill-replicas, --decode-replicas"
    ):
        up.run(parse(["--prefill-replicas", "1", "--decode-replicas", "1", "--model", str(tmp_path)]))
    with pytest.raises(local_stack.UpError, match="--mode disaggregated does not take --workers"):
        up.run(parse(["--mode", "disaggregated", "--workers", "2", "--model", str(tmp_path)]))


def disaggregated_plan(tmp_path: Path, num_prefill: int = 1, num_decode: int = 1) -> local_stack.StackPlan:
    workers = local_stack.plan_workers(
        "disaggregated", prefill_replicas=num_prefill, decode_replicas=num_decode
    )
    return local_stack.StackPlan(
        host="127.0.0.1",
        ports=local_stack.derive_ports(9000, len(workers), no_free_ports, tuple(w.name for w in workers)),
        config_path=tmp_path / "config.yaml",
        model_dir=tmp_path / "model",
        threads_per_worker=local_stack.threads_per_worker(2, len(workers)),
        env=local_stack.child_env({"PATH": "/bin"}, TOKEN),
        mode="disaggregated",
        worker_roles=tuple(w.role for w in workers),
    )


def test_disaggregated_ports_keep_the_scheme_with_prefill_then_decode_workers(tmp_path: Path) -> None:
    ports = disaggregated_plan(tmp_path, num_prefill=1, num_decode=2).ports
    assert ports.all() == [("prefill-0", 9002), ("decode-0", 9003), ("decode-1", 9004), ("router", 9001),
                           ("codec", 9000)]  # fmt: skip


def test_disaggregated_workers_get_their_role_name_and_a_share_of_the_cores(tmp_path: Path) -> None:
    specs = local_stack.build_specs(disaggregated_plan(tmp_path), python="py")
    by_name = {spec.name: spec for spec in specs}
    assert [s.name for s in specs] == ["prefill-0", "decode-0", "router", "codec"]
    cfg, model = str(tmp_path / "config.yaml"), str(tmp_path / "model")
    assert list(by_name["prefill-0"].argv) == [
        "py", "-m", "services.cli.main", "worker", "--config", cfg, "--model", model, "--role", "prefill",
        "--host", "127.0.0.1", "--port", "9002", "--threads", "1", "--name", "prefill-0",
    ]  # fmt: skip
    decode = list(by_name["decode-0"].argv)
    assert decode[decode.index("--role") + 1] == "decode" and decode[decode.index("--name") + 1] == "decode-0"
    assert decode[decode.index("--threads") + 1] == "1"  # 2 cores over 1 prefill + 1 decode worker
    router = list(by_name["router"].argv)
    assert router[router.index("--workers") + 1] == "127.0.0.1:9002,127.0.0.1:9003"
    assert by_name["decode-0"].health == GrpcHealthCheck("127.0.0.1:9003")
    assert by_name["decode-0"].liveness == GrpcHealthCheck("127.0.0.1:9003", 2.0, LIVENESS_SERVICE)


def test_a_plan_without_roles_is_colocated(tmp_path: Path) -> None:
    assert plan(tmp_path).workers() == [("worker-0", "colocated"), ("worker-1", "colocated")]


@pytest.mark.usefixtures("no_supervisor")
def test_a_busy_port_names_the_disaggregated_worker_that_needs_it(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        decode_port = busy.getsockname()[1]
        argv = ["--mode", "disaggregated", "--model", str(tmp_path), "--port", str(decode_port - 3)]
        # As in the colocated test below, a neighbour's process may hold an earlier port of the stack.
        with pytest.raises(
            local_stack.UpError,
            match=r"port \d+ \((codec|router|prefill-0|decode-0)\) on 127\.0\.0\.1 is not free",
        ):
            up.run(parse(argv))


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
            local_stack.UpError, match=r"port \d+ \((codec|router|worker-0)\) on 127\.0\.0\.1 is not free"
        ):
            up.run(parse(["--model", str(tmp_path), "--port", str(router_port - 1)]))


def test_the_public_grpc_port_reaches_the_codec_only_when_asked(tmp_path: Path) -> None:
    import dataclasses

    def codec_argv(p: local_stack.StackPlan) -> list[str]:
        return next(list(s.argv) for s in local_stack.build_specs(p, python="py") if s.name == "codec")

    assert "--grpc-port" not in codec_argv(plan(tmp_path))
    argv = codec_argv(dataclasses.replace(plan(tmp_path), grpc_port=9100))
    assert argv[argv.index("--grpc-port") + 1] == "9100"
