"""The schedule family the optimizer searches, and its exact memory model.

A plan of this family is fixed by one choice per forward node: *keep* its
outputs from the forward pass until their last use in backward, or *drop*
them (free them after their last forward use) and recompute the node in
backward, lazily:

* the forward section computes every forward node in graph order; a value is
  freed right after its last forward use unless its node is kept and
  backward needs it;
* the backward section computes the backward nodes in graph order; before
  backward node ``b_j``, every dropped forward node first needed at stage
  ``j`` (read by ``b_j``, or by the recompute of another dropped node first
  needed at ``j``) is recomputed, in forward order;
* every value is freed right after its last use (a backward read, or the
  recompute of a consumer); a recomputed output that nothing reads is freed
  right after the recompute.

The backward nodes keep their graph order, except zero-cost views of saved
forward values (autograd's `detach` of saved tensors, traced at the start of
backward), which move to just before their first reader: otherwise every
saved value would be "needed" at the first backward step.

A node is needed at the first stage that reads one of its outputs, so each
dropped node is recomputed at most once.  Views cost nothing and own no
memory: a view follows the keep/drop choice of the node owning its storage.
Nodes that may not be recomputed (in-place updates, nodes whose storage is
updated in place, readers of a storage updated later, forward results) are
always kept.

Offload (`Analysis(..., offload=...)`): a set of decision nodes is
*offload-only*: kept, or dropped and *restored* from the host instead of
recomputed.  For device memory an offloaded node is exactly a dropped node
whose restore reads none of its inputs: its outputs' storages are live from
its compute to their ASAP death in forward (where `wait V` releases them in
place of `free V`; `offload V` is issued right after the compute), and again
from the lazy restore point (`reload V`, `wait V`, where a `recompute` would
be) to their last use.  Every storage of it that a plan may need in backward
travels (`Analysis.owned`), and one not needed after the restore is freed
right after it, as a recomputed output is.  Views of an offloaded storage
are recomputed after its reload, as views of a dropped owner are.  So the
family, its MILP and every search are the same; only what a restore reads
(`Analysis.rin`: a recompute reads the node's inputs, a reload nothing) and
what it costs (`Analysis.cost`: the node's compute, or its copies,
`remat_ir.ir.costs.offload_cost`) differ.

`Analysis` derives, once per program and budget scope, everything the MILPs
and the schedule builder need: which nodes are decisions, which storages can
be live in backward, when backward reads them, and the memory of everything
the choice does not change (parameters, backward temporaries, gradients,
tangents), taken from `simulate()` itself so the model and the simulator
agree to the byte.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat_ir.ir.costs import node_cost, offload_cost
from remat_ir.ir import (
    BACKWARD, BUFFER, COMPUTE, FORWARD, FREE, GRAD, INPUT, OFFLOAD, PARAM, RECOMPUTE, RELOAD, RESULT, TANGENT,
    VALUE, WAIT, Instr, Program, node_inputs,
)
from remat_ir.check.simulate import ACTIVATIONS, TEMPORARIES, simulate, value_categories
from remat_ir.ir.types import DEFAULT_SCOPE

NEVER = 1 << 40  # "no stage"

# Forward node kinds.
UNIT = "unit"  # a decision: keep or recompute
VIEW = "view"  # a pure view of an activation: follows its storage owner's decision
FORCED = "forced"  # may not be recomputed: always kept
FIXED = "fixed"  # outputs are graph inputs' views or forward results: always kept, no memory choice


def position(stage: int, slot: int, nf: int) -> int:
    """A point of the backward timeline: the recompute of forward node `slot`
    (0..nf-1) at backward stage `stage`, or the compute of backward node
    `stage` itself (slot nf).  The forward pass is position -1."""
    return stage * (nf + 1) + slot


@dataclass
class Storage:
    """A storage owned by a forward value whose liveness the plan decides."""

    name: str
    size: int
    owner: int  # forward node index producing the owner value
    aliases: list[str]  # forward values with this storage
    reads: list[int]  # backward stages reading an alias (sorted)
    holds: list[int]  # backward stages at which a backward view of it is last used
    consumers: list[int]  # forward nodes (unit/view) reading an alias
    asap_death: int  # last forward index at which it is live without a keep

    @property
    def last_static(self) -> int:
        last = -1
        if self.reads:
            last = self.reads[-1]
        if self.holds:
            last = max(last, self.holds[-1])
        return last


class Analysis:
    """Facts about a program the optimizer needs; see the module docstring."""

    def __init__(self, program: Program, scope: str = DEFAULT_SCOPE, offload=frozenset()):
        if scope not in ("total", "activations"):
            raise ValueError(f"scope must be 'total' or 'activations', not {scope!r}")
        self.program = program
        self.scope = scope
        values = self.values = program.value_map()
        self.fwd = [n for n in program.nodes if n.phase == FORWARD]
        # Cost of running each forward node in the plan's cost model: FLOPs, or
        # microseconds measured on the device (`remat-compile --cost profile`).
        self.compute_cost = [node_cost(n, program.header.cost) for n in self.fwd]
        # Cost of restoring each forward node in backward: its recompute, or
        # (offload-only nodes, set below) its copies.
        self.cost = list(self.compute_cost)
        self.bwd = _sink_views([n for n in program.nodes if n.phase == BACKWARD], self.fwd, values)
        nf = self.nf = len(self.fwd)
        self.nb = len(self.bwd)
        self.fidx = {n.name: i for i, n in enumerate(self.fwd)}
        self.bidx = {n.name: j for j, n in enumerate(self.bwd)}
        self.fin = [node_inputs(n) for n in self.fwd]
        self.bin = [node_inputs(n) for n in self.bwd]
        prod_f: dict[str, int] = {}
        for i, n in enumerate(self.fwd):
            for o in n.outputs:
                if o:
                    prod_f[o] = i
        self.prod_f = prod_f
        prod_b: dict[str, int] = {}
        for j, n in enumerate(self.bwd):
            for o in n.outputs:
                if o:
                    prod_b[o] = j
        self.results = {o.value for o in program.outputs if o.kind == RESULT}
        self.grads = {o.value for o in program.outputs if o.kind == GRAD}

        # Storages that are live whatever the plan: graph inputs and results.
        always = {v.storage for v in program.values if v.kind in (INPUT, PARAM, BUFFER)}
        pinned = {values[r].storage for r in self.results}
        self.pinned_storages = pinned - always
        always |= pinned
        self.always = always

        def is_act(v: str) -> bool:  # a forward value whose storage the plan decides
            return v in prod_f and values[v].storage not in always

        # In-place updates: storage -> graph positions (forward i, backward nf + j).
        mutated_at: dict[str, list[int]] = {}
        for i, n in enumerate(self.fwd):
            for m in n.mutates:
                mutated_at.setdefault(values[m].storage, []).append(i)
        for j, n in enumerate(self.bwd):
            for m in n.mutates:
                mutated_at.setdefault(values[m].storage, []).append(nf + j)

        # ---- classify forward nodes
        kind = [FIXED] * nf
        for i, n in enumerate(self.fwd):
            outs = [o for o in n.outputs if o]
            if not outs or not any(is_act(o) for o in outs):
                kind[i] = FIXED
                continue
            if any(values[o].storage in pinned for o in outs):
                # An output is a result, or a result views its storage: that
                # storage is never freed, so the node is never recomputed.
                kind[i] = FIXED
                continue
            in_storages = {values[r].storage for r in self.fin[i]}
            views = [o for o in outs if values[o].storage != o]
            forced = bool(n.mutates)
            forced = forced or any(values[o].storage in mutated_at for o in outs)
            forced = forced or any(p > i for r in self.fin[i] for p in mutated_at.get(values[r].storage, ()))
            forced = forced or (views and len(views) != len(outs))
            forced = forced or any(values[o].storage not in in_storages for o in views)
            if forced:
                kind[i] = FORCED
            elif views:
                kind[i] = VIEW
            else:
                kind[i] = UNIT
        # A storage some always-kept node aliases cannot be recomputed either.
        for i, n in enumerate(self.fwd):
            if kind[i] in (FORCED, FIXED):
                for o in n.outputs:
                    if o and is_act(o):
                        s = values[o].storage
                        u = prod_f.get(s)
                        if u is not None and kind[u] == UNIT:
                            kind[u] = FORCED
        self.kind = kind

        # Decision key of each node: its own index (unit), its storage owner's
        # key (view), or -1 (always kept).
        key = [-1] * nf
        for i in range(nf):
            if kind[i] == UNIT:
                key[i] = i
            elif kind[i] == VIEW:
                outs = [o for o in self.fwd[i].outputs if o]
                owner = prod_f.get(values[outs[0]].storage)
                key[i] = owner if owner is not None and kind[owner] == UNIT else -1
        self.key = key

        # ---- offload-only nodes: what each node's restore reads
        off = set()
        for name in offload:
            i = self.fidx.get(name)
            why = offload_refused(self, i) if i is not None else "no forward node of this graph"
            if why:
                raise ValueError(f"{name} cannot be offloaded: {why}")
            off.add(i)
        self.offload = frozenset(off)
        self.rin = [[] if i in off else ins for i, ins in enumerate(self.fin)]

        # ---- backward reads of forward values, and holds by backward views
        reads: dict[str, list[int]] = {}
        reads_all: dict[str, list[int]] = {}  # every forward value read in backward
        for j, ins in enumerate(self.bin):
            for r in ins:
                if r in prod_f:
                    reads_all.setdefault(r, []).append(j)
                    if is_act(r):
                        reads.setdefault(r, []).append(j)
        self.reads = reads
        self.reads_all = reads_all
        last_use_b: dict[str, int] = {}
        for j, ins in enumerate(self.bin):
            for r in ins:
                last_use_b[r] = j
        holds: dict[str, list[int]] = {}
        for j, n in enumerate(self.bwd):
            for o in n.outputs:
                if o and values[o].storage != o and values[o].storage in prod_f \
                        and values[o].storage not in always:
                    holds.setdefault(values[o].storage, []).append(max(j, last_use_b.get(o, j)))

        # ---- consumers (forward nodes that may be recomputed and read a value)
        # (a consumer is a node whose restore reads the value: an offloaded node reads nothing)
        cons: list[list[int]] = [[] for _ in range(nf)]  # node -> consumer nodes
        for w, ins in enumerate(self.rin):
            if kind[w] not in (UNIT, VIEW):
                continue
            for r in ins:
                if is_act(r):
                    cons[prod_f[r]].append(w)
        self.cons = [sorted(set(c)) for c in cons]
        # First backward read of any output of each node.
        dfirst = [NEVER] * nf
        for v, js in reads.items():
            i = prod_f[v]
            dfirst[i] = min(dfirst[i], js[0])
        self.dfirst = dfirst
        # Which recomputable nodes could ever be recomputed.
        maybe = [False] * nf
        for i in range(nf - 1, -1, -1):
            if kind[i] in (UNIT, VIEW) and key[i] >= 0:
                maybe[i] = dfirst[i] < NEVER or any(maybe[w] for w in self.cons[i])
        self.maybe = maybe

        # ---- ASAP forward liveness of activation storages
        last_fwd: dict[str, int] = {}
        for i, ins in enumerate(self.fin):
            for r in ins:
                last_fwd[r] = i
        death: dict[str, int] = {}
        for v, i in prod_f.items():
            s = values[v].storage
            if s in always and s not in self.pinned_storages:
                continue
            d = NEVER if v in self.results else max(i, last_fwd.get(v, i))
            death[s] = max(death.get(s, -1), d)
        self.asap_death = death

        # ---- the storages a plan decides
        aliases: dict[str, list[str]] = {}
        for v in prod_f:
            if is_act(v):
                aliases.setdefault(values[v].storage, []).append(v)
        self.storages: list[Storage] = []
        for s, al in aliases.items():
            if s not in prod_f:
                continue
            owner = prod_f[s]
            rs = sorted({j for a in al for j in reads.get(a, ())})
            hs = sorted(holds.get(s, ()))
            cs = sorted({w for a in al for w in self.cons[prod_f[a]] if self._reads(w, a)})
            # (a recomputed node makes every output; a reloaded one, those a plan may need)
            relevant = rs or hs or any(maybe[w] for w in cs) or (maybe[owner] and owner not in off)
            if not relevant:
                continue
            self.storages.append(Storage(s, values[s].nbytes, owner, al, rs, hs, cs, death[s]))
        self.storage_index = {st.name: k for k, st in enumerate(self.storages)}
        # Storages each node owns: what an offloaded node moves to the host and back.
        owned: dict[int, list[int]] = {}
        for k, st in enumerate(self.storages):
            owned.setdefault(st.owner, []).append(k)
        self.owned = owned
        # An offloaded node's restore cost: its copies, each offload overlapping the
        # forward compute between it and its wait (`remat_ir.ir.costs`).
        done = np.concatenate([[0.0], np.cumsum(self.compute_cost)]) if nf else np.zeros(1)
        for i in off:
            self.cost[i] = self.transfer_cost(i, done)

        self._constants()

    def _reads(self, w: int, v: str) -> bool:
        return v in self.rin[w]

    def transfer_cost(self, i: int, done=None) -> float:
        """What restoring node `i` from the host costs: a copy each way of
        every storage it owns, an offload's only beyond the forward compute
        between it (after node `i`) and its wait (after the storage's ASAP
        death).  `done`: prefix sums of the forward nodes' compute costs."""
        if done is None:
            done = np.concatenate([[0.0], np.cumsum(self.compute_cost)])
        h = self.program.header
        return float(sum(offload_cost(self.storages[k].size, float(done[self.storages[k].asap_death + 1] - done[i + 1]),
                                      h.device, h.cost) for k in self.owned.get(i, ())))

    # ------------------------------------------------------------ constants

    def _constants(self) -> None:
        """Memory the plan does not change, at every point of the timeline."""
        p = self.program
        nf, nb = self.nf, self.nb
        values = self.values
        # The keep-everything plan: backward temporaries live as in any plan.
        fwd_i, bwd_i = build_schedule(self, self.keep_of(set(self.decisions())))
        base = Program(header=p.header, values=p.values, nodes=p.nodes, forward=fwd_i, backward=bwd_i,
                       outputs=p.outputs)
        stage_of = {}
        for idx, ins in enumerate(bwd_i):
            if ins.kind == COMPUTE:
                stage_of[idx] = self.bidx[ins.target]
        # What `other` counts: every storage in scope "total"; in scope
        # "activations" the temporaries (a held gradient is not one).
        counted = value_categories(p)
        const_b = np.zeros(nb, dtype=np.int64)
        const_pre = np.zeros(nb, dtype=np.int64)
        start = 0
        base_f = 0
        for gp in (True, False):
            rep = simulate(base, grads_present=gp, keep_timeline=True)
            seen = set()
            for ev in rep.timeline:
                act = ev.by_category[ACTIVATIONS]
                other = ev.total - act if self.scope == "total" else ev.by_category[TEMPORARIES]
                if ev.phase == "forward":
                    base_f = max(base_f, other)
                elif ev.phase == "start" or ev.index < 0:
                    start = max(start, other)
                else:
                    j = stage_of.get(ev.index)
                    if j is None:
                        continue
                    const_b[j] = max(const_b[j], other)
                    if j not in seen:
                        seen.add(j)
                        own = sum(values[o].nbytes for o in self.bwd[j].outputs
                                  if o and values[o].storage == o
                                  and (self.scope == "total" or counted[o] == TEMPORARIES))
                        const_pre[j] = max(const_pre[j], other - own)
            if self.scope == "total":
                base_f = max(base_f, rep.baseline_bytes)
        pinned = sum(values[s].nbytes for s in self.pinned_storages)
        self.pinned_bytes = pinned
        self.const_b = const_b + pinned
        self.const_pre = const_pre + pinned
        self.const_start = start + pinned
        self.base_f = base_f
        # ASAP forward occupancy of activation storages (after each forward compute).
        diff = np.zeros(nf + 1, dtype=np.int64)
        for s, d in self.asap_death.items():
            owner = self.prod_f.get(s)
            if owner is None:
                continue
            diff[owner] += values[s].nbytes
            if d < nf:
                diff[d + 1] -= values[s].nbytes
        self.fwd_asap = np.cumsum(diff)[:nf]

    def peak_lower_bound(self) -> int:
        """A peak no plan goes under: the forward pass with every value freed
        as soon as it can be, the start of backward, and each backward node
        with the storages it reads live (kept or recomputed before it, every
        plan holds them there), on top of the constants.  A floor search
        whose plan reaches it is done; a budget under it needs no search."""
        lb = self.__dict__.get("_lower_bound")
        if lb is None:
            at = self.const_b.copy()
            for st in self.storages:
                if st.reads:
                    at[np.asarray(st.reads, dtype=np.int64)] += st.size
            fwd = self.base_f + self.fwd_asap
            lb = max(int(fwd.max()) if len(fwd) else 0, int(self.const_start), int(at.max()) if len(at) else 0)
            self.__dict__["_lower_bound"] = lb
        return lb

    # ------------------------------------------------------------ plans

    def keep_of(self, decisions: set[int] | frozenset[int]) -> list[bool]:
        """Per forward node: kept, given the set of kept decision nodes."""
        return [k < 0 or k in decisions for k in self.key]

    def decisions(self) -> list[int]:
        """Decision nodes that could ever be recomputed (themselves or a view
        of their storage)."""
        hit = set()
        for w in range(self.nf):
            if self.maybe[w] and self.key[w] >= 0:
                hit.add(self.key[w])
        return sorted(hit)

    def first_needs(self, keep: list[bool]) -> dict[int, int]:
        """Backward stage at which each dropped node is recomputed."""
        f: dict[int, int] = {}
        for i in range(self.nf - 1, -1, -1):
            if keep[i] or self.kind[i] not in (UNIT, VIEW):
                continue
            best = self.dfirst[i]
            for w in self.cons[i]:
                fw = f.get(w)
                if fw is not None and fw < best:
                    best = fw
            if best < NEVER:
                f[i] = best
        return f

    def value_needs(self, keep: list[bool], f: dict[int, int]) -> dict[str, int]:
        """Last backward position at which each forward value is needed."""
        nf = self.nf
        last: dict[str, int] = {}
        for v, js in self.reads_all.items():
            last[v] = position(js[-1], nf, nf)
        for w, fw in f.items():
            pw = position(fw, w, nf)
            for r in self.rin[w]:
                if r in self.prod_f and last.get(r, -1) < pw:
                    last[r] = pw
        return last

    def intervals(self, keep: list[bool], f: dict[int, int] | None = None, storages=None):
        """(start, end) backward positions of each decided storage (start -1:
        live since forward; None when not live in backward), for the storages
        indexed by `storages` (default: every one), in that order.  A value's
        last need is its last backward read or the latest recompute of a
        forward node that reads it (`value_needs`, asked of these storages
        only: a block's occupancy asks for a few of thousands)."""
        nf = self.nf
        if f is None:
            f = self.first_needs(keep)
        readers = self._forward_readers()
        out = []
        for k in (range(len(self.storages)) if storages is None else storages):
            st = self.storages[k]
            end = -1
            for a in st.aliases:
                js = self.reads_all.get(a)
                e = position(js[-1], nf, nf) if js else -1
                if a in self.prod_f:
                    for w in readers.get(a, ()):
                        fw = f.get(w)
                        if fw is not None:
                            e = max(e, position(fw, w, nf))
                end = max(end, e)
            if st.holds:
                end = max(end, position(st.holds[-1], nf, nf))
            if keep[st.owner]:
                out.append((-1, end) if end >= 0 else None)
            elif st.owner in f:
                p0 = position(f[st.owner], st.owner, nf)
                out.append((p0, max(end, p0)))
            else:
                out.append(None)
        return out

    def _forward_readers(self) -> dict[str, list[int]]:
        """Forward value -> the forward nodes whose restore reads it (made once)."""
        r = self.__dict__.get("_readers")
        if r is None:
            r = {}
            for w, ins in enumerate(self.rin):
                for v in dict.fromkeys(ins):
                    r.setdefault(v, []).append(w)
            self.__dict__["_readers"] = r
        return r

    def recompute_cost(self, keep: list[bool], f: dict[int, int] | None = None) -> float:
        """Cost of the restores of plan `keep` (recomputes and host copies), in
        the program's cost model."""
        if f is None:
            f = self.first_needs(keep)
        return float(sum(self.cost[i] for i in f))


