"""Decomposition: cut the forward graph into segments along the model chain
and find repeated blocks by structural hashing.

Segments are contiguous runs of forward nodes that ran in the same repeated
module (the module path up to its first list index, e.g. ``transformer.h.3``
for ``transformer.h.3.attn.c_attn``); small runs in between (embedding,
final norm, head, loss) join the neighbouring block, larger ones are their
own segments.  Two segments are the same block when their
node sequences hash equal: ops, operand structure (operands made inside the
segment by position, operands from outside by order of first use and their
shape), output shapes, sizes and aliasing, and the backward stages reading
each storage relative to the segment's first one -- not the names, so the
layer index is ignored.

A block with more than SPLIT_DECISIONS decisions is cut along the next
list index inside it when it has one (T5's ``decoder.block.0.layer.1``: its
self-attention, cross-attention and feed-forward sub-layers): a block's
option MILPs grow with its decisions times the memory rows they learn, and
on T5 (one decoder block of 118 decisions, most of the graph) its least-peak
MILPs alone took minutes where the sub-layers' take seconds.

Storages read across segments are kept (they are the checkpoints between
blocks); each storage is *assigned* to the segment whose forward pass
consumes it last, so its bytes are counted once.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from remat_ir.optimize.family import UNIT, Analysis


# A block with more decisions than this is cut along the next list index
# inside it, when it has one (see the module's docstring).  The blocks of the
# decoder-only families hold at most about 60.
SPLIT_DECISIONS = 80


def block_key(module: str) -> str | None:
    """`transformer.h.3.attn.c_attn` -> `transformer.h.3` (up to the first
    list index); None outside lists."""
    if not module:
        return None
    parts = module.split(".")
    last = None
    for i, p in enumerate(parts):
        if p.isdigit():
            last = i
            break  # the outermost indexed module is the block
    if last is None:
        return None
    return ".".join(parts[:last + 1])


def sub_key(module: str, key: str) -> str | None:
    """Within block `key` (`decoder.block.0`): `decoder.block.0.layer.1.EncDecAttention.k`
    -> `decoder.block.0.layer.1` (up to the next list index); None when there is none."""
    if not module or not module.startswith(key + "."):
        return None
    parts = module.split(".")
    for i in range(key.count(".") + 1, len(parts)):
        if parts[i].isdigit():
            return ".".join(parts[:i + 1])
    return None


def _runs(keys: list, idx: list[int]) -> list[tuple[str | None, list[int]]]:
    """Contiguous runs of equal keys over `idx` (keys[k] for idx[k]); a key
    seen in two runs (interleaved code) merges everything in between."""
    runs: list[tuple[str | None, list[int]]] = []
    for k, i in zip(keys, idx):
        if runs and runs[-1][0] == k:
            runs[-1][1].append(i)
        else:
            runs.append((k, [i]))
    merged: list[tuple[str | None, list[int]]] = []
    for k, ii in runs:
        if k is not None:
            j = next((m for m in range(len(merged)) if merged[m][0] == k), None)
            if j is not None:
                allidx = [i for _, jj in merged[j:] for i in jj] + ii
                merged = merged[:j] + [(k, allidx)]
                continue
        merged.append((k, ii))
    return merged


def _split(a: Analysis, key: str, idx: list[int]) -> list[tuple[str, list[int]]]:
    """Block `key`'s nodes cut along the next list index inside it
    (`sub_key`); nodes outside any sub-block join the sub-block before them
    (the first one's, those before it).  Returns [(key, idx)] when there is
    nothing to cut."""
    keys = [sub_key(a.fwd[i].module, key) for i in idx]
    first = next((k for k in keys if k is not None), None)
    if first is None:
        return [(key, idx)]
    prev = first
    for n, k in enumerate(keys):
        if k is None:
            keys[n] = prev
        else:
            prev = k
    out = _runs(keys, idx)
    return out if len(out) >= 2 else [(key, idx)]


@dataclass
class Segment:
    index: int
    name: str
    nodes: list[int]  # forward node indices, in order
    storages: list[int] = field(default_factory=list)  # storages assigned to it
    decisions: list[int] = field(default_factory=list)
    signature: str = ""  # its class: segments that share option MILPs
    layout: str = ""  # equal for segments whose every storage and stage lines up (occupancies map by offset)
    window: tuple[int, int] = (0, -1)  # backward stages [lo, hi] where its storages are needed

    @property
    def fwd_range(self) -> tuple[int, int]:
        return self.nodes[0], self.nodes[-1]


def segments(a: Analysis, merge_small: int = 12) -> tuple[list[Segment], dict[int, int]]:
    """Segments in forward order, and the decision nodes that must be kept
    (node -> 1) because their storage crosses segments."""
    nf = a.nf
    keys = [block_key(n.module) for n in a.fwd]
    # Contiguous runs of the same key (unkeyed runs are their own segments);
    # a key seen in two runs (interleaved code) merges everything in between.
    merged = _runs(keys, list(range(nf)))
    # Blocks too large for their option MILPs: cut along the sub-blocks.
    merged = [r for k, idx in merged
              for r in (_split(a, k, idx) if k is not None and _n_decisions(a, idx) > SPLIT_DECISIONS
                        else [(k, idx)])]
    # Small runs outside the repeated blocks (embedding, head, loss) join the
    # neighbouring block, so the storage between them (the first block's
    # input, the last block's output) can be recomputed rather than kept.
    if merge_small and any(k is not None for k, _ in merged):
        out: list[tuple[str | None, list[int]]] = []
        pending: list[int] = []
        pending_names: list[str] = []
        for k, idx in merged:
            if k is None and _n_decisions(a, idx) <= merge_small:
                if out and out[-1][0] is not None:
                    pk, pidx = out[-1]
                    out[-1] = (pk, pidx + idx)
                    out[-1] = (out[-1][0] if out[-1][0].endswith("+" + _unkeyed_name(a, idx))
                               else out[-1][0] + "+" + _unkeyed_name(a, idx), out[-1][1])
                else:
                    pending += idx
                    pending_names.append(_unkeyed_name(a, idx))
                continue
            if pending and k is not None:
                idx = pending + idx
                k = "+".join(pending_names + [k])
                pending, pending_names = [], []
            elif pending:
                out.append(("+".join(pending_names), pending))
                pending, pending_names = [], []
            out.append((k, idx))
        if pending:
            out.append(("+".join(pending_names), pending))
        merged = out
    segs = [Segment(i, k if k is not None else _unkeyed_name(a, idx), idx) for i, (k, idx) in enumerate(merged)]
    seg_of = [0] * nf
    for s in segs:
        for i in s.nodes:
            seg_of[i] = s.index

    # Assign storages; force-keep those crossing segments.
    fixed: dict[int, int] = {}
    crossing: set[int] = set()
    for k, st in enumerate(a.storages):
        users = {seg_of[w] for al in st.aliases for w in _readers(a, al)}
        home = seg_of[st.owner]
        cross = {u for u in users if u != home}
        if cross:
            crossing.add(k)
            home = max(cross)
            if a.kind[st.owner] == UNIT:
                fixed[st.owner] = 1
            for al in st.aliases:
                i = a.prod_f[al]
                if a.key[i] >= 0:
                    fixed[a.key[i]] = 1
        segs[home].storages.append(k)
    decs = a.decisions()
    for d in decs:
        if d not in fixed:
            segs[seg_of[d]].decisions.append(d)
    for s in segs:
        stages = [j for k in s.storages for j in a.storages[k].reads + a.storages[k].holds]
        s.window = (min(stages), max(stages)) if stages else (a.nb, a.nb - 1)
        s.signature = _signature(a, s, crossing)
        s.layout = _signature(a, s, crossing, exact=True)
    return segs, fixed


@dataclass(frozen=True)
class Decomposition:
    """A program's segments and what the combine of their options needs."""

    segs: list[Segment]
    fixed: dict[int, int]  # decisions forced to keep (storages crossing segments)
    part: dict[int, tuple[int, int]]  # segment -> its backward window of stages (a partition)
    first_window: int  # the first backward stage of any segment's window
    classes: dict[str, list[Segment]]  # structural signature -> its segments, first one canonical
    chain: bool  # backward visits the segments in reverse forward order: the combine is a DP

    @property
    def blocks(self) -> int:
        """Segments that hold decisions."""
        return sum(1 for s in self.segs if s.decisions)


def decompose(a: Analysis) -> Decomposition:
    segs, fixed = segments(a)
    # Partition of the backward stages into windows, in backward order.
    with_st = sorted((s for s in segs if s.storages), key=lambda s: s.window[0])
    part = {}
    for i, s in enumerate(with_st):
        hi = with_st[i + 1].window[0] - 1 if i + 1 < len(with_st) else a.nb - 1
        part[s.index] = (s.window[0], max(hi, s.window[1]))
    classes: dict[str, list[Segment]] = {}
    for s in segs:
        classes.setdefault(s.signature, []).append(s)
    # Backward visits the segments in reverse forward order when the windows
    # starting later are exactly those of the segments before: what the
    # others hold during a segment (forward or backward) is then what the
    # segments before it keep.
    pos = {s.index: i for i, s in enumerate(segs)}
    lo = {si: part[si][0] for si in part}
    chain = all({j for j in lo if lo[j] > lo[si]} == {j for j in lo if pos[j] < pos[si]} for si in lo)
    return Decomposition(segs, fixed, part, with_st[0].window[0] if with_st else a.nb, classes, chain)


def _n_decisions(a: Analysis, idx: list[int]) -> int:
    return sum(1 for i in idx if a.kind[i] == UNIT)


def _readers(a: Analysis, v: str) -> list[int]:
    out = getattr(a, "_readers_cache", None)
    if out is None:
        out = {}
        for w, ins in enumerate(a.fin):
            for r in ins:
                out.setdefault(r, []).append(w)
        a._readers_cache = out
    return out.get(v, [])


def _unkeyed_name(a: Analysis, idx: list[int]) -> str:
    mods = [a.fwd[i].module for i in idx if a.fwd[i].module]
    if mods:
        top = sorted({m.split(".")[0] if not m.startswith("transformer.") else ".".join(m.split(".")[:2])
                      for m in mods})
        return "+".join(top[:3])
    return a.fwd[idx[0]].name


def _signature(a: Analysis, s: Segment, crossing: set[int], exact: bool = False) -> str:
    """Structural hash of a segment: equal for repeated blocks.  Storages
    that cross segments are left out: they are kept whatever a segment
    decides, and the last block that reads one (the encoder output every
    decoder block reads, a position bias every layer reads) is its home,
    which would make that block unlike its twins.  A class shares its option
    MILPs; each instance's options are then evaluated on the instance
    itself, its own crossing storages included.  `exact`: every storage,
    with stages counted from the window's start, so that segments of equal
    exact signatures have occupancies equal up to an offset."""
    values = a.values
    local: dict[str, int] = {}
    ext: dict[str, int] = {}
    parts = []

    def ref(r: str):
        if r in local:
            return ("L", local[r])
        if r not in ext:
            ext[r] = len(ext)
        v = values[r]
        return ("X", ext[r], v.kind, tuple(v.shape), v.dtype)

    def arg(x):
        from remat_ir.ir import Ref, Seq
        if isinstance(x, Ref):
            return ref(x.name)
        if isinstance(x, Seq):
            return ("S", tuple(arg(i) for i in x.items))
        return repr(x)

    for i in s.nodes:
        n = a.fwd[i]
        args = tuple(arg(x) for x in n.args)
        kwargs = tuple(sorted((k, arg(x)) for k, x in n.kwargs.items()))
        outs = []
        for o in n.outputs:
            if not o:
                outs.append(None)
                continue
            v = values[o]
            st = v.storage
            alias = local.get(st, ("X", ext.get(st, -1))) if st != o else None
            outs.append((tuple(v.shape), tuple(v.stride), v.dtype, v.nbytes, alias))
            local[o] = len(local)
        parts.append((n.op, args, kwargs, tuple(outs), n.flops, a.kind[i], n.random,
                      tuple(ref(m) for m in n.mutates)) + ((a.cost[i],) if i in a.offload else ()))
    own = [k for k in s.storages if exact or k not in crossing]
    # Backward stages by rank among the ones its storages are read or held at:
    # a stage between them that none of them meets (another block's gradient
    # accumulation) does not change the block's problem.
    rank = {j: r for r, j in enumerate(sorted({j for k in own for j in a.storages[k].reads + a.storages[k].holds}))}
    if exact:
        rank = {j: j - s.window[0] for j in rank}
    for k in own:
        st = a.storages[k]
        parts.append(("st", ref(st.name), st.size, tuple(rank[j] for j in st.reads),
                      tuple(rank[j] for j in st.holds), tuple(w - s.nodes[0] for w in st.consumers)))
    h = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    return h
