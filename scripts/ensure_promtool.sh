#!/usr/bin/env bash
# Print the path of a `promtool` (Prometheus' rule checker), installing Debian's `prometheus` package when
# there is none. tests/unit/test_deploy_observability.py calls this to check deploy/prometheus/.
#
#   $PROMTOOL, when set, names the promtool to use (it must be executable).
#   Otherwise: `promtool` on PATH, then /usr/bin/promtool; if neither exists and we are root on a machine
#   with apt-get, `apt-get install -y --no-install-recommends prometheus` (after `apt-get update` if the
#   first try fails). Anything else exits 1 with a message saying what to install.
#
# Only the path goes to stdout; apt's output goes to stderr.
set -euo pipefail

fail() {
  echo "ensure_promtool: $*" >&2
  exit 1
}

found() {
  echo "$1"
  exit 0
}

if [[ -n "${PROMTOOL:-}" ]]; then
  [[ -x "$PROMTOOL" ]] || fail "PROMTOOL=$PROMTOOL is not an executable file"
  found "$PROMTOOL"
fi

if path=$(command -v promtool); then
  found "$path"
fi
if [[ -x /usr/bin/promtool ]]; then
  found /usr/bin/promtool
fi

how="install Debian's prometheus package (apt-get install -y --no-install-recommends prometheus), \
or put promtool on PATH, or set PROMTOOL to its path"
[[ "$EUID" == 0 ]] || fail "promtool not found and not root, so not installing it: $how"
command -v apt-get >/dev/null || fail "promtool not found and there is no apt-get here: $how"

install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >&2
}

echo "ensure_promtool: promtool not found; installing Debian's prometheus package" >&2
if ! install; then
  echo "ensure_promtool: install failed; running apt-get update and retrying" >&2
  apt-get update >&2 || fail "apt-get update failed: $how"
  install || fail "apt-get install prometheus failed: $how"
fi

if path=$(command -v promtool); then
  found "$path"
fi
[[ -x /usr/bin/promtool ]] || fail "the prometheus package is installed but has no promtool: $how"
found /usr/bin/promtool
