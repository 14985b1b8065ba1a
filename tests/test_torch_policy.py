"""Compression policies selected through CGXState (DDP) and GradientSync.

In-process: argument checks, the torch-side policy wrapper (layers, state dicts that
``torch.load(weights_only=True)`` reads, logging), error feedback across a switch to
uncompressed. Spawned (2 ranks, one job per integration): every policy trains the same
model from the same seed with different data per rank; the ranks must end with the
same assignment and bit-identical parameters, "static" must be bit-identical to the
hook as it was before policies existed, the stats must list every layer, and a state
saved mid-run must continue exactly as the run it came from.
"""

from __future__ import annotations

import io
import logging
import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_helpers import join_cgx_with_gloo, run_torch_ranks  # noqa: E402

from cgx_ucx.compression.policies import Schedule  # noqa: E402
from cgx_ucx.config import VALID_BITS, CompressionConfig  # noqa: E402
from cgx_ucx.errors import ConfigError  # noqa: E402
from cgx_ucx.layout import Layout  # noqa: E402
from cgx_ucx.torch import CGXOptions, CGXState  # noqa: E402
from cgx_ucx.torch._feedback import LayerFeedback  # noqa: E402
from cgx_ucx.torch._policy import PolicyRunner, named_parameters  # noqa: E402

#: Decisions at steps 2 and 5, statistics on the two steps before each: a short run
#: sees two decisions, the second from statistics that straddle a checkpoint.
SCHEDULE = Schedule(warmup=2, interval=3, window=2)
STEPS = 6
ADAPTIVE = ("kmeans", "budget", "auto")


def _net() -> Any:
    import torch.nn as nn

    # Three compressible layers of different sizes (kmeans and budget have a choice),
    # one under layer_min_size (480 values) and 1-D biases: both stay uncompressed.
    return nn.Sequential(
        nn.Linear(64, 96),
        nn.ReLU(),
        nn.Linear(96, 96),
        nn.ReLU(),
        nn.Linear(96, 48),
        nn.ReLU(),
        nn.Linear(48, 10),
    )


def _policy_params(name: str) -> dict[str, Any]:
    return {"schedule": SCHEDULE} if name in ("kmeans", "budget") else {}


# -- in-process ----------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_backend_options_refuse_per_layer_policies() -> None:
    assert CGXOptions(policy="static").policy == "static"
    with pytest.raises(ConfigError, match="CGXState"):
        CGXOptions(policy="kmeans")
    with pytest.raises(ConfigError, match="unknown"):
        CGXOptions(policy="fastest")


@pytest.mark.timeout(30)
def test_state_arguments_are_checked_before_any_communication() -> None:
    group = object()  # never used: every check below fails before the communicator
    with pytest.raises(ConfigError, match="needs model="):
        CGXState(group, policy="kmeans")
    with pytest.raises(ConfigError, match="unknown compression policy"):
        CGXState(group, policy="k-means", model=_net())
    with pytest.raises(ConfigError, match="static"):
        CGXState(group, policy_params={"bits_min": 2})
    with pytest.raises(ConfigError, match="log_every"):
        CGXState(group, log_every=-1)


class _Solo:
    """The collectives of a world of one: a sum or a broadcast returns the input."""

    world_size = 1

    def allreduce(self, x: Any, op: str = "sum") -> Any:
        return x

    def broadcast(self, x: Any, root: int = 0) -> Any:
        return x


def _runner(name: str, model: Any, **kw: Any) -> PolicyRunner:
    return PolicyRunner(
        name,
        named_parameters(model),
        CompressionConfig(bits=4, bucket_size=1024),
        1024,
        _Solo(),
        world_size=1,
        timeout=5.0,
        params=kw.pop("params", _policy_params(name)),
        **kw,
    )


