#!/usr/bin/env bash
# Re-vendor the Compose specification's JSON schema into tests/deploy/compose-spec.schema.json.
#
# Source: the PyPI package docker-compose==1.29.2 (the last Python Compose), which ships the compose-spec
# project's schema as compose/config/compose_spec.json. Only the wheel is downloaded (no install, no
# dependencies); the file is copied byte for byte and its sha256 checked against the one recorded in
# tests/deploy/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
VERSION=1.29.2
SHA256=0dc04bd346dcfee1b1419628fff79937bbf076925f298f272a2b490e2b112bac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "docker-compose==$VERSION"
"$PY" - "$tmp" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("docker_compose-*.whl"))
data = zipfile.ZipFile(wheel).read("compose/config/compose_spec.json")
pathlib.Path("tests/deploy/compose-spec.schema.json").write_bytes(data)
PY
echo "$SHA256  tests/deploy/compose-spec.schema.json" | sha256sum --check
