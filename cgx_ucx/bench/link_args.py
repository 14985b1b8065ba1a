"""The command-line options and sizes shared by ``bench link`` and ``bench nodes``.

Sizes are float32 buffers given in MiB or with a unit (:func:`parse_size`); each rank of the
machine must hold :data:`BUFFERS_PER_RANK` of the largest (:func:`check_sizes`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..errors import CGXError
from .report import arg_error, check_rank_buffers, count_arg, positive_number
from .shaping import parse_rate

__all__ = [
    "BUFFERS_PER_RANK",
    "MIB",
    "add_training_args",
    "check_iters",
    "check_sizes",
    "parse_size",
    "rate_arg",
    "size_label",
]

MIB = 1 << 20
#: Buffers of an allreduce size each rank holds at once (:mod:`cgx_ucx.bench.link_worker`):
#: the input, the buffer reduced in place, gloo's result kept for the error check, the
#: float64 difference (2) and the communicator's staging (about 6 in all).
BUFFERS_PER_RANK = 6


def parse_size(text: str) -> int:
    """Bytes of ``"64"`` (MiB), ``"64MiB"``, ``"512KiB"``; a multiple of 4 (float32)."""
    t = text.strip().lower()
    scale = MIB
    for suffix, s in (("kib", 1 << 10), ("mib", MIB), ("gib", 1 << 30), ("b", 1)):
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], s
            break
    try:
        size = int(float(t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"size must be e.g. 64 (MiB) or 512KiB: {text!r}"
        ) from None
    if size <= 0 or size % 4:
        raise argparse.ArgumentTypeError(f"size must be a positive multiple of 4 bytes: {text!r}")
    return size


def rate_arg(text: str) -> int:
    """An argparse ``type``: a link rate in bits per second (:func:`~cgx_ucx.bench.shaping.
    parse_rate`: a number or tc's units, e.g. ``1gbit``)."""
    try:
        return parse_rate(text)
    except CGXError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def check_iters(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error unless ``--min-iters <= --max-iters`` (shared with ``bench nodes``)."""
    if args.max_iters < args.min_iters:
        arg_error(
            parser,
            "--max-iters",
            f"must be at least --min-iters ({args.min_iters}), got {args.max_iters}",
        )


def check_sizes(
    parser: argparse.ArgumentParser, option: str, sizes: Sequence[int], ranks: int
) -> None:
    """A usage error when ``ranks`` ranks of this machine cannot hold the largest of
    ``sizes`` (:data:`BUFFERS_PER_RANK` buffers each) in its physical memory."""
    largest = max(sizes)
    check_rank_buffers(parser, option, ranks, BUFFERS_PER_RANK, largest, size_label(largest))


def size_label(size: int) -> str:
    return f"{size // MIB} MiB" if size % MIB == 0 else f"{size / 1024:g} KiB"


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The training run's options and the timeouts (shared with ``bench nodes``)."""
    p.add_argument("--steps", type=count_arg(1), default=20, help="timed training steps")
    p.add_argument("--warmup", type=count_arg(0), default=3, help="untimed steps first")
    p.add_argument("--batch", type=count_arg(1), default=8, help="per rank (see bench link's doc)")
    p.add_argument(
        "--hidden", type=count_arg(1), default=3072, help="MLP width (3072: ~22 M params)"
    )
    p.add_argument("--probe-seconds", type=positive_number, default=1.0)
    p.add_argument(
        "--timeout", type=positive_number, default=300.0, help="seconds any single wait may take"
    )
