# ruff: noqa  (a throw-away probe kept as it ran; see ../README.md)
# PROBE: cost of building a CGXWork from an already-completed future
import time, concurrent.futures, torch
from cgx_ucx.torch.work import CGXWork


def bench(f, n=5000):
    for _ in range(100):
        f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


t = [torch.ones(4)]


def mk():
    cf = concurrent.futures.Future()
    cf.set_result(None)
    w = CGXWork.from_future("allreduce", 300.0, cf, lambda _: t)
    w.wait()


print("work from done future + wait us", bench(mk))
print("torch Future() us", bench(lambda: torch.futures.Future()))


def fut_set():
    f = torch.futures.Future()
    f.set_result(t)


print("torch Future set_result us", bench(fut_set))
print("cf Future us", bench(lambda: concurrent.futures.Future().set_result(1)))
