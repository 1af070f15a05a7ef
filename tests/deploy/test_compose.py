"""The compose files (deploy/compose/) validate against the Compose specification's JSON schema and run
the chart's topology on one Docker host: codec -> router -> prefill + decode workers, Redis.

The schema is vendored as tests/deploy/compose-spec.schema.json (see tests/deploy/README.md for its
source and version). Each file is validated as written and after variable interpolation with its
defaults (what `docker compose config` would see with an empty environment); the GPU overlay also merged
over the base file. No Docker daemon is needed.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services.cli.main import build_parser
from services.common.config import load_config
from tests.deploy.chart import REPO_ROOT

COMPOSE_DIR = REPO_ROOT / "deploy" / "compose"
BASE = COMPOSE_DIR / "compose.yaml"
GPU = COMPOSE_DIR / "compose.gpu.yaml"
SCHEMA = Path(__file__).with_name("compose-spec.schema.json")
KVRELAY_SERVICES = ("codec", "router", "prefill", "decode")
GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|ms|s|m|h))+$")
VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?:(:?-)([^}]*)|(:?\?)([^}]*))?\}")


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # PyYAML resolves the `<<:` merge keys as Compose does


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default} and ${VAR:?error} in every string."""

    def one(match: re.Match[str]) -> str:
        name, default_op, default, error_op, error = match.groups()
        value = env.get(name)
        if error_op is not None and not value:
            raise ValueError(f"{name}: {error}")
        if default_op == ":-" and not value:
            return default
        if default_op == "-" and value is None:
            return default
        return value or ""

    if isinstance(node, str):
        return VARIABLE.sub(one, node)
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    return node


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of a second -f file: mappings merge, sequences of options and scalars replace."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    return copy.deepcopy(override)


def durations(node: Any, key: str = "") -> list[tuple[str, str]]:
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("interval", "timeout", "start_period", "stop_grace_period") and isinstance(v, str):
                found.append((k, v))
            else:
                found += durations(v, k)
    elif isinstance(node, list):
        for v in node:
            found += durations(v, key)
    return found


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft201909Validator)
    cls.check_schema(schema)
    return cls(schema)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return interpolate(load(BASE), {})


def errors(validator: jsonschema.protocols.Validator, document: Any) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


@pytest.mark.parametrize("path", [BASE, GPU], ids=lambda p: p.name)
def test_validates_against_the_compose_spec(validator: jsonschema.protocols.Validator, path: Path) -> None:
    raw = load(path)
    assert errors(validator, raw) == []
    assert errors(validator, interpolate(raw, {})) == []
    for key, value in durations(raw):
        assert GO_DURATION.match(value), (key, value)


def test_gpu_overlay_merged_validates(validator: jsonschema.protocols.Validator) -> None:
    merged = interpolate(merge(load(BASE), load(GPU)), {"KVRELAY_WORKER_VARIANT": "cuda"})
    assert errors(validator, merged) == []
    for stage in ("prefill", "decode"):
        service = merged["services"][stage]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert service["build"]["target"] == "worker-cuda"
        assert service["image"].endswith("-cuda")
        assert service["volumes"] == merged["services"]["codec"]["volumes"]  # the base's mounts survive
    assert merged["services"]["prefill"]["deploy"] != merged["services"]["decode"]["deploy"]  # one GPU each


def test_validation_rejects_a_broken_file(validator: jsonschema.protocols.Validator, compose: dict) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["codec"]["helthcheck"] = {}
    broken["services"]["router"]["depends_on"] = {"decode": {"condition": "when_ready"}}
    found = "\n".join(errors(validator, broken))
    assert "helthcheck" in found and "when_ready" in found


