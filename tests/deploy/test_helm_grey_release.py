"""Grey release in the chart (issue 55, docs/deploy.md "Grey release"): a canary release (greyRelease.main)
runs no state of its own and its codec and drainers use the main release's Redis, queue and batch store,
which the main release's policies let them reach; the canary split by header, cookie and weight renders for
the Gateway API (HTTPRoute, GRPCRoute, checked against the Gateway API's schema) and for ingress-nginx;
and every documented command of the grey release renders and validates, step by step, with
`--reuse-values` as Helm applies it."""

from __future__ import annotations

import copy
import itertools
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.chart import (
    CRD_KINDS,
    NAMESPACE,
    REPO_ROOT,
    env_of,
    find,
    gateway_errors,
    helm_error,
    one,
    render,
    validation_errors,
)
from tests.deploy.netpol import reachable, rendered_pods

MAIN, CANARY = "kvrelay", "kvrelay-next"
STATEFUL = {"queue": {"enabled": True}, "batches": {"enabled": True}}
FINGERPRINT = "ab" * 32


def codec_env(objects: list[dict], release: str, stage: str = "codec") -> dict[str, Any]:
    pod = one(objects, "Deployment", f"{release}-{stage}")["spec"]["template"]["spec"]
    return env_of(next(c for c in pod["containers"] if c["name"] == "codec"))


def valid(objects: list[dict]) -> None:
    for obj in objects:
        if obj["apiVersion"].startswith("gateway.networking.k8s.io/"):
            assert gateway_errors(obj) == [], (obj["kind"], gateway_errors(obj))
        elif (obj["apiVersion"], obj["kind"]) not in CRD_KINDS:
            assert validation_errors(obj) == [], (obj["kind"], obj["metadata"]["name"])


@pytest.fixture(scope="module")
def pair() -> tuple[list[dict], list[dict]]:
    main = render(STATEFUL, name=MAIN)
    canary = render({**STATEFUL, "greyRelease": {"main": MAIN}}, name=CANARY)
    return main, canary


