"""The synchronous engine: one loop thread, futures, FIFO order, clean stop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cgx_ucx.engine import Engine
from cgx_ucx.errors import CGXTimeoutError, TransportError


@pytest.mark.timeout(20)
def test_submit_runs_on_the_engine_thread_in_order():
    engine = Engine.get(retain=True)
    try:
        seen = []

        async def job(i):
            seen.append((i, threading.current_thread().name))
            await asyncio.sleep(0)
            return i

        futs = [engine.submit(job(i)) for i in range(20)]
        assert [f.result(5) for f in futs] == list(range(20))
        assert [i for i, _ in seen] == list(range(20))  # started in submission order
        assert {name for _, name in seen} == {"cgx-engine"}
        assert Engine.get() is engine
    finally:
        engine.release()
    assert not engine.running
    assert "cgx-engine" not in [t.name for t in threading.enumerate()]


@pytest.mark.timeout(20)
def test_run_timeout_and_errors_and_restart():
    engine = Engine.get(retain=True)
    try:
        with pytest.raises(CGXTimeoutError):
            engine.run(asyncio.sleep(5), timeout=0.05)

        async def boom():
            raise ValueError("x")

        with pytest.raises(ValueError):
            engine.run(boom())

        async def nested():
            # Blocking on the engine from its own thread would deadlock: refused.
            coro = asyncio.sleep(0)
            with pytest.raises(TransportError, match="deadlock"):
                engine.run(coro)
            return True

        assert engine.run(nested())
    finally:
        engine.release()
    with pytest.raises(TransportError):
        engine.submit(asyncio.sleep(0))
    fresh = Engine.get(retain=True)  # a new one starts after the last user left
    try:
        assert fresh is not engine and fresh.running
    finally:
        fresh.release()


def test_a_timeout_raised_inside_the_coroutine_is_typed():
    """A TimeoutError escaping the coroutine is not taken for the wait's own timeout (here
    there is none): it is raised as a CGXTimeoutError saying it timed out inside."""
    import asyncio

    from cgx_ucx.engine import Engine
    from cgx_ucx.errors import CGXTimeoutError

    async def times_out() -> None:
        await asyncio.wait_for(asyncio.sleep(1), 0.001)

    engine = Engine.get(retain=True)
    try:
        with pytest.raises(CGXTimeoutError, match="timed out inside"):
            engine.run(times_out())
    finally:
        engine.release()
