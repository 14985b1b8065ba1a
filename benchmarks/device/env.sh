# Sourced by benchmarks/device_check.sh: makes the carried packages and tools usable.
#   device_env ROOT SITE   (PY names the interpreter)
# - ucxx: when PY cannot import it, the wheels of ROOT/.whl (benchmarks/device/prepare.sh
#   fetches them) are installed into SITE, which goes first on PYTHONPATH. The machine has
#   no network: nothing else is installed, its own torch, CuPy, Numba and NumPy are used.
# - ip and tc (iproute2, for the link emulation): when either is missing, or
#   CGX_DEVICE_CARRIED_IPROUTE=1, the bundle ROOT/.whl/iproute goes first on PATH (its
#   wrappers run the carried binaries with the carried libraries).
# - ROOT goes on PYTHONPATH: the package runs from the checkout, nothing installs it.
# Returns non-zero, saying why, when ucxx stays missing.
device_env() {
  local root="$1" site="$2" whl="$1/.whl"
  if [ "${CGX_DEVICE_CARRIED_IPROUTE:-0}" = 1 ] || ! command -v ip >/dev/null \
      || ! command -v tc >/dev/null; then
    if [ -x "$whl/iproute/ip" ] && [ -x "$whl/iproute/tc" ]; then
      export PATH="$whl/iproute:$PATH"
      echo "== ip and tc from the carried bundle: $("$whl/iproute/ip" -V 2>&1 | head -1)"
    else
      echo "== no ip/tc here and no carried bundle in $whl/iproute: link emulation will fail"
    fi
  fi
  if ! "$PY" -c "import ucxx" 2>/dev/null; then
    if ! compgen -G "$whl/*.whl" >/dev/null; then
      echo "== ucxx is missing and $whl holds no wheels (run benchmarks/device/prepare.sh)"
      return 1
    fi
    echo "== installing the carried wheels into $site: $(cd "$whl" && ls -- *.whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$whl"/*.whl || { echo "== the wheels did not install"; return 1; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c "import ucxx" || { echo "== ucxx does not import"; return 1; }
}
