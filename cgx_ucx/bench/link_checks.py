"""The link benchmark's honesty checks: a run that fails one is refused, not reported.

:func:`verify_allreduce` checks the TCP probe and the allreduce rows (the traffic crossed the
shaped link, cgx32 equals gloo, every result is finite); :func:`verify_fsdp` the FSDP2 rows
(losses, the cgx group was used, the bytes the shaped device sent).
:data:`MAX_COMPRESSED_SLOWDOWN` is the rule ``bench link`` reports compressed allreduces
against.
"""

from __future__ import annotations

import math
from typing import Any

from ..compression import encoded_nbytes
from .link_args import MIB, size_label
from .measurements import TcpMeasurement
from .netns import LinkEmulator
from .shaping import format_rate

__all__ = [
    "CHECK_MIN_BURSTS",
    "EXACT_REL_ERR",
    "FSDP_EXACT_LOSS",
    "FSDP_LOSS_TOLERANCE",
    "FSDP_MIN_SAVING",
    "MAX_COMPRESSED_SLOWDOWN",
    "RATE_TOLERANCE",
    "fsdp_bytes_model",
    "verify_allreduce",
    "verify_fsdp",
]

#: Tolerance of the honesty checks: tbf's rate is exact to well under 1% (TCP payload is at
#: most 1448/1514 of the frame rate tbf counts); 5% leaves room for timers.
RATE_TOLERANCE = 1.05
#: cgx32 must match gloo's float32 sum: the same sum in another order differs by ~1e-7.
EXACT_REL_ERR = 1e-5
#: The uncompressed check needs a transfer well beyond the bucket's burst to mean anything.
CHECK_MIN_BURSTS = 4
#: cgx32 runs the same FSDP2 step as gloo, adding in another order: float rounding only.
FSDP_EXACT_LOSS = 1e-3
#: A compressed reduce-scatter may move the held-out loss by at most this (relative).
FSDP_LOSS_TOLERANCE = 0.02
#: The compressed run must save at least this share of the bytes the model says the
#: quantized reduce-scatter saves (framing, control messages and ACKs blur the rest).
FSDP_MIN_SAVING = 0.7
#: A compressed allreduce is never slower than the uncompressed one by more than this, at
#: any size where the ``auto`` policy would compress.
MAX_COMPRESSED_SLOWDOWN = 1.10


def verify_allreduce(
    rows: list[dict[str, Any]], link: LinkEmulator, probe: TcpMeasurement, world: int
) -> list[str]:
    """The honesty checks of ``bench link``'s doc; the list of violations (empty when honest)."""
    bad = []
    if probe.fraction_of_rate > RATE_TOLERANCE:
        bad.append(
            f"raw TCP {probe.bits_per_s / 1e9:.3f} Gbit/s exceeds the shaped "
            f"{format_rate(link.rate_bps)}: traffic is not crossing the link"
        )
    for row in rows:
        name = f"{row['method']} {size_label(row['size'])}"
        if "finite" in row and not row["finite"]:
            bad.append(f"{name}: non-finite values in the result")
        if row["method"] == "cgx32" and row.get("rel_l2_err", 0.0) > EXACT_REL_ERR:
            bad.append(f"{name}: differs from gloo (relative L2 error {row['rel_l2_err']:.3g})")
        if row["method"] not in ("gloo", "cgx32"):
            continue
        min_bytes = 2 * (world - 1) / world * row["size"]
        if min_bytes < CHECK_MIN_BURSTS * link.burst_bytes:
            continue
        floor_s = (min_bytes - link.burst_bytes) / (link.rate_bps / 8) / RATE_TOLERANCE
        if row["time_s"] < floor_s:
            bad.append(
                f"{name}: {row['time_s'] * 1e3:.1f} ms is faster than the shaped link allows "
                f"({floor_s * 1e3:.1f} ms): traffic is not crossing the link"
            )
        if row["tx_bytes"] is not None and row["tx_bytes"] < 0.9 * min_bytes:
            bad.append(
                f"{name}: the shaped device sent {row['tx_bytes'] / MIB:.1f} MiB of the "
                f"{min_bytes / MIB:.1f} MiB an allreduce must send: traffic went elsewhere"
            )
    return bad


