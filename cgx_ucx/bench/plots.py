"""The docs' benchmark plots, drawn from a result JSON with matplotlib (Agg).

Each plotter takes the parsed JSON and a Figure (or None: only say whether it would draw)
and returns False when the JSON holds nothing to draw, so the page's Markdown does not depend
on matplotlib being installed. :func:`save` writes a PNG without a creation time or software
tag, so that the same JSON and matplotlib give the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["PLOTTERS", "drawable", "save"]

MIB = 1 << 20


def _ticks(ax: Any, values: list[float]) -> None:
    """Log-2 axis labelled with the values themselves (1, 4, 16 rather than 2^0, 2^2)."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(values))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{v:g}" for v in ticks])


_METHOD_STYLE = {"gloo": "k--", "cgx32": "C0", "cgx8": "C1", "cgx4": "C2", "cgx2": "C3"}


def _link(data: dict[str, Any], fig: Any) -> bool:
    configs = [c for c in data.get("configs", []) if len({r["size"] for r in c["allreduce"]}) > 1]
    if not configs or fig is None:
        return bool(configs)
    axes = fig.subplots(1, len(configs), squeeze=False, sharey=True)[0]
    for ax, config in zip(axes, configs, strict=True):
        results = config["allreduce"]
        for method, style in _METHOD_STYLE.items():
            mine = sorted((r for r in results if r["method"] == method), key=lambda r: r["size"])
            if mine:
                sizes = [r["size"] / MIB for r in mine]
                ax.plot(
                    sizes, [r.get("speedup") or 0 for r in mine], style, marker="o", label=method
                )
        _ticks(ax, [r["size"] / MIB for r in results])
        ax.set_title(f"{config.get('world_size')} ranks, {config.get('link', {}).get('rate')}")
        ax.set_xlabel("MiB")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speed-up over gloo")
    axes[0].legend(fontsize=8)
    return True


def _nodes(data: dict[str, Any], fig: Any) -> bool:
    cases = [
        (
            config.get("link", {}).get("rate"),
            size,
            [r for r in config["allreduce"] if r["size"] == size],
        )
        for config in data.get("configs", [])
        for size in sorted({r["size"] for r in config.get("allreduce", [])})
    ]
    if not cases or fig is None:
        return bool(cases)
    ax = fig.subplots()
    methods = [m for m in ("gloo", "flat32", "hier32", "flat4", "hier4")]
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = []
        for _rate, _size, rows in cases:
            hit = [r for r in rows if r["method"] == method]
            values.append(hit[0]["time_s"] * 1e3 if hit else 0.0)
        ax.bar([k + i * width for k in range(len(cases))], values, width, label=method)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(cases))])
    ax.set_xticklabels([f"{rate}\n{size // MIB} MiB" for rate, size, _ in cases], fontsize=8)
    ax.set_ylabel("median ms")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return True


def _throughput(rows: list[dict[str, Any]], series: dict[str, str], fig: Any) -> bool:
    rows = sorted((r for r in rows if r.get("bits") == 4), key=lambda r: r["MiB"])
    if not rows or fig is None:
        return bool(rows)
    ax = fig.subplots()
    for key, label in series.items():
        ax.plot([r["MiB"] for r in rows], [r.get(key) or 0 for r in rows], marker="o", label=label)
    _ticks(ax, [r["MiB"] for r in rows])
    ax.set_xlabel("MiB of float32 input")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return True


def _codec(data: dict[str, Any], fig: Any) -> bool:
    series = {"memcpy_GBps": "memcpy", "encode_GBps": "encode 4-bit"}
    series |= {"encode_sr_GBps": "encode, stochastic", "decode_add_GBps": "decode_add"}
    return _throughput(data.get("rows", []), series, fig)


def _gpu_codec(data: dict[str, Any], fig: Any) -> bool:
    series = {"copy_GBps": "device copy", "encode_GBps": "encode 4-bit"}
    series |= {"decode_GBps": "decode", "decode_add_GBps": "decode_add"}
    return _throughput(data.get("throughput", []), series, fig)


def _latency(data: dict[str, Any], fig: Any) -> bool:
    rows = [r for r in data.get("rows", []) if r.get("path") == "torch" and r.get("world") == 2]
    rows = [r for r in rows if "barrier" not in r["method"]]
    if len({r["kib"] for r in rows}) < 2 or fig is None:
        return len({r["kib"] for r in rows}) >= 2
    ax = fig.subplots()
    for method, style in _METHOD_STYLE.items():
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["kib"])
        if mine:
            ax.plot(
                [r["kib"] for r in mine],
                [r["median_us"] for r in mine],
                style,
                marker="o",
                label=method,
            )
    _ticks(ax, [r["kib"] for r in rows])
    ax.set_yscale("log")
    ax.set_xlabel("KiB")
    ax.set_ylabel("median us, torch all_reduce, 2 ranks")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return True


#: Plotters by the JSON's ``benchmark`` field.
PLOTTERS: dict[str, Callable[[dict[str, Any], Any], bool]] = {
    "link": _link,
    "nodes": _nodes,
    "codec": _codec,
    "gpu_codec": _gpu_codec,
    "latency": _latency,
}


def drawable(benchmark: str, data: dict[str, Any]) -> bool:
    """Whether :func:`save` draws a plot of this result (matplotlib not needed to tell)."""
    plotter = PLOTTERS.get(benchmark)
    return plotter is not None and plotter(data, None)


def save(benchmark: str, data: dict[str, Any], path: Path) -> bool:
    """Draw ``data`` with the plotter of ``benchmark`` into ``path`` (PNG); False when there
    is no plotter for it, nothing to draw, or no matplotlib."""
    plotter = PLOTTERS.get(benchmark)
    if plotter is None:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(8, 3.6), dpi=100, layout="constrained")
    if not plotter(data, fig):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None})
    return True
