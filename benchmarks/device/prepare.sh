#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with what benchmarks/device_check.sh needs on a machine
# without network; copy it there with the checkout (git does not take it along):
#   bash benchmarks/device/prepare.sh
# 1. The UCXX wheels for the machine's Python 3.12 (x86-64 manylinux): ucxx-cu12 and the
#    libraries it loads (libucxx, libucx, librmm, rapids-logger), the versions this
#    checkout's environment runs (scripts/setup_env.sh), about 51 MB. torch, CuPy, Numba,
#    NumPy and pytest are the machine's own (a CUDA torch wheel is gigabytes).
# 2. .whl/iproute: ip and tc of this machine with the shared libraries they load, behind
#    wrappers that run them through the dynamic loader with those libraries (the loader's
#    --library-path, so nothing they start inherits LD_LIBRARY_PATH).
# Prints what .whl/ weighs, and fails above 60 MiB: the checkout (about 3 MiB) and .whl/
# are copied to the machine together, and such a copy is limited to 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
PYTHON_VERSION="${CGX_DEVICE_PYTHON_VERSION:-3.12}"
WHL=.whl
mkdir -p "$WHL"
version() {  # the version installed in this checkout's environment, else the default
  local v
  v=$(.venv/bin/python -c "from importlib.metadata import version; print(version('$1'))" \
      2>/dev/null) || v="$2"
  echo "$1==$v"
}
specs=("$(version ucxx-cu12 0.52.0)" "$(version libucxx-cu12 0.52.0)"
       "$(version libucx-cu12 1.21.0)" "$(version librmm-cu12 26.10.0)"
       "$(version rapids-logger 0.3.0)")
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
echo "== pip download ${specs[*]} (Python $PYTHON_VERSION)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
  --implementation cp "${platforms[@]}" -d "$WHL" "${specs[@]}"

echo "== iproute2 bundle"
bundle="$WHL/iproute"
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
for tool in ip tc; do
  src=$(command -v "$tool") || { echo "no $tool here: apt-get install iproute2"; exit 1; }
  cp -L "$src" "$bundle/bin/$tool"
  ldd "$src" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;
      *) cp -L "$lib" "$bundle/lib/" ;;
    esac
  done
  cat >"$bundle/$tool" <<WRAP
#!/bin/sh
# $tool of the carried iproute2, with its own libraries (benchmarks/device/prepare.sh).
d=\$(dirname "\$(readlink -f "\$0")")
exec /lib64/ld-linux-x86-64.so.2 --library-path "\$d/lib" "\$d/bin/$tool" "\$@"
WRAP
  chmod +x "$bundle/$tool"
done
"$bundle/ip" -V
"$bundle/tc" -V
ls -la "$WHL" "$bundle/lib"
du -sh "$WHL"
size=$(du -sm "$WHL" | cut -f1)
if [ "$size" -gt 60 ]; then
  echo "$WHL weighs $size MiB: with the checkout it would pass the 64 MiB of one copy"
  exit 1
fi
