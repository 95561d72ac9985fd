"""Offload at run time: the copies a plan's `offload`, `reload` and `wait`
instructions make (their meaning: `remat_ir.check.simulate`).

`Transfers` holds one step's copies: each offloaded value's host buffer and
the copy of it in flight.  It copies a value's whole storage as bytes, so a
reload gives back the same bits in a fresh storage of the same size, viewed
with the value's dtype, shape, strides and offset.  How a copy is made is
the business of a `Copies` engine, one per device, kept across steps:

* `HostCopies` (CPU): host buffers are allocated inside
  `memtrack.host_pool()`, so the storage tracker counts them in its host
  pool, apart from the device's; each copy is done when it is started.
* `StreamCopies` (CUDA): pinned host buffers from a pool kept across steps
  (keyed by bytes); one copy stream.  A copy waits on the copy stream for an
  event recorded on the compute stream (the value is written), copies
  `non_blocking`, and records an event; its `wait` makes the compute stream
  wait for that event (no host synchronisation).  The CUDA calls go through
  `CudaStreams`, which tests replace by a fake.

Generated code (`remat_ir.runtime.interpret`) calls `Transfers.offload`,
`reload`, `wait` and `free` (a `free` of a value on the host).
"""
from __future__ import annotations

import torch

from remat_ir.ir import OFFLOAD, RELOAD
from remat_ir.runtime.memtrack import HOST_BYTES, host_pool

__all__ = ["Copies", "CudaStreams", "HostCopies", "StreamCopies", "Transfers", "copies_for"]


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of `t` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def view_of_bytes(raw: torch.Tensor, like: tuple) -> torch.Tensor:
    """`raw`'s storage seen as the tensor `like` describes: (dtype, shape,
    strides, storage offset)."""
    dtype, shape, stride, offset = like
    return torch.empty(0, dtype=dtype, device=raw.device).set_(raw.untyped_storage(), offset, shape, stride)


class Copies:
    """How copies between the device and the host are made (one per device,
    kept across steps)."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of `nbytes`."""
        raise NotImplementedError

    def release_host(self, buf: torch.Tensor) -> None:
        """`buf` is no longer needed (its copies are done)."""

    def device_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 device buffer of `nbytes`, allocated now on the compute stream."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def start(self, dst: torch.Tensor, src: torch.Tensor):
        """Start copying `src` into `dst` after the work issued so far; a handle for `finish`."""
        raise NotImplementedError

    def finish(self, handle) -> None:
        """The work issued after this sees the copy done."""


class HostCopies(Copies):
    """CPU: host buffers in the storage tracker's host pool; copies done at once."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        with host_pool():
            return torch.empty(nbytes, dtype=torch.uint8)

    def start(self, dst: torch.Tensor, src: torch.Tensor):
        dst.copy_(src)
        return None


class CudaStreams:
    """The CUDA calls `StreamCopies` makes: streams, events, pinned buffers."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy = torch.cuda.Stream(device)

    def compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def copy_stream(self):
        return self.copy

    def event(self):
        return torch.cuda.Event()

    def on(self, stream):
        """A context in which work is issued on `stream`."""
        return torch.cuda.stream(stream)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class StreamCopies(Copies):
    """CUDA: pinned host buffers from a pool kept across steps, keyed by
    bytes, and one copy stream ordered against the compute stream by events."""

    def __init__(self, streams: CudaStreams, host_bytes=HOST_BYTES):
        self.streams = streams
        self.pool: dict[int, list[torch.Tensor]] = {}  # nbytes -> pinned buffers not in use
        self.host_bytes = host_bytes  # where the bytes in use are reported (memtrack.HOST_BYTES)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        free = self.pool.get(nbytes)
        buf = free.pop() if free else self.streams.pinned(nbytes)
        self.host_bytes.alloc(nbytes)
        return buf

    def release_host(self, buf: torch.Tensor) -> None:
        # Its copies are done for the compute stream, and a later copy into it
        # is issued on the same copy stream, after them.
        self.pool.setdefault(buf.numel(), []).append(buf)
        self.host_bytes.free(buf.numel())

    def start(self, dst: torch.Tensor, src: torch.Tensor):
        s = self.streams
        copy = s.copy_stream()
        ready = s.event()
        ready.record(s.compute_stream())  # what writes `src` (and allocated `dst`) is issued before this
        copy.wait_event(ready)
        with s.on(copy):
            dst.copy_(src, non_blocking=True)
        done = s.event()
        done.record(copy)
        return done

    def finish(self, done) -> None:
        self.streams.compute_stream().wait_event(done)


def copies_for(device: torch.device) -> Copies:
    """The copy engine for `device`."""
    if device.type == "cuda":
        return StreamCopies(CudaStreams(device))
    return HostCopies()


class Transfers:
    """One step's offloaded values: their host buffers and copies in flight."""

    def __init__(self, copies: Copies, device: torch.device):
        self.copies = copies
        self.device = device
        self.host: dict[str, tuple[torch.Tensor, tuple]] = {}  # value -> (host buffer, its tensor's layout)
        self.flight: dict[str, tuple] = {}  # value -> (OFFLOAD, handle) or (RELOAD, handle, device tensor)

    def offload(self, name: str, t: torch.Tensor) -> None:
        """Start copying `t`'s storage to a new host buffer; `t` stays readable until `wait`."""
        raw = storage_bytes(t)
        buf = self.copies.host_buffer(raw.numel())
        self.host[name] = (buf, (t.dtype, t.shape, t.stride(), t.storage_offset()))
        self.flight[name] = (OFFLOAD, self.copies.start(buf, raw))

    def reload(self, name: str) -> None:
        """Allocate a fresh device storage for `name` now and start copying its host buffer into it."""
        buf, like = self.host[name]
        raw = self.copies.device_buffer(buf.numel(), self.device)
        handle = self.copies.start(raw, buf)
        self.flight[name] = (RELOAD, handle, view_of_bytes(raw, like))

    def wait(self, name: str, env: dict) -> None:
        """End the copy of `name` in flight: after an offload its device tensor
        leaves `env` (its storage is released), after a reload it enters `env`
        and its host buffer is released."""
        kind, handle, *rest = self.flight.pop(name)
        self.copies.finish(handle)
        if kind == OFFLOAD:
            del env[name]
        else:
            env[name] = rest[0]
            self.copies.release_host(self.host.pop(name)[0])

    def free(self, name: str) -> None:
        """`name` is on the host and no longer needed: release its host buffer."""
        self.copies.release_host(self.host.pop(name)[0])

    def clear(self) -> None:
        """The step is over (or failed): every buffer back."""
        for _kind, handle, *_ in self.flight.values():
            self.copies.finish(handle)
        self.flight.clear()
        for buf, _ in self.host.values():
            self.copies.release_host(buf)
        self.host.clear()
