#!/usr/bin/env bash
# Installs the Debian packages zeroshard builds and tests with. Idempotent: when everything is
# present it prints one line and touches nothing (no apt-get update, no root needed).
set -euo pipefail

# One package per line; add new ones here.
packages=(
  build-essential
  cmake
  ninja-build
  pkg-config
  libopenmpi-dev
  openmpi-bin
  libtbb-dev
  liburing-dev
  fio
  e2fsprogs
  iproute2
  slurmctld
  slurmd
  nlohmann-json3-dev
  libgtest-dev
  libgmock-dev
  libbenchmark-dev
  libopenblas-dev
  python3
  python3-dev
  python3-venv
  python3-torch
  python3-pytest
  python3-matplotlib
  python3-pyflakes
  clang-format
)

if ! command -v dpkg-query >/dev/null; then
  echo "setup: not a Debian system; install these yourself: ${packages[*]}"
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  # "ii " = wanted and installed; anything else (absent, half-installed, removed) needs apt.
  if [[ "$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null)" != "ii " ]]; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

sudo=()
if ((EUID != 0)); then
  if ! command -v sudo >/dev/null; then
    echo "setup: need root or sudo to install: ${missing[*]}" >&2
    exit 1
  fi
  sudo=(sudo)
fi

# Runs an apt command quietly; prints one line for it, and its output only if it fails.
apt_get() {
  echo "setup: apt-get $*"
  local log
  log="$(mktemp)"
  if ! "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "setup: apt-get $1 failed" >&2
    exit 1
  fi
  rm -f "$log"
}

apt_get update
apt_get install -y --no-install-recommends "${missing[@]}"