# ---------------------------------------------------------------- offload


def offload_refused(a: Analysis, i: int) -> str:
    """Why forward node `i` cannot be offload-only ("" when it can): it must
    be a decision owning its outputs' storages (not a view, not always
    kept), each output a value no gradient output is (docs/08-memory-model.md)."""
    if a.kind[i] != UNIT:
        return {VIEW: "it makes views", FORCED: "it is always kept (in place, or a storage updated in place)",
                FIXED: "its outputs are results or inputs' views"}[a.kind[i]]
    for o in a.fwd[i].outputs:
        if o and (a.values[o].kind != VALUE or o in a.grads):
            return f"its output {o} is a gradient output"
    return ""


OFFLOAD_HEAVY, OFFLOAD_ALL = "heavy", "all"
OFFLOAD_KINDS = (OFFLOAD_HEAVY, OFFLOAD_ALL)


def offload_candidates(a: Analysis, which: str) -> frozenset[str]:
    """The decision nodes an offload rung makes offload-only: "all" (every
    decision that may be offloaded), or "heavy" (those whose copies cost
    less than their recompute: matmuls, convolutions, attention, whose
    compute is large for their bytes).  `a` is the graph's analysis
    without offload."""
    if which not in OFFLOAD_KINDS:
        raise ValueError(f"offload rung must be one of {', '.join(OFFLOAD_KINDS)}, not {which!r}")
    out = []
    for i in a.decisions():
        if offload_refused(a, i) or not a.owned.get(i):
            continue
        if which == OFFLOAD_ALL or a.transfer_cost(i) < a.compute_cost[i]:
            out.append(a.fwd[i].name)
    return frozenset(out)