@pytest.mark.timeout(30)
def test_runner_layers_indices_and_bad_params() -> None:
    model = _net()
    model.extra = torch.nn.Parameter(torch.zeros(64, 64, dtype=torch.float64))
    model[0].bias.requires_grad_(False)
    r = _runner("static", model)
    names = [s.name for s in r.stats()]
    assert "0.bias" not in names and names[:2] == ["extra", "0.weight"] and len(names) == 8
    bits = {s.name: s.bits for s in r.stats()}
    # 2-D float32 layers of >= 1024 values at 4 bits; the float64 one, the small one
    # and the biases uncompressed, as layer_layout decides.
    assert bits["0.weight"] == bits["2.weight"] == bits["4.weight"] == 4
    assert bits["extra"] == bits["6.weight"] == bits["2.bias"] == 32
    assert r.indices([model[2].weight, model[0].weight]) == (2, 1)
    with pytest.raises(ConfigError, match="model="):
        r.indices([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ConfigError, match="policy_params"):
        _runner("kmeans", model, params={"bits_minimum": 2})
    with pytest.raises(ConfigError, match="link_bandwidth or link_probe"):
        PolicyRunner(
            "auto",
            named_parameters(model),
            CompressionConfig(),
            1024,
            None,
            world_size=2,
            timeout=1.0,
            params={"link_probe": None},
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["static", "kmeans", "budget"])
def test_runner_state_round_trips_through_torch_load(name: str) -> None:
    """Saved mid-window, loaded (weights_only) into a fresh runner: same state, and the
    next decisions are the same as the original's."""
    torch.manual_seed(0)
    model = _net()
    a, b = _runner(name, model, log_every=2), _runner(name, model, log_every=2)
    grads = [torch.randn_like(p) * (i + 1) for i, p in enumerate(model.parameters())]
    idx = tuple(range(len(grads)))
    for step in range(4):  # a decision at 2, the next window opens at 3
        a.agree(step)
        a.observe(step, grads, idx)
    b.load_state_dict(_saved(a.state_dict()))
    sa, sb = a.policy.state_dict(), b.policy.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(np.asarray(sa[k]), np.asarray(sb[k]), err_msg=k)
    if name != "static":
        assert a.policy.decisions == 1
    tail = [g.flip(0) for g in grads]
    for step in range(4, 9):  # a decision at 5 and at 8
        for r in (a, b):
            r.agree(step)
            r.observe(step, tail, idx)
            assert r.layout(idx) == r.policy.layout(idx)
    assert a.policy.current == b.policy.current and a.policy.decisions == b.policy.decisions
    other = "budget" if name != "budget" else "kmeans"
    with pytest.raises(ConfigError):
        _runner(other, model).load_state_dict(a.state_dict())


@pytest.mark.timeout(30)
def test_stats_logged_at_info_every_n_steps(caplog: pytest.LogCaptureFixture) -> None:
    model = _net()
    r = _runner("static", model, log_every=3)
    grads = [torch.randn_like(p) for p in model.parameters()]
    idx = tuple(range(len(grads)))
    with caplog.at_level(logging.INFO, logger="cgx_ucx.adaptive"):
        for step in range(4):
            r.agree(step)
            r.observe(step, grads, idx)
    logs = [rec.getMessage() for rec in caplog.records if rec.name == "cgx_ucx.adaptive"]
    assert len(logs) == 2 and "0.weight" in logs[1] and "rel_error" in logs[1]
    rows = {s.name: s for s in r.stats()}
    assert 0 < rows["0.weight"].rel_error < 0.1  # 4 bits on Gaussian values: ~1%
    assert rows["0.bias"].rel_error == 0.0


@pytest.mark.timeout(30)
def test_error_feedback_flushes_a_layer_that_goes_uncompressed() -> None:
    fb = LayerFeedback()
    n = 3000
    grad = torch.linspace(-1, 1, n) ** 3
    lossy = Layout.from_sizes([n], bits=[2], bucket_sizes=[128])
    exact = Layout.from_sizes([n], bits=[32], bucket_sizes=[128])
    buf = grad.clone()
    fb.apply(0, buf, lossy)
    residual = fb.state_dict()["0.0"].clone()
    assert fb.holds(0) and float(residual.abs().max()) > 0
    buf = torch.zeros(n)
    fb.apply(0, buf, exact)  # the policy switched the layer to uncompressed
    assert torch.equal(buf, residual) and not fb.holds(0)
    buf = torch.zeros(n)
    fb.apply(0, buf, exact)  # added once only
    assert torch.equal(buf, torch.zeros(n)) and fb.state_dict() == {}


# -- spawned: DDP --------------------------------------------------------------------------
# Unannotated: DDP compares a hook's annotations as objects, and this file's are strings.
def _old_hook(state, bucket):
    """cgx_hook as it was before policies existed (commit 845e44a), without feedback."""
    from cgx_ucx.torch import layer_layout
    from cgx_ucx.torch._convert import as_array
    from cgx_ucx.torch.futures import to_torch_future

    buf = bucket.buffer()
    config = state.compression
    layout = layer_layout(bucket.gradients(), config, state.layer_min_size)
    buf.div_(state.world_size)
    seed = (config.seed + (state.steps << 20) + bucket.index()) % (1 << 64)
    cf = state.communicator.allreduce(
        as_array(buf), op="sum", layout=layout, stochastic=config.stochastic, seed=seed
    )
    state.record_sent(0, last=bucket.is_last())
    return to_torch_future(cf, lambda _: buf)


def _flat(module: Any) -> Any:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _same_on_ranks(t: Any, gloo: Any) -> bool:
    import torch.distributed as dist

    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, t, group=gloo)
    return all(torch.equal(rows[0], r) for r in rows[1:])


