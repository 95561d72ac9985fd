"""The optimizer: rewrite a program's schedule to fit a memory budget with the
least recomputation.

    result = optimize(program, budget_bytes, scope="activations")
    result.program          # same graph, new explicit schedule, header.budget set
    result.predicted_peak   # simulate() peak in the scope (max of first step / steady state)

The plan family and its exact memory model are in `family.py`: per forward
node, keep its outputs for backward or recompute it lazily in backward.  The
MILP (`milp.py`, cvxpy; HiGHS by default) picks the cheapest plan that fits.

Small graphs are solved in one MILP ("flat", exact).  Large ones are
decomposed (`blocks.py`): the forward graph is cut into segments along the
model chain; repeated blocks are found by structural hashing and each
distinct segment is solved once, for a range of targets, giving a Pareto set
of options (bytes kept into backward, transient peak, recompute cost); a
dynamic program along the chain (a small MILP when backward does not visit
the segments in reverse order) picks one option per segment, and more
options are added around the chosen ones while time remains.  Every plan is
built into an explicit schedule and checked with `simulate()`; when the real
peak exceeds the budget (the decomposition is approximate) the combine step
is tightened and re-solved, and only plans that fit are returned.
"""
from __future__ import annotations

import math
import re
import time
import warnings
from bisect import bisect_left
from dataclasses import dataclass, field

import cvxpy as cp
import msgspec
import numpy as np

from remat_ir.optimize.blocks import Segment, segments
from remat_ir.optimize.family import Analysis, apply_plan, profile, simulated_peak
from remat_ir.ir.costs import node_cost
from remat_ir.ir import COST_PROFILE, Budget, Program
from remat_ir.ir.printer import human_bytes
from remat_ir.ir.syntax import clip
from remat_ir.optimize.milp import KeepModel, SolveRecord, has_solution, installed_solvers, mip_gap, quiet_stdout, solver_options
from remat_ir.ir.schedule import default_schedule
from remat_ir.check.simulate import GRADIENTS, OPTIMIZER, PARAMS, simulate

FLAT_MAX_DECISIONS = 16  # above this, decompose (when the graph has segments)
# Up to this many decisions the flat MILP still finds good plans within a
# minute, just not always proven ones: it is solved beside the decomposed
# search (which keeps every block input, so it misses plans that recompute
# one) and below its floor, and the better plan is taken.
FLAT_FALLBACK_DECISIONS = 64

# "fast": each per-block option MILP stops after `Planner.solve_cap` seconds
# with its incumbent, so the option sets (and the plan) can differ with
# machine load.  "full": every option MILP runs to its gap tolerance; the plan
# then depends only on the program and the budget (unless --time-limit stops
# the whole solve first, which the solve records show).
EFFORTS = ("fast", "full")


class Infeasible(ValueError):
    """The budget is below the smallest peak this optimizer can reach."""

    def __init__(self, message: str, floor_bytes: int, budget_bytes: int | None = None,
                 scope: str = "total"):
        super().__init__(message)
        self.floor_bytes = int(floor_bytes)
        self.budget_bytes = budget_bytes
        self.scope = scope


@dataclass
class OptimizeResult:
    program: Program
    predicted_peak: int
    extra_cost: float  # recompute cost of the plan, in the program's cost model
    base_cost: float  # cost of every op of the step, same unit
    solves: list[SolveRecord]
    seconds: float
    budget: int = 0
    scope: str = "total"
    mode: str = "flat"  # "flat", "decomposed" or "none" (the unoptimized plan fits)
    recomputed: list[str] = field(default_factory=list)

    @property
    def overhead(self) -> float:
        return self.extra_cost / self.base_cost if self.base_cost else 0.0


# ---------------------------------------------------------------- budgets

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
    "t": 1000 ** 4, "tb": 1000 ** 4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def unoptimized_peak(program: Program, scope: str = "total") -> int:
    """Peak of the default schedule (compute in order, free after last use)."""
    fwd, bwd = default_schedule(program)
    base = Program(header=program.header, values=program.values, nodes=program.nodes,
                   forward=fwd, backward=bwd, outputs=program.outputs)
    return simulated_peak(base, scope)[0]


