"""Shared output of the benchmarks: a plain-text table on the terminal and a JSON record."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["default_results_dir", "format_table", "machine_info", "write_json"]


def default_results_dir() -> Path:
    """``benchmarks/results`` of the checkout when run from one, else ``./benchmarks/results``."""
    here = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    return here if here.parent.is_dir() else Path.cwd() / "benchmarks" / "results"


def machine_info() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Right-aligned columns; floats with 3 significant decimals."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return (
                f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}".rstrip("0").rstrip(".")
            )
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in text]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in text]
    return "\n".join(lines)


def write_json(name: str, record: dict[str, Any], out_dir: str | Path | None = None) -> Path:
    """Write ``record`` (plus machine info) to ``<out_dir>/<name>.json``; returns the path."""
    out = Path(out_dir) if out_dir else default_results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = {"benchmark": name, "machine": machine_info(), **record}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path