def test_topology(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {*KVRELAY_SERVICES, "redis"}
    parser = build_parser()
    args = {name: parser.parse_args(services[name]["command"]) for name in KVRELAY_SERVICES}
    assert args["prefill"].role == "prefill" and args["decode"].role == "decode"
    assert args["router"].discovery == "static"
    assert args["router"].workers.split(",") == [
        f"prefill:{args['prefill'].port}",
        f"decode:{args['decode'].port}",
    ]
    assert args["codec"].router == f"router:{args['router'].port}"
    for name in KVRELAY_SERVICES:
        assert args[name].config == "/etc/kvrelay/config.yaml"
    # start order follows health: workers, then the router, then the codec
    assert services["router"]["depends_on"] == {
        "prefill": {"condition": "service_healthy"},
        "decode": {"condition": "service_healthy"},
    }
    assert services["codec"]["depends_on"]["router"] == {"condition": "service_healthy"}
    # only the codec is published, on loopback by default
    assert [n for n, s in services.items() if "ports" in s] == ["codec"]
    assert all(p.startswith("127.0.0.1:") for p in services["codec"]["ports"])


def test_services_are_hardened_and_share_the_token(compose: dict) -> None:
    for name in KVRELAY_SERVICES:
        service = compose["services"][name]
        assert service["user"] == "10001:10001"
        assert service["read_only"] is True and service["cap_drop"] == ["ALL"]
        assert service["secrets"] == ["internal_token"]
        assert service["environment"]["KVRELAY_INTERNAL_TOKEN_FILE"] == "/run/secrets/internal_token"
        assert "KVRELAY_INTERNAL_TOKEN" not in service["environment"]
        assert service["healthcheck"]["test"][:2] == ["CMD", "kvrelay-healthcheck"]
    assert compose["secrets"]["internal_token"]["file"] == "./secrets/internal-token"


def test_model_is_mounted_read_only_never_built_in(compose: dict) -> None:
    for name in ("codec", "prefill", "decode"):
        service = compose["services"][name]
        (mount,) = service["volumes"]
        assert mount["read_only"] is True and mount["target"] == "/models/current"
        assert (COMPOSE_DIR / mount["source"]).resolve() == REPO_ROOT / "models" / "smollm2-135m-instruct"
        assert build_parser().parse_args(service["command"]).model == "/models/current"
    assert "volumes" not in compose["services"]["router"]


def test_images_build_from_the_repository_dockerfiles(compose: dict) -> None:
    from tests.deploy.test_dockerfiles import stages  # needs dockerfile-parse

    for name, dockerfile, target in (
        ("codec", "codec", None),
        ("router", "router", None),
        ("prefill", "worker", "worker-cpu"),
        ("decode", "worker", "worker-cpu"),
    ):
        build = compose["services"][name]["build"]
        context = (COMPOSE_DIR / build["context"]).resolve()
        assert context == REPO_ROOT
        path = context / build["dockerfile"]
        assert path == REPO_ROOT / "deploy" / "docker" / f"{dockerfile}.Dockerfile"
        assert build.get("target") == target
        if target:
            assert target in {s.name for s in stages(path)}
        assert {"VERSION", "MODEL_FINGERPRINT"} <= set(build["args"])
        assert compose["services"][name]["image"].startswith(f"kvrelay-{dockerfile}:0.1.0")


def codec_config(compose: dict) -> Any:
    """The config the codec loads: the config file and its environment."""
    env = {k: v for k, v in compose["services"]["codec"]["environment"].items() if k.startswith("KVRELAY_")}
    return load_config(COMPOSE_DIR / compose["configs"]["kvrelay_config"]["file"], env)


def test_config_file_is_valid(compose: dict) -> None:
    cfg = codec_config(compose)
    assert cfg.quotas.backend == "redis" and cfg.model.path == "/models/current"
    assert cfg.quotas.redis_url == "redis://redis:6379/0"
    assert cfg.responses.redis_url == "redis://redis:6379/1"  # stored Responses in a database of their own


def test_codec_on_every_address_in_its_container_says_open_mode_out_loud(compose: dict) -> None:
    """The codec refuses open mode on a non-loopback address unless auth.allow_open: it binds 0.0.0.0
    inside its container (published on 127.0.0.1 alone unless KVRELAY_BIND says otherwise)."""
    args = build_parser().parse_args(compose["services"]["codec"]["command"])
    cfg = codec_config(compose)
    assert args.host == "0.0.0.0" and cfg.auth.keys_file is None
    assert cfg.auth.allow_open is True
    closed = interpolate(load(BASE), {"KVRELAY_ALLOW_OPEN": "false"})
    assert codec_config(closed).auth.allow_open is False
