"""Numba kernels compiled per signature, off the calling thread, into a per-user disk cache.

A :class:`Kernel` wraps one ``@njit`` function. A call asks :meth:`Kernel.ready` whether
the signature its arguments make (element types, read-only or not, alignment) is compiled.
By default a missing one is compiled then, on the calling thread, as Numba does. Once
:func:`compile_in_background` is called (by :func:`cgx_ucx.collectives.connect`: a
collective must not compile inside a peer's deadline), a small call runs the NumPy
reference codec instead (:mod:`.reference`, bytes equal to the kernels', which the tests
check) and the signature is compiled by one background thread once calls of it have moved
:data:`COMPILE_AFTER_VALUES` values or made :data:`COMPILE_AFTER_CALLS` calls: a job
compiles only the signatures it uses (a job whose only host-side calls are the few small
ones made while connecting compiles none). A call of at least
:data:`COMPILE_AFTER_VALUES` values waits for its kernel instead (the reference would
take as long as the compile), and where the disk cache already holds the kernel, a call of
at least :data:`LOAD_CACHED_AFTER_VALUES` values loads it (milliseconds).
:func:`compiling_here` compiles on the calling thread in either mode (:func:`.cpu.warmup`).

Compiled kernels are kept in :func:`cache_dir`, one directory per user, Numba version and
Python version, shared by every virtual environment of the user. Files are named after a
digest of the kernels' module with its docstrings and comments left out
(:func:`source_digest`): an edit to a docstring keeps the cache, an edit to code makes new
files, and two installed versions of cgx_ucx keep their kernels side by side.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import hashlib
import importlib
import inspect
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..config import read_env

__all__ = [
    "COMPILE_AFTER_CALLS",
    "COMPILE_AFTER_VALUES",
    "ENV_KERNEL_CACHE",
    "LOAD_CACHED_AFTER_VALUES",
    "Kernel",
    "cache_dir",
    "compile_in_background",
    "compiling_here",
    "host_kernels_due",
    "settle",
    "source_digest",
    "uncounted",
    "user_cache_root",
    "wait_compiled",
]

log = logging.getLogger("cgx_ucx")

#: The environment variable that sets :func:`cache_dir`.
ENV_KERNEL_CACHE = "CGX_UCX_KERNEL_CACHE"

#: Values a signature's calls move on the NumPy reference before it is compiled. The
#: reference takes 50-100x a kernel's time, a few hundred ns per value (measured by
#: `python -m cgx_ucx.bench codec`, which times both), and a cold compile several seconds
#: of one core: calls adding up to fewer values cost less than the compile they would start.
COMPILE_AFTER_VALUES = 1 << 20
#: Calls of a signature after which it is compiled whatever their size: a job that makes
#: many small compressed calls pays the reference's fixed cost (tens of us per call) on
#: each, while connect's own few calls stay below it.
COMPILE_AFTER_CALLS = 64
#: Values from which a call loads its kernel from a warm disk cache instead of running the
#: reference: there the reference takes tens of ms, more than a load; below it, loading
#: would only add the kernels' memory to a process whose calls are small (connect's own).
LOAD_CACHED_AFTER_VALUES = 1 << 16


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where compiled kernels are kept: ``CGX_UCX_KERNEL_CACHE``, else ``NUMBA_CACHE_DIR``
    (Numba's own setting, so that a Numba-wide choice holds here too), else
    ``$XDG_CACHE_HOME/cgx_ucx/numba-<Numba version>-py<X.Y>`` (``~/.cache`` without
    ``XDG_CACHE_HOME``).

    Per user, so every virtual environment of the user loads what one compiled; per Numba
    and Python version, because Numba's index of a kernel drops the entries another
    version wrote (two environments that differ would evict each other's kernels).
    """
    import numba

    env = os.environ if env is None else env
    chosen = read_env(ENV_KERNEL_CACHE, env) or env.get("NUMBA_CACHE_DIR")
    if chosen:
        return Path(chosen).expanduser()
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return user_cache_root(env) / f"numba-{numba.__version__}-py{py}"