def fsdp_bytes_model(params: int, world: int, bits: int, gathers: float, bucket: int) -> float:
    """Bytes one rank sends per FSDP2 step: ``gathers`` exact all-gathers of its shard to
    each peer (forward, and again in backward with FSDP2's default reshard after forward),
    one reduce-scatter sending each peer its shard at ``bits``."""
    share = (world - 1) / world
    rs = 4 * params if bits == 32 else encoded_nbytes(params, bits, bucket)
    return share * (gathers * 4 * params + rs)


def verify_fsdp(rows: list[dict[str, Any]], world: int, bucket: int) -> list[str]:
    """The FSDP rows' honesty checks; the list of violations (empty when honest).

    - every rank ends with the same held-out loss (FSDP2 keeps one model, sharded);
    - cgx32's loss is gloo's within FSDP_EXACT_LOSS, compressed runs' within
      FSDP_LOSS_TOLERANCE;
    - every cgx run's reduce-scatters went through the cgx group;
    - with device counters: the uncompressed runs sent at least 90% of the bytes FSDP2 must
      send (else traffic did not cross the shaped link), and each compressed run saved at
      least FSDP_MIN_SAVING of what quantizing the reduce-scatter saves, against cgx32 when
      it ran (the same framing), else against gloo.
    """
    bad = []
    by = {r["method"]: r for r in rows}
    gloo = by["gloo"]
    cgx = [r for r in rows if r["backend"] == "cgx"]
    counts = cgx[0]["cgx_collectives_per_step"] if cgx else {}
    scatters = counts.get("reduce_scatter", 0.0)
    gathers = counts.get("allgather", 0.0) / scatters if scatters else 2.0
    for row in rows:
        name = f"fsdp {row['method']}"
        losses = row["eval_loss_per_rank"]
        if not all(math.isfinite(v) for v in losses) or max(losses) != min(losses):
            bad.append(f"{name}: ranks ended with different or non-finite losses {losses}")
        limit = FSDP_EXACT_LOSS if row["bits"] == 32 else FSDP_LOSS_TOLERANCE
        if abs(row["loss_vs_gloo"]) > limit:
            bad.append(
                f"{name}: held-out loss {row['eval_loss']:.5f} is {row['loss_vs_gloo']:+.2%} "
                f"from gloo's {gloo['eval_loss']:.5f} (tolerance {limit:.2%})"
            )
        if row["backend"] == "cgx" and not row["cgx_collectives_per_step"].get("reduce_scatter"):
            bad.append(f"{name}: no reduce_scatter went through the cgx group")
        row["tx_bytes_model"] = fsdp_bytes_model(row["params"], world, row["bits"], gathers, bucket)
    ref = by.get("cgx32", gloo)
    for row in rows:
        name = f"fsdp {row['method']}"
        if row["tx_bytes_per_step"] is None or ref["tx_bytes_per_step"] is None:
            continue
        if row["bits"] == 32 and row["tx_bytes_per_step"] < 0.9 * row["tx_bytes_model"]:
            bad.append(
                f"{name}: the shaped device sent {row['tx_bytes_per_step'] / MIB:.2f} MiB per "
                f"step of the {row['tx_bytes_model'] / MIB:.2f} MiB FSDP2 must send: traffic "
                "went elsewhere"
            )
        if row["bits"] == 32:
            continue
        saved = ref["tx_bytes_per_step"] - row["tx_bytes_per_step"]
        model = ref["tx_bytes_model"] - row["tx_bytes_model"]
        row["tx_saved_vs_" + ref["method"]] = saved
        if saved < FSDP_MIN_SAVING * model:
            bad.append(
                f"{name}: sent {saved / MIB:.2f} MiB per step less than {ref['method']}, not "
                f"the {model / MIB:.2f} MiB a {row['bits']}-bit reduce-scatter saves: the "
                "gradients were not compressed"
            )
    return bad