# ---------------------------------------------------------------- builder


def _sink_views(bwd, fwd, values):
    """Backward order with zero-cost views of forward values (autograd's
    `detach` of saved tensors, often at the very start of backward) moved to
    just before their first reader, so a saved value is needed when it is
    used rather than when autograd unpacked it."""
    fwd_out = {o for n in fwd for o in n.outputs if o}
    prod = {o: j for j, n in enumerate(bwd) for o in n.outputs if o}
    mutated = {values[m].storage for n in bwd for m in n.mutates}
    readers: dict[str, int] = {}
    for j, n in enumerate(bwd):
        for r in node_inputs(n):
            readers[r] = readers.get(r, 0) + 1
    movable = [False] * len(bwd)
    for j, n in enumerate(bwd):
        outs = [o for o in n.outputs if o]
        if not outs or n.mutates or n.random:
            continue
        if any(values[o].storage == o for o in outs):
            continue
        if any(values[o].storage in mutated for o in outs):
            continue
        if not any(readers.get(o) for o in outs):
            continue
        ins = node_inputs(n)
        if ins and all(r in fwd_out or (r in prod and movable[prod[r]]) for r in ins):
            movable[j] = True
    order: list = []
    done = [False] * len(bwd)

    def emit(j):
        stack = [(j, False)]
        while stack:
            k, ready = stack.pop()
            if done[k]:
                continue
            if ready:
                done[k] = True
                order.append(bwd[k])
                continue
            stack.append((k, True))
            for r in reversed(node_inputs(bwd[k])):
                p = prod.get(r)
                if p is not None and movable[p] and not done[p]:
                    stack.append((p, False))

    for j in range(len(bwd)):
        if not movable[j]:
            emit(j)
    return order


