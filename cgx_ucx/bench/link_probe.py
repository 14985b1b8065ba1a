"""Raw TCP throughput across an emulated link: a bounded sender and receiver.

Run inside the link emulator's namespaces (see :meth:`cgx_ucx.bench.netns.LinkEmulator.
measure_tcp`), never on its own: ``python -m cgx_ucx.bench.link_probe recv --bind ADDR``
prints ``PORT <n>`` once it listens, then one JSON line with what it received;
``python -m cgx_ucx.bench.link_probe send --to ADDR:PORT`` streams zeros for at most
``--seconds`` or ``--bytes``, whichever ends first. Both stop at ``--deadline`` seconds
whatever happens, so a probe never hangs a benchmark.

The receiver measures from the end of the first ``--skip`` bytes to the last byte: the first
bytes ride the token bucket's burst allowance (tbf lets ``burst`` bytes through at line
speed), which would otherwise inflate a short measurement.

Only the standard library is used, so the probe measures the link and not an import.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

#: Send/receive block; large enough that Python's per-call cost is negligible against the
#: kernel's copy (64 KiB is the largest GSO segment a veth hands to the qdisc).
BLOCK = 1 << 20


def _recv(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.deadline
    with socket.create_server((args.bind, 0)) as server:
        server.settimeout(args.deadline)
        print(f"PORT {server.getsockname()[1]}", flush=True)
        conn, _ = server.accept()
    with conn:
        buf = bytearray(BLOCK)
        view = memoryview(buf)
        total = 0
        t_mark = None
        mark_bytes = 0
        t_last = time.monotonic()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            conn.settimeout(left)
            try:
                n = conn.recv_into(view)
            except TimeoutError:
                break
            if n == 0:
                break
            total += n
            t_last = time.monotonic()
            if t_mark is None and total >= args.skip:
                t_mark, mark_bytes = t_last, total
    measured = total - mark_bytes
    seconds = (t_last - t_mark) if t_mark is not None else 0.0
    print(
        json.dumps({"bytes": total, "measured_bytes": measured, "seconds": seconds}),
        flush=True,
    )
    return 0


def _send(args: argparse.Namespace) -> int:
    host, _, port = args.to.rpartition(":")
    start = time.monotonic()
    stop = start + min(args.seconds, args.deadline)
    block = memoryview(bytes(BLOCK))
    sent = 0
    with socket.create_connection((host, int(port)), timeout=args.deadline) as conn:
        while sent < args.bytes and time.monotonic() < stop:
            n = min(BLOCK, args.bytes - sent)
            conn.settimeout(max(stop - time.monotonic(), 0.01))
            try:
                sent += conn.send(block[:n])
            except TimeoutError:
                break
        conn.shutdown(socket.SHUT_WR)
    print(json.dumps({"sent": sent, "seconds": time.monotonic() - start}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgx_ucx.bench.link_probe")
    sub = parser.add_subparsers(dest="mode", required=True)
    recv = sub.add_parser("recv", help="listen on ADDR, report what arrives")
    recv.add_argument("--bind", required=True)
    recv.add_argument("--skip", type=int, default=0, help="bytes excluded from the timing")
    recv.add_argument("--deadline", type=float, default=30.0)
    send = sub.add_parser("send", help="stream zeros to ADDR:PORT")
    send.add_argument("--to", required=True)
    send.add_argument("--seconds", type=float, default=1.0)
    send.add_argument("--bytes", type=int, default=1 << 40)
    send.add_argument("--deadline", type=float, default=30.0)
    args = parser.parse_args(argv)
    return _recv(args) if args.mode == "recv" else _send(args)


if __name__ == "__main__":
    sys.exit(main())