def _check_policy(policy: Any, params: list[Any], gloo: Any) -> dict[str, Any]:
    """Ranks agree; every layer has a row; auto follows its cost model. A summary."""
    from cgx_ucx.compression.policies import AutoPolicy, layer_seconds

    enc = torch.from_numpy(policy.current.encode())
    assert _same_on_ranks(enc, gloo), (policy.name, enc)
    rows = policy.stats()
    assert [r.numel for r in rows] == [p.numel() for p in params]
    for r in rows:
        assert r.bits in VALID_BITS and r.bucket_size > 0 and r.wire_bytes > 0, r
        assert r.rel_error == 0.0 if r.bits == 32 else 0 < r.rel_error < 1, r
    out = {"bits": list(policy.current.bits), "decisions": policy.decisions}
    if isinstance(policy, AutoPolicy):
        bw, codec, cfg = policy.link_bandwidth, policy.codec, policy.config
        assert bw is not None and bw > 0 and codec is not None
        w = policy.world_size
        for i, n in enumerate(policy.sizes.tolist()):
            worth = layer_seconds(n, cfg.bits, cfg.bucket_size, w, bw, codec) < layer_seconds(
                n, 32, 1, w, bw, None
            )
            want = cfg.bits if policy.compressible[i] and worth else 32
            assert policy.current.bits[i] == want, (i, n, bw, codec)
        out.update(bandwidth=bw, codec=[codec.encode_bps, codec.overhead_s])
    return out


