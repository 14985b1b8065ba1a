"""Probe (session 10): the cost of one thread hop into an asyncio loop, no UCX.

python probe_hop.py; compare with ``taskset -c 0 python probe_hop.py`` (one vCPU)."""

import asyncio
import concurrent.futures as cf
import threading
import time

import numpy as np


def median_us(fn, n=3000):
    for _ in range(100):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e6


loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
latch = threading.Lock()
latch.acquire()


async def noop():
    return None


def via_future():
    f = cf.Future()
    loop.call_soon_threadsafe(f.set_result, None)
    f.result()


for _ in range(3):
    cst = median_us(lambda: (loop.call_soon_threadsafe(latch.release), latch.acquire()))
    rcts = median_us(lambda: asyncio.run_coroutine_threadsafe(noop(), loop).result())
    print(f"call_soon_threadsafe + lock {cst:.1f} us; run_coroutine_threadsafe {rcts:.1f} us")
print(f"call_soon_threadsafe + concurrent future {median_us(via_future):.1f} us")
