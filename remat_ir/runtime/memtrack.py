"""Exact live-bytes measurement of a training step.

CPU has no peak-memory API, so `StorageTracker` is a ``TorchDispatchMode`` that
looks at the output of every aten op and records each *new* untyped storage
(bytes = ``storage.nbytes()``), keyed by the C++ storage pointer
``storage._cdata``.  A weakref callback on the storage's Python object removes
it when the storage dies: PyTorch preserves a storage's Python object for as
long as the C++ storage lives, so the callback fires exactly when the memory is
released, not when our Python reference goes away.

What counts as new memory
    An op output whose storage is (a) not the storage of any tensor argument of
    that op (views, in-place and ``out=`` ops alias an argument), (b) not
    registered as pre-existing and (c) not already tracked.  Rule (a) means a
    view of a pre-existing tensor never counts, registered or not; registering
    pre-existing tensors (params, buffers, inputs, grads, optimizer state)
    additionally gives the baseline and its split by category, and lets the
    tracker see baseline storages freed during the step.

Scope and caveats
    * Only memory allocated by ops dispatched while the mode is active is seen.
      Scratch buffers a kernel allocates and frees internally are not (the
      profiler does not attribute them either on CPU for the ops we use).
    * The autograd engine's ops during ``loss.backward()`` are seen: on CPU the
      engine runs on the calling thread and the dispatch-mode stack is
      propagated to it (``ones_like`` of the loss, gradient buffers,
      ``AccumulateGrad``'s clone/add).  A gradient AccumulateGrad steals into
      ``.grad`` (first step) stays live and counts; on later steps ``.grad`` is
      accumulated in place and the incoming gradient is freed.
    * Storages recorded while the mode was active keep being tracked after it
      exits (frees still update ``live_bytes``), but new allocations are not
      recorded any more: measure the whole step inside one ``with`` block.
    * Works under ``FakeTensorMode`` too (enter the fake mode first, then the
      tracker): fake tensors have meta storages with correct ``nbytes``.
    * A storage resized in place (``untyped_storage().resize_(n)``, no aten
      op: FSDP2 frees and re-gathers its unsharded parameters so) counts by
      its new size while the mode is active: a tracked or registered storage
      grows or shrinks, and one the tracker has not seen, grown from empty,
      is new memory.

Two pools
    A plan that offloads activations (`offload` / `reload` / `wait`) keeps
    their copies in host memory.  On CPU both pools are CPU memory, so the
    tracker tells them apart by where the allocation is made: a storage an op
    allocates inside `host_pool()` is a host buffer, counted in
    ``host_live_bytes`` / ``host_peak_bytes`` and never in the device pool
    (``live_bytes`` / ``peak_bytes``).  On CUDA the host buffers are pinned
    memory the allocator's statistics do not see; the copy engine reports
    them to `HOST_BYTES` as it hands them out and takes them back.

`measure_step` wraps a step: on CPU (and fake/meta) with `StorageTracker`; on
CUDA with the caching allocator's statistics (and `HOST_BYTES`).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HOST_BYTES", "HostBytes", "StorageTracker", "StepMemory", "host_pool", "measure_step", "storage_key",
           "storage_nbytes"]

MiB = 2**20

# How many `host_pool()` contexts are open: while one is, new storages are host buffers.
_host_depth = 0


@contextlib.contextmanager
def host_pool():
    """Within it, the storages ops allocate are host memory (offloaded
    copies): a `StorageTracker` counts them in its host pool, apart from
    the device pool."""
    global _host_depth
    _host_depth += 1
    try:
        yield
    finally:
        _host_depth -= 1


class HostBytes:
    """Bytes of host buffers in use, as the CUDA copy engine reports them
    (pinned memory, which the CUDA allocator's statistics do not count)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def alloc(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def free(self, nbytes: int) -> None:
        self.live -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.live


HOST_BYTES = HostBytes()


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage: the C++ StorageImpl pointer (stable while it lives)."""
    return t.untyped_storage()._cdata


def storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _has_storage(t) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    if t.layout != torch.strided:  # sparse and other layouts have no single storage
        return False
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


class StorageTracker(TorchDispatchMode):
    """Records every op's new output storages and their frees; exact live and peak bytes.

    ``live_bytes``: bytes of storages first seen inside the mode and still alive.
    ``peak_bytes``: the maximum over time of ``live_bytes - freed_baseline_bytes``,
    i.e. the peak above the registered baseline (0 if nothing was allocated).
    ``host_live_bytes`` / ``host_peak_bytes``: the same of the host pool, the
    storages allocated inside `host_pool()` (in neither of the above).
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}  # key -> nbytes, allocated inside the mode
        self._refs: dict[int, weakref.ref] = {}  # key -> weakref (keeps callbacks alive)
        self._registered: dict[int, tuple[str, int]] = {}  # key -> (category, nbytes)
        self._host: dict[int, int] = {}  # key -> nbytes, host buffers allocated inside the mode
        self.live_bytes = 0
        self.peak_bytes = 0
        self.host_live_bytes = 0
        self.host_peak_bytes = 0
        self.freed_baseline_bytes = 0
        self.n_allocations = 0
        self.allocated_bytes = 0  # total bytes ever allocated inside the mode
        self.peak_op: Optional[str] = None  # the op whose output reached the peak
        self._op: Optional[str] = None

    # ------------------------------------------------------------ dispatch mode
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let dynamo trace through the mode so compiled graphs' ops are seen
        # (otherwise dynamo silently falls back to eager under a mode).
        return True

    def __enter__(self):
        _Resizes.enter(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _Resizes.exit(self)
        return super().__exit__(*exc)

    def _resized(self, s: torch.UntypedStorage, old: int) -> None:
        key, new = s._cdata, s.nbytes()
        if key in self._live:
            self.allocated_bytes += max(0, new - self._live[key])
            self._live[key] = new
            self._add(new - old)
        elif key in self._registered:
            cat, nb = self._registered[key]
            self._registered[key] = (cat, new)
            # A baseline storage shrunk is baseline memory freed (and grown again, taken back).
            self.freed_baseline_bytes += nb - new
            self._add(0)
        elif new > 0 and old == 0:
            self._op = "UntypedStorage.resize_"
            self._track(s, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs, _ = tree_flatten(out)
        if not any(isinstance(o, torch.Tensor) for o in outs):
            return out
        self._op = str(func)
        ins, _ = tree_flatten((args, kwargs))
        in_keys = {storage_key(t) for t in ins if _has_storage(t)}
        for o in outs:
            if not _has_storage(o):
                continue
            s = o.untyped_storage()
            key = s._cdata
            if key in self._host:  # a host buffer written (the copy into it)
                continue
            if key in self._live:  # seen before; may have been resized in place (out=)
                nb = s.nbytes()
                if nb != self._live[key]:
                    self.allocated_bytes += max(0, nb - self._live[key])
                    self._add(nb - self._live[key])
                    self._live[key] = nb
                continue
            if key in in_keys or key in self._registered:
                continue  # a view / in-place result of an argument, or pre-existing
            if _host_depth:
                self._track_host(s, key)
            else:
                self._track(s, key)
        return out

    # --------------------------------------------------------------- bookkeeping
    def _add(self, delta: int) -> None:
        self.live_bytes += delta
        above = self.live_bytes - self.freed_baseline_bytes
        if above > self.peak_bytes:
            self.peak_bytes = above
            self.peak_op = self._op

    def _track(self, s: torch.UntypedStorage, key: int) -> None:
        nb = s.nbytes()
        self._live[key] = nb
        self._refs[key] = weakref.ref(s, self._make_free_cb(key, registered=False))
        self.n_allocations += 1
        self.allocated_bytes += nb
        self._add(nb)

    def _track_host(self, s: torch.UntypedStorage, key: int) -> None:
        nb = s.nbytes()
        self._host[key] = nb
        self._refs[key] = weakref.ref(s, self._make_free_cb(key, registered=False, host=True))
        self.host_live_bytes += nb
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)

    def _make_free_cb(self, key: int, registered: bool, host: bool = False):
        self_ref = weakref.ref(self)

        def on_free(_ref, key=key, registered=registered):
            tracker = self_ref()
            if tracker is None:
                return
            if host:
                tracker.host_live_bytes -= tracker._host.pop(key, 0)
            elif registered:
                entry = tracker._registered.pop(key, None)
                if entry is not None:
                    tracker.freed_baseline_bytes += entry[1]
            else:
                nb = tracker._live.pop(key, None)
                if nb is not None:
                    tracker.live_bytes -= nb
            tracker._refs.pop(key, None)

        return on_free

    def register(self, tensors: Union[torch.Tensor, Iterable], category: str = "other") -> int:
        """Declare pre-existing tensors (any nesting of lists/tuples/dicts).

        Their storages are part of the baseline, never counted as new memory.
        A storage registered twice is counted once (first category wins).
        Returns the bytes newly added to the baseline.
        """
        flat, _ = tree_flatten(tensors)
        added = 0
        for t in flat:
            if not _has_storage(t):
                continue
            s = t.untyped_storage()
            key = s._cdata
            if key in self._registered or key in self._live or key in self._host:
                continue
            nb = s.nbytes()
            self._registered[key] = (category, nb)
            self._refs[key] = weakref.ref(s, self._make_free_cb(key, registered=True))
            added += nb
        return added

    def reset_peak(self) -> None:
        """Restart peak tracking (both pools) from the current live bytes."""
        self.peak_bytes = max(0, self.live_bytes - self.freed_baseline_bytes)
        self.host_peak_bytes = self.host_live_bytes
        self.peak_op = None

    def baseline_by_category(self) -> dict[str, int]:
        """Bytes of registered storages still alive, by category."""
        out: dict[str, int] = {}
        for cat, nb in self._registered.values():
            out[cat] = out.get(cat, 0) + nb
        return out

    @property
    def baseline_bytes(self) -> int:
        return sum(nb for _, nb in self._registered.values())

    def is_tracked(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was allocated inside the mode and is still alive."""
        return storage_key(t) in self._live

    def __repr__(self) -> str:
        return (f"StorageTracker(live={self.live_bytes / MiB:.3f} MiB, peak={self.peak_bytes / MiB:.3f} MiB, "
                f"baseline={self.baseline_bytes / MiB:.3f} MiB)")


class _Resizes:
    """Routes `UntypedStorage.resize_` to the active trackers: the method is
    wrapped while at least one tracker is active, and restored after."""

    active: list = []
    original = None

    @classmethod
    def enter(cls, tracker: StorageTracker) -> None:
        if not cls.active:
            cls.original = original = torch.UntypedStorage.resize_

            def resize_(storage, size, _original=original):
                old = storage.nbytes()
                out = _original(storage, size)
                if storage.nbytes() != old:
                    for t in list(cls.active):
                        t._resized(storage, old)
                return out

            torch.UntypedStorage.resize_ = resize_
        cls.active.append(tracker)

    @classmethod
    def exit(cls, tracker: StorageTracker) -> None:
        if tracker in cls.active:
            cls.active.remove(tracker)
        if not cls.active and cls.original is not None:
            torch.UntypedStorage.resize_ = cls.original
            cls.original = None


# ---------------------------------------------------------------- step measure


@dataclass
class StepMemory:
    """Memory of one step, in bytes.

    peak_bytes: baseline_bytes + peak_above_baseline.
    baseline_bytes: the registered tensors' distinct storages before the step.
    baseline_by_category: registered bytes per category (CUDA: plus
        ``"unregistered"``, memory the device held before the step that no
        registered tensor accounts for, such as cuBLAS workspaces; not in
        baseline_bytes or peak_bytes).
    peak_above_baseline: the peak of what the step allocated on top of the baseline.
    live_after_bytes: bytes the step left allocated above the baseline
        (e.g. ``.grad`` created on a first step).
    host_peak_bytes: the peak of the host pool during the step (copies of
        offloaded values; 0 when nothing was offloaded).
    """

    peak_bytes: int
    baseline_bytes: int
    baseline_by_category: dict[str, int] = field(default_factory=dict)
    peak_above_baseline: int = 0
    live_after_bytes: int = 0
    host_peak_bytes: int = 0

    def summary(self) -> str:
        cats = ", ".join(f"{k} {v / MiB:.3f}" for k, v in self.baseline_by_category.items() if k != "unregistered")
        outside = self.baseline_by_category.get("unregistered", 0)
        return (f"peak {self.peak_bytes / MiB:.3f} MiB = baseline {self.baseline_bytes / MiB:.3f} MiB"
                f" ({cats}) + {self.peak_above_baseline / MiB:.3f} MiB"
                + (f"; host pool peak {self.host_peak_bytes / MiB:.3f} MiB" if self.host_peak_bytes else "")
                + (f"; not counted: {outside / MiB:.3f} MiB the device held beyond them" if outside else ""))


def _distinct_bytes_by_category(pre_existing: dict) -> tuple[dict[str, int], int]:
    seen: set[int] = set()
    by_cat: dict[str, int] = {}
    for cat, tensors in pre_existing.items():
        flat, _ = tree_flatten(tensors)
        for t in flat:
            if not _has_storage(t):
                continue
            key = storage_key(t)
            if key in seen:
                continue
            seen.add(key)
            by_cat[cat] = by_cat.get(cat, 0) + storage_nbytes(t)
    return by_cat, sum(by_cat.values())


def measure_step(fn: Callable[[], object], *, pre_existing: Optional[dict] = None,
                 device=None) -> StepMemory:
    """Run ``fn()`` once and measure its memory.

    ``pre_existing`` maps a category ("params", "buffers", "inputs", "grads",
    "optimizer", ...) to tensors that exist before the step.  ``device`` picks
    the method: CUDA uses the allocator's statistics (run a warm-up step first
    so one-time allocations such as cuBLAS workspaces are not in the peak);
    anything else uses `StorageTracker`.  The return value of ``fn`` is dropped
    before measuring what stays live.  ``peak_bytes`` is the named tensors'
    bytes plus the step's peak above its start; on CUDA, memory the device
    held before the step beyond the named tensors is
    ``baseline_by_category["unregistered"]``, outside ``peak_bytes``.
    """
    pre_existing = pre_existing or {}
    if device is None:
        device = "cpu"
    device = torch.device(device)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        HOST_BYTES.reset_peak()
        host_base = HOST_BYTES.live
        result = fn()
        del result
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        after = torch.cuda.memory_allocated(device)
        host_peak = HOST_BYTES.peak - host_base
        by_cat, registered = _distinct_bytes_by_category(pre_existing)
        # What the device held before the step beyond the tensors named
        # (cuBLAS's workspaces: one per handle, and the autograd thread has
        # a handle of its own; other models) is shown apart and not counted:
        # the peak is the named state plus the step's peak above what was
        # there, as on CPU, where the tracker sees only the named tensors.
        if base > registered:
            by_cat["unregistered"] = base - registered
        return StepMemory(peak_bytes=registered + peak - base, baseline_bytes=registered,
                          baseline_by_category=by_cat, peak_above_baseline=peak - base,
                          live_after_bytes=after - base, host_peak_bytes=host_peak)

    tracker = StorageTracker()
    for cat, tensors in pre_existing.items():
        tracker.register(tensors, cat)
    by_cat = tracker.baseline_by_category()
    base = sum(by_cat.values())
    with tracker:
        result = fn()
        del result
    return StepMemory(peak_bytes=base + tracker.peak_bytes, baseline_bytes=base,
                      baseline_by_category=by_cat, peak_above_baseline=tracker.peak_bytes,
                      live_after_bytes=tracker.live_bytes - tracker.freed_baseline_bytes,
                      host_peak_bytes=tracker.host_peak_bytes)