def _two_batches(seed: int) -> list[tuple[Any, Any]]:
    """Two batches of 32 (64 features, 10 classes) that a job alternates between."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen))
        for _ in range(2)
    ]


def _saved(state: dict[str, Any]) -> Any:
    """``state`` after a trip through ``torch.save`` and ``torch.load(weights_only=True)``,
    as a checkpoint would come back."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _ddp_job(rank: int, world: int, store: Any) -> dict[str, Any]:
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgx_ucx.torch import cgx_hook, wire_bytes

    gloo = join_cgx_with_gloo(rank, world, store)
    base = _net()
    runs: dict[str, tuple[Any, Any, Any]] = {}

    def add(name: str, hook: Any, policy: str | None = None, with_model: bool = True) -> None:
        model = DDP(copy.deepcopy(base))
        kw: dict[str, Any] = {}
        if policy is not None:
            kw.update(policy=policy, policy_params=_policy_params(policy))
        if with_model:
            kw["model"] = model  # the DDP wrapper: names "module.0.weight", ...
        state = CGXState(dist.group.WORLD, log_every=2, **kw)
        model.register_comm_hook(state, hook)
        runs[name] = (model, state, torch.optim.SGD(model.parameters(), lr=0.1))

    add("before", _old_hook, with_model=False)
    add("default", cgx_hook, with_model=False)  # static; its layers found in step 0
    add("static", cgx_hook, policy="static")
    for name in ADAPTIVE:
        add(name, cgx_hook, policy=name)
    data = _two_batches(10 + rank)  # different data on each rank
    twin = None
    for step in range(STEPS):
        x, y = data[step % 2]
        if step == 4:  # checkpoint kmeans mid-window (decision at 5), resume in a twin
            model, state, _ = runs["kmeans"]
            saved = _saved(state.state_dict())
            twin_model = DDP(copy.deepcopy(model.module))
            twin_state = CGXState(
                dist.group.WORLD,
                log_every=2,
                policy="kmeans",
                policy_params=_policy_params("kmeans"),
                model=twin_model,
            )
            twin_state.load_state_dict(saved)
            twin_model.register_comm_hook(twin_state, cgx_hook)
            twin = (twin_model, twin_state, torch.optim.SGD(twin_model.parameters(), lr=0.1))
        for model, _, opt in [*runs.values(), *([twin] if twin else [])]:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    out: dict[str, Any] = {}
    for name, (model, state, _) in runs.items():
        assert _same_on_ranks(_flat(model), gloo), name
        if name == "before":
            continue
        assert state.steps == STEPS and len(state.stats()) == 8, name
        out[name] = _check_policy(state.policy, list(model.parameters()), gloo)
        out[name]["bytes_per_step"] = state.bytes_per_step
        # the hook sent the policy's layout: its bytes are the assignment's
        lay = state.policy.layout()
        assert state.bytes_per_step == wire_bytes(lay, 4, world), name
        out[name]["names"] = [r.name for r in state.stats()]
    ref = _flat(runs["before"][0])
    assert torch.equal(_flat(runs["default"][0]), ref)
    assert torch.equal(_flat(runs["static"][0]), ref)
    # The resumed twin decided at step 5 from the saved step-3 statistics and its own
    # step-4 gradients (equal to the original's: same parameters, same data): same
    # policy state as the uninterrupted run. (Not the same parameters bit for bit: the
    # twin's DDP starts from unrebuilt buckets, and a bucket's layer order moves the
    # engine's chunk boundaries, hence the quantization blocks.)
    (tm, ts, _), ks = twin, runs["kmeans"][1]  # type: ignore[misc]
    assert _same_on_ranks(_flat(tm), gloo)
    assert ts.policy.current == ks.policy.current and ts.policy.decisions == 2
    a, b = ts.policy.state_dict(), ks.policy.state_dict()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    return out


@pytest.mark.timeout(150)
def test_ddp_policies() -> None:
    out = run_torch_ranks(_ddp_job, 2, timeout=140)[0]
    print({k: (v["bits"], v["bytes_per_step"]) for k, v in out.items()})
    static = out["static"]
    assert static["bits"] == [4, 32, 4, 32, 4, 32, 32, 32]
    assert static["names"][0] == "module.0.weight" and out["default"]["names"][0] == "param0"
    assert out["default"]["bits"] == static["bits"]
    assert static["decisions"] == 0
    for name in ("kmeans", "budget"):
        assert out[name]["decisions"] == 2, name
        assert out[name]["bytes_per_step"] <= static["bytes_per_step"], name
    assert out["kmeans"]["bits"] != static["bits"]  # three layers, three clusters
    auto = out["auto"]
    assert auto["decisions"] == 1 and math.isfinite(auto["bandwidth"])


