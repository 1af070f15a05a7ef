"""What gpu_check needs on a GPU machine beyond what its image has: computed from an import trace.

    .venv/bin/python scripts/gpu_check_wheels.py --write          # trace a CPU dry run, write the plan
    .venv/bin/python scripts/gpu_check_wheels.py --download .whl  # fetch the plan's wheels (cp312)

The device's image (scripts/gpu_device_packages.txt: its distribution names as the device README lists
them) has torch, triton, transformers, numpy and most of the scientific stack. What kvrelay's CUDA path
imports beyond that must travel as wheels. Rather than a hand-kept list, `--write` runs gpu_check's dry run
on the CPU with KVRELAY_IMPORT_TRACE set: every interpreter that imports gpu_check (the check and the
children of stages 9 and 10) appends the files of the third-party modules it loaded when it exits. Those
files map to their distributions (importlib.metadata). A traced distribution is carried when kvrelay's
worker requires it and the image lacks it, or when the code generated from protos/ needs a newer one than
an image may hold (protobuf and grpcio: the generated modules refuse an older runtime at import).
Versions are this venv's, so the device runs what CI tested.

The plan is written to scripts/gpu_check_wheels.json, a lock file: CI's dry run (tests/integration/
test_gpu_check_dry.py) traces again and fails when the plan is stale, and it runs with `blocked_modules`
blocked from import: every module this venv has whose distribution is neither on the device nor in the
plan. So a hard import of an optional package on the CUDA path (llguidance, gguf, opentelemetry) fails CI
instead of the first GPU run, and OPTIONAL may never enter the plan.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPTS_DIR.parent
DEVICE_PACKAGES = SCRIPTS_DIR / "gpu_device_packages.txt"
PLAN = SCRIPTS_DIR / "gpu_check_wheels.json"
BLOCK_ENV = "KVRELAY_BLOCKED_MODULES"  # read by tests/import_blocker/sitecustomize.py
# Loaded only when a request or a setting needs them; the GPU path must run without them.
OPTIONAL = (
    "llguidance",
    "gguf",
    "opentelemetry-sdk",
    "opentelemetry-api",
    "opentelemetry-exporter-otlp-proto-grpc",
)
TRACE_ENV = "KVRELAY_IMPORT_TRACE"
PROJECT = "kvrelay"
WORKER_EXTRA = "worker"  # the GPU path is a worker's
# The device runs Python 3.12 on x86-64: compiled wheels must be cp312 or abi3 for one of these.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
LOCAL_MODULES = {"services", "tests", "gpu_check", "gpu_check_model", "gpu_check_kernels",
                 "gpu_check_transfer", "gpu_check_t5", "gpu_check_wheels", "sitecustomize",
                 "usercustomize"}  # fmt: skip


def normalize(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def register_trace() -> None:
    """When KVRELAY_IMPORT_TRACE names a file, append this interpreter's top-level modules to it at exit."""
    path = os.environ.get(TRACE_ENV)
    if path:
        atexit.register(_append_modules, Path(path))


def _append_modules(path: Path) -> None:
    """One JSON line: the file of every loaded third-party module (a namespace package such as `google`
    or `grpc`'s extras spans several distributions, so files, not names, say which ones were used)."""
    files = set()
    for name, module in list(sys.modules.items()):
        top = name.split(".")[0]
        origin = getattr(module, "__file__", None)
        if origin and top not in sys.stdlib_module_names and top not in LOCAL_MODULES:
            files.add(str(Path(origin).resolve()))
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(sorted(files)) + "\n")


def traced_files(trace: Path) -> set[str]:
    """The union of the module files every traced interpreter wrote."""
    lines = trace.read_text(encoding="utf-8").splitlines() if trace.exists() else []
    return {name for line in lines if line.strip() for name in json.loads(line)}


def dry_run_argv(out: Path) -> list[str]:
    """gpu_check on the CPU over the tiny shape, every stage: what CI runs and what the trace follows."""
    return [
        sys.executable, str(SCRIPTS_DIR / "gpu_check.py"), "--device", "cpu", "--check-shape", "tiny",
        "--shapes", "tiny", "--identity-tokens", "24", "--copy-mib", "8", "--ipc-mib", "4",
        "--decode-steps", "4", "--attentions", "auto", "--budget-s", "900", "--out", str(out),
        "--work", str(out / "work"),
    ]  # fmt: skip


def trace_dry_run(out: Path) -> set[str]:
    """Run the dry run with the trace on; the files of the third-party modules it imported."""
    trace = out / "imports.jsonl"
    env = {**os.environ, TRACE_ENV: str(trace)}
    subprocess.run(dry_run_argv(out), env=env, cwd=REPO_ROOT, check=False, capture_output=True, timeout=600)
    return traced_files(trace)


