#!/usr/bin/env bash
# Regenerate the Python gRPC code from protos/ into services/proto_gen/ (committed, so the codec needs no
# grpcio-tools). `make protos` runs this; tests/unit/test_protos_fresh.py checks it is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-services/proto_gen}
mkdir -p "$out"
.venv/bin/python -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/kvrelay/v1/*.proto
# Generated modules import `kvrelay.v1...`; make those imports package-relative.
find "$out/kvrelay" -name '*.py' -exec sed -i 's/^from kvrelay\.v1 import/from services.proto_gen.kvrelay.v1 import/' {} +
touch "$out/__init__.py" "$out/kvrelay/__init__.py" "$out/kvrelay/v1/__init__.py"
