"""The UCX context's shutdown shortcuts read reference counts only where they are exact."""

from __future__ import annotations

import types

import pytest

from cgx_ucx.transport import ucx


def _fake_ucxx() -> types.SimpleNamespace:
    """A ucxx whose application context nothing else refers to."""
    ctx = types.SimpleNamespace(worker=object(), context=object())
    core = types.SimpleNamespace(_ctx=ctx, stop_notifier_thread=lambda: None)
    del ctx
    return types.SimpleNamespace(core=core)


def test_an_unreferenced_context_is_dropped_without_a_collection(monkeypatch) -> None:
    monkeypatch.setattr(ucx, "_REFCOUNTS_EXACT", True)
    fake = _fake_ucxx()
    assert ucx._context_holders(fake) == []
    assert ucx._drop_context(fake) is True
    assert fake.core._ctx is None


def test_without_exact_refcounts_the_collector_decides(monkeypatch) -> None:
    monkeypatch.setattr(ucx, "_REFCOUNTS_EXACT", False)
    fake = _fake_ucxx()
    # No shortcut: ucxx.reset() (which collects) does the shutdown.
    assert ucx._drop_context(fake) is False
    assert fake.core._ctx is not None
    assert ucx._context_holders(fake) == []
    holder = [fake.core._ctx]
    assert [h.split()[0] for h in ucx._context_holders(fake)] == ["list"]
    del holder


@pytest.mark.parametrize("exact", [True, False])
def test_a_held_context_is_kept(monkeypatch, exact) -> None:
    monkeypatch.setattr(ucx, "_REFCOUNTS_EXACT", exact)
    fake = _fake_ucxx()
    holder = {"ep": fake.core._ctx}
    assert ucx._drop_context(fake) is False
    assert ucx._context_holders(fake)
    del holder