def build_schedule(a: Analysis, keep: list[bool]) -> tuple[list[Instr], list[Instr]]:
    """The forward and backward instruction lists of the plan `keep`."""
    nf = a.nf
    values = a.values
    f = a.first_needs(keep)
    last_need = a.value_needs(keep, f)  # forward value -> last backward position
    kept_out = a.results
    # Dropped offload-only nodes that backward needs: their storages go to the
    # host after their compute and come back where a recompute would be.
    moved = {i: [a.storages[k].name for k in a.owned.get(i, ())] for i in f if i in a.offload}
    waits_f: dict[int, list[str]] = {}  # forward index -> offloads waited for after it (at the ASAP death)
    for i in moved:
        for k in a.owned.get(i, ()):
            waits_f.setdefault(a.storages[k].asap_death, []).append(a.storages[k].name)
    on_host = {v for vs in moved.values() for v in vs}

    fwd: list[Instr] = []
    last_fwd: dict[str, int] = {}
    for i, ins in enumerate(a.fin):
        for r in ins:
            last_fwd[r] = i
    frees_f: dict[int, list[str]] = {}
    for i, n in enumerate(a.fwd):
        for o in n.outputs:
            if not o or o in kept_out or o in on_host:  # (an offloaded storage is released by its wait)
                continue
            retained = keep[i] and o in last_need
            if retained:
                continue
            frees_f.setdefault(max(i, last_fwd.get(o, i)), []).append(o)
    for i, n in enumerate(a.fwd):
        fwd.append(Instr(COMPUTE, n.name))
        for v in moved.get(i, ()):
            fwd.append(Instr(OFFLOAD, v))
        for o in frees_f.get(i, ()):
            fwd.append(Instr(FREE, o))
        for v in waits_f.get(i, ()):
            fwd.append(Instr(WAIT, v))

    # Backward: recomputes per stage, then the node; frees at last positions.
    rec_at: dict[int, list[int]] = {}
    for i, j in f.items():
        rec_at.setdefault(j, []).append(i)
    frees_b: dict[int, list[str]] = {}
    for v, p in last_need.items():
        if v in kept_out:
            continue
        frees_b.setdefault(p, []).append(v)
    # Recomputed (or reloaded) outputs nothing reads afterwards: freed right after.
    for i, j in f.items():
        p = position(j, i, nf)
        for o in (moved[i] if i in moved else a.fwd[i].outputs):
            if o and o not in last_need and o not in kept_out:
                frees_b.setdefault(p, []).append(o)
    # Backward values and tangents: freed after their last use.
    last_b: dict[str, int] = {}
    for j, n in enumerate(a.bwd):
        for r in a.bin[j]:
            last_b[r] = j
        for o in n.outputs:
            if o:
                last_b.setdefault(o, j)
    bwd: list[Instr] = []
    for v in a.program.values:
        if v.kind == TANGENT and v.name not in last_b:
            bwd.append(Instr(FREE, v.name))
    for name, j in last_b.items():
        v = values[name]
        if name in a.prod_f or name in a.grads or name in kept_out:
            continue
        if v.kind not in ("value", TANGENT):
            continue
        frees_b.setdefault(position(j, nf, nf), []).append(name)
    for j, n in enumerate(a.bwd):
        for i in sorted(rec_at.get(j, ())):
            if i in moved:
                bwd += [Instr(RELOAD, v) for v in moved[i]] + [Instr(WAIT, v) for v in moved[i]]
            else:
                bwd.append(Instr(RECOMPUTE, a.fwd[i].name))
            for v in frees_b.get(position(j, i, nf), ()):
                bwd.append(Instr(FREE, v))
        bwd.append(Instr(COMPUTE, n.name))
        for v in frees_b.get(position(j, nf, nf), ()):
            bwd.append(Instr(FREE, v))
    return fwd, bwd


