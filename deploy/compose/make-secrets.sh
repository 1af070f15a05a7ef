#!/usr/bin/env bash
# Writes the internal gRPC token the compose stack's services share (secrets/internal-token), once.
# The file is mounted into the containers, which run as uid 10001: it is made readable by them.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p secrets
if [ ! -s secrets/internal-token ]; then
  umask 022
  python3 -c 'import secrets; print(secrets.token_urlsafe(36))' > secrets/internal-token
  echo "wrote $(pwd)/secrets/internal-token"
else
  echo "$(pwd)/secrets/internal-token exists; keeping it"
fi
