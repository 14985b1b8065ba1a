# ruff: noqa  (a throw-away probe kept as it ran; see ../README.md)
# PROBE (not a command): 2 processes lockstep "allreduce" of 4 KiB via shared mmap + numba nogil spin
import mmap, os, sys, time, numpy as np, numba
from numba import types
from numba.extending import intrinsic
import multiprocessing as mp


@intrinsic
def fence(typingctx):
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(nogil=True, cache=True)
def publish(hdr, slot, data, seq):
    slot[: data.size] = data
    fence()
    hdr[0] = seq
    fence()


@numba.njit(nogil=True, cache=True)
def wait(hdr, seq, limit):
    for i in range(limit):
        if hdr[0] >= seq:
            fence()
            return i
    return -1


SLOT = 1 << 20


def worker(r, n, fd_path, iters, nbytes, q):
    buf = mmap.mmap(-1, 0) if False else None
    f = open(fd_path, "r+b")
    m = mmap.mmap(f.fileno(), 0)
    arr = np.frombuffer(m, np.uint8)

    def hdr(k):
        return arr[k * (4096 + 2 * SLOT) : k * (4096 + 2 * SLOT) + 8].view(np.int64)

    def slot(k, s):
        o = k * (4096 + 2 * SLOT) + 4096 + s * SLOT
        return arr[o : o + SLOT].view(np.float32)

    x = np.ones(nbytes // 4, np.float32) * (r + 1)
    out = np.empty_like(x)
    ts = []
    for it in range(1, iters + 1):
        t0 = time.perf_counter()
        s = it % 2
        publish(hdr(r), slot(r, s), x, it)
        for p in range(n):
            if p != r:
                while wait(hdr(p), it, 20000) < 0:
                    time.sleep(0)
        out[:] = slot(0, s)[: x.size]
        for p in range(1, n):
            np.add(out, slot(p, s)[: x.size], out=out)
        ts.append(time.perf_counter() - t0)
    q.put(
        (r, float(np.median(ts[10:]) * 1e6), float(np.percentile(ts[10:], 99) * 1e6), float(out[0]))
    )


if __name__ == "__main__":
    n = int(sys.argv[1])
    nbytes = int(sys.argv[2])
    path = "/dev/shm/cgxprobe"
    with open(path, "wb") as f:
        f.truncate(n * (4096 + 2 * SLOT))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, n, path, 2000, nbytes, q)) for r in range(n)]
    [p.start() for p in ps]
    [p.join() for p in ps]
    while not q.empty():
        print(q.get())
    os.unlink(path)