def user_cache_root(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/cgx_ucx`` (``~/.cache/cgx_ucx`` without ``XDG_CACHE_HOME``): the
    user's folder of compiled kernels, host and GPU."""
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cgx_ucx"


#: Digests by module name, made once: every kernel of a module asks, often at once from
#: several codec threads, and CPython 3.11's ``ast.parse`` is not safe to run on two
#: threads at a time (it fails with "SystemError: AST constructor recursion depth
#: mismatch").
_digests: dict[str, str] = {}
_digest_lock = threading.Lock()


def source_digest(module: ModuleType) -> str:
    """A digest of ``module``'s code without its docstrings and comments, and of the
    numbers among its globals (constants a kernel freezes when it is compiled); computed
    once per module, one thread at a time."""
    with _digest_lock:
        digest = _digests.get(module.__name__)
        if digest is None:
            digest = _digests[module.__name__] = _source_digest(module)
        return digest


def _source_digest(module: ModuleType) -> str:
    import numba

    tree = ast.parse(inspect.getsource(module))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
    numbers = sorted(
        (name, repr(value))
        for name, value in vars(module).items()
        if isinstance(value, int | float | np.generic) and not isinstance(value, bool)
    )
    text = ast.dump(tree) + repr(numbers) + numba.__version__
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_class(path: Path, digest: str) -> type:
    """A Numba cache class that keeps a kernel in ``path`` under ``digest``."""
    from numba.core.caching import CompileResultCacheImpl, FunctionCache, _CacheLocator

    class Locator(_CacheLocator):
        def __init__(self, py_func: Any, py_file: str) -> None:
            self._py_file = py_file  # Numba's warnings name it

        def get_cache_path(self) -> str:
            return str(path)

        def get_source_stamp(self) -> str:
            return digest

        def get_disambiguator(self) -> str:
            return digest

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Locator | None:
            self = cls(py_func, py_file)
            try:
                self.ensure_cache_path()
            except OSError:  # not writable: Numba tries its other places
                return None
            return self

    class Impl(CompileResultCacheImpl):
        _locator_classes = [Locator, *CompileResultCacheImpl._locator_classes]  # noqa: SLF001

    class Cache(FunctionCache):
        _impl_class = Impl

    return Cache


#: Names of the element types the kernels see: half types travel as 16-bit integers.
_VALUE_NAMES = {"uint16": "float16", "int16": "bfloat16"}


def _arg_key(a: Any) -> Any:
    """What of an argument decides its Numba type, as far as the kernels' callers vary it."""
    if isinstance(a, np.ndarray):
        f = a.flags
        return (a.dtype.char, a.ndim, f.writeable, f.aligned, f.c_contiguous)
    return type(a)


class _Compiler:
    """The background thread that compiles queued signatures, one at a time."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[tuple[Kernel, Any, tuple[Any, ...]]] = queue.Queue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.pending = 0
        self.idle = threading.Condition(self.lock)
        self.told = False  # the INFO line was written

    def submit(self, kernel: Kernel, key: Any, sig: tuple[Any, ...]) -> None:
        with self.lock:
            self.pending += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="cgx-compile", daemon=True)
                self.thread.start()
        self.jobs.put((kernel, key, sig))

    def _run(self) -> None:
        while True:
            kernel, key, sig = self.jobs.get()
            try:
                kernel.compile_signature(key, sig)
            except Exception as exc:  # the kernel stays on the NumPy reference
                log.warning("compiling %s failed, the NumPy codec stands in: %s", kernel, exc)
                kernel.mark_failed(key)
            finally:
                with self.lock:
                    self.pending -= 1
                    self.idle.notify_all()

    def wait(self, timeout: float | None) -> bool:
        return self.wait_for(lambda: self.pending == 0, timeout)

    def wait_for(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until ``done()`` holds; it is checked after each compile."""
        with self.lock:
            return self.idle.wait_for(done, timeout)


_compiler = _Compiler()
_here = threading.local()
_background = False
_early_lock = threading.Lock()


#: Values of the host codec calls that ran on the NumPy reference before anything needed
#: the Numba kernels (:func:`host_kernels_due`).
_early_values = 0
_host_due = False
_host_import: threading.Thread | None = None
_HOST_MODULE = f"{__package__}.cpu"


def host_kernels_due(numel: int) -> bool:
    """Whether a host codec call of ``numel`` values goes through the Numba kernels'
    module (:mod:`.cpu`, which imports Numba) rather than the NumPy reference (the same
    bytes). Once True, always True.

    Without :func:`compile_in_background`, or inside :func:`compiling_here`, the module is
    imported on the calling thread at the first call. Otherwise calls run the reference
    and Numba is not imported, so that a job whose only host codec calls are connect's few
    small ones (a GPU job, an uncompressed one, one that makes hundreds of groups) never
    loads it (about 55 MiB a process), until a call of at least
    :data:`LOAD_CACHED_AFTER_VALUES` values, or calls adding up to
    :data:`COMPILE_AFTER_VALUES` values (a thousand calls of 4 KiB), start importing it
    on a background thread (half a second: not inside a collective's deadline). Calls
    run the reference until it is imported, except a call of at least
    :data:`COMPILE_AFTER_VALUES` values, which waits for it (the reference would take as
    long). From there each kernel counts its own signatures' calls (:meth:`Kernel.ready`).
    """
    global _early_values, _host_due
    if _host_due:
        return True
    if _HOST_MODULE in sys.modules and _host_import is None:
        _host_due = True  # imported by its user (a benchmark, a test): nothing to save
        return True
    if not _background or getattr(_here, "on", False):
        _import_host()
        return _host_due
    if _uncounted.get():
        return False
    with _early_lock:
        _early_values += max(int(numel), 0)
        due = numel >= LOAD_CACHED_AFTER_VALUES or _early_values >= COMPILE_AFTER_VALUES
        thread = _host_import
        if due and thread is None:
            thread = _start_host_import()
    if thread is not None and numel >= COMPILE_AFTER_VALUES:
        thread.join()
    return _host_due


_uncounted: contextvars.ContextVar[bool] = contextvars.ContextVar("cgx_uncounted", default=False)


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Host codec calls made inside this block (on this thread, or in this asyncio task)
    do not count toward :func:`host_kernels_due`: connect's own warm-up, which a job that
    makes a group per phase, or torchft at every quorum, repeats hundreds of times."""
    token = _uncounted.set(True)
    try:
        yield
    finally:
        _uncounted.reset(token)


def _start_host_import() -> threading.Thread:
    """Import the kernels' module on a daemon thread (called under ``_early_lock``)."""
    global _host_import
    thread = threading.Thread(target=_import_host, name="cgx-codec-import", daemon=True)
    _host_import = thread
    thread.start()
    return thread


def _import_host() -> None:
    global _host_due
    t0 = time.perf_counter()
    try:
        importlib.import_module(_HOST_MODULE)
    except ImportError as exc:  # pragma: no cover - numba is a dependency
        log.warning("the host codec runs on NumPy only: its Numba kernels failed: %s", exc)
        return
    if not _host_due:
        _host_due = True
        log.info(
            "loaded the host codec's Numba kernels' module in %.2f s", time.perf_counter() - t0
        )


def compile_in_background(on: bool = True) -> None:
    """From now on, calls whose kernel is not compiled run the NumPy reference while a
    background thread compiles it (``on``), or compile it first (not ``on``)."""
    global _background
    _background = bool(on)


@contextlib.contextmanager
def compiling_here() -> Iterator[None]:
    """Within this block, calls on this thread compile what they need before they run
    (as Numba does by default) instead of running the NumPy reference meanwhile."""
    before = getattr(_here, "on", False)
    _here.on = True
    try:
        yield
    finally:
        _here.on = before


def wait_compiled(timeout: float | None = None) -> bool:
    """Wait until every queued signature is compiled; False if ``timeout`` passed first."""
    return _compiler.wait(timeout)


def settle(timeout: float) -> None:
    """Wait until the kernels' module started importing in the background
    (:func:`host_kernels_due`) is imported and every signature queued so far is compiled,
    so that later calls run the kernels rather than the NumPy reference: a benchmark's
    warm-up ends here (a call that started the import ran on the reference: warm up once
    more, then settle again). Raises :class:`TimeoutError` if that takes longer than
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    thread = _host_import
    if thread is not None:
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"the codec's kernels were not imported within {timeout:g} s")
    if not wait_compiled(max(deadline - time.monotonic(), 0.0)):
        raise TimeoutError(f"the codec's kernels were not compiled within {timeout:g} s")


class Kernel:
    """A Numba kernel (``nogil``) whose signatures compile only when calls ask for them.

    ``module`` is the module that defines ``py_func`` and every function it calls: its
    :func:`source_digest` names the cached files.
    """

    def __init__(self, py_func: Callable[..., Any], module: ModuleType | None = None) -> None:
        import numba

        self.dispatcher = numba.njit(nogil=True)(py_func)
        self._module = module if module is not None else sys.modules[py_func.__module__]
        self._ready: set[Any] = set()
        self._queued: set[Any] = set()
        self._failed: set[Any] = set()
        self._moved: dict[Any, int] = {}
        self._calls: dict[Any, int] = {}
        self._cache_on = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Kernel({self.dispatcher.py_func.__qualname__})"

    def __call__(self, *args: Any) -> Any:
        return self.dispatcher(*args)

    def ready(self, args: tuple[Any, ...], numel: int) -> bool:
        """Whether the signature of ``args`` is compiled (then call the kernel with them).

        If it is not, it is compiled now (True), unless :func:`compile_in_background` is
        on and this thread is not inside :func:`compiling_here`: then the call counts
        ``numel`` values towards :data:`COMPILE_AFTER_VALUES`, after which the signature is
        queued for the background thread (False until it is compiled).
        """
        key = tuple(map(_arg_key, args))
        if key in self._ready:
            return True
        if (
            not _background
            or getattr(_here, "on", False)
            or (numel >= LOAD_CACHED_AFTER_VALUES and self._cached_before())
        ):
            self.compile_signature(key, self.signature(args))
            return True
        with self._lock:
            moved = self._moved.get(key, 0) + max(int(numel), 1)
            self._moved[key] = moved
            calls = self._calls.get(key, 0) + 1
            self._calls[key] = calls
            due = moved >= COMPILE_AFTER_VALUES or calls >= COMPILE_AFTER_CALLS
            submit = due and key not in self._queued
            if submit:
                self._queued.add(key)
        if submit:
            _compiler.submit(self, key, self.signature(args))
        if numel >= COMPILE_AFTER_VALUES:
            # A call this large costs the reference at least what the compile does.
            _compiler.wait_for(lambda: key in self._ready or key in self._failed)
            return key in self._ready
        return False

    def _cached_before(self) -> bool:
        """Whether the disk cache holds an index of this kernel: then a signature loads in
        milliseconds (compiling one the index lacks is the rare case), so the call waits
        for it instead of running the reference."""
        with self._lock:
            if not self._cache_on:
                self._use_cache()
        cache_file = getattr(getattr(self.dispatcher, "_cache", None), "_cache_file", None)
        index = getattr(cache_file, "_index_path", None)  # Numba's IndexDataCacheFile
        return isinstance(index, str) and os.path.exists(index)

    def mark_failed(self, key: Any) -> None:
        """``key`` could not be compiled: its calls run the reference from now on."""
        self._failed.add(key)

    def signature(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(self.dispatcher.typeof_pyval(a) for a in args)

    def compile_signature(self, key: Any, sig: tuple[Any, ...]) -> None:
        """Compile (or load from the disk cache) ``sig``; ``key`` becomes ready."""
        with self._lock:
            if not self._cache_on:
                self._use_cache()
        t0 = time.perf_counter()
        misses = sum(self.dispatcher.stats.cache_misses.values())
        self.dispatcher.compile(sig)
        took = time.perf_counter() - t0
        self._ready.add(key)
        if sum(self.dispatcher.stats.cache_misses.values()) == misses:
            log.debug("%s loaded from the kernel cache in %.2f s", self, took)
            return
        with _compiler.lock:
            tell, _compiler.told = not _compiler.told, True
        level = logging.INFO if tell else logging.DEBUG
        if log.isEnabledFor(level):
            values = {
                _VALUE_NAMES.get(str(t.dtype), str(t.dtype)) for t in sig if hasattr(t, "dtype")
            }
            background = threading.current_thread() is _compiler.thread
            where = " in the background (the NumPy codec ran meanwhile)" if background else ""
            log.log(
                level,
                "compiled the host codec kernel %s (%s) in %.1f s%s; kept in %s for later runs",
                self.dispatcher.py_func.__name__.strip("_").removesuffix("_range"),
                ", ".join(sorted(values - {"uint8"})),
                took,
                where,
                cache_dir(),
            )

    def _use_cache(self) -> None:
        path = cache_dir()
        try:
            cls = _cache_class(path, source_digest(self._module))
            self.dispatcher._cache = cls(self.dispatcher.py_func)  # noqa: SLF001 - Numba's cache slot
        except (OSError, RuntimeError) as exc:  # no writable place: compile every run
            log.debug("no kernel cache for %s: %s", self, exc)
        self._cache_on = True
