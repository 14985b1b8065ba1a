"""The docs' benchmark sections, one per result JSON: what the benchmark measures, its tables
of figures and the provenance line, rendered as Markdown from the JSON alone.

A section renderer takes the parsed JSON and returns Markdown blocks (tables, lists). It
reads fields with ``.get`` so that a result written by an older version of its benchmark,
which may lack a field, still renders (the missing cell shows ``-``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "RENDERERS",
    "SUMMARIES",
    "TITLES",
    "accuracy",
    "fmt",
    "percent",
    "provenance_line",
    "ratio",
    "table",
]

MIB = 1 << 20
#: cgx methods in the order the tables show them, uncompressed first.
CGX_METHODS = ("cgx32", "cgx8", "cgx4", "cgx2")


def fmt(value: Any, unit: str = "") -> str:
    """A figure with three significant digits at most (``-`` for a missing one)."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    size = abs(value)
    if size >= 100 or (value == int(value) and size >= 1):
        text = f"{value:.0f}"
    elif size >= 10:
        text = f"{value:.1f}"
    elif size >= 1:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3g}"
    return text + unit


def ratio(value: Any) -> str:
    """A speed-up or a ratio of times: ``6.9x`` (``-`` for a missing one)."""
    return "-" if value is None else fmt(value, "x")


def accuracy(value: Any) -> str:
    """An accuracy in percent with two decimals (``97.59``): three digits hide the
    differences between policies."""
    return "-" if value is None else f"{value:.2f}"