def apply_plan(a: Analysis, keep: list[bool], budget=None) -> Program:
    """A copy of the program with the plan's schedule (and `budget` in its header)."""
    import msgspec

    p = a.program
    fwd, bwd = build_schedule(a, keep)
    header = msgspec.structs.replace(p.header, budget=budget) if budget is not None else p.header
    return Program(header=header, values=p.values, nodes=p.nodes, forward=fwd, backward=bwd,
                   outputs=p.outputs)


def simulated_peak(program: Program, scope: str) -> tuple[int, object]:
    """Max over first step (no .grad) and steady state of the scope's peak.
    (No `top`: the optimizer reads peaks only, and the storages at the peak
    cost the simulator a second pass.)"""
    best, rep_best = -1, None
    for gp in (True, False):
        rep = simulate(program, grads_present=gp, top_k=0)
        v = rep.scope_peak(scope)
        if v > best:
            best, rep_best = v, rep
    return best, rep_best


# ---------------------------------------------------------------- model peak


def model_peak(a: Analysis, keep: list[bool]) -> int:
    """The peak the exact model predicts for plan `keep` (equals the simulated
    peak; used to cross-check the model against `simulate`)."""
    prof = occupancy(a, keep, range(len(a.storages)))
    return int(max(prof.peak_fwd, prof.peak_bwd, prof.start))


