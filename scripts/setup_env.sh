#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv from nothing, and says
# what it is doing: each step prints what it does and about how long it takes, and pip's
# own lines stream through (after 8 s of silence a "still working" line: never 10 s mute).
#
# - torch's exact version comes from scripts/constraints.txt (pip -c): the package itself
#   declares only the range it supports (setup.cfg), the pin keeps this project's runs
#   reproducible and on the CPU build.
# - The gpu extra (CuPy, about 250 MB) is installed only where `nvidia-smi -L` finds a GPU,
#   or when CGX_UCX_GPU=1 asks for it (CGX_UCX_GPU=0: never).
# - Re-installs only when the packaging files or that choice change.
#
# Usage: source scripts/setup_env.sh
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="$_root/.venv"
_stamp="$_venv/.cgx_ucx_stamp"
_t_setup=$SECONDS

_say() { printf 'setup: %s\n' "$*"; }

# Streams a command's output, indented; after 8 s of silence it says it is alive.
_stream() {
    local t0=$SECONDS line rc
    while true; do
        if IFS= read -r -t 8 line; then
            printf '    %s\n' "$line"
        else
            rc=$?
            [ "$rc" -gt 128 ] || { [ -z "$line" ] || printf '    %s\n' "$line"; break; }
            [ -z "$line" ] || printf '    %s\n' "$line"
            printf '    ... still working (%d s)\n' $((SECONDS - t0))
        fi
    done
}

# _step "what it does (~time)" command...: runs it with its output streamed, then the time.
_step() {
    local what="$1" t0=$SECONDS rc
    shift
    _say "$what"
    set +e
    "$@" 2>&1 | _stream
    rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" -ne 0 ]; then
        _say "FAILED (exit $rc) after $((SECONDS - t0)) s: $*"
        return "$rc"
    fi
    _say "  done in $((SECONDS - t0)) s"
}

_say "checking .venv in $_root (first run: about 2-5 min; later runs: instant)"

case "${CGX_UCX_GPU:-auto}" in
    1 | yes | true) _gpu=1 _why="CGX_UCX_GPU=${CGX_UCX_GPU}" ;;
    0 | no | false) _gpu=0 _why="CGX_UCX_GPU=${CGX_UCX_GPU}" ;;
    *)
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            _gpu=1 _why="nvidia-smi -L found a GPU"
        else
            _gpu=0 _why="no GPU found by nvidia-smi -L; CGX_UCX_GPU=1 installs it anyway"
        fi
        ;;
esac
_extras="torch,test,bench,examples,docs,ft"
if [ "$_gpu" = 1 ]; then
    _extras="$_extras,gpu"
fi
_want="$(
    cat "$_root/setup.cfg" "$_root/pyproject.toml" "$_root/scripts/constraints.txt" | sha256sum | cut -d' ' -f1
)-$_extras"

if [ ! -x "$_venv/bin/python" ]; then
    _step "creating .venv with $(python3 --version 2>&1) (~5-15 s)" python3 -m venv "$_venv"
fi
if [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; then
    _step "upgrading pip, setuptools and wheel in .venv (~10 s)" \
        "$_venv/bin/python" -m pip install --upgrade pip setuptools wheel
    if [ "$_gpu" = 1 ]; then
        _say "GPU extra (CuPy): yes ($_why)"
    else
        _say "GPU extra (CuPy): no ($_why)"
    fi
    _step "installing cgx_ucx[$_extras] (editable): torch CPU, ucxx, numba, pytest, mkdocs, ... (~1-4 min: torch alone unpacks ~750 MB)" \
        "$_venv/bin/python" -m pip install -c "$_root/scripts/constraints.txt" -e "$_root[$_extras]"
    if [ "$_gpu" = 0 ] && "$_venv/bin/python" -m pip show -q cupy-cuda12x >/dev/null 2>&1; then
        _say "note: CuPy from an earlier set-up stays in .venv (pip uninstall cupy-cuda12x drops it)"
    fi
    echo "$_want" >"$_stamp"
    _say "environment ready in $((SECONDS - _t_setup)) s"
else
    _say ".venv is up to date (scripts/constraints.txt, setup.cfg unchanged)"
fi
# iproute2 (ip, tc) for the network-namespace link emulation; best effort as root.
if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        _step "installing iproute2 (ip, tc) for the link emulation, best effort (~10-30 s)" \
            bash -c 'apt-get update -qq && apt-get install -y -qq iproute2' || true
    fi
fi
export PATH="$_venv/bin:$PATH"
