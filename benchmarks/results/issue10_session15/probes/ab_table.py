# ruff: noqa
"""Prints torch - core per run of an A/B folder: ``python ab_table.py ../ab``."""

import json, sys, glob, os

R = sys.argv[1]


def rows(d):
    j = json.load(open(f"{d}/latency.json"))
    m = {(r["world"], r["kib"], r["path"], r["method"]): r["median_us"] for r in j["rows"]}
    return m, j.get("load_before"), j.get("load_after")


for kind in ("before", "after"):
    for d in sorted(glob.glob(f"{R}/{kind}_*")):
        m, lb, la = rows(d)
        out = []
        for kib in (4, 64):
            for meth in ("cgx32", "cgx4"):
                t, c = m[(2, kib, "torch", meth)], m[(2, kib, "core", meth)]
                out.append(f"{kib}K/{meth[3:]}: {t:5.0f}-{c:4.0f}={t - c:4.0f}")
        print(f"{os.path.basename(d):9s} load {lb}->{la}  " + "  ".join(out))