# -- spawned: GradientSync -------------------------------------------------------------------
def _sync_job(rank: int, world: int, store: Any) -> dict[str, Any]:
    import asyncio
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F

    from cgx_ucx.torch import GradientSync, layer_layout, wire_bytes
    from cgx_ucx.torch._convert import as_array

    gloo = join_cgx_with_gloo(rank, world, store)
    comm = dist.group.WORLD.communicator
    base = _net()
    runs: dict[str, tuple[Any, Any, Any]] = {}
    for name in ("static", *ADAPTIVE):
        model = copy.deepcopy(base)
        sync = GradientSync(
            model, policy=name, policy_params=_policy_params(name) or None, log_every=2
        )
        runs[name] = (model, sync, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_model = copy.deepcopy(base)
    data = _two_batches(20 + rank)
    twin = None
    for step in range(STEPS):
        x, y = data[step % 2]
        if step == 4:  # checkpoint budget mid-window (decision at 5), resume in a twin
            model, sync, _ = runs["budget"]
            saved = _saved(sync.state_dict())
            twin_model = copy.deepcopy(model)
            twin_sync = GradientSync(
                twin_model, policy="budget", policy_params=_policy_params("budget"), log_every=2
            )
            twin_sync.load_state_dict(saved)
            twin = (twin_model, twin_sync, torch.optim.SGD(twin_model.parameters(), lr=0.1))
        # the static rule by hand: local gradients, the paper's layout, one allreduce
        static_model, static_sync, _ = runs["static"]
        ref_model.load_state_dict(static_model.state_dict())
        ref_model.zero_grad()
        F.cross_entropy(ref_model(x), y).backward()
        (bucket,) = static_sync.buckets
        ref_params = dict(zip(map(id, ref_model.parameters()), ref_model.parameters(), strict=True))
        grads = [ref_params[id(q)].grad for q in _mirror(bucket, static_model, ref_model)]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(world)
        lay = layer_layout(grads, static_sync.compression, 1024)
        comm.allreduce(as_array(flat), layout=lay).result(60)
        for model, sync, opt in [*runs.values(), *([twin] if twin else [])]:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if step == 4:  # the asyncio face; its agreement for step 5 decides
                asyncio.run(sync.synchronize_async())
            else:
                sync.synchronize()
            if sync is static_sync:
                got = torch.cat([p.grad.reshape(-1) for p in bucket])
                assert torch.equal(got, flat), step
            opt.step()
    out: dict[str, Any] = {}
    for name, (model, sync, _) in runs.items():
        assert _same_on_ranks(_flat(model), gloo), name
        assert sync.steps == STEPS and len(sync.stats()) == 8, name
        out[name] = _check_policy(sync.policy, list(model.parameters()), gloo)
        assert sync.bytes_per_step == wire_bytes(sync.policy.layout(), 4, world), name
        out[name]["bytes_per_step"] = sync.bytes_per_step
    # The resumed twin continues exactly as the uninterrupted run: same buckets, same
    # assignment, same gradients, bit for bit.
    (tm, ts, _), (bm, bs, _) = twin, runs["budget"]  # type: ignore[misc]
    assert torch.equal(_flat(tm), _flat(bm))
    assert ts.policy.current == bs.policy.current and ts.policy.decisions == 2
    a, b = ts.policy.state_dict(), bs.policy.state_dict()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
    return out


def _mirror(params: list[Any], model: Any, other: Any) -> list[Any]:
    """``other``'s parameters at the positions ``params`` have in ``model``."""
    where = {id(p): i for i, p in enumerate(model.parameters())}
    mine = list(other.parameters())
    return [mine[where[id(p)]] for p in params]


@pytest.mark.timeout(150)
def test_gradient_sync_policies() -> None:
    out = run_torch_ranks(_sync_job, 2, timeout=140)[0]
    print({k: (v["bits"], v["bytes_per_step"]) for k, v in out.items()})
    static = out["static"]
    assert static["bits"] == [4, 32, 4, 32, 4, 32, 32, 32] and static["decisions"] == 0
    for name in ("kmeans", "budget"):
        assert out[name]["decisions"] == 2, name
        assert out[name]["bytes_per_step"] <= static["bytes_per_step"], name
    assert out["kmeans"]["bits"] != static["bits"]
    assert out["auto"]["decisions"] == 1
