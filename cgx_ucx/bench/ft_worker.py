"""One torchft replica group (one process): the training job that ``python -m cgx_ucx.bench
ft``, examples/torchft_train.py and the torchft tests start, kill and restart.

    python -m cgx_ucx.bench.ft_worker --replica-id 0 --lighthouse http://host:port \\
        --backend cgx --bits 4 --mode ddp --steps 50 --out DIR

It trains an MLP 64-H-H-H/2-10 (``--hidden``; 3840 gives the 22 M-parameter model of
``python -m cgx_ucx.bench train``) on a synthetic task: inputs from a seeded generator,
labels from a fixed random teacher network, so every replica and every run sees the same
data for a given (step, replica). ``--mode ddp``: torchft's DistributedDataParallel and
OptimizerWrapper, fault tolerant at every step; ``--mode diloco``: torchft's DiLoCo, an
outer synchronisation of pseudo-gradients every ``--sync-every`` inner steps (with
``--error-feedback``, :class:`cgx_ucx.torchft.PseudoGradientFeedback` on them).

It appends one JSON line per step to ``OUT/replica<id>.jsonl`` (time, manager step,
committed, bytes the cgx group sent, outer-sync time) and, at the end, a line with
``"final": true``: the step, a SHA-256 of the parameters and the evaluation loss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

__all__ = ["main"]

#: Samples of the held-out set the evaluation loss is measured on.
EVAL_SAMPLES = 2048
IN_FEATURES = 64
CLASSES = 10


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cgx_ucx.bench.ft_worker")
    p.add_argument("--replica-id", type=int, required=True)
    p.add_argument("--lighthouse", required=True, help="the Lighthouse's address")
    p.add_argument("--backend", choices=("gloo", "cgx"), default="cgx")
    p.add_argument("--bits", type=int, default=4, help="cgx all_reduce bits (32: exact)")
    p.add_argument(
        "--mode",
        choices=("ddp", "diloco", "local"),
        default="ddp",
        help="local: the DDP run's steps with no process group and no Manager (the "
        "compute every group does whatever the backend)",
    )
    p.add_argument("--steps", type=int, default=50, help="manager steps (outer syncs)")
    p.add_argument("--sync-every", type=int, default=20, help="DiLoCo inner steps per sync")
    p.add_argument(
        "--error-feedback",
        action="store_true",
        help="DiLoCo (cgx): error feedback on the pseudo-gradients",
    )
    p.add_argument("--hidden", type=int, default=3840)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="collective timeout (s)")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument(
        "--end-with",
        type=int,
        default=1,
        help="after --steps, go on until this many replica groups share a step",
    )
    p.add_argument("--host", default="127.0.0.1", help="address of this group's store")
    p.add_argument("--hostname", default=None, help="address peers dial for this group's Manager")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (s)")
    p.add_argument(
        "--start-with",
        type=int,
        default=1,
        help="before training, wait for a quorum of this many replica groups",
    )
    p.add_argument("--die-at", type=int, default=None, help="SIGKILL itself at this step")
    p.add_argument("--wait-go", action="store_true", help="start training once OUT/go exists")
    p.add_argument("--out", required=True, help="folder of the JSON-lines reports")
    return p


def _model(hidden: int, seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden // 2),
        nn.ReLU(),
        nn.Linear(hidden // 2, CLASSES),
    )


class _Task:
    """Inputs from a seeded generator, labels from a fixed random teacher."""

    def __init__(self, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(10_000 + seed)
        self._w1 = torch.randn(IN_FEATURES, 64, generator=g)
        self._w2 = torch.randn(64, CLASSES, generator=g)
        self._seed = seed
        self.eval = self.batch(-1, -1, EVAL_SAMPLES)

    def batch(self, step: int, replica: int, size: int) -> tuple[Any, Any]:
        import torch

        g = torch.Generator().manual_seed(hash((self._seed, step, replica)) & 0x7FFFFFFF)
        x = torch.randn(size, IN_FEATURES, generator=g)
        y = torch.tanh(x @ self._w1) @ self._w2
        return x, y.argmax(dim=1)


def _digest(model: Any) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _eval_loss(model: Any, task: _Task) -> float:
    import torch

    with torch.no_grad():
        x, y = task.eval
        return float(torch.nn.functional.cross_entropy(model(x), y))


def _process_group(args: argparse.Namespace) -> Any:
    timeout = timedelta(seconds=args.timeout)
    if args.backend == "gloo":
        from torchft.process_group import ProcessGroupGloo

        return ProcessGroupGloo(timeout=timeout)
    from ..torchft import ProcessGroupCGX

    return ProcessGroupCGX(timeout=timeout, bits=args.bits)


def _checkpoint_transport(hostname: str | None, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, advertising ``hostname`` when given: in a
    network namespace the machine's hostname names each namespace's own address."""
    from torchft.checkpointing import HTTPTransport

    if not hostname:
        return None

    class _Transport(HTTPTransport):
        def address(self) -> str:
            own = f"//{socket.gethostname()}:"
            return super().address().replace(own, f"//{hostname}:", 1)

    return _Transport(timeout=timeout, num_chunks=0)