def resolve_budget(program: Program, text: str | int | float, scope: str = "total") -> int:
    """Bytes of a budget given as "1.5GiB", "800MB" (SI), "123456" (bytes), or
    a fraction of the unoptimized peak in the scope: "0.5", "50%".  Raises
    ValueError when it cannot be read, or is not a finite number of bytes
    that fits a 64-bit integer ("1e400", "inf", "99999999999999999999TiB")."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        return _budget_int(int(text), text)
    if isinstance(text, float):
        if not math.isfinite(text):
            raise ValueError(f"budget {text!r} is not a finite number: {_HOW}")
        return _budget_int(text * unoptimized_peak(program, scope), text)
    s = str(text).strip().replace("_", "").replace(" ", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)(%|[a-zA-Z]*)", s)
    if not m:
        raise ValueError(f"cannot read budget {clip(repr(text))}: {_HOW}")
    num, unit = m.group(1), m.group(2).lower()
    if unit == "%":
        return _budget_int(float(num) / 100.0 * unoptimized_peak(program, scope), text)
    if unit == "" and "." in num and "e" not in num.lower():
        frac = float(num)
        if frac <= 0:
            raise ValueError(f"budget fraction must be positive, not {clip(repr(text))}")
        return _budget_int(frac * unoptimized_peak(program, scope), text)
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {clip(repr(m.group(2)))} in budget {clip(repr(text))}; "
                         f"use B, KB, MB, GB, KiB, MiB, GiB")
    return _budget_int(float(num) * _UNITS[unit], text)


_HOW = "write bytes (123456), a size (800MB, 1.5GiB) or a fraction of the unoptimized peak (0.5, 50%)"
MAX_BUDGET = 2 ** 63 - 1  # bytes: what a plan's budget line (an int64) can hold, 8 EiB


def _budget_int(nbytes: float | int, text) -> int:
    """`nbytes` rounded to an int, refusing what is no amount of memory."""
    if isinstance(nbytes, float) and not math.isfinite(nbytes):
        raise ValueError(f"budget {clip(repr(text))} is not a finite number of bytes: {_HOW}")
    if nbytes > MAX_BUDGET:
        raise ValueError(f"budget {clip(repr(text))} is {float(nbytes):.3g} bytes, more than any memory "
                         f"(a budget is at most 2**63 - 1 bytes, 8 EiB): {_HOW}")
    return int(round(nbytes))


# ---------------------------------------------------------------- planner


@dataclass
class Plan:
    keep: list[bool]
    peak: int  # simulated, max over first step / steady state
    cost: float  # recompute cost, in the program's cost model
    report: object = None


class Planner:
    """Everything about one program and scope that solves can share."""

    def __init__(self, program: Program, scope: str, *, solver: str = "HIGHS", log=None,
                 decompose: bool | None = None, effort: str = "fast"):
        if effort not in EFFORTS:
            raise ValueError(f"effort must be one of {', '.join(EFFORTS)}, not {effort!r}")
        self.program = program
        self.effort = effort
        self.scope = scope
        self.solver = solver.upper()
        self.log = log
        self.a = Analysis(program, scope)
        self.solves: list[SolveRecord] = []
        self.plans: dict[tuple, Plan] = {}
        a = self.a
        self.all_dec = a.decisions()
        # The step's cost in the plan's cost model (FLOPs, or profiled microseconds).
        self.base_cost = float(sum(node_cost(n, program.header.cost) for n in program.nodes))
        self.requested = decompose
        self.auto = decompose is None  # decompose=True asks for the decomposed search alone
        if decompose is None:
            decompose = len(self.all_dec) > FLAT_MAX_DECISIONS
            if decompose:
                segs, _ = segments(a)
                decompose = sum(1 for s in segs if s.decisions) >= 2
        self.decompose = decompose
        self.segs = None
        self.flat_models: dict[str, object] = {}
        self.floor_plan: Plan | None = None
        self.floor_proven = False  # the flat MILP proved the floor optimal
        self.flat_floor_tried = False
        self.floor_mode = "flat"  # which search found the floor plan
        self.key = _cache_key(program)
        self.r_levels = 5
        self.r_power = 1.5
        self.pk_levels = 4
        self.option_gap = 1e-3  # option MILPs sample a Pareto set: near-optimal is enough
        self.options_seconds = 12.0  # at most this long for the first option sets (all classes)
        self.p_levels = 1
        # Peak-capped options per class (fit_options); 2^k + 1 spreads nest, so
        # "full" tries every cap "fast" does.
        self.fit_per_class = {"fast": 3, "full": 9}
        self._dp_steps = None  # (segments, frontier after each) of the last chain DP
        self.fallback_cap = 15.0  # seconds for each flat MILP beside the decomposed search (effort "fast")
        self.densify_rounds = 3
        self.combine_cap = 10.0  # seconds per combine MILP (non-chain graphs)
        self.class_models: dict = {}
        self.solve_cap = 1.0  # seconds per option MILP: options need not be optimal
        self.last_window_whole = False  # the last refine_windows solved one window over every decision

    def say(self, msg: str) -> None:
        if self.log:
            self.log(msg)

    def cost_text(self, cost: float) -> str:
        """A recompute cost for the log: GFLOP, or ms under the profile cost model."""
        if self.program.header.cost == COST_PROFILE:
            return f"{cost / 1e3:.4g} ms"
        return f"{cost / 1e9:.4g} GFLOP"

    # ---- evaluation

    def evaluate(self, kept: set[int]) -> Plan:
        key = tuple(sorted(kept))
        if key in self.plans:
            return self.plans[key]
        keep = self.a.keep_of(kept)
        prog = apply_plan(self.a, keep)
        peak, rep = simulated_peak(prog, self.scope)
        plan = Plan(keep, peak, self.a.recompute_cost(keep), rep)
        self.plans[key] = plan
        return plan

    def keep_all(self) -> Plan:
        return self.evaluate(set(self.all_dec))

    # ---- flat

    def _flat(self, objective: str):
        c = self.flat_models.get(objective)
        if c is None:
            if "model" not in self.flat_models:
                t0 = time.perf_counter()
                self.flat_models["model"] = KeepModel(self.a).build()
                self.say(f"flat model: {self.flat_models['model'].ny} decisions, built in "
                         f"{time.perf_counter() - t0:.2f} s")
            c = self.flat_models["model"].compile(objective)
            self.flat_models[objective] = c
        return c

    def flat_floor(self, deadline: float) -> Plan | None:
        c = self._flat("peak")
        self.flat_floor_tried = True
        kept, rec = c.solve("flat floor", solver=self.solver, time_limit=_left(deadline), log=self.log)
        self.solves.append(rec)
        if kept is None:
            return None
        self.floor_proven = rec.status == "optimal"
        return self.evaluate(kept)

    def flat_budget(self, budget: int, deadline: float) -> Plan | None:
        c = self._flat("cost")
        c.B.value = float(budget)
        kept, rec = c.solve(f"flat budget {human_bytes(budget)}", solver=self.solver,
                            time_limit=_left(deadline), log=self.log)
        self.solves.append(rec)
        if kept is None:
            return None
        return self.evaluate(kept)

    # ---- decomposed

    def prepare_segments(self, deadline: float) -> None:
        if self.segs is not None:
            return
        a = self.a
        t0 = time.perf_counter()
        segs, fixed = segments(a)
        self.segs, self.fixed = segs, fixed
        # Partition of the backward stages into windows, in backward order.
        with_st = sorted((s for s in segs if s.storages), key=lambda s: s.window[0])
        self.part = {}
        for i, s in enumerate(with_st):
            hi = with_st[i + 1].window[0] - 1 if i + 1 < len(with_st) else a.nb - 1
            self.part[s.index] = (s.window[0], max(hi, s.window[1]))
        self.first_window = with_st[0].window[0] if with_st else a.nb
        classes: dict[str, list[Segment]] = {}
        for s in segs:
            classes.setdefault(s.signature, []).append(s)
        self.classes = classes
        self.say(f"decomposition: {len(segs)} segments, {len(classes)} distinct, "
                 f"{len(fixed)} checkpoints forced, {len(self.all_dec)} decisions "
                 f"({time.perf_counter() - t0:.2f} s)")
        # Per class: Pareto options from the canonical instance.
        self.options: dict[int, list[dict]] = {}
        budget_t = _left(deadline) if self.effort == "full" else min(_left(deadline) * 0.5, self.options_seconds)
        t_opts = time.perf_counter()
        for ci, (sig, inst) in enumerate(classes.items()):
            canon = inst[0]
            if not canon.decisions:
                opts = [frozenset()]
            else:
                left_t = budget_t - (time.perf_counter() - t_opts)
                n_left = sum(1 for ss in list(classes.values())[ci:] if ss[0].decisions)
                share = max(left_t / max(n_left, 1), 0.5)
                opts = self._class_options(canon, time.perf_counter() + share)
            self._evaluate_options(canon, inst, opts)

    def _class_model(self, canon: Segment) -> dict:
        cm = self.class_models.get(canon.signature)
        if cm is None:
            m = KeepModel(self.a, nodes=canon.nodes, storages=canon.storages, fixed=self.fixed,
                          mode="local", decisions=canon.decisions).build()
            cm = self.class_models[canon.signature] = {"model": m}
        return cm

    def _solve_class(self, canon: Segment, objective: str, label: str, *, B=None, R=None,
                     time_limit: float = 1.0):
        """One MILP on a class's canonical segment; returns (kept, rec, B value)."""
        cm = self._class_model(canon)
        c = cm.get(objective)
        if c is None:
            c = cm[objective] = cm["model"].compile(objective, tie_retained=1e-3 if objective == "cost" else 0.0)
        if objective != "peak":
            c.B.value = float(B) if B is not None else 1e18
        c.Rcap.value = float(R) if R is not None else 1e18
        kept, rec = c.solve(f"{canon.name} {label}", solver=self.solver, time_limit=time_limit,
                            log=self.log, warm=True, rel_gap=self.option_gap)
        self.solves.append(rec)
        bval = float(c.B.value) if (objective == "peak" and c.B.value is not None) else None
        return kept, rec, bval

    def _class_options(self, canon: Segment, deadline: float) -> list[frozenset]:
        """Kept-decision sets of the canonical instance: a Pareto set over
        (bytes kept into backward, transient peak, recompute cost)."""
        a = self.a
        # Two plans need no solve: keep everything, recompute everything.
        opts: list[frozenset] = [frozenset(canon.decisions), frozenset()]
        others = set(self.all_dec) - set(canon.decisions)

        def retained(k):
            return profile(a, a.keep_of(others | set(k)), canon.storages, with_constants=False).retained

        r_all = retained(canon.decisions)
        r_levels = self.r_levels
        pk_levels = self.pk_levels
        left = [4 + r_levels + 2 * self.p_levels + pk_levels]

        def run(objective, label, B=None, R=None, weight=1.0):
            if self.effort == "full":
                tl = max(_left(deadline), 0.05)
            else:
                tl = min(max(weight * _left(deadline) / max(left[0], 1), 0.05), weight * self.solve_cap)
            left[0] = max(left[0] - weight, 1)
            kept, rec, bval = self._solve_class(canon, objective, label, B=B, R=R, time_limit=tl)
            if kept is not None:
                opts.append(frozenset(kept))
            return kept, bval

        # The two extremes first, with more time: they decide the floor.
        k_min, _ = run("retained", "min kept", weight=2.0)
        r_min = retained(k_min) if k_min is not None else r_all
        k_pk, p_min = run("peak", "min peak", weight=2.0)
        p_all = self._local_peak(canon, frozenset(canon.decisions))
        # Lower-transient options for the smallest kept sizes: the least
        # peak, then the cheapest plan at that peak.
        levels = [r_min + (r_all - r_min) * (i / max(r_levels, 1)) ** self.r_power
                  for i in range(max(r_levels, 1))]
        for r in levels[:self.p_levels]:
            if _left(deadline) <= 0:
                break
            k, bval = run("peak", f"min peak kept<={human_bytes(r)}", R=r + 0.5)
            if k is None or bval is None:
                continue
            pcap = bval * (1 + 1e-6) + 4096
            run("cost", f"peak<={human_bytes(pcap)} kept<={human_bytes(r)}", B=pcap, R=r + 0.5)
        # Then levels of kept size (peak free) and of transient peak (kept
        # size free), interleaved so a short time limit samples both.
        p_ok = k_pk is not None and p_min is not None and p_all > p_min + 1
        for i in range(max(r_levels, pk_levels if p_ok else 0)):
            if _left(deadline) <= 0:
                break
            if i < r_levels:
                run("cost", f"kept<={human_bytes(levels[i])}", R=levels[i] + 0.5)
            if p_ok and i < pk_levels:
                pcap = p_min + (p_all - p_min) * (i / pk_levels) ** 1.5
                run("cost", f"peak<={human_bytes(pcap)}", B=pcap * (1 + 1e-6) + 4096)
        return list(dict.fromkeys(opts))

    def _option_limit(self, deadline: float) -> float:
        if self.effort == "full":
            return max(_left(deadline), 0.05)
        return min(self.solve_cap, _left(deadline) / 4)

    def _local_peak(self, canon: Segment, kept: frozenset) -> float:
        """The local peak of an option as the segment's MILP counts it."""
        a = self.a
        others = set(self.all_dec) - set(canon.decisions)
        pr = profile(a, a.keep_of(others | set(kept)), canon.storages, with_constants=False)
        lo, hi = canon.window
        pb = 0.0
        if hi >= lo:
            js = np.arange(lo, hi + 1)
            pb = float(max((a.const_b[js] + pr.live_b[js]).max(), (a.const_pre[js] + pr.live_q[js]).max()))
        f0, f1 = canon.fwd_range
        ts = np.arange(f0, f1 + 1)
        return max(pb, float((a.base_f + a.fwd_asap[ts] + pr.fwd_extra[ts]).max()))

    def densify(self, choice: dict, deadline: float) -> bool:
        """Add options next to the ones the combine chose (kept sizes halfway
        to the neighbouring options).  Returns whether any option was added."""
        added = False
        for sig, inst in self.classes.items():
            canon = inst[0]
            if not canon.decisions or _left(deadline) <= 0.3:
                continue
            have = sorted({o["retained"] for o in self.options[canon.index]})
            chosen = sorted({choice[s.index]["retained"] for s in inst if s.index in choice})
            caps = set()
            for r in chosen:
                i = have.index(r) if r in have else bisect_left(have, r)
                if i > 0:
                    caps.add((have[i - 1] + r) / 2)
                if i + 1 < len(have):
                    caps.add((r + have[i + 1]) / 2)
            caps = {c for c in caps if not any(abs(c - h) < 1 for h in have)}
            solves = [(f"kept<={human_bytes(c)}", dict(R=c + 0.5)) for c in sorted(caps)]
            added = self._add_options(canon, inst, solves, deadline, reserve=0.3) or added
        return added

    def fit_options(self, budget: float, deadline: float) -> bool:
        """Options cut to the room the chain leaves each segment.  The first
        option sets sample kept size and transient peak on fixed levels; the
        cheapest plan often pairs a segment's cheaper, larger-peak option
        with smaller kept sizes before it.  The chain DP's frontier before
        each segment lists the kept sizes S that can precede it, so solve each
        class again with its peak capped at budget - S (a few such S per
        class, spread over the frontier).  Returns whether any option was
        added."""
        if not self._is_chain() or self._dp_steps is None:
            return False
        segs_dp, steps = self._dp_steps
        per_class = self.fit_per_class[self.effort]
        caps: dict[str, set] = {}
        for k, s in enumerate(segs_dp):
            if not s.decisions or k >= len(steps) + 1:
                continue
            prefixes = {0.0} if k == 0 else {float(t[0]) for t in steps[k - 1]}
            caps.setdefault(s.signature, set()).update(budget - S for S in prefixes if S < budget)
        added = False
        for sig, cs in caps.items():
            inst = self.classes[sig]
            canon = inst[0]
            cs = sorted(cs)
            if len(cs) > per_class:
                cs = [cs[round(i * (len(cs) - 1) / (per_class - 1))] for i in range(per_class)]
            solves = [(f"peak<={human_bytes(cap)} (room)", dict(B=cap)) for cap in dict.fromkeys(cs)]
            added = self._add_options(canon, inst, solves, deadline, reserve=0.5) or added
        return added

    def _add_options(self, canon: Segment, inst: list[Segment], solves: list[tuple[str, dict]],
                     deadline: float, reserve: float) -> bool:
        """Solve the class MILP (least recompute) under each (label, caps) in
        `solves` while more than `reserve` seconds remain, and add what it
        finds to the class's options.  Returns whether the option sets grew."""
        new = []
        for label, caps in solves:
            if _left(deadline) <= reserve:
                break
            kept, _, _ = self._solve_class(canon, "cost", label, time_limit=self._option_limit(deadline),
                                           **caps)
            if kept is not None:
                new.append(frozenset(kept))
        if not new:
            return False
        before = {o["kept"] for s in inst for o in self.options[s.index]}
        self._evaluate_options(canon, inst, new)
        return {o["kept"] for s in inst for o in self.options[s.index]} != before

    def _evaluate_options(self, canon: Segment, inst: list[Segment], opts: list[frozenset]) -> None:
        a = self.a
        others = set(self.all_dec) - set(canon.decisions)
        for o in opts:
            pr = profile(a, a.keep_of(others | set(o)), canon.storages, with_constants=False)
            for s in inst:
                nmap = dict(zip(canon.nodes, s.nodes))
                kept = frozenset(nmap[d] for d in o)
                db = s.window[0] - canon.window[0]
                df = s.nodes[0] - canon.nodes[0]
                lo, hi = self.part.get(s.index, (s.window[0], s.window[1]))
                pb = 0
                if hi >= lo:
                    js = np.arange(lo, hi + 1)
                    rel = js - db
                    ok = (rel >= 0) & (rel < a.nb)
                    lb = np.zeros(len(js), dtype=np.int64)
                    lq = np.zeros(len(js), dtype=np.int64)
                    lb[ok] = pr.live_b[rel[ok]]
                    lq[ok] = pr.live_q[rel[ok]]
                    pb = int(max((a.const_b[js] + lb).max(), (a.const_pre[js] + lq).max()))
                f0, f1 = s.fwd_range
                ts = np.arange(f0, f1 + 1)
                pf = int((a.base_f + a.fwd_asap[ts] + pr.fwd_extra[ts - df]).max())
                self.options.setdefault(s.index, []).append(dict(
                    kept=kept, retained=int(pr.retained), pf=pf, pb=pb, cost=pr.cost))
        for s in inst:
            # Drop dominated options.
            ops = self.options[s.index]
            uniq = {}
            for o in ops:
                uniq.setdefault(o["kept"], o)
            ops = list(uniq.values())
            keep = []
            for o in ops:
                dom = any(q is not o and q["retained"] <= o["retained"] and q["pf"] <= o["pf"]
                          and q["pb"] <= o["pb"] and q["cost"] <= o["cost"]
                          and (q["retained"], q["pf"], q["pb"], q["cost"]) !=
                          (o["retained"], o["pf"], o["pb"], o["cost"]) for q in ops)
                if not dom:
                    keep.append(o)
            # identical numbers: keep one
            seen, final = set(), []
            for o in keep:
                k = (o["retained"], o["pf"], o["pb"], o["cost"])
                if k not in seen:
                    seen.add(k)
                    final.append(o)
            self.options[s.index] = final

    def _is_chain(self) -> bool:
        """Backward visits the segments in reverse forward order, so what the
        others hold during a segment (forward or backward) is exactly what the
        segments before it keep: the combine is a dynamic program."""
        if hasattr(self, "_chain"):
            return self._chain
        pos = {s.index: i for i, s in enumerate(self.segs)}
        lo = {si: self.part[si][0] for si in self.part}
        ok = True
        for si in lo:
            after = {j for j in lo if lo[j] > lo[si]}
            before = {j for j in lo if pos[j] < pos[si]}
            if after != before:
                ok = False
                break
        self._chain = ok
        return ok

    def _start_const(self) -> float:
        start = float(self.a.const_start)
        if self.first_window > 0:
            start = max(start, float(self.a.const_b[:self.first_window].max()))
        return start

    def combine(self, budget: float | None, deadline: float, label: str):
        """Pick one option per segment.  budget None: minimize the modeled
        peak.  Returns (kept decision set, modeled peak, choice) or None."""
        if self._is_chain():
            return self.combine_dp(budget, label)
        return self.combine_milp(budget, deadline, label)

    def combine_dp(self, budget: float | None, label: str):
        """Dynamic program along the chain.  State: bytes kept by the segments
        so far (S); each segment's option must fit `S + max(forward,
        backward transient) <= budget`.  The frontier keeps the Pareto-best
        (S, cost) states (with a budget) or (S, peak so far) (floor)."""
        t0 = time.perf_counter()
        segs = [s for s in self.segs if self.options.get(s.index)]
        start = self._start_const()
        front = [(0.0, 0.0, -1, -1)]  # (S, recompute cost or peak, parent, option)
        steps = []
        for s in segs:
            opts = self.options[s.index]
            lims = [max(o["pf"], o["pb"]) if s.index in self.part else o["pf"] for o in opts]
            cand = []
            for pi, st in enumerate(front):
                S, c = st[0], st[1]
                for oi, o in enumerate(opts):
                    need = S + lims[oi]
                    if budget is None:
                        cand.append((S + o["retained"], max(c, need), pi, oi, o["cost"]))
                    elif need <= budget:
                        cand.append((S + o["retained"], c + o["cost"], pi, oi, 0.0))
            cand.sort(key=lambda t: (t[0], t[1], t[4]))
            pruned, best = [], float("inf")
            for t in cand:
                if t[1] < best:
                    pruned.append(t)
                    best = t[1]
            if len(pruned) > 20000:  # keep the frontier small: thin it evenly
                step = len(pruned) / 20000.0
                pruned = [pruned[int(i * step)] for i in range(20000)] + [pruned[-1]]
            front = pruned
            steps.append(front)
            if not front:
                break
        self._dp_steps = (segs, steps)
        ok = [(max(t[1], start + t[0]) if budget is None else t[1], i) for i, t in enumerate(front)
              if budget is None or start + t[0] <= budget]
        rec = SolveRecord(f"combine {label} (chain DP)", "optimal" if ok else "infeasible", None, 0.0,
                          time.perf_counter() - t0, sum(len(self.options[s.index]) for s in segs), 0,
                          len(segs))
        if not ok or not front:
            rec.status = "infeasible"
            self.solves.append(rec)
            if self.log:
                self.log(f"  {rec.name}: infeasible, {rec.seconds:.2f} s")
            return None
        val, i = min(ok)
        rec.objective = float(val)
        self.solves.append(rec)
        if self.log:
            self.log(f"  {rec.name}: optimal, {rec.seconds:.2f} s (frontier {max(len(f) for f in steps)})")
        choice = {}
        for k in range(len(segs) - 1, -1, -1):
            t = steps[k][i]
            choice[segs[k].index] = self.options[segs[k].index][t[3]]
            i = t[2]
        modeled = self.modeled_peak(choice)
        return self.kept_of(choice), modeled, choice

    def modeled_peak(self, choice: dict) -> float:
        pos = {s.index: i for i, s in enumerate(self.segs)}
        lo = {si: self.part[si][0] for si in self.part}
        peak = self._start_const() + sum(o["retained"] for o in choice.values())
        for si, o in choice.items():
            before = sum(choice[j]["retained"] for j in choice if pos[j] < pos[si])
            peak = max(peak, o["pf"] + before)
            if si in lo:
                after = sum(choice[j]["retained"] for j in choice if j in lo and lo[j] > lo[si])
                peak = max(peak, o["pb"] + after)
        return float(peak)

    def combine_milp(self, budget: float | None, deadline: float, label: str):
        """Pick one option per segment with a small MILP (any window order)."""
        segs = self.segs
        idx = []  # (segment, option)
        for s in segs:
            for k, o in enumerate(self.options.get(s.index, [])):
                idx.append((s.index, k))
        n = len(idx)
        col = {p: i for i, p in enumerate(idx)}
        R = np.array([self.options[s][k]["retained"] for s, k in idx], dtype=float)
        PF = np.array([self.options[s][k]["pf"] for s, k in idx], dtype=float)
        PB = np.array([self.options[s][k]["pb"] for s, k in idx], dtype=float)
        CO = np.array([self.options[s][k]["cost"] for s, k in idx], dtype=float)
        rows, consts = [], []
        order_f = [s.index for s in segs]
        pos_f = {si: i for i, si in enumerate(order_f)}
        for s in segs:
            if s.index not in self.options:
                continue
            # forward range of s: its transient + what earlier segments keep
            r = np.zeros(n)
            for (si, k), c in col.items():
                if si == s.index:
                    r[c] = PF[c]
                elif pos_f[si] < pos_f[s.index]:
                    r[c] = R[c]
            rows.append(r)
            consts.append(0.0)
            if s.index in self.part:
                lo = self.part[s.index][0]
                r = np.zeros(n)
                for (si, k), c in col.items():
                    if si == s.index:
                        r[c] = PB[c]
                    elif si in self.part and self.part[si][0] > lo:
                        r[c] = R[c]
                rows.append(r)
                consts.append(0.0)
        start = self._start_const()
        rows.append(R.copy())
        consts.append(start)
        A = np.array(rows)
        cst = np.array(consts)
        scale = 1000.0 / max(float(np.abs(A).max()), 1.0)
        z = cp.Variable(n, boolean=True)
        cons = []
        for s in segs:
            cols = [col[(s.index, k)] for k in range(len(self.options.get(s.index, [])))]
            if cols:
                cons.append(cp.sum(z[cols]) == 1)
        cosc = CO / max(CO.sum(), 1.0)
        if budget is None:
            B = cp.Variable()
            cons.append((A * scale) @ z + cst * scale <= B)
            obj = cp.Minimize(B + 1e-4 * (cosc @ z))
        else:
            cons.append((A * scale) @ z + cst * scale <= float(budget) * scale)
            obj = cp.Minimize(cosc @ z)
        prob = cp.Problem(obj, cons)
        t0 = time.perf_counter()
        status, gap = "error", None
        try:
            with quiet_stdout(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                prob.solve(solver=self.solver,
                           **solver_options(self.solver, min(max(_left(deadline), 0.5), self.combine_cap)))
            status = prob.status
            gap = mip_gap(prob, self.solver)
        except Exception as e:  # noqa: BLE001
            status = f"error: {str(e)[:80]}"
        rec = SolveRecord(f"combine {label}", status, None if prob.value is None else float(prob.value),
                          gap, time.perf_counter() - t0, n, n, len(rows) + len(segs))
        self.solves.append(rec)
        if self.log:
            g = "-" if gap is None else f"{gap:.2%}"
            self.log(f"  MILP {rec.name}: {status}, gap {g}, {rec.seconds:.2f} s ({n} options)")
        if status not in ("optimal", "optimal_inaccurate", "user_limit") or z.value is None \
                or not has_solution(prob, self.solver):
            return None
        zv = np.asarray(z.value)
        if np.any(np.abs(zv - np.round(zv)) > 1e-4):
            return None
        modeled = float(((A @ np.round(zv)) + cst).max())
        choice = {si: self.options[si][k] for (si, k), c in col.items() if zv[c] > 0.5}
        return self.kept_of(choice), modeled, choice

    def kept_of(self, choice: dict) -> set[int]:
        kept = set(self.all_dec) - {d for s in self.segs for d in s.decisions}
        for o in choice.values():
            kept |= set(o["kept"])
        return kept

    def decomposed_budget(self, budget: int, deadline: float) -> Plan | None:
        """The cheapest plan the combine finds that really fits (simulated),
        improved with denser options around the chosen ones while time
        remains."""
        self.prepare_segments(deadline)
        target = float(budget)
        best = None
        for it in range(8):
            got = self.combine(target, deadline, f"{human_bytes(budget)}" + (f" (try {it + 1})" if it else ""))
            if got is None:
                break
            kept, modeled, choice = got
            plan = self.evaluate(kept)
            self.say(f"  plan: modeled {human_bytes(modeled)}, simulated {human_bytes(plan.peak)}, "
                     f"+{self.cost_text(plan.cost)}")
            if plan.peak <= budget:
                best = (plan, choice, target)
                break
            over = plan.peak - budget
            target = min(target - over, modeled - over) - 1
            if _left(deadline) <= 0:
                break
        if best is None:
            return None
        plan, choice, target = best
        for rnd in range(self.densify_rounds):
            if plan.cost <= 0 or _left(deadline) <= 1.0 or not self.densify(choice, deadline):
                break
            got = self.combine(target, deadline, f"{human_bytes(budget)} (denser options)")
            if got is None:
                break
            kept, modeled, ch2 = got
            p2 = self.evaluate(kept)
            self.say(f"  denser: simulated {human_bytes(p2.peak)}, +{self.cost_text(p2.cost)}")
            if p2.peak <= budget and p2.cost < plan.cost:
                gain = plan.cost - p2.cost
                plan, choice = p2, ch2
                if gain < 0.002 * plan.cost:
                    break  # diminishing returns
            else:
                break
        if plan.cost > 0 and _left(deadline) > 1.0 and self.fit_options(budget, deadline):
            got = self.combine(target, deadline, f"{human_bytes(budget)} (options fitted to the room)")
            if got is not None:
                kept, modeled, ch2 = got
                p2 = self.evaluate(kept)
                self.say(f"  fitted: simulated {human_bytes(p2.peak)}, +{self.cost_text(p2.cost)}")
                if p2.peak <= budget and p2.cost < plan.cost:
                    plan, choice = p2, ch2
        if plan.cost > 0:
            plan = self.refine_windows(plan, budget, deadline)
        return plan

    def refine_windows(self, plan: Plan, budget: int, deadline: float) -> Plan:
        """Re-solve the decisions of two adjacent segments at a time with the
        exact (flat) memory model, every other decision held at `plan`'s,
        warm-started from `plan`: the segment models and the combine only
        approximate what segments cost each other.  Each window keeps the
        cheaper plan that fits.  With effort "full" every window is solved;
        with "fast" only a window that holds every decision (two segments:
        one warm-started flat MILP), since on longer chains each window costs
        seconds (gpt2-small: 1.5 s to build, 1-4 s to solve)."""
        self.last_window_whole = False
        segs = [s for s in self.segs if s.decisions]
        if len(segs) < 2 or (self.effort == "fast" and len(segs) > 2):
            return plan
        for i in range(len(segs) - 1):
            if _left(deadline) <= 1.0 or plan.cost <= 0:
                break
            window = set(segs[i].decisions) | set(segs[i + 1].decisions)
            kept = {d for d in self.all_dec if plan.keep[d]}
            fixed = {d: int(d in kept) for d in self.all_dec if d not in window}
            c = KeepModel(self.a, fixed=fixed).build().compile("cost")
            c.B.value = float(budget)
            if c.y is None:
                continue
            c.y.value = np.array([1.0 if d in kept else 0.0 for d in c.m.dec])
            limit = _left(deadline) - 0.5 if self.effort == "full" else min(self.fallback_cap, _left(deadline) - 0.5)
            got, rec = c.solve(f"window {segs[i].name}+{segs[i + 1].name}", solver=self.solver,
                               time_limit=limit, warm=True, log=self.log)
            self.solves.append(rec)
            if got is None:
                continue
            if len(segs) == 2:
                self.last_window_whole = True  # that MILP was the flat one, warm-started
            p2 = self.evaluate(set(got) | {d for d, v in fixed.items() if v})
            self.say(f"  window {segs[i].name}+{segs[i + 1].name}: simulated {human_bytes(p2.peak)}, "
                     f"+{self.cost_text(p2.cost)}")
            if p2.peak <= budget and p2.cost < plan.cost:
                plan = p2
        return plan

    def decomposed_floor(self, deadline: float) -> Plan | None:
        self.prepare_segments(deadline)
        got = self.combine(None, deadline, "min peak")
        cands = []
        if got is not None:
            kept, modeled, _ = got
            plan = self.evaluate(kept)
            cands.append(plan)
            # The model is approximate: try to close the gap with budgets just
            # below the first plan's simulated peak.
            if plan.peak > modeled:
                p2 = self.decomposed_budget(int(modeled), deadline)
                if p2 is not None:
                    cands.append(p2)
        cands.append(self.keep_all())
        cands.append(self.evaluate(self.kept_of({})))  # checkpoint every segment
        return min(cands, key=lambda p: (p.peak, p.cost))

    # ---- the floor

    def _fallback_deadline(self, deadline: float) -> float:
        # The flat MILP rarely proves these graphs optimal: with effort "fast"
        # it gets a bounded share of the time, not all that is left.
        if self.effort == "full":
            return deadline
        return min(deadline, time.perf_counter() + self.fallback_cap)

    def flat_fallback(self, deadline: float) -> bool:
        return (self.auto and self.decompose and len(self.all_dec) <= FLAT_FALLBACK_DECISIONS
                and _left(deadline) > 1.0)

    def floor_plan_for(self, deadline: float) -> Plan:
        if self.floor_plan is None:
            plan = None
            flat = None
            if not self.decompose:
                plan = self.flat_floor(deadline)
            else:
                plan = self.decomposed_floor(deadline)
                if self.flat_fallback(deadline):
                    self.say("  the flat MILP may go below the decomposed floor: trying it")
                    flat = self.flat_floor(self._fallback_deadline(deadline))
            cands = [p for p in (plan, flat, self.keep_all(), self.evaluate(set())) if p is not None]
            self.floor_plan = min(cands, key=lambda p: (p.peak, p.cost))
            self.floor_mode = "flat" if (flat is self.floor_plan or not self.decompose) else "decomposed"
        return self.floor_plan


def _left(deadline: float) -> float:
    return deadline - time.perf_counter()


_CACHE: list = []


def _cache_key(program: Program) -> tuple:
    h = program.header
    return (len(program.values), len(program.nodes), len(program.outputs), h.optim_state_bytes)


def _planner(program: Program, scope: str, solver: str, log, decompose, effort: str = "fast") -> Planner:
    for pl in _CACHE:
        if pl.program is program and pl.key == _cache_key(program) and pl.scope == scope \
                and pl.solver == solver.upper() and pl.effort == effort \
                and pl.requested == decompose:
            pl.log = log
            return pl
    pl = Planner(program, scope, solver=solver, log=log, decompose=decompose, effort=effort)
    _CACHE.append(pl)
    del _CACHE[:-4]
    return pl


def _infeasible(pl: Planner, budget: int, floor_plan: Plan) -> Infeasible:
    scope = pl.scope
    f = floor_plan.peak
    if scope == "total":
        base = simulate(pl.program, grads_present=True).baseline
        params = base.get(PARAMS, 0)
        grads = base.get(GRADIENTS, 0)
        opt = base.get(OPTIMIZER, 0)
        fixed = sum(base.values())
        if fixed > budget:
            parts = [f"parameters {human_bytes(params)}", f"gradients {human_bytes(grads)}"]
            if opt:
                parts.append(f"optimizer state {human_bytes(opt)}")
            rest = fixed - params - grads - opt
            if rest:
                parts.append(f"buffers and inputs {human_bytes(rest)}")
            msg = (f"budget {human_bytes(budget)} (total) is below the floor: {' + '.join(parts)} "
                   f"already exceed it (the smallest total peak is {human_bytes(f)})")
            return Infeasible(msg, f, budget, scope)
    where = profile(pl.a, floor_plan.keep, range(len(pl.a.storages))).where
    what = "activation peak" if scope == "activations" else "total peak"
    how = ""
    if pl.decompose and not pl.flat_floor_tried:
        how = " (decomposed search: block inputs kept as checkpoints)"
    elif not pl.floor_proven:
        how = " (best found within the time limit)"
    msg = (f"budget {human_bytes(budget)} ({scope}) is below the floor: the smallest {what} this "
           f"graph allows is {human_bytes(f)} (at {where}){how}; asked {human_bytes(budget)}")
    return Infeasible(msg, f, budget, scope)


def floor(program: Program, scope: str = "total", *, time_limit: float = 60.0, solver: str = "HIGHS",
          log=None, decompose: bool | None = None, effort: str = "fast") -> int:
    """The smallest peak (in `scope`, max of first step and steady state) of
    any plan this optimizer can produce for `program`."""
    pl = _planner(program, scope, solver, log, decompose, effort)
    return pl.floor_plan_for(time.perf_counter() + time_limit).peak


def optimize(program: Program, budget_bytes: int, scope: str = "total", *, time_limit: float = 60.0,
             solver: str = "HIGHS", log=None, decompose: bool | None = None,
             effort: str = "fast") -> OptimizeResult:
    """A plan for `program` whose simulated peak in `scope` fits `budget_bytes`
    (first step and steady state), with the least recompute cost found
    within `time_limit` seconds.  Raises `Infeasible` below the floor.
    `effort`: "fast" caps each per-block MILP at about a second; "full" solves
    each to its gap tolerance, so the plan does not depend on machine speed."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    budget = int(budget_bytes)
    solver = solver.upper()
    if solver not in installed_solvers():
        raise ValueError(f"solver {solver} is not installed; installed MILP solvers: "
                         f"{', '.join(installed_solvers())}")
    pl = _planner(program, scope, solver, log, decompose, effort)
    n_solves = len(pl.solves)
    pl.say(f"optimize {program.header.model or 'program'}: budget {human_bytes(budget)} ({scope}), "
           f"{pl.a.nf} forward / {pl.a.nb} backward nodes, {len(pl.all_dec)} decisions, "
           f"{'decomposed' if pl.decompose else 'flat'}")
    plan, mode = None, "none"
    base = pl.keep_all()
    if base.peak <= budget:
        plan = base  # nothing to recompute
    else:
        mode = "decomposed" if pl.decompose else "flat"
        if pl.decompose:
            plan = pl.decomposed_budget(budget, deadline)
            if pl.flat_fallback(deadline) and not (plan is not None and pl.last_window_whole):
                # Few enough decisions for the exact flat MILP, which also
                # weighs what the decomposition keeps at block boundaries and
                # approximates between segments: the cheaper plan that fits
                # wins.  (Skipped when the decomposed search's own refinement
                # already was that MILP.)
                pl.say("  small graph: trying the flat MILP too")
                flat = pl.flat_budget(budget, pl._fallback_deadline(deadline))
                if flat is not None and flat.peak <= budget and (plan is None or flat.cost < plan.cost):
                    plan, mode = flat, "flat"
        else:
            plan = pl.flat_budget(budget, deadline)
            if plan is not None and plan.peak > budget:  # the flat model is exact: a backend's bad point
                plan = None
        if plan is None:
            fp = pl.floor_plan_for(max(deadline, time.perf_counter() + 5.0))
            if fp.peak > budget:
                raise _infeasible(pl, budget, fp)
            plan, mode = fp, pl.floor_mode
    out = apply_plan(pl.a, plan.keep, Budget(budget, scope))
    # The result owns its graph: editing it must not change the input program.
    out = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=Program)
    recomputed = [ins.target for ins in out.backward if ins.kind == "recompute"]
    return OptimizeResult(
        program=out, predicted_peak=int(plan.peak), extra_cost=float(plan.cost),
        base_cost=pl.base_cost, solves=list(pl.solves[n_solves:]), seconds=time.perf_counter() - t0,
        budget=budget, scope=scope, mode=mode, recomputed=recomputed)
