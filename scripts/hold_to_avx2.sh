#!/usr/bin/env bash
# Runs a command as if this machine's CPU had AVX2 and FMA only (no AVX-512, AMX or AVX-VNNI), to measure
# what an AVX2-only CPU would run (docs/performance.md): a mount namespace shows the command a copy of
# /proc/cpuinfo without those flags (so kvrelay's CPU checks, `model.weights: auto`, the step threshold
# table and the kernel build all see an AVX2 CPU), and torch, oneDNN and MKL are capped at AVX2.
# Needs root (unshare -m). llama.cpp is held apart: build it with -DGGML_NATIVE=OFF -DGGML_AVX2=ON.
#
#   scripts/hold_to_avx2.sh .venv/bin/kvrelay bench threshold --threads 1,2
set -euo pipefail
if [[ $# -eq 0 ]]; then
    echo "usage: $0 COMMAND [ARG...]" >&2
    exit 2
fi
fake="$(mktemp)"
trap 'rm -f "$fake"' EXIT
sed -E '/^flags/ s/ (avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni[a-z0-9_]*)//g' /proc/cpuinfo > "$fake"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
unshare -m --propagation private bash -c 'mount --bind "$0" /proc/cpuinfo && exec "$@"' "$fake" "$@"
