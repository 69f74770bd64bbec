#!/usr/bin/env bash
# Debian packages that the proxy benchmark, the router-shard setup and the
# monitoring tests need: wrk drives the load, nginx serves the instant stub
# engines, haproxy fronts router shards, prometheus (with promtool) scrapes a
# live pool for the dashboard's queries and unit-tests the alert rules.
# Idempotent: installs only what is missing, and refreshes the package lists
# only when something has to be installed.
#   scripts/system-packages.sh                        all of them
#   scripts/system-packages.sh haproxy prometheus     only these commands (make test)
set -euo pipefail

# command name -> Debian package
declare -A PACKAGES=([wrk]=wrk [nginx]=nginx [haproxy]=haproxy [prometheus]=prometheus [promtool]=prometheus)

wanted=("$@")
if [[ ${#wanted[@]} -eq 0 ]]; then
    wanted=("${!PACKAGES[@]}")
fi
missing=()
for cmd in "${wanted[@]}"; do
    if [[ -z "${PACKAGES[$cmd]+x}" ]]; then
        echo "system-packages.sh: unknown command '$cmd'; known: ${!PACKAGES[*]}" >&2
        exit 2
    fi
    # nginx and haproxy live in /usr/sbin, which a non-root PATH may lack.
    if ! command -v "$cmd" >/dev/null 2>&1 && [[ ! -x "/usr/sbin/$cmd" ]]; then
        missing+=("${PACKAGES[$cmd]}")
    fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi

if [[ $(id -u) -eq 0 ]]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
else
    echo "system-packages.sh: missing ${missing[*]}; run as root or install sudo" >&2
    exit 2
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "system-packages.sh: missing ${missing[*]} and no apt-get (Debian/Ubuntu only)" >&2
    exit 2
fi

export DEBIAN_FRONTEND=noninteractive
# Install from the current lists first; refresh them only when that fails
# (a fresh machine has none, an old one may name gone versions).
if ! "${SUDO[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; then
    "${SUDO[@]}" apt-get update
    "${SUDO[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
fi
echo "system-packages.sh: installed ${missing[*]}"
