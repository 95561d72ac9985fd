"""A plan's fingerprint: a hash of what the plan says about the model.

A plan has two kinds of content.  The graph section (values, nodes, outputs)
and the header fields the compile sets (device, loss, output structure,
optimizer state) are derived from the model: the verifier and the
interpreter trust them.  The schedule (forward, backward), the budget, the
header comment and the cost annotations (`flops`, measured `time_us`) are
what people read and edit.  The fingerprint hashes the first kind and
nothing of the second, so a schedule edit never changes it and any edit of
the graph section or of those header fields does.  The tracer writes it;
the verifier recomputes it and refuses a plan whose content no longer
matches.  An empty fingerprint (a hand-written plan) is not checked.
"""
from __future__ import annotations

import hashlib
import math

import msgspec

from remat_ir.ir.types import MAX_NESTING, Program, arg_depth

# Fields that do not change what the plan computes: where it was printed,
# and what recomputing an op is believed to cost.
_NOT_HASHED = frozenset({"line", "lines", "flops", "time_us"})
_HEADER_HASHED = ("version", "device", "has_loss", "output_spec", "optim", "optim_state_bytes")
_HEADER_HASHED_WHEN_SET = ("rewrites", "autocast", "held_gradients", "constants", "guards", "sizes", "size_guards")


def fingerprint(program: Program) -> str:
    """16 hex digits of a hash of `program`'s header fields derived from the
    model and of its graph section."""
    h = program.header
    for n in program.nodes:  # (msgspec recurses into lists: a deeper one is no plan's)
        if any(arg_depth(a, MAX_NESTING) > MAX_NESTING for a in list(n.args) + list(n.kwargs.values())):
            raise ValueError(f"node {n.name}: an argument has lists nested more than {MAX_NESTING} deep")
    content = {
        # Rewrites only when there are some, so plans without any keep their fingerprints.
        # Later fields only when set, so plans without them keep their fingerprints.
        "header": {f: getattr(h, f) for f in _HEADER_HASHED}
        | {f: getattr(h, f) for f in _HEADER_HASHED_WHEN_SET if getattr(h, f)},
        "values": [_facts(v) for v in program.values],
        "nodes": [_facts(n) for n in program.nodes],
        "outputs": [[o.kind, o.key, o.value] for o in program.outputs],
    }
    return hashlib.sha256(msgspec.json.encode(content)).hexdigest()[:16]


def _facts(struct) -> dict:
    d = msgspec.to_builtins(struct)
    _special_floats(d)
    return {k: d[k] for k in sorted(d) if k not in _NOT_HASHED}


_SPECIAL = {"type": "special"}  # how a Special argument hashes: {"type": "special", "name": "inf"}


def _special_floats(obj) -> None:
    """Replace, in place, every infinite or NaN float in `obj` (a node's
    arguments, made in memory) by the Special argument it means, `inf`,
    `-inf` or `nan`, as the runtime runs both alike.  JSON has no such
    numbers: msgspec writes each as `null`, which would hash `inf` as `none`,
    so an argument edited from one to the other kept the fingerprint.
    Finite floats are untouched, so no fingerprint written before changes."""
    stack = [obj]
    while stack:
        o = stack.pop()
        for k, x in (o.items() if isinstance(o, dict) else enumerate(o)):
            if type(x) is float and not math.isfinite(x):
                o[k] = dict(_SPECIAL, name="nan" if x != x else "inf" if x > 0 else "-inf")
            elif isinstance(x, (dict, list)):
                stack.append(x)
