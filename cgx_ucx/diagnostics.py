"""What a bug report needs: versions, UCX transports, GPU status, the variables in effect.

``cgx_ucx.describe()`` prints it and returns it as a dict; ``python -m cgx_ucx.diagnostics``
prints it from a shell. Nothing here imports torch, ucxx or CuPy unless asked to look at
them (CuPy only when installed), and nothing here raises: a part that cannot be found is
reported as such, since the report is most wanted when something is broken.

UCX's transports come from ``ucx_info -d`` of the libucx wheel (the same library ucxx
loads), run with a deadline: importing ucxx only to list them would start UCX in this
process, with its environment defaults, before the user's job does.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

from .config import environment_problems, resolve_compression
from .errors import CGXError

__all__ = ["describe", "format_report"]

#: Distributions whose versions a report lists: (label, distribution names to try).
PACKAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("cgx_ucx", ("cgx_ucx", "cgx-ucx")),
    ("numpy", ("numpy",)),
    ("numba", ("numba",)),
    ("ml_dtypes", ("ml_dtypes", "ml-dtypes")),
    ("torch", ("torch",)),
    ("ucxx", ("ucxx-cu12", "ucxx-cu13", "ucxx")),
    ("libucx", ("libucx-cu12", "libucx-cu13", "libucx")),
    ("cupy", ("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy")),
)
#: Variables shown besides CGX_* and UCX_*: they change threads and rendezvous.
RELATED_ENV = (
    "NUMBA_NUM_THREADS",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)
#: ucx_info normally answers well under a second; a hung one must not hang a bug report.
UCX_INFO_TIMEOUT = 10.0


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _ucx_info(flag: str) -> tuple[str | None, str | None]:
    """(stdout of ``ucx_info <flag>``, None) or (None, why not)."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or spec.origin is None:
        return None, "libucx is not installed"
    root = Path(spec.origin).parent
    exe = root / "bin" / "ucx_info"
    if not exe.exists():
        return None, f"{exe} not found"
    lib = str(root / "lib")
    old = os.environ.get("LD_LIBRARY_PATH")
    env = dict(os.environ, LD_LIBRARY_PATH=f"{lib}:{old}" if old else lib)
    try:
        proc = subprocess.run(
            [str(exe), flag], env=env, capture_output=True, text=True, timeout=UCX_INFO_TIMEOUT
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"ucx_info {flag}: {type(exc).__name__}: {exc}"
    if proc.returncode != 0:
        return None, f"ucx_info {flag} exited {proc.returncode}: {proc.stderr.strip()[-200:]}"
    return proc.stdout, None


def _ucx() -> dict[str, Any]:
    out: dict[str, Any] = {"version": None, "transports": [], "error": None}
    text, err = _ucx_info("-v")
    if text is not None:
        for line in text.splitlines():
            if "Library version:" in line:
                out["version"] = line.split(":", 1)[1].strip()
    text, err2 = _ucx_info("-d")
    out["error"] = err or err2
    if text is not None:
        seen: dict[str, list[str]] = {}
        transport = None
        for line in text.splitlines():
            key, _, value = line.strip().lstrip("#").strip().partition(":")
            if key == "Transport":
                transport = value.strip()
                seen.setdefault(transport, [])
            elif key == "Device" and transport is not None and value.strip() not in seen[transport]:
                seen[transport].append(value.strip())
        out["transports"] = [{"transport": t, "devices": d} for t, d in seen.items()]
    return out


def _gpu() -> dict[str, Any]:
    out: dict[str, Any] = {"cupy_installed": importlib.util.find_spec("cupy") is not None}
    out["cupy_importable"] = False
    out["devices"] = 0
    out["error"] = None
    if not out["cupy_installed"]:
        out["error"] = "CuPy is not installed (the gpu extra): CPU arrays only"
        return out
    try:
        import cupy

        out["cupy_importable"] = True
        out["devices"] = int(cupy.cuda.runtime.getDeviceCount())
        if out["devices"]:
            props = cupy.cuda.runtime.getDeviceProperties(0)
            name = props.get("name", b"")
            out["device0"] = name.decode() if isinstance(name, bytes) else str(name)
    except Exception as exc:  # no driver, no device: say so, do not fail the report
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _environment() -> dict[str, str]:
    """The variables that matter, secrets masked (the output is meant for bug reports)."""
    return {
        k: ("(set, not shown)" if "SECRET" in k else v)
        for k, v in sorted(os.environ.items())
        if k.startswith(("CGX_", "UCX_")) or k in RELATED_ENV
    }


def _collect() -> dict[str, Any]:
    versions = {"python": platform.python_version()}
    versions.update({label: _version(names) for label, names in PACKAGES})
    ucx = _ucx()
    versions["UCX"] = ucx.pop("version")
    from .transport.topology import hierarchy_problems  # here only: import stays light

    problems = environment_problems() + hierarchy_problems()
    try:
        config = str(resolve_compression())
    except CGXError:
        config = "not resolved (a bad CGX_COMPRESSION_* variable, below)"
    return {
        "versions": versions,
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "ucx": ucx,
        "gpu": _gpu(),
        "environment": _environment(),
        "compression_from_environment": config,
        "environment_problems": problems,
    }


def format_report(info: dict[str, Any]) -> str:
    """The text :func:`describe` prints, from the dict it returns."""
    lines = ["cgx_ucx diagnostics"]
    lines.append(f"  platform: {info['platform']}, {info['cpus']} CPUs")
    lines.append("  versions:")
    for name, version in info["versions"].items():
        lines.append(f"    {name:10s} {version or 'not installed'}")
    ucx = info["ucx"]
    lines.append("  UCX transports (ucx_info -d):")
    for t in ucx["transports"]:
        lines.append(f"    {t['transport']:10s} {', '.join(t['devices'])}")
    if ucx["error"]:
        lines.append(f"    ({ucx['error']})")
    gpu = info["gpu"]
    status = f"{gpu['devices']} device(s)" if gpu["cupy_importable"] else "CuPy not importable"
    if gpu.get("device0"):
        status += f", device 0: {gpu['device0']}"
    lines.append(f"  GPU: {status}" + (f" ({gpu['error']})" if gpu["error"] else ""))
    lines.append(f"  compression from the environment: {info['compression_from_environment']}")
    problems = info.get("environment_problems", [])
    lines.append(f"  bad CGX_* variables: {len(problems) or 'none'}")
    for problem in problems:
        lines.append(f"    bad: {problem}")
    lines.append("  environment (CGX_*, UCX_*, threads, rendezvous):")
    for k, v in info["environment"].items():
        lines.append(f"    {k}={v}")
    if not info["environment"]:
        lines.append("    (none set)")
    return "\n".join(lines)


def describe(file: TextIO | None = None, *, quiet: bool = False) -> dict[str, Any]:
    """Print (to ``file``, default stdout; nothing when ``quiet``) and return what a bug
    report needs: versions (cgx_ucx, Python, NumPy, Numba, torch, ucxx, UCX), the UCX
    transports and devices available, GPU status (CuPy importable, device count) and the
    CGX_*/UCX_* variables in effect."""
    info = _collect()
    if not quiet:
        print(format_report(info), file=file if file is not None else sys.stdout, flush=True)
    return info


if __name__ == "__main__":
    describe()