def percent(value: Any, digits: int = 2) -> str:
    """A relative difference as a signed percentage: ``+0.04%``."""
    return "-" if value is None else f"{value * 100:+.{digits}f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; cells already formatted as text."""
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def rate_label(rate: Any) -> str:
    """``1gbit`` as ``1 Gbit/s``; other spellings as given."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg])bit", str(rate))
    if not match:
        return str(rate)
    return f"{match[1]} {match[2].upper()}bit/s"


def size_label(nbytes: float) -> str:
    """``64 MiB``, ``512 KiB``."""
    if nbytes >= MIB:
        return f"{fmt(nbytes / MIB)} MiB"
    return f"{fmt(nbytes / 1024)} KiB"


def _load(values: Any) -> str:
    if not values:
        return "-"
    return " / ".join(f"{v:.2f}" for v in values)


def provenance_line(data: dict[str, Any]) -> str:
    """One line: date, commit, host, load before and after, library versions; for a result
    written without a provenance block, ``provenance: not recorded`` and what the old
    ``machine`` record says."""
    prov = data.get("provenance")
    if not isinstance(prov, dict):
        machine = data.get("machine") or {}
        known = ", ".join(
            text
            for text in (
                f"written {machine['time']}" if machine.get("time") else "",
                f"{machine['cpus']} cores" if machine.get("cpus") else "",
                f"Python {machine['python']}" if machine.get("python") else "",
            )
            if text
        )
        return "Provenance: not recorded" + (f" ({known})." if known else ".")
    git = prov.get("git") or {}
    commit = git.get("commit")
    commit_text = f"commit `{commit[:10]}`" if commit else "no git checkout"
    if git.get("dirty"):
        changed = git.get("changed")
        commit_text += (
            f" (uncommitted changes to {', '.join(f'`{c}`' for c in changed)})"
            if changed
            else " (uncommitted changes)"
        )
    host = prov.get("host") or {}
    gpus = host.get("gpus") or []
    gpu_text = ", ".join(g.get("name", "?") for g in gpus) if gpus else "no GPU"
    host_text = (
        f"{host.get('cpu', '?')}, {host.get('logical_cores', '?')} logical cores, "
        f"{fmt(host.get('memory_gib'))} GiB, {gpu_text}"
    )
    libs = prov.get("libraries") or {}
    lib_text = ", ".join(f"{name} {version}" for name, version in libs.items() if version)
    return (
        f"Provenance: {prov.get('date', '?')}, {commit_text}; {host_text}; load "
        f"{_load(prov.get('load_before'))} before, {_load(prov.get('load_after'))} after; "
        f"{lib_text}."
    )


def _codec(data: dict[str, Any]) -> list[str]:
    rows = [
        [
            f"{fmt(r.get('MiB'))} MiB",
            r.get("bits", "-"),
            fmt(r.get("memcpy_GBps")),
            f"{fmt(r.get('encode_GBps'))} ({ratio(r.get('encode_vs_memcpy'))})",
            fmt(r.get("encode_sr_GBps")),
            f"{fmt(r.get('decode_add_GBps'))} ({ratio(r.get('decode_add_vs_memcpy'))})",
            ratio(r.get("encode_vs_ref")),
        ]
        for r in data.get("rows", [])
    ]
    headers = ["buffer", "bits", "memcpy", "encode (x memcpy)", "encode, stochastic"]
    headers += ["decode_add (x memcpy)", "encode vs NumPy reference"]
    note = (
        f"{data.get('units', 'GB/s')}; bucket {data.get('bucket_size', '-')}, median of "
        f"{data.get('repeat', '-')}, {data.get('codec_threads', '-')} codec threads."
    )
    return [table(headers, rows), note]


def _allreduce(data: dict[str, Any]) -> list[str]:
    blocks = []
    results = data.get("allreduce", [])
    for world in sorted({r.get("world") for r in results}):
        mine = [r for r in results if r.get("world") == world]
        methods = [m for m in ("gloo", *CGX_METHODS) if any(r["method"] == m for r in mine)]
        rows = []
        for size in sorted({r.get("size_mib") for r in mine}):
            cells = [f"{fmt(size)} MiB"]
            for method in methods:
                hit = [r for r in mine if r["method"] == method and r.get("size_mib") == size]
                if not hit:
                    cells.append("-")
                elif method == "gloo":
                    cells.append(fmt(hit[0].get("algbw_GBps")))
                else:
                    r = hit[0]
                    cells.append(f"{fmt(r.get('algbw_GBps'))} ({ratio(r.get('speedup_vs_gloo'))})")
            rows.append(cells)
        blocks.append(f"{world} ranks, algorithm bandwidth in GB/s (x gloo):")
        blocks.append(table(["size", *methods], rows))
    p2p = data.get("p2p") or []
    if p2p:
        rows = [
            [
                f"{fmt(r.get('size_mib'))} MiB",
                fmt(r.get("GBps")),
                fmt(r.get("perftest_GBps")),
                ratio(r.get("ratio")),
            ]
            for r in p2p
        ]
        blocks.append("Point to point between the same two processes, GB/s:")
        blocks.append(table(["size", "cgx_ucx", "ucx_perftest tag_bw", "ratio"], rows))
    return blocks


def _latency_rows(data: dict[str, Any]) -> list[str]:
    blocks = []
    results = data.get("rows", [])
    widths = [
        m for m in ("cgx32", "cgx4", "cgx8", "cgx2") if any(r["method"] == m for r in results)
    ]
    for world in sorted({r.get("world") for r in results}):
        mine = [r for r in results if r.get("world") == world]

        def median(method: str, path: str, kib: float, rows: list[dict[str, Any]] = mine) -> Any:
            for r in rows:
                if r["method"] == method and r.get("path") == path and r.get("kib") == kib:
                    return r.get("median_us")
            return None

        headers = ["all_reduce", "gloo"]
        for m in widths:
            headers.append(f"cgx {m[3:]}-bit: torch / engine / core (x gloo)")
        rows = []
        for kib in sorted({r.get("kib") for r in mine if "barrier" not in r["method"]}):
            gloo = median("gloo", "torch", kib)
            cells = [size_label(kib * 1024), fmt(gloo, " us")]
            for m in widths:
                torch = median(m, "torch", kib)
                x = torch / gloo if torch is not None and gloo else None
                paths = " / ".join(fmt(median(m, p, kib)) for p in ("torch", "sync", "core"))
                cells.append(f"{paths} ({ratio(x)})")
            rows.append(cells)
        barrier = [r for r in mine if "barrier" in r["method"]]
        if barrier:
            cgx = " / ".join(
                fmt(median("cgx barrier", p, 0, barrier)) for p in ("torch", "sync", "core")
            )
            rows.append(["barrier", fmt(median("gloo barrier", "torch", 0, barrier), " us"), cgx])
            rows[-1] += [""] * (len(headers) - len(rows[-1]))
        blocks.append(f"{world} ranks, median microseconds of the slowest rank:")
        blocks.append(table(headers, rows))
    return blocks


def _latency(data: dict[str, Any]) -> list[str]:
    blocks = _latency_rows(data)
    first = data.get("first_call") or {}
    if first:
        rows = []
        for world, runs in sorted(first.items()):
            for run in runs:
                f, later, warm = (run.get(k) for k in ("first_s", "warm_after_barrier_s", "warm_s"))
                rows.append(
                    [
                        world,
                        fmt(f * 1e3 if f is not None else None, " ms"),
                        fmt(later * 1e3 if later is not None else None, " ms"),
                        fmt(warm * 1e3 if warm is not None else None, " ms"),
                        ratio(f / later if f and later else None),
                        ratio(f / warm if f and warm else None),
                    ]
                )
        headers = ["ranks", "first call", "later call, same start", "back to back"]
        headers += ["first / same start", "first / back to back"]
        blocks.append("The first compressed call of a process (empty Numba cache), per rank:")
        blocks.append(table(headers, rows))
    return blocks


def _link_allreduce(config: dict[str, Any]) -> str:
    results = config.get("allreduce", [])
    methods = [m for m in ("gloo", *CGX_METHODS) if any(r["method"] == m for r in results)]
    rows = []
    for size in sorted({r.get("size") for r in results}):
        cells = [size_label(size)]
        for method in methods:
            hit = [r for r in results if r["method"] == method and r.get("size") == size]
            if not hit:
                cells.append("-")
                continue
            r = hit[0]
            ms = fmt(r["time_s"] * 1e3) if r.get("time_s") is not None else "-"
            cells.append(ms if method == "gloo" else f"{ms} ({ratio(r.get('speedup'))})")
        compressed = [r for r in results if r.get("size") == size and r["method"] == "cgx4"]
        cells.append(ratio(compressed[0].get("x_bound")) if compressed else "-")
        rows.append(cells)
    headers = ["size", *(f"{m} ms" for m in methods), "cgx4 x lower bound"]
    return table(headers, rows)


def _link(data: dict[str, Any]) -> list[str]:
    blocks = []
    train_rows, fsdp_rows = [], []
    for config in data.get("configs", []):
        link = config.get("link") or {}
        world, rate = config.get("world_size", "-"), rate_label(link.get("rate", "-"))
        probe = (config.get("tcp_probe") or {}).get("fraction_of_rate")
        blocks.append(
            f"{world} ranks, {rate} link (raw TCP reached {fmt((probe or 0) * 100)}% of the "
            "shaped rate); median ms, x gloo in brackets:"
        )
        blocks.append(_link_allreduce(config))
        for r in config.get("train") or []:
            step = r.get("step_s_mean")
            train_rows.append(
                [
                    world,
                    rate,
                    r.get("backend", "-"),
                    r.get("bits", "-"),
                    fmt(step * 1000.0 if step else None),
                    ratio(r.get("speedup")),
                    fmt((r.get("tx_bytes_per_step") or 0) / MIB),
                    percent(r.get("loss_vs_gloo")),
                ]
            )
        for r in config.get("fsdp") or []:
            step = r.get("step_s_median")
            fsdp_rows.append(
                [
                    world,
                    rate,
                    r.get("method", "-"),
                    fmt(step * 1000.0 if step else None),
                    ratio(r.get("speedup")),
                    fmt((r.get("tx_bytes_per_step") or 0) / MIB),
                    percent(r.get("loss_vs_gloo"), 3),
                ]
            )
    if train_rows:
        headers = ["ranks", "link", "backend", "bits", "mean step ms", "x gloo"]
        headers += ["MiB sent per step and rank", "held-out loss vs gloo"]
        blocks.append("DDP training of the 22 M-parameter MLP:")
        blocks.append(table(headers, train_rows))
    if fsdp_rows:
        headers = ["ranks", "link", "method", "median step ms", "x gloo"]
        headers += ["MiB sent per step and rank", "held-out loss vs gloo"]
        blocks.append(
            "FSDP2 training of the same MLP (only the gradient reduce-scatter is quantized):"
        )
        blocks.append(table(headers, fsdp_rows))
    return blocks


def _nodes(data: dict[str, Any]) -> list[str]:
    blocks = []
    train_rows = []
    for config in data.get("configs", []):
        link = config.get("link") or {}
        nodes = config.get("nodes") or []
        shape = " x ".join(str(n) for n in (len(nodes), nodes[0])) if nodes else "-"
        rate = rate_label(link.get("rate", "-"))
        rows = [
            [
                size_label(r.get("size", 0)),
                r.get("method", "-"),
                fmt(r["time_s"] * 1e3) if r.get("time_s") is not None else "-",
                ratio(r.get("speedup")),
                ratio(r.get("over_flat")),
                ratio(r.get("bytes_vs_formula")),
            ]
            for r in config.get("allreduce", [])
        ]
        blocks.append(f"{shape} (nodes x ranks per node), {rate} between nodes:")
        headers = ["size", "method", "median ms", "x gloo", "x flat", "link bytes / formula"]
        blocks.append(table(headers, rows))
        for r in config.get("train") or []:
            step = r.get("step_s_mean")
            train_rows.append(
                [
                    rate,
                    r.get("method", "-"),
                    fmt(step * 1000.0 if step else None),
                    ratio(r.get("speedup")),
                    ratio(r.get("over_flat")),
                    percent(r.get("loss_vs_gloo"), 3),
                ]
            )
    if train_rows:
        blocks.append("DDP training of the 22 M-parameter MLP across the emulated nodes:")
        headers = ["link", "method", "mean step ms", "x gloo", "x flat", "held-out loss vs gloo"]
        blocks.append(table(headers, train_rows))
    return blocks


def _contention(data: dict[str, Any]) -> list[str]:
    summary = data.get("summary") or {}
    args = data.get("args") or {}
    rows = [
        [method, fmt(s.get("quiet_ms")), fmt(s.get("hog_ms")), ratio(s.get("slowdown")),
         fmt(s.get("quiet_cpu_ms")), fmt(s.get("hog_cpu_ms")),
         fmt(s.get("quiet_switches")), fmt(s.get("hog_switches"))]
        for method, s in summary.items()
        if isinstance(s, dict)
    ]  # fmt: skip
    hogs = args.get("hogs", "the")
    headers = ["method", "quiet step ms", f"step ms beside {hogs} busy loops", "slowdown"]
    headers += ["CPU ms quiet", "CPU ms beside them", "sleeps quiet", "sleeps beside them"]
    text = (
        f"cgx's slowdown over gloo's: {ratio(summary.get('cgx_vs_gloo_slowdown'))} "
        f"({args.get('world', '-')} ranks, {args.get('steps', '-')} steps, "
        f"{args.get('repeats', '-')} repeats in rotating order). CPU and sleeps per step "
        "and rank: every thread's CPU time, and its threads' voluntary context switches."
    )
    return [table(headers, rows), text]


def _train(data: dict[str, Any]) -> list[str]:
    results = data.get("results", [])
    base = next((r.get("bytes_per_step") for r in results if r.get("policy") == "none"), None)
    rows = []
    for r in results:
        nbytes = r.get("bytes_per_step")
        less = ratio(base / nbytes) if base and nbytes else "-"
        rows.append(
            [
                r.get("policy", "-"),
                accuracy(r.get("accuracy")),
                f"{nbytes:,} ({less})",
                fmt(r.get("step_ms_median")),
                fmt(r.get("final_loss")),
            ]
        )
    headers = ["policy", "accuracy %", "bytes per step (x fewer)", "median step ms", "final loss"]
    config = data.get("config") or {}
    note = (
        f"{config.get('world', '-')} ranks, {config.get('epochs', '-')} epochs, "
        f"median of {config.get('repeats', '-')} runs, link: {data.get('link_rate', '-')}."
    )
    return [table(headers, rows), note]


def _gpu_codec(data: dict[str, Any]) -> list[str]:
    rows = [
        [
            f"{fmt(r.get('MiB'))} MiB",
            r.get("bits", "-"),
            fmt(r.get("copy_GBps")),
            f"{fmt(r.get('encode_GBps'))} ({ratio(r.get('encode_vs_copy'))})",
            fmt(r.get("encode_sr_GBps")),
            fmt(r.get("decode_GBps")),
            fmt(r.get("decode_add_GBps")),
        ]
        for r in data.get("throughput", [])
        if r.get("bits") == 4
    ]
    headers = ["buffer", "bits", "device copy", "encode (x copy)", "encode, stochastic"]
    headers += ["decode", "decode_add"]
    checks = data.get("checks") or []
    same = sum(1 for c in checks if c.get("identical"))
    note = (
        f"{data.get('device', 'GPU')}, CuPy {data.get('cupy', '-')}: {same} of {len(checks)} "
        f"code cases byte-identical to the CPU backend; {data.get('units', 'GB/s')}, bucket "
        f"{data.get('bucket_size', '-')}, median of {data.get('repeat', '-')}."
    )
    return [table(headers, rows), note]


def _ddp_peers(data: dict[str, Any]) -> list[str]:
    rows = []
    for r in data.get("rows", []):
        if "error" in r:
            rows.append([r.get("method", "-"), "failed", "-", "-", "-", "-"])
            continue
        tx = r.get("tx_bytes_per_step") or []
        step = r.get("step_s")
        rows.append(
            [
                r.get("method", "-"),
                fmt(step * 1e3 if step else None),
                ratio(r.get("speedup")),
                "/".join(fmt(b / (1 << 20)) for b in tx) if tx else "-",
                percent(r.get("loss_vs_gloo")),
                "equal" if r.get("replicas_equal") else "differ",
            ]
        )
    headers = ["method", "step ms", "x gloo", "MiB/step/rank", "held-out loss vs gloo"]
    headers.append("replicas")
    link = data.get("link") or {}
    note = (
        f"DDP of the {fmt((data.get('rows') or [{}])[0].get('params', 0) / 1e6)} M-parameter "
        f"MLP on {data.get('device', '-')} tensors, 2 ranks over an emulated "
        f"{rate_label(link.get('rate', '-'))} link; median step after the warm-up. "
        + " ".join(h.get("text", "") for h in data.get("headline", []))
    )
    from .ddp_peers import METHODS

    ran = {r.get("method") for r in data.get("rows", [])}
    missing = [m for m in METHODS if m not in ran]
    if missing:
        note += f" Not in this run: {', '.join(missing)}."
    return [table(headers, rows), note]


def _p2p_ipc(data: dict[str, Any]) -> list[str]:
    rows = [
        [
            f"{fmt(r.get('MiB'))} MiB",
            fmt(r.get("GBps")),
            fmt(r.get("copy_GBps")),
            ratio(r.get("vs_copy")),
            fmt(r.get("perftest_GBps")),
        ]
        for r in data.get("rows", [])
    ]
    headers = ["message", "send/recv GB/s", "device copy GB/s", "x copy", "ucx_perftest GB/s"]
    transports = ", ".join(sorted(set((data.get("transports") or {}).values()))) or "-"
    note = (
        f"Two processes on one {data.get('device', '-')} device, window of "
        f"{data.get('window', '-')} messages; UCX transports: {transports}."
    )
    return [table(headers, rows), note]


#: Columns of the DiLoCo table of ``bench ft``.
DILOCO_HEADERS = [
    "run", "MB/sync", "sync s", "comm s", "outer s", "wall s", "all groups", "eval loss",
    "replicas equal",
]  # fmt: skip


def _ft(data: dict[str, Any]) -> list[str]:
    config = data.get("config") or {}
    groups = config.get("groups", "-")
    where = "links" if config.get("netns") else "loopback (unshaped)"
    out = []
    ddp = data.get("ddp") or {}
    if ddp:
        rows = []
        for label, m in ddp.items():
            per_step = m.get("link_bytes_per_step") or m.get("cgx_bytes_per_step")
            rows.append(
                [
                    label,
                    fmt(m.get("step_s")),
                    fmt(per_step / 1e6 if per_step else None),
                    fmt(m.get("stall_s")),
                    str(m.get("steps_lost", "-")),
                    fmt(m.get("rejoin_s")),
                    str(m.get("batches", "-")),
                    fmt(m.get("loss_at_steps")),
                    "yes" if m.get("bit_identical") else "no",
                ]
            )
        headers = ["run", "step s", "MB/step", "stall s", "steps lost", "rejoin s", "batches"]
        headers += [f"loss at step {config.get('steps', '-')}", "replicas equal"]
        out += [
            f"Per-step fault tolerance (torchft DDP + OptimizerWrapper), {groups} replica "
            f"groups, {rate_label(config.get('ddp_rate', '-'))} {where}; the last group is "
            f"killed at step {config.get('kill_at', '-')} and restarted:",
            table(headers, rows),
        ]
        trials = data.get("ddp_trials")
        if trials and trials.get("trials", 1) > 1:
            from .ft import trials_line

            out.append(trials_line(trials) + ".")
        floor = data.get("ddp_floor")
        if floor and floor.get("step_s"):
            from .ft import floor_line

            out.append(floor_line(floor, groups) + ".")
    diloco = data.get("diloco") or {}
    if diloco:
        rows = [
            [
                label,
                fmt((m.get("bytes_per_sync") or 0) / 1e6 or None),
                fmt(m.get("sync_s")),
                fmt(m.get("comm_s")),
                fmt(m.get("outer_s")),
                fmt(m.get("sync_wall_s")),
                f"{m['syncs_all_groups']}/{m['syncs']}" if "syncs" in m else "-",
                fmt(m.get("final_loss")),
                "yes" if m.get("bit_identical") else "no",
            ]
            for label, m in diloco.items()
        ]
        out += [
            f"DiLoCo, an outer sync every {config.get('sync_every', '-')} steps, "
            f"{rate_label(config.get('diloco_rate', '-'))} {where}. Sync: per sync, the time "
            "of the group that arrived last; of it, comm: the quorum, the all-reduce and the "
            "commit vote, outer: torchft's outer optimizer step, merge and parameter copies "
            "(local compute, the same for every process group); wall: replica 0's, its wait "
            "for slower groups included; all groups: syncs whose quorum held every group:",
            table(DILOCO_HEADERS, rows),
        ]
    checks = data.get("targets") or []
    if checks:
        out.append(
            "Targets: "
            + "; ".join(
                f"{c.get('target')} {c.get('detail')} ({'met' if c.get('met') else 'missed'})"
                for c in checks
            )
            + "."
        )
    return out


def _memory(data: dict[str, Any]) -> list[str]:
    rows = []
    for r in data.get("memory", []):
        staging = r.get("staging_mib") or {}
        rows.append(
            [
                f"{fmt(r.get('size_mib'))} MiB",
                r.get("method", "-"),
                fmt(r.get("rss_init_mib")),
                fmt(r.get("held_over_init_mib")),
                fmt(r.get("peak_mib")),
                fmt(r.get("rss_held_file_mib")),
                fmt(staging.get("idle")) if staging else "-",
                fmt(staging.get("peak")) if staging else "-",
            ]
        )
    headers = ["buffer", "method", "RSS after init", "held after the calls", "peak"]
    headers += ["of the RSS: mapped files", "staging idle", "staging peak"]
    note = (
        f"MiB, rank 0 of {data.get('world', '-')} ranks, link: {data.get('link_rate', '-')}; "
        f"held: RSS after {data.get('calls', '-')} all_reduces of one tensor, the tensor "
        "freed, minus RSS after init; peak: the process's high-water mark; mapped files: "
        "the part of the RSS held that is pages of mapped files (shared libraries such as "
        "LLVM's, which the compressed CPU path loads: resident once per host, shared by "
        "every process that maps them)."
    )
    return [table(headers, rows), note]


#: Section title by result file name (without ``.json``); others are titled by their name.
TITLES = {
    "codec": "Codec",
    "allreduce": "All-reduce on one host",
    "latency": "Small calls",
    "latency_cold": "First call",
    "link": "Emulated links",
    "link_1gbit_fsdp": "FSDP2 over an emulated 1 Gbit/s link",
    "nodes": "Emulated nodes",
    "nodes_train": "Emulated nodes, training",
    "contention": "CPU contention",
    "train": "Compression policies, loopback",
    "train_1gbit": "Compression policies, emulated 1 Gbit/s link",
    "gpu_codec": "GPU codec",
    "memory": "Memory",
    "ddp_peers": "GPU DDP against PyTorch's compression hooks",
    "ft": "Fault-tolerant training (torchft)",
    "p2p_ipc": "Point-to-point on one GPU",
}
#: What each result measures, by its file name, else by its benchmark.
SUMMARIES = {
    "latency_cold": "The first compressed call of a process, on an empty Numba cache "
    "(`--cold`), against later calls started the same way and back-to-back calls.",
    "link_1gbit_fsdp": "FSDP2 training over an emulated 1 Gbit/s link (`--fsdp`): the "
    "parameter all-gathers stay exact, the gradient reduce-scatter is quantized; and the "
    "64 MiB all-reduce of the same run.",
    "nodes_train": "DDP training across emulated nodes (a namespace per node, a shaped link "
    "between): gloo against flat and two-level cgx_ucx, and the all-reduce of the same run.",
    "codec": "Quantization codec throughput (Numba kernels) next to a memcpy of the same "
    "bytes, and next to the NumPy reference, in one run.",
    "allreduce": "cgx_ucx's all-reduce against torch.distributed gloo in the same processes "
    "on one host, and its point-to-point transfer against `ucx_perftest`.",
    "latency": "Small-call latency hop by hop: torch.distributed `all_reduce` on the `cgx` "
    "backend, the engine's synchronous face and the asyncio core, against gloo; compressed "
    "rows once the codec's kernels are loaded, as in a long job.",
    "link": "Ranks in network namespaces joined by veth and shaped with `tc tbf` to a "
    "commodity link: all-reduce and training, cgx_ucx against gloo on the same links, with "
    "the lower bound max(wire bytes / measured rate, codec time).",
    "nodes": "Emulated nodes (a namespace per node, shared memory inside, a shaped link "
    "between): gloo against flat and two-level cgx_ucx, and the bytes each node sends.",
    "contention": "DDP step time of an MLP, quiet and beside busy-looping processes: cgx "
    "4-bit against gloo.",
    "train": "Training step time, accuracy and bytes per step of each compression policy "
    "against uncompressed.",
    "gpu_codec": "GPU quantization codec (CuPy kernels): codes against the CPU backend, and "
    "throughput next to a device-to-device copy of the same bytes.",
    "ft": "A torchft Lighthouse and replica groups in network namespaces joined by shaped "
    "links: a group killed mid-run and restarted, per-step DDP on gloo and cgx, then DiLoCo "
    "with fp32, 4-bit and 2-bit pseudo-gradients.",
    "ddp_peers": "DDP on CUDA tensors over an emulated link: gloo, PyTorch's fp16 and "
    "PowerSGD hooks, and the cgx 4-bit backend and hook, in one run.",
    "p2p_ipc": "CuPy buffers sent between two processes of one GPU through UCX (cuda_ipc), "
    "against a copy within the device and `ucx_perftest` with CUDA memory.",
    "memory": "Host memory of a rank: RSS after init, what stays held after all-reduces once "
    "the tensor is freed, the peak, and the communicator's own staging, gloo against cgx.",
}
#: Markdown blocks of each benchmark's figures, by its ``benchmark`` field.
RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "codec": _codec,
    "allreduce": _allreduce,
    "latency": _latency,
    "link": _link,
    "nodes": _nodes,
    "contention": _contention,
    "train": _train,
    "gpu_codec": _gpu_codec,
    "memory": _memory,
    "ddp_peers": _ddp_peers,
    "ft": _ft,
    "p2p_ipc": _p2p_ipc,
}