@dataclass
class Occupancy:
    """Memory of a plan restricted to some storages, on top of the constants: which
    bytes occupy each point of the step (a memory profile; "profile" elsewhere is op timing)."""

    fwd_extra: np.ndarray  # per forward position: retained bytes beyond ASAP
    live_b: np.ndarray  # per stage: live bytes after the backward node
    live_q: np.ndarray  # per stage: max live bytes after a recompute (0: none)
    retained: int  # bytes kept from forward into backward
    cost: float  # recompute cost, in the program's cost model
    peak_fwd: int = 0  # with constants
    peak_bwd: int = 0
    start: int = 0
    where: str = ""
    fwd_total: np.ndarray | None = None  # with constants: bytes after each forward node
    # with constants: every backward record (stage, slot: a forward node's
    # recompute, or nf for the backward node itself) and its bytes
    records: tuple | None = None


def occupancy(a: Analysis, keep: list[bool], storages, *, with_constants: bool = True) -> Occupancy:
    """Exact per-record live bytes of `storages` (indices) under plan `keep`."""
    nf, nb = a.nf, a.nb
    f = a.first_needs(keep)
    storages = list(storages)
    sts = [a.storages[k] for k in storages]
    ivs = a.intervals(keep, f, storages)
    # Forward: retained storages count from their ASAP death to the end of forward.
    fdiff = np.zeros(nf + 1, dtype=np.int64)
    retained = 0
    for st, it in zip(sts, ivs):
        if it is not None and it[0] < 0:
            retained += st.size
            if st.asap_death + 1 <= nf:
                fdiff[st.asap_death + 1] += st.size
    fwd_extra = np.cumsum(fdiff)[:nf]
    # Backward records: every b_j, and every recompute slot.
    recs = {position(j, nf, nf) for j in range(nb)}
    recs |= {position(j, i, nf) for i, j in f.items()}
    rec = np.array(sorted(recs), dtype=np.int64)
    diff = np.zeros(len(rec) + 1, dtype=np.int64)
    for st, it in zip(sts, ivs):
        if it is None:
            continue
        lo = np.searchsorted(rec, it[0], side="left")
        hi = np.searchsorted(rec, it[1], side="right")
        if hi > lo:
            diff[lo] += st.size
            diff[hi] -= st.size
    live = np.cumsum(diff)[:len(rec)]
    stage = rec // (nf + 1)
    slot = rec % (nf + 1)
    live_b = np.zeros(nb, dtype=np.int64)
    live_q = np.zeros(nb, dtype=np.int64)
    isb = slot == nf
    live_b[stage[isb]] = live[isb]
    np.maximum.at(live_q, stage[~isb], live[~isb])
    prof = Occupancy(fwd_extra, live_b, live_q, retained, a.recompute_cost(keep, f))
    if with_constants:
        const = np.where(slot == nf, a.const_b[stage], a.const_pre[stage])
        tot = live + const
        k = int(np.argmax(tot)) if len(tot) else 0
        prof.peak_bwd = int(tot[k]) if len(tot) else 0
        pf = a.base_f + a.fwd_asap + fwd_extra
        prof.peak_fwd = int(pf.max()) if len(pf) else 0
        prof.start = int(a.const_start + retained)
        prof.fwd_total = pf
        prof.records = (stage, slot, tot)
        if prof.peak_fwd >= max(prof.peak_bwd, prof.start):
            prof.where = a.fwd[int(np.argmax(pf))].name
        elif prof.peak_bwd >= prof.start and len(tot):
            j, i = int(stage[k]), int(slot[k])
            prof.where = a.bwd[j].name if i == nf else a.fwd[i].name + " (recompute)"
        else:
            prof.where = "start of backward"
    return prof
