#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv from nothing.
# Everything comes from the package registries; torch is pinned in setup.cfg
# (an unpinned torch pulls a multi-GB CUDA build). Re-installs only when the
# packaging files change. Usage: source scripts/setup_env.sh
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="$_root/.venv"
_stamp="$_venv/.cgx_ucx_stamp"
_want="$(cat "$_root/setup.cfg" "$_root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$_venv/bin/python" ]; then
    python3 -m venv "$_venv"
fi
if [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; then
    "$_venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
    "$_venv/bin/python" -m pip install -q -e "$_root[torch,gpu,test,bench,examples]"
    echo "$_want" > "$_stamp"
fi
# iproute2 (ip, tc) for the network-namespace link emulation; best effort as root.
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq iproute2) >/dev/null 2>&1 || true
    fi
fi
export PATH="$_venv/bin:$PATH"
