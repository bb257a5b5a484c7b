#!/usr/bin/env bash
# Installs the system packages the test suite drives for real: PostgreSQL server binaries and
# Debian's Chromium (Playwright never downloads a browser here). Idempotent and quiet when present.
set -euo pipefail
need=()
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$pg_bin" ] || [ ! -x "$pg_bin/initdb" ]; then need+=(postgresql); fi
if [ ! -x /usr/bin/chromium ]; then need+=(chromium); fi
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing system packages: ${need[*]} (run as root or install them with apt-get)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