def _sent(pg: Any) -> int | None:
    group = getattr(pg, "group", None)
    if group is None:
        return None
    return int(group.communicator.stats.bytes_sent)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    import torch.distributed as dist
    from torchft import Manager
    from torchft.optim import OptimizerWrapper

    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    report = open(os.path.join(args.out, f"replica{args.replica_id}.jsonl"), "a")  # noqa: SIM115

    def emit(**fields: Any) -> None:
        report.write(json.dumps({"replica": args.replica_id, "pid": os.getpid(), **fields}) + "\n")
        report.flush()

    emit(event="start", t=time.time())
    task = _Task(args.seed)
    model = _model(args.hidden, args.seed)
    emit(event="ready", t=time.time())
    while args.wait_go and not os.path.exists(os.path.join(args.out, "go")):
        time.sleep(0.02)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    if args.mode == "local":
        try:
            _run_local(args, model, inner, loss_fn, task, emit)
        finally:
            report.close()
        return 0
    pg = _process_group(args)
    store = dist.TCPStore(args.host, 0, is_master=True, wait_for_workers=False)
    diloco = args.mode == "diloco"
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = Manager(
        pg=pg,
        min_replica_size=args.min_replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica{args.replica_id}",
        store_addr=args.host,
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        use_async_quorum=not diloco,
        # Every group starts from the same seeded model: no transfer at step 0.
        init_sync=False,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=max(args.timeout, 60.0)),
        connect_timeout=timedelta(seconds=args.timeout),
        checkpoint_transport=_checkpoint_transport(args.hostname, timedelta(seconds=args.timeout)),
        **({"hostname": args.hostname} if args.hostname else {}),
    )
    try:
        _wait_for_groups(manager, args.start_with, args.timeout)
        if diloco:
            _run_diloco(args, manager, model, inner, outer, task, loss_fn, pg, emit)
        else:
            from ..torchft import DistributedDataParallel

            net = DistributedDataParallel(manager, model)
            opt = OptimizerWrapper(manager, inner)
            evaluated = False
            while not _done(args, manager):
                t0 = time.time()
                sent0 = _sent(pg)
                _train_step(args, net, opt, loss_fn, task, manager.current_step())
                sent1 = _sent(pg)
                emit(
                    event="step",
                    t=time.time(),
                    dt=time.time() - t0,
                    step=manager.current_step(),
                    participants=manager.num_participants(),
                    sent=None if sent0 is None or sent1 is None else max(sent1 - sent0, 0),
                    errored=None if manager.errored() is None else str(manager.errored())[:200],
                )
                if args.step_delay:
                    time.sleep(args.step_delay)
                if not evaluated and manager.current_step() >= args.steps:
                    # At --steps exactly, whatever the run does after, so that runs
                    # that wait longer for a restarted group compare at the same step.
                    evaluated = True
                    emit(
                        event="eval", step=manager.current_step(), eval_loss=_eval_loss(model, task)
                    )
                if args.die_at is not None and manager.current_step() >= args.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # dies as a killed group does
        emit(
            event="final",
            final=True,
            t=time.time(),
            step=manager.current_step(),
            digest=_digest(model),
            eval_loss=_eval_loss(model, task),
            configures=getattr(pg, "configures", None),
        )
    finally:
        report.close()
        manager.shutdown(wait=False)
        pg.shutdown()
    return 0


def _train_step(
    args: argparse.Namespace, net: Any, opt: Any, loss_fn: Any, task: _Task, step: int
) -> None:
    """One training step on this group's batch of ``step``."""
    opt.zero_grad()
    x, y = task.batch(step, args.replica_id, args.batch)
    loss_fn(net(x), y).backward()
    opt.step()


