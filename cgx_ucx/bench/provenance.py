"""Where a benchmark figure comes from: the ``provenance`` block of every result JSON.

:func:`collect` records the command line, the git commit of the checkout, the UTC date, the
host (CPU model, logical cores, memory, GPUs), the library versions, the load average when
this process started (this module's import, which every benchmark does before it measures)
and when the result is written, and the machine class. The machine class names the folder
of ``benchmarks/results/`` that holds the checkout's current figures of such a host:
``cpu-2core`` (no GPU, 2 logical cores), ``h200-16core`` (an H200, 16 logical cores).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "collect",
    "command_line",
    "git_state",
    "gpus",
    "host_info",
    "library_versions",
    "load_average",
    "machine_class",
]

#: The checkout this package runs from (a source tree has ``.git`` here).
REPO_ROOT = Path(__file__).resolve().parents[2]
#: Distributions whose versions a result records, by the name shown; the first installed
#: distribution of each list is taken (CUDA builds carry a suffix).
LIBRARIES: dict[str, tuple[str, ...]] = {
    "cgx_ucx": ("cgx_ucx", "cgx-ucx"),
    "torch": ("torch",),
    "numpy": ("numpy",),
    "numba": ("numba",),
    "ucxx": ("ucxx-cu12", "ucxx-cu13", "ucxx", "ucx-py-cu12"),
    "libucx": ("libucx-cu12", "libucx-cu13", "libucx"),
    "cupy": ("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy"),
}
#: Seconds any external query (git, nvidia-smi) may take before it is given up.
QUERY_TIMEOUT = 10.0
#: Vendor words dropped from a GPU's name before its short name is taken.
_GPU_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the system has none."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except (AttributeError, OSError):
        return None


#: The load when this process started: benchmarks import this module before they measure.
LOAD_AT_START = load_average()


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran, as a user would type it: ``python -m cgx_ucx.bench codec ...``
    for the benchmark command line (whichever way it was started), ``python <script> ...``
    for a script, relative to the checkout when it lies inside it."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "python"
    script, args = Path(argv[0]), argv[1:]
    bench_dir = Path(__file__).resolve().parent
    try:
        resolved = script.resolve()
    except OSError:
        resolved = script
    if script.name == "cgx-bench" or resolved == bench_dir / "__main__.py":
        prefix = ["python", "-m", "cgx_ucx.bench"]
    elif resolved.parent == bench_dir and resolved.suffix == ".py":
        prefix = ["python", "-m", "cgx_ucx.bench", resolved.stem]
    else:
        try:
            shown = str(resolved.relative_to(REPO_ROOT))
        except ValueError:
            shown = argv[0]
        prefix = ["python", shown]
    return shlex.join(prefix + args)


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=QUERY_TIMEOUT, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


#: Tracked paths a benchmark run writes or renders (its results, the docs pages and the
#: README's headline table): changes there say nothing about the code that was measured.
OUTPUT_PATHS = ("benchmarks/results/", "docs/", "README.md")
#: Changed paths named in a result's provenance, at most.
MAX_CHANGED = 20


def git_state(root: Path = REPO_ROOT) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool, "changed": [path, ...]}`` of the checkout at
    ``root``, or None outside one. ``changed``: the tracked files that differ from the
    commit (untracked files do not count), but for :data:`OUTPUT_PATHS` (a refresh of
    one tracked result before another would otherwise mark the second as measured on
    uncommitted code); at most :data:`MAX_CHANGED` of them. ``dirty``: any such file."""
    if not (root / ".git").exists():
        return None
    commit = _run(["git", "rev-parse", "HEAD"], root)
    if not commit:
        return None
    diff = _run(["git", "diff", "--name-only", "HEAD", "--"], root)
    if diff is None:
        return {"commit": commit, "dirty": None, "changed": None}
    changed = sorted(
        path for path in diff.splitlines() if path and not path.startswith(OUTPUT_PATHS)
    )
    return {"commit": commit, "dirty": bool(changed), "changed": changed[:MAX_CHANGED]}


@functools.cache
def gpus() -> list[dict[str, Any]]:
    """The NVIDIA GPUs ``nvidia-smi`` lists (name, memory in MiB, driver); [] without one."""
    text = _run(
        [
            "nvidia-smi",
            "--query-gpu=name,memory.total,driver_version",
            "--format=csv,noheader,nounits",
        ]
    )
    found = []
    for line in (text or "").splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3 or not parts[0]:
            continue
        memory = int(parts[1]) if parts[1].isdigit() else None
        found.append({"name": parts[0], "memory_mib": memory, "driver": parts[2]})
    return found


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return total if total > 0 else None


def host_info() -> dict[str, Any]:
    """CPU model, logical cores, physical memory, OS and GPUs of this machine."""
    memory = _memory_bytes()
    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "memory_gib": round(memory / (1 << 30), 1) if memory else None,
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "gpus": gpus(),
    }


def _gpu_short_name(name: str) -> str:
    words = [w for w in re.split(r"[\s_]+", name) if w and w.lower() not in _GPU_VENDOR_WORDS]
    if not words:
        return "gpu"
    short = words[0].split("-")[0]
    if short.isalpha() and len(words) > 1:  # "RTX 4090" -> "rtx4090"
        short += words[1].split("-")[0]
    return re.sub(r"[^a-z0-9]", "", short.lower()) or "gpu"


def machine_class(cores: int | None = None, gpu_names: list[str] | None = None) -> str:
    """The folder of ``benchmarks/results/`` for this kind of machine: the first GPU's short
    name (or ``cpu``) and the logical cores, e.g. ``cpu-2core``, ``h200-16core``.
    ``cores`` and ``gpu_names`` default to this machine's."""
    if cores is None:
        cores = os.cpu_count() or 1
    names = [gpu["name"] for gpu in gpus()] if gpu_names is None else gpu_names
    kind = _gpu_short_name(names[0]) if names else "cpu"
    return f"{kind}-{cores}core"


def _ucx_version() -> str | None:
    ucxx = sys.modules.get("ucxx")  # only when the benchmark loaded it: no import here
    if ucxx is None:
        return None
    try:
        return ".".join(str(part) for part in ucxx.get_ucx_version())
    except Exception:  # a version query must never fail a benchmark
        return None


def library_versions() -> dict[str, str | None]:
    """Python and the installed versions of :data:`LIBRARIES` (None: not installed), and
    the UCX library's own version when ucxx is loaded."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for shown, names in LIBRARIES.items():
        versions[shown] = None
        for name in names:
            try:
                versions[shown] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
    ucx = _ucx_version()
    if ucx is not None:
        versions["ucx"] = ucx
    return versions


def collect(argv: list[str] | None = None) -> dict[str, Any]:
    """The ``provenance`` block of a result written now (see the module doc)."""
    return {
        "command": command_line(argv),
        "git": git_state(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": host_info(),
        "libraries": library_versions(),
        "load_before": LOAD_AT_START,
        "load_after": load_average(),
        "machine_class": machine_class(),
    }
