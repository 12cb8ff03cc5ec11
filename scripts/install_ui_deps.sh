#!/usr/bin/env bash
# System packages for the UI and PostgreSQL tests: Debian's headless-capable `chromium`
# and `postgresql` (initdb/pg_ctl under /usr/lib/postgresql/*/bin). Idempotent: does
# nothing when both are present; otherwise one `apt-get update`, then one install.
# Needs root (or sudo); the server is never started as a service here, tests start their own.
set -euo pipefail

have_chromium() { command -v chromium >/dev/null 2>&1; }
have_postgres() { compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null 2>&1; }

missing=()
have_chromium || missing+=(chromium)
have_postgres || missing+=(postgresql)
if [ ${#missing[@]} -eq 0 ]; then
    echo "ui deps: chromium and postgresql already installed"
    exit 0
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "ui deps: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
# --no-install-recommends keeps the download small (fonts-dejavu-core: readable screenshots).
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" fonts-dejavu-core >/dev/null
echo "ui deps: installed ${missing[*]}"