def _run_local(
    args: argparse.Namespace, model: Any, opt: Any, loss_fn: Any, task: _Task, emit: Any
) -> None:
    """The DDP run's step (:func:`_train_step`) with nothing to communicate: run by every
    group at once, its time is the floor under any process group's step on this host."""
    for step in range(args.steps):
        t0 = time.time()
        _train_step(args, model, opt, loss_fn, task, step)
        t1 = time.time()
        emit(event="step", t=t1, dt=t1 - t0, step=step, participants=1)
    emit(event="final", final=True, t=time.time(), step=args.steps, digest=_digest(model))


def _wait_for_groups(manager: Any, groups: int, timeout: float) -> None:
    """Form quorums until one holds ``groups`` replica groups, so that a run starts with
    all of them instead of with whichever group was up first."""
    end = time.monotonic() + timeout
    while groups > 1:
        manager.start_quorum()
        if manager.num_participants() >= groups or time.monotonic() > end:
            return
        time.sleep(0.1)


def _done(args: argparse.Namespace, manager: Any) -> bool:
    """Past ``--steps`` with ``--end-with`` groups in the last quorum: every group of it
    ends after the same commit (a restarted group that has healed ends with the others)."""
    if manager.current_step() < args.steps:
        return False
    return manager.current_step() > 0 and manager.num_participants() >= args.end_with


class _Phases:
    """Seconds spent in each phase of an outer sync, summed until :meth:`take`: the
    quorum (``start_quorum``), handing the pseudo-gradients to the group (``prepare``),
    waiting for their all-reduce (``wait``), the commit vote (``commit``) and the rest
    of ``perform_sync``: the outer step, the merge and the parameter copies (``outer``)."""

    def __init__(self, manager: Any, fragments: Sequence[Any]) -> None:
        self.spent: dict[str, float] = {}
        self._t0 = 0.0
        self._wrap(manager, "start_quorum", "quorum")
        self._wrap(manager, "should_commit", "commit")
        for f in fragments:
            self._wrap(f, "prepare_sync", "prepare")
            self._wrap(f, "perform_sync", "perform")
            self._mark(f, "_save_local_parameters")  # the first call after the waits

    def _wrap(self, obj: Any, name: str, phase: str) -> None:
        inner = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)

    def _mark(self, obj: Any, name: str) -> None:
        inner = getattr(obj, name)
        perform = obj.perform_sync  # the timed wrapper

        def marked(*a: Any, **kw: Any) -> Any:
            self.spent["wait"] = self.spent.get("wait", 0.0) + time.perf_counter() - self._t0
            return inner(*a, **kw)

        def perform_marked(*a: Any, **kw: Any) -> Any:
            self._t0 = time.perf_counter()
            return perform(*a, **kw)

        setattr(obj, name, marked)
        obj.perform_sync = perform_marked

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {}
        # perform_sync holds the wait for the all-reduce, the commit vote and the outer step.
        perform = spent.pop("perform", 0.0)
        spent["outer"] = max(perform - spent.get("commit", 0.0) - spent.get("wait", 0.0), 0.0)
        return {k: round(v, 4) for k, v in spent.items()}


def _run_diloco(
    args: argparse.Namespace,
    manager: Any,
    model: Any,
    inner: Any,
    outer: Any,
    task: _Task,
    loss_fn: Any,
    pg: Any,
    emit: Any,
) -> None:

    from torchft.local_sgd import DiLoCo

    local = 0
    with DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every) as diloco:
        if args.error_feedback:
            from ..torchft import PseudoGradientFeedback

            PseudoGradientFeedback(diloco, pg)
        # torchft keeps a DiLoCo's fragments (one here) private; each runs its own sync.
        phases = _Phases(manager, diloco._fragments)  # noqa: SLF001
        while not _done(args, manager):
            t0 = time.time()
            before = manager.current_step()
            sent0 = _sent(pg)
            inner.zero_grad()
            x, y = task.batch(before * args.sync_every + local, args.replica_id, args.batch)
            loss_fn(model(x), y).backward()
            t_step = time.time()
            inner.step()  # every sync_every-th step runs the outer sync inside
            local = (local + 1) % args.sync_every
            if local == 0:
                sent1 = _sent(pg)
                emit(
                    event="sync",
                    t=time.time(),
                    dt=time.time() - t0,
                    sync_s=time.time() - t_step,
                    phases=phases.take(),
                    step=manager.current_step(),
                    committed=manager.current_step() > before,
                    participants=manager.num_participants(),
                    sent=None if sent0 is None or sent1 is None else max(sent1 - sent0, 0),
                )


if __name__ == "__main__":
    raise SystemExit(main())
