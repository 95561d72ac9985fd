"""Tracing through `torch.utils.checkpoint`: checkpointed code is plain code to the tracer.

A model may checkpoint its own layers (`torch.utils.checkpoint.checkpoint`,
`checkpoint_sequential`, transformers' `gradient_checkpointing_enable()`).
remat-ir plans recomputation itself, from the whole step's graph, so while a
step is traced a checkpointed function is simply called: `checkpoint(fn,
*args, **kwargs)` is `fn(*args, **kwargs)`, reentrant or not, and a
selective-checkpoint `context_fn` has nothing left to select.  The values are
eager's: checkpointing recomputes the same ops, and restores the RNG state
for the recomputation, so a checkpointed step's gradients are those of the
same step without checkpointing, which is what the plan computes.

The mechanism must reach every way of calling checkpoint, including a
`functools.partial(checkpoint, use_reentrant=...)` that transformers binds
on each layer when checkpointing is enabled (so patching the module
attribute `torch.utils.checkpoint.checkpoint` would not).  Both of its paths
look up their implementation in the module's globals at each call:
`CheckpointFunction.apply` (reentrant) and
`_checkpoint_without_reentrant_generator` (not).  `inline_checkpoints()`
replaces those two for the duration of a trace with stand-ins that call the
function directly in a thread that is tracing, and hand over to the
originals in any other thread, so training elsewhere in the process still
checkpoints.  The originals are back when the last trace ends.
"""
from __future__ import annotations

import contextlib
import threading

import torch.utils.checkpoint as _ckpt

__all__ = ["inline_checkpoints", "inlining"]

_state = threading.local()  # .depth: how many traces this thread is inside
_lock = threading.Lock()
_users = 0  # traces in progress, all threads
_ORIGINAL_FUNCTION = _ckpt.CheckpointFunction
_ORIGINAL_GENERATOR = _ckpt._checkpoint_without_reentrant_generator


def inlining() -> bool:
    """Whether checkpoints are called as plain code in this thread now."""
    return getattr(_state, "depth", 0) > 0


class _InlineCheckpointFunction(_ORIGINAL_FUNCTION):
    """`CheckpointFunction` while a trace is on: its `apply` (the reentrant
    path) calls the function itself in a tracing thread."""

    @classmethod
    def apply(cls, function, preserve_rng_state, *args):
        if inlining():
            return function(*args)
        return _ORIGINAL_FUNCTION.apply(function, preserve_rng_state, *args)


def _inline_generator(*args, **kwargs):
    """`_checkpoint_without_reentrant_generator` while a trace is on: in a
    tracing thread it sets nothing up before the forward (checkpoint then
    calls the function) and nothing after."""
    if inlining():
        yield
        return
    yield from _ORIGINAL_GENERATOR(*args, **kwargs)


@contextlib.contextmanager
def inline_checkpoints():
    """Within the block, this thread calls checkpointed functions directly
    (see the module's docstring)."""
    global _users
    with _lock:
        if _users == 0:
            _ckpt.CheckpointFunction = _InlineCheckpointFunction
            _ckpt._checkpoint_without_reentrant_generator = _inline_generator
        _users += 1
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
        with _lock:
            _users -= 1
            if _users == 0:
                _ckpt.CheckpointFunction = _ORIGINAL_FUNCTION
                _ckpt._checkpoint_without_reentrant_generator = _ORIGINAL_GENERATOR