def test_the_canary_runs_no_state_and_uses_the_main_releases(pair: tuple[list[dict], list[dict]]) -> None:
    main, canary = pair
    owned = {(o["kind"], o["metadata"]["name"]) for o in main}
    for stateful in (f"{MAIN}-redis", f"{MAIN}-queue", f"{MAIN}-batch-store"):
        assert ("Deployment", stateful) in owned and ("Service", stateful) in owned
    names = {o["metadata"]["name"] for o in canary}
    assert not names & {
        f"{CANARY}-{c}" for c in ("redis", "queue", "batch-store", "redis-auth", "queue-auth")
    }
    for stage in ("codec", "drainer"):
        env = codec_env(canary, CANARY, stage)
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{MAIN}-redis-auth"
        assert env["QUEUE_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{MAIN}-queue-auth"
        assert env["BATCH_STORE_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{MAIN}-batch-store-auth"
        assert f"@{MAIN}-redis:6379/0" in env["KVRELAY_QUOTAS__REDIS_URL"]["value"]
        assert f"@{MAIN}-redis:6379/1" in env["KVRELAY_RESPONSES__REDIS_URL"]["value"]
        assert f"@{MAIN}-queue:6379/0" in env["KVRELAY_QUEUE__URL"]["value"]
        assert f"@{MAIN}-batch-store:5432/" in env["KVRELAY_BATCHES__STORE_URL"]["value"]
        main_env = codec_env(main, MAIN, stage)
        assert env["KVRELAY_QUEUE__KEY_PREFIX"] == main_env["KVRELAY_QUEUE__KEY_PREFIX"]  # one queue
    valid(canary)


def test_the_main_releases_policies_let_the_canary_reach_its_state_and_no_one_else(
    pair: tuple[list[dict], list[dict]],
) -> None:
    main, canary = pair
    policies = find(main, "NetworkPolicy") + find(canary, "NetworkPolicy")
    main_pods, canary_pods = rendered_pods(main, NAMESPACE), rendered_pods(canary, NAMESPACE)
    for client in ("codec", "drainer"):
        for state, port in (("redis", "redis"), ("queue", "redis"), ("batch-store", "postgres")):
            assert reachable(policies, canary_pods[client], main_pods[state], port), (client, state)
            assert reachable(policies, main_pods[client], main_pods[state], port), (client, state)
    for stranger in ("router", "decode", "stranger"):
        assert not reachable(policies, canary_pods[stranger], main_pods["redis"], "redis"), stranger


def test_gateway_routes_split_by_header_cookie_and_weight() -> None:
    objects = render({"gateway": {"enabled": True, "canary": {"release": CANARY, "weight": 10}}}, name=MAIN)
    valid(objects)
    http = one(objects, "HTTPRoute", f"{MAIN}-codec")["spec"]
    header, cookie, rest = http["rules"]
    canary_only = [{"name": f"{CANARY}-codec", "port": 8000}]
    assert header["backendRefs"] == canary_only
    assert header["matches"][0]["headers"] == [
        {"type": "Exact", "name": "x-kvrelay-canary", "value": "always"}
    ]
    assert cookie["backendRefs"] == canary_only
    regex = re.compile(cookie["matches"][0]["headers"][0]["value"])
    assert regex.match("kvrelay_canary=always") and regex.match("a=1; kvrelay_canary=always; b=2")
    assert not regex.match("kvrelay_canary=never") and not regex.match("xkvrelay_canary=always")
    assert [(b["name"], b["weight"]) for b in rest["backendRefs"]] == [
        (f"{MAIN}-codec", 90),
        (f"{CANARY}-codec", 10),
    ]
    assert all(rule["timeouts"] == {"request": "3600s"} for rule in http["rules"])  # streams outlast 15 s
    grpc = one(objects, "GRPCRoute", f"{MAIN}-codec")["spec"]
    assert not set(grpc["hostnames"]) & set(http["hostnames"]), "one hostname: the Gateway takes one route"
    assert grpc["rules"][0]["backendRefs"] == [{"name": f"{CANARY}-codec", "port": 50052}]
    assert [b["weight"] for b in grpc["rules"][1]["backendRefs"]] == [90, 10]
    alone = render({"gateway": {"enabled": True}}, name=MAIN)
    assert one(alone, "HTTPRoute", f"{MAIN}-codec")["spec"]["rules"] == [
        {
            "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
            "timeouts": {"request": "3600s"},
            "backendRefs": [{"name": f"{MAIN}-codec", "port": 8000}],
        }
    ]


def test_overlapping_route_hostnames_and_a_canary_of_itself_are_refused() -> None:
    shared = {"enabled": True, "hostnames": ["api.example.com"], "grpc": {"hostnames": ["api.example.com"]}}
    with pytest.raises(helm_error(), match=r"gateway\.grpc\.hostnames and gateway\.hostnames both hold"):
        render({"gateway": shared}, name=MAIN)
    with pytest.raises(helm_error(), match=r"greyRelease\.main names this release itself"):
        render({"greyRelease": {"main": MAIN}}, name=MAIN)


def test_with_a_fullname_override_the_codec_still_reaches_its_own_state() -> None:
    objects = render({**STATEFUL, "fullnameOverride": "kvr"}, name="prod")
    policies, pods = find(objects, "NetworkPolicy"), rendered_pods(objects, NAMESPACE)
    for state, port in (("redis", "redis"), ("queue", "redis"), ("batch-store", "postgres")):
        assert reachable(policies, pods["codec"], pods[state], port), state


def test_ingress_nginx_canary_by_header_cookie_and_weight_for_http_and_grpc() -> None:
    canary = {"enabled": True, "weight": 5, "headerValue": "staff"}
    objects = render({"ingress": {"enabled": True, "grpc": {"enabled": True}, "canary": canary}}, name=CANARY)
    valid(objects)
    http = one(objects, "Ingress", f"{CANARY}-codec")["metadata"]["annotations"]
    grpc = one(objects, "Ingress", f"{CANARY}-codec-grpc")["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    for notes in (http, grpc):
        assert notes[prefix + "canary"] == "true" and notes[prefix + "canary-weight"] == "5"
        assert notes[prefix + "canary-by-header"] == "x-kvrelay-canary"
        assert notes[prefix + "canary-by-header-value"] == "staff"
    assert http[prefix + "canary-by-cookie"] == "kvrelay_canary"
    assert prefix + "canary-by-cookie" not in grpc  # gRPC clients send no cookies
    assert grpc[prefix + "backend-protocol"] == "GRPC"
    port = one(objects, "Ingress", f"{CANARY}-codec-grpc")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert port["service"]["port"] == {"name": "grpc"}


# -- the documented commands ----------------------------------------------------------------------------


def documented_blocks() -> list[list[tuple[str, list[str]]]]:
    """The sh blocks of docs/deploy.md's grey release: each command with the step its comment names
    ("1.", "4a." ...; "" before any), continuation lines joined."""
    text = (REPO_ROOT / "docs" / "deploy.md").read_text()
    section = text.split("### Grey release", 1)[1].split("\n### ", 1)[0]
    blocks = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        step, commands = "", []
        for line in block.replace("\\\n", " ").splitlines():
            code, _, comment = line.partition("#")
            if not code.strip():
                step = comment.split(".", 1)[0].strip() if re.match(r"\s*\d", comment) else step
                continue
            commands.append((step, shlex.split(code.replace("<new>", FINGERPRINT))))
        blocks.append(commands)
    return blocks


def set_value(values: dict[str, Any], assignment: str) -> None:
    """One `--set a.b=c`, typed as Helm types it (integers, booleans; `a=` is the empty string)."""
    path, _, raw = assignment.partition("=")
    value: Any = raw
    if re.fullmatch(r"-?\d+", raw):
        value = int(raw)
    elif raw in ("true", "false"):
        value = raw == "true"
    *parents, leaf = path.split(".")
    node = values
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def apply(command: list[str], releases: dict[str, dict[str, Any]], files: dict[str, dict[str, Any]]) -> str:
    """Applies one documented helm command to `releases` (name -> values) as Helm would; `helm get values
    ... > FILE` keeps a copy in `files` for a later `-f FILE`. Returns the release named."""
    verb, name = command[1], command[2]
    if verb == "uninstall":
        del releases[name]
        return name
    if verb == "get":
        assert command[2:4] == ["values", command[3]] and command[-2] == ">", command
        files[command[-1]] = copy.deepcopy(releases[command[3]])
        return command[3]
    assert command[3] == "deploy/helm/kvrelay" and command[4:6] == ["-n", "serving"], command
    flags = command[6:]
    if verb == "install":
        assert name not in releases
        values: dict[str, Any] = {}
    else:
        assert verb == "upgrade" and "--reuse-values" in flags, command
        values = copy.deepcopy(releases[name])
    for flag, argument in itertools.pairwise(flags):
        if flag == "-f":
            values = copy.deepcopy(files[argument])
        elif flag == "--set":
            set_value(values, argument)
    releases[name] = values
    return name


INSTALLED_MAIN: dict[str, Any] = {  # the main release as Install makes it, with the Gateway and keys
    "model": {"version": "smollm2-135m-instruct", "fingerprint": FINGERPRINT},
    "auth": {"existingSecret": "kvrelay-api-keys"},
    "responses": {"compactionKeys": {"existingSecret": "kvrelay-compaction-keys"}},
    "gateway": {"enabled": True},
    "ingress": {"enabled": True, "grpc": {"enabled": True}},
    **STATEFUL,
}


def run_scenario(commands: list[list[str]]) -> dict[str, dict[str, Any]]:
    """Applies the helm commands in order, rendering and validating each release touched; returns the
    releases left installed."""
    releases: dict[str, dict[str, Any]] = {MAIN: copy.deepcopy(INSTALLED_MAIN)}
    files: dict[str, dict[str, Any]] = {}
    for command in commands:
        name = apply(command, releases, files)
        if name not in releases:
            continue
        objects = render(releases[name], name=name, base=False)
        valid(objects)
        if name == CANARY:  # its codec uses the main release's state, keys and model name
            env = codec_env(objects, CANARY)
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{MAIN}-redis-auth"
            assert f"@{MAIN}-queue:" in env["KVRELAY_QUEUE__URL"]["value"]
            assert f"@{MAIN}-batch-store:" in env["KVRELAY_BATCHES__STORE_URL"]["value"]
            assert not {o["metadata"]["name"] for o in objects} & {f"{CANARY}-redis", f"{CANARY}-queue"}
            assert releases[CANARY]["responses"] == releases[MAIN]["responses"]
            assert releases[CANARY]["model"]["servedName"] == "smollm2-135m-instruct"  # the main's name
            assert not find(objects, "HTTPRoute"), "the canary renders no route of its own"
        canary = releases[MAIN]["gateway"].get("canary", {})
        if name == MAIN and canary.get("release"):
            rules = one(objects, "HTTPRoute", f"{MAIN}-codec")["spec"]["rules"]
            backends = {b["name"] for b in rules[-1]["backendRefs"]}
            expected = {0: {f"{MAIN}-codec"}, 100: {f"{CANARY}-codec"}}.get(canary["weight"])
            assert backends == (expected or {f"{MAIN}-codec", f"{CANARY}-codec"}), command
    return releases


def test_gateway_promote_and_abort_render_step_by_step() -> None:
    gateway = documented_blocks()[0]
    steps = [step for step, _ in gateway]
    assert {"1", "2", "3", "4a", "4b"} <= set(steps), steps
    helm = [(step, c) for step, c in gateway if c[0] == "helm"]
    promote = run_scenario([c for step, c in helm if step != "4b"])
    assert list(promote) == [MAIN], "the canary is uninstalled"
    assert promote[MAIN]["model"]["version"] == "smollm2-v2" and promote[MAIN]["image"]["tag"] == "0.2.0"
    assert promote[MAIN]["gateway"]["canary"]["release"] == ""
    abort = run_scenario([c for step, c in helm if step != "4a"])
    assert list(abort) == [MAIN] and abort[MAIN]["model"]["version"] == "smollm2-135m-instruct"
    assert abort[MAIN]["gateway"]["canary"]["release"] == ""
    [report] = [c for _, c in gateway if c[0] != "helm"]
    from services.cli.main import build_parser

    args = build_parser().parse_args(report[1:])  # the documented report's flags are the command's
    assert args.command == "canary" and (args.main, args.canary) == (MAIN, CANARY)


def test_ingress_nginx_canary_commands_render() -> None:
    nginx = [c for _, c in documented_blocks()[1]]
    releases = run_scenario(nginx)
    ingress = one(render(releases[CANARY], name=CANARY, base=False), "Ingress", f"{CANARY}-codec")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/canary-weight"] == "5"


def test_documented_commands_use_only_flags_the_chart_knows() -> None:
    """A `--set` naming no value of values.yaml would render silently: each documented path must exist."""
    import yaml

    defaults = yaml.safe_load((Path(REPO_ROOT) / "deploy/helm/kvrelay/values.yaml").read_text())
    for _, command in [c for block in documented_blocks() for c in block]:
        for flag, argument in itertools.pairwise(command):
            if flag != "--set":
                continue
            node: Any = defaults
            for key in argument.partition("=")[0].split("."):
                assert isinstance(node, dict) and key in node, argument
                node = node[key]
