# ruff: noqa  (a throw-away probe kept as it ran; see ../README.md)
# PROBE: per-call cost of the codec layers on a 4 KiB buffer
import time, numpy as np
from cgx_ucx.collectives.allreduce import prepare_allreduce
from cgx_ucx.collectives.piece_codec import encode_piece, decode_add_piece
from cgx_ucx.compression import cpu
from cgx_ucx.compression.codec import encode, decode_add

cpu.warm_up()
x = np.random.rand(1024).astype(np.float32)
t, (flat, spec) = prepare_allreduce(x, "sum", world_size=2, bits=4)
piece = spec.plan.chunks[0].pieces[0]
buf = np.empty(1 << 20, np.uint8)
acc = np.zeros(1024, np.float32)


def bench(f, n=2000):
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


out = encode_piece(flat, 0, piece, buf, False, 0, 1, 0)
print("encode_piece us", bench(lambda: encode_piece(flat, 0, piece, buf, False, 0, 1, 0)))
print("decode_add_piece us", bench(lambda: decode_add_piece(out, piece, acc, 0, flat.dtype)))
print("codec.encode us", bench(lambda: encode(flat, 4, 1024, out=buf[: out.size])))
print("codec.decode_add us", bench(lambda: decode_add(out, acc)))
print("np.zeros us", bench(lambda: np.zeros(1024, np.float32)))
print("prepare us", bench(lambda: prepare_allreduce(x, "sum", world_size=2, bits=4, cache={})))
cache = {}
print(
    "prepare cached us",
    bench(lambda: prepare_allreduce(x, "sum", world_size=2, bits=4, cache=cache)),
)