def distributions(files: set[str]) -> dict[str, str]:
    """The distributions that installed these files: normalized name -> installed version. Files no
    distribution installed (the repository's own, generated ones) are dropped."""
    owner: dict[str, tuple[str, str]] = {}
    for dist in importlib.metadata.distributions():
        for entry in dist.files or ():
            if entry.suffix in (".py", ".so", ".pyd") or ".cpython-" in entry.name:
                where = str(Path(str(dist.locate_file(entry))).resolve())
                owner[where] = (dist.metadata["Name"], dist.version)
    found = (owner[f] for f in files if f in owner)
    return {normalize(name): version for name, version in found}


def device_packages() -> set[str]:
    lines = DEVICE_PACKAGES.read_text(encoding="utf-8").splitlines()
    return {normalize(line) for line in lines if line.strip() and not line.startswith("#")}


def generated_code_needs() -> dict[str, str]:
    """The runtimes the generated protobuf and gRPC modules refuse to be older than."""
    gen = REPO_ROOT / "services" / "proto_gen" / "kvrelay" / "v1"
    pb2 = (gen / "worker_pb2.py").read_text(encoding="utf-8")
    grpc = (gen / "worker_pb2_grpc.py").read_text(encoding="utf-8")
    needs = {}
    if match := re.search(r"Protobuf Python Version: (\S+)", pb2):
        needs["protobuf"] = match.group(1)
    if match := re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc):
        needs["grpcio"] = match.group(1)
    return needs


def requirement_closure(roots: list[tuple[str, str]], stop: set[str]) -> set[str]:
    """The distributions `roots` (name, extra) require here, transitively, not descending into `stop`."""
    from packaging.requirements import Requirement

    found: set[str] = set()
    todo = list(roots)
    while todo:
        name, extra = todo.pop()
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            dep = normalize(req.name)
            if dep not in found:
                found.add(dep)
                if dep not in stop:
                    todo.append((dep, ""))
    return found


def own_requirements() -> set[str]:
    """kvrelay's requirements as a worker (the base and the `worker` extra) and theirs, not descending into a
    distribution the device has: what a device package imports is its own business (its versions differ)."""
    return requirement_closure([(PROJECT, WORKER_EXTRA)], stop=device_packages())


def wheels_to_carry(traced: dict[str, str]) -> dict[str, str]:
    """Of the traced distributions that kvrelay itself requires, those the device lacks or may hold too
    old (the generated code's runtimes): name -> this venv's version."""
    on_device = device_packages()
    pinned = generated_code_needs()
    own = own_requirements()
    return {
        name: version
        for name, version in sorted(traced.items())
        if name in own and (name not in on_device or name in pinned)
    }


def blocked_modules(carried: set[str]) -> list[str]:
    """Top-level modules importable here whose every distribution is on neither the device nor carried. What
    the device's packages require here counts as theirs (this venv's huggingface-hub needs other HTTP
    clients than the device's older one does)."""
    on_device = device_packages()
    theirs = requirement_closure([(name, "") for name in on_device], stop=set())
    allowed = on_device | theirs | {normalize(n) for n in carried}
    owners = importlib.metadata.packages_distributions()
    blocked = []
    for module, dists in owners.items():
        if module in LOCAL_MODULES or module in sys.stdlib_module_names or not module.isidentifier():
            continue
        if not any(normalize(d) in allowed for d in dists):
            blocked.append(module)
    return sorted(blocked)


def download(wheels: dict[str, str], dest: Path) -> None:
    """pip download each wheel for the device's Python (3.12, x86-64), without dependencies."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in wheels.items():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest),
             f"{name}=={version}"],
            check=True,
        )  # fmt: skip


def read_plan() -> dict[str, str]:
    """The committed plan: distribution -> version."""
    return dict(json.loads(PLAN.read_text(encoding="utf-8"))["carry"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="trace a dry run and write the plan")
    p.add_argument("--download", type=Path, help="fetch the plan's wheels into this folder (e.g. .whl)")
    args = p.parse_args(argv)
    if args.write:
        with tempfile.TemporaryDirectory() as tmp:
            traced = distributions(trace_dry_run(Path(tmp)))
        plan = {"carry": wheels_to_carry(traced), "generated_code_needs": generated_code_needs()}
        PLAN.write_text(json.dumps(plan, indent=2) + "\n", encoding="utf-8")
    wheels = read_plan()
    print(json.dumps({"carry": wheels}))
    if args.download:
        args.download.mkdir(parents=True, exist_ok=True)
        download(wheels, args.download)
    return 0


if __name__ == "__main__":
    sys.exit(main())
