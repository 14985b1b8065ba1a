"""How a rank waits for its peers' mailbox posts (cgx_ucx.collectives.local): on a host
with a spare core it spins and yields; on a full host it neither spins nor yields (a
sched_yield hands the core to another process for a whole time slice) but sleeps briefly,
which the scheduler wakes promptly."""

from __future__ import annotations

import asyncio

import pytest

from cgx_ucx.collectives import local


class Round:
    """A round whose peers post after ``misses`` polls."""

    def __init__(self, misses: int) -> None:
        self.misses = misses
        self.polls: list[int] = []

    def poll(self, spins: int) -> bool:
        self.polls.append(spins)
        return len(self.polls) > self.misses

    def overdue(self) -> None:
        pass


@pytest.fixture
def calls(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(local.os, "sched_yield", lambda: seen.append("yield"))
    real_sleep = local.time.sleep

    def sleep(s: float) -> None:
        seen.append("sleep")
        real_sleep(s)

    monkeypatch.setattr(local.time, "sleep", sleep)
    return seen


@pytest.mark.parametrize("full", [False, True])
def test_blocking_wait_sleeps_instead_of_yielding_on_a_full_host(monkeypatch, calls, full):
    monkeypatch.setattr(local.progress, "host_oversubscribed", lambda: full)
    monkeypatch.setattr(local, "SPIN_S", 0.0)  # straight to the wait after the spin
    r = Round(misses=3)
    assert local.wait_blocking(r, budget=5.0)
    assert r.polls[0] == (0 if full else local.SPINS)
    if full:
        assert "yield" not in calls and calls.count("sleep") >= 1
    else:
        assert "sleep" not in calls and calls.count("yield") >= 1


def test_loop_wait_on_a_full_host_does_not_yield(monkeypatch, calls):
    monkeypatch.setattr(local.progress, "host_oversubscribed", lambda: True)
    r = Round(misses=3)
    asyncio.run(local.wait_async(r))
    assert "yield" not in calls and len(r.polls) == 4


def test_loop_wait_on_a_full_host_sleeps_the_thread_briefly_and_lets_the_loop_run(
    monkeypatch, calls
):
    # The loop's own timers last at least a millisecond: its first waits are thread
    # sleeps of FIRST_SLEEP_S, each followed by a turn of the loop's other callbacks.
    monkeypatch.setattr(local.progress, "host_oversubscribed", lambda: True)
    r = Round(misses=3)
    turns: list[int] = []

    async def main() -> None:
        async def other() -> None:
            while True:
                turns.append(len(r.polls))
                await asyncio.sleep(0)

        task = asyncio.ensure_future(other())
        await local.wait_async(r)
        task.cancel()

    asyncio.run(main())
    assert calls == ["sleep"] * 3 and len(r.polls) == 4
    assert {1, 2, 3} <= set(turns)  # the other task ran between the polls
