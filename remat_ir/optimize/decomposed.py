"""The decomposed search, for graphs too large for one MILP.

The forward graph is cut into segments along the model chain (`blocks.py`);
each distinct segment (a block class) is solved once, for a range of
targets, giving a Pareto set of options (bytes kept into backward, transient
peak, recompute cost); a dynamic program along the chain (a small MILP when
backward does not visit the segments in reverse order) picks one option per
segment, and more options are added around the chosen ones.  Every plan is
built into an explicit schedule and simulated; when the real peak exceeds
the budget (the decomposition is approximate) the combine is tightened and
solved again, and only plans that fit are returned.

The options of a block class and the memory rows its MILPs learned live in
the memo, so a later budget (or the floor, then a budget) starts from them.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from remat_ir.ir.printer import human_bytes
from remat_ir.optimize.blocks import Segment
from remat_ir.optimize.family import occupancy
from remat_ir.optimize.flat import highest
from remat_ir.optimize.milp import COMBINE, OPTION, WINDOW, KeepModel, SolveRecord, pick_options, silenced
from remat_ir.optimize.problem import Option, Plan, Run


# ---------------------------------------------------------------- options of a block class


def ensure_options(run: Run, floor_only: bool = False) -> None:
    """Every block class's options in the memo: the ones the floor needs
    (the extremes and the least-peak options), or (`floor_only` False) the
    full set a budget's combine chooses from.  A class another graph of the
    same model already solved (`Memo.shared`: the rungs of the rewrite
    ladder share their blocks) starts from that graph's options, mapped by
    node name, and is not solved again."""
    per_class(run, lambda r, item: _ensure_class(r, *item, floor_only),
              list(run.problem.decomposition.classes.items()))


def per_class(run: Run, fn, items: list) -> list:
    """`fn(run, item)` for each block class's `item`, on up to
    `settings.workers` threads (HiGHS lets go of the GIL while it solves).
    Each class reads and extends only its own part of the memo, so what
    they find does not depend on the order the threads end in; each class's
    solve records and log lines are taken back in `items`' order, as a
    serial run has them."""
    workers = min(run.settings.workers, len(items)) if run.settings.solver == "HIGHS" else 1
    if workers <= 1:
        return [fn(run, item) for item in items]
    children = [run.child() for _ in items]
    with silenced(), ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(fn, children, items))
    for child in children:
        run.adopt(child)
    return results


def _ensure_class(run: Run, sig: str, inst: list[Segment], floor_only: bool) -> None:
    memo = run.memo
    fwd = run.a.fwd
    canon = inst[0]
    if not canon.decisions:
        if canon.index not in memo.options:
            evaluate_options(run, canon, inst, [frozenset()])
        return
    seen, index = _shared(run, canon)
    for kind, make, wanted in (("floor", floor_options, True), ("budget", budget_options, not floor_only)):
        done = canon.index in memo.options if kind == "floor" else sig in memo.classes_with_budget_options
        if done or not wanted:
            continue
        if kind in seen:
            opts = [frozenset(index[n] for n in names) for names in seen[kind]]
            if kind == "floor":
                least = {k: None if v is None else frozenset(index[n] for n in v)
                         for k, v in seen["extremes"].items()}
                memo.extremes[sig] = dict(least, peak=None if least["least peak"] is None
                                          else local_peak(run, canon, least["least peak"]))
                memo.peak_work[sig] = seen["peak work"]
        else:
            opts = make(run, canon)
            seen[kind] = [frozenset(fwd[i].name for i in o) for o in opts]
            if kind == "floor":
                seen["extremes"] = {k: None if memo.extremes[sig][k] is None
                                    else frozenset(fwd[i].name for i in memo.extremes[sig][k])
                                    for k in ("least kept", "least peak")}
                seen["peak work"] = memo.peak_work.get(sig, 0)
        if kind == "budget":
            memo.classes_with_budget_options.add(sig)
        evaluate_options(run, canon, inst, opts)


def _shared(run: Run, canon: Segment) -> tuple[dict, dict]:
    """What other graphs of the same model learned of this class (by node
    name; `Memo.shared`, else a dict of its own), and this graph's node
    index by name."""
    memo, fwd = run.memo, run.a.fwd
    key = (canon.signature, tuple(fwd[i].name for i in canon.nodes))
    seen = memo.shared.setdefault(key, {}) if memo.shared is not None else {}
    return seen, {fwd[i].name: i for i in canon.nodes}


def solve_class(run: Run, canon: Segment, objective: str, label: str, *, B=None, R=None, gap=None):
    """One MILP on a class's canonical segment; returns (kept, B value).

    Like the flat search, it is solved with only the memory rows plans
    break, learned per class (in the memo): a row one option's plan broke is
    a row of every option of the class."""
    a, st, memo = run.a, run.settings, run.memo
    d = run.problem.decomposition
    learned = memo.class_rows.setdefault(canon.signature, set())
    others = set(run.problem.decisions) - set(canon.decisions)
    capped = objective == "peak" or B is not None  # without a memory cap no row matters
    for rnd in range(st.lazy_rounds):
        rows = learned if capped else set()
        key = (canon.signature, objective, frozenset(rows))
        c = memo.class_models.get(key)
        if c is None:
            m = KeepModel(a, nodes=canon.nodes, storages=canon.storages, fixed=d.fixed,
                          mode="local", decisions=canon.decisions).build(rows)
            c = memo.class_models[key] = m.compile(objective, tie_retained=1e-3 if objective == "cost" else 0.0)
        if objective != "peak":
            c.B.value = float(B) if B is not None else 1e18
        c.Rcap.value = float(R) if R is not None else 1e18
        kept, rec = run.solve(c, OPTION, f"{canon.name} {label}", round=rnd + 1 if capped else 0,
                              nodes=st.option_nodes, warm=True, rel_gap=st.option_gap if gap is None else gap)
        if objective == "peak" and R is None:
            memo.peak_work[canon.signature] = (memo.peak_work.get(canon.signature, 0)
                                               + (rec.iterations or 0) * rec.constraints)
        if kept is None or not capped:
            break
        limit = float(c.B.value) + 0.5 if objective == "peak" else float(B)
        prof = occupancy(a, a.keep_of(others | set(kept)), canon.storages)
        over = c.m.rows_over(prof, limit)
        new = set(over) - learned
        if objective == "peak":
            new = highest(new, over, st.peak_rows_per_round)
        if not new:
            break
        learned |= new
    bval = float(c.B.value) if (objective == "peak" and c.B.value is not None) else None
    if objective == "peak" and R is None and kept is not None:
        bound = c.peak_lower_bound()
        if bound is not None:
            bounds = memo.peak_bounds
            bounds[canon.signature] = max(bounds.get(canon.signature, bound), bound)
    return kept, bval


def _retained(run: Run, canon: Segment, kept) -> float:
    others = set(run.problem.decisions) - set(canon.decisions)
    return occupancy(run.a, run.a.keep_of(others | set(kept)), canon.storages, with_constants=False).retained


def _levels(run: Run, canon: Segment) -> tuple[float, float, list[float]]:
    """(least kept, all kept, the kept levels between), from the class's
    least-kept option (the first MILP of `floor_options`)."""
    st = run.settings
    r_all = _retained(run, canon, canon.decisions)
    k_min = run.memo.extremes[canon.signature]["least kept"]
    r_min = _retained(run, canon, k_min) if k_min is not None else r_all
    n = max(st.kept_levels, 1)
    return r_min, r_all, [r_min + (r_all - r_min) * (i / n) ** st.level_power for i in range(n)]


def floor_options(run: Run, canon: Segment) -> list[frozenset]:
    """The options that decide the floor: keep everything, recompute
    everything, the least kept, the least peak, and at the smallest kept
    levels the least peak, then the cheapest plan at that peak."""
    st = run.settings
    opts: list[frozenset] = [frozenset(canon.decisions), frozenset()]

    def run_one(objective, label, B=None, R=None, gap=None):
        if run.out_of_time():
            return None, None
        kept, bval = solve_class(run, canon, objective, label, B=B, R=R, gap=gap)
        if kept is not None:
            opts.append(frozenset(kept))
        return kept, bval

    k_min, _ = run_one("retained", "min kept")
    k_pk, p_min = run_one("peak", "min peak", gap=st.peak_gap)
    run.memo.extremes[canon.signature] = {"least kept": k_min, "least peak": k_pk, "peak": p_min}
    _, _, levels = _levels(run, canon)
    for r in levels[:st.low_peak_levels]:
        k, bval = run_one("peak", f"min peak kept<={human_bytes(r)}", R=r + 0.5, gap=st.peak_gap)
        if k is None or bval is None:
            continue
        pcap = bval * (1 + 1e-6) + 4096
        run_one("cost", f"peak<={human_bytes(pcap)} kept<={human_bytes(r)}", B=pcap, R=r + 0.5)
    return list(dict.fromkeys(opts))


def budget_options(run: Run, canon: Segment) -> list[frozenset]:
    """The options a budget's combine needs besides the floor's: levels of
    kept size (peak free) and of transient peak (kept size free)."""
    st = run.settings
    opts: list[frozenset] = []
    _, _, levels = _levels(run, canon)
    ext = run.memo.extremes[canon.signature]
    k_pk, p_min = ext["least peak"], ext["peak"]
    p_all = local_peak(run, canon, frozenset(canon.decisions))
    p_ok = k_pk is not None and p_min is not None and p_all > p_min + 1
    for i in range(max(st.kept_levels, st.peak_levels if p_ok else 0)):
        if run.out_of_time():
            break
        if i < st.kept_levels:
            kept, _ = solve_class(run, canon, "cost", f"kept<={human_bytes(levels[i])}", R=levels[i] + 0.5)
            if kept is not None:
                opts.append(frozenset(kept))
        # The first peak level would be the least peak itself, the hardest
        # MILP of all, whose cheap plan the least-peak MILP (its objective
        # breaks ties by cost) already gave.
        if p_ok and 0 < i < st.peak_levels:
            pcap = p_min + (p_all - p_min) * (i / st.peak_levels) ** st.level_power
            kept, _ = solve_class(run, canon, "cost", f"peak<={human_bytes(pcap)}", B=pcap * (1 + 1e-6) + 4096)
            if kept is not None:
                opts.append(frozenset(kept))
    return list(dict.fromkeys(opts))


def local_peak(run: Run, canon: Segment, kept: frozenset) -> float:
    """The local peak of an option as the segment's MILP counts it."""
    a = run.a
    others = set(run.problem.decisions) - set(canon.decisions)
    pr = occupancy(a, a.keep_of(others | set(kept)), canon.storages, with_constants=False)
    lo, hi = canon.window
    pb = 0.0
    if hi >= lo:
        js = np.arange(lo, hi + 1)
        pb = float(max((a.const_b[js] + pr.live_b[js]).max(), (a.const_pre[js] + pr.live_q[js]).max()))
    f0, f1 = canon.fwd_range
    ts = np.arange(f0, f1 + 1)
    return max(pb, float((a.base_f + a.fwd_asap[ts] + pr.fwd_extra[ts]).max()))


def add_options(run: Run, canon: Segment, inst: list[Segment], solves: list[tuple[str, dict]]) -> bool:
    """Solve the class MILP (least recompute) under each (label, caps) in
    `solves`, and add what it finds to the class's options.  Returns
    whether the option sets grew."""
    new = []
    for label, caps in solves:
        if run.out_of_time():
            break
        kept, _ = solve_class(run, canon, "cost", label, **caps)
        if kept is not None:
            new.append(frozenset(kept))
    if not new:
        return False
    options = run.memo.options
    before = {o.kept for s in inst for o in options[s.index]}
    evaluate_options(run, canon, inst, new)
    return {o.kept for s in inst for o in options[s.index]} != before


def evaluate_options(run: Run, canon: Segment, inst: list[Segment], opts: list[frozenset]) -> None:
    """Each option of a class, mapped onto its instances.  Instances of one
    layout (every storage and stage lines up) share one occupancy, shifted; a
    class can hold several layouts (the storages crossing segments live where
    they are last read), each measured on its own first instance."""
    a = run.a
    part = run.problem.decomposition.part
    options = run.memo.options
    layouts: dict[str, list[Segment]] = {}
    for s in inst:
        layouts.setdefault(s.layout, []).append(s)
    for group in layouts.values():
        rep = group[0]
        to_rep = dict(zip(canon.nodes, rep.nodes))
        others = set(run.problem.decisions) - set(rep.decisions)
        for o in opts:
            kept = frozenset(to_rep[d] for d in o)
            pr = occupancy(a, a.keep_of(others | set(kept)), rep.storages, with_constants=False)
            for s in group:
                nmap = dict(zip(rep.nodes, s.nodes))
                db = s.window[0] - rep.window[0]
                df = s.nodes[0] - rep.nodes[0]
                lo, hi = part.get(s.index, (s.window[0], s.window[1]))
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
                options.setdefault(s.index, []).append(Option(
                    frozenset(nmap[d] for d in kept), int(pr.retained), pf, pb, pr.cost))
    for s in inst:
        options[s.index] = pareto_options(options[s.index])


def pareto_options(options: list[Option]) -> list[Option]:
    """`options` without duplicates and without any another option dominates
    (no worse in every number, better in one); first come first kept."""
    uniq: dict = {}
    for o in options:
        uniq.setdefault(o.kept, o)
    out, seen = [], set()
    for o in uniq.values():
        if o.numbers in seen:
            continue
        if any(q.numbers != o.numbers and all(x <= y for x, y in zip(q.numbers, o.numbers))
               for q in uniq.values()):
            continue
        seen.add(o.numbers)
        out.append(o)
    return out


# ---------------------------------------------------------------- combining options


def chain_dp(options: list[list[Option]], in_window: list[bool], start: float, budget: float | None):
    """One option per segment of a chain (backward visits the segments in
    reverse), by dynamic programming.  State: bytes kept by the segments so
    far (S); an option fits when `S + its transient peak <= budget`, the
    transient being the forward peak, and the backward one for segments with
    a backward window.  The frontier keeps the Pareto-best states: (S, cost)
    with a budget, (S, peak so far) without (the least peak).

    Returns (chosen option index per segment, or None; the objective; the
    frontier after each segment)."""
    # The frontier: rows (S, cost or peak, parent, option), as arrays.
    front = np.array([[0.0, 0.0, -1, -1]])
    steps = []
    for opts, win in zip(options, in_window):
        lims = np.array([max(o.fwd_peak, o.bwd_peak) if win else o.fwd_peak for o in opts], dtype=float)
        ret = np.array([o.retained for o in opts], dtype=float)
        ocost = np.array([o.cost for o in opts], dtype=float)
        S, c = front[:, 0][:, None], front[:, 1][:, None]
        pi = np.broadcast_to(np.arange(len(front))[:, None], (len(front), len(opts)))
        oi = np.broadcast_to(np.arange(len(opts))[None, :], (len(front), len(opts)))
        need = S + lims[None, :]
        s_new = S + ret[None, :]
        if budget is None:
            c_new, tie = np.maximum(c, need), np.broadcast_to(ocost[None, :], need.shape)
            ok = np.ones(need.shape, dtype=bool)
        else:
            c_new, tie = c + ocost[None, :], np.zeros(need.shape)
            ok = need <= budget
        cs, cc, ct, cp, co = (x[ok] for x in (s_new, np.broadcast_to(c_new, need.shape), tie, pi, oi))
        # Sorted by (S, cost, tie, parent, option); a state is kept when its
        # cost is below every state with less or equal S before it.
        order = np.lexsort((co, cp, ct, cc, cs))
        cs, cc, cp, co = cs[order], cc[order], cp[order], co[order]
        if len(cc):
            best_before = np.concatenate(([np.inf], np.minimum.accumulate(cc)[:-1]))
            keep = cc < best_before
            cs, cc, cp, co = cs[keep], cc[keep], cp[keep], co[keep]
        pruned = np.stack([cs, cc, cp.astype(float), co.astype(float)], axis=1) if len(cc) else np.zeros((0, 4))
        if len(pruned) > 20000:  # keep the frontier small: thin it evenly
            step = len(pruned) / 20000.0
            pruned = np.concatenate([pruned[[int(i * step) for i in range(20000)]], pruned[-1:]])
        front = pruned
        steps.append(front)
        if not len(front):
            return None, None, steps
    ok = [(max(t[1], start + t[0]) if budget is None else t[1], i) for i, t in enumerate(front.tolist())
          if budget is None or start + t[0] <= budget]
    if not ok:
        return None, None, steps
    val, i = min(ok)
    chosen = [0] * len(options)
    for k in range(len(options) - 1, -1, -1):
        t = steps[k][i]
        chosen[k] = int(t[3])
        i = int(t[2])
    return chosen, float(val), steps


def start_const(run: Run) -> float:
    a, d = run.a, run.problem.decomposition
    start = float(a.const_start)
    if d.first_window > 0:
        start = max(start, float(a.const_b[:d.first_window].max()))
    return start


def combine(run: Run, budget: float | None, label: str):
    """Pick one option per segment.  budget None: minimize the modeled peak.
    Returns (kept decision set, modeled peak, choice, frontier) or None; the
    frontier is the chain DP's (segments, frontier after each), or None."""
    d, options = run.problem.decomposition, run.memo.options
    segs = [s for s in d.segs if options.get(s.index)]
    frontier = None
    if run.settings.combine == "auto" and d.chain:
        t0 = time.perf_counter()
        chosen, val, steps = chain_dp([options[s.index] for s in segs],
                                      [s.index in d.part for s in segs], start_const(run), budget)
        frontier = (segs, steps)
        rec = SolveRecord(COMBINE, label, "infeasible" if chosen is None else "optimal",
                          time.perf_counter() - t0, val, 0.0, method="DP",
                          variables=sum(len(options[s.index]) for s in segs), constraints=len(segs))
        run.solves.append(rec)
        run.say(f"  {rec.name}: {rec.status}, {rec.seconds:.2f} s (frontier "
                f"{max((len(f) for f in steps), default=0)})")
    else:
        chosen = _combine_milp(run, segs, budget, label)
    if chosen is None:
        return None
    choice = {s.index: options[s.index][k] for s, k in zip(segs, chosen)}
    return kept_of(run, choice), modeled_peak(run, choice), choice, frontier


def _combine_milp(run: Run, segs: list[Segment], budget: float | None, label: str):
    """The combine for any window order: a small MILP over the options, one
    memory row per segment's forward range and backward window."""
    part, options = run.problem.decomposition.part, run.memo.options
    cols = [(s.index, k) for s in segs for k in range(len(options[s.index]))]
    opt = [options[si][k] for si, k in cols]
    R = np.array([o.retained for o in opt], dtype=float)
    pos_f = {s.index: i for i, s in enumerate(segs)}
    rows = []
    for s in segs:
        # forward range of s: its transient + what earlier segments keep
        rows.append([o.fwd_peak if si == s.index else (o.retained if pos_f[si] < pos_f[s.index] else 0.0)
                     for (si, _), o in zip(cols, opt)])
        if s.index in part:
            lo = part[s.index][0]
            rows.append([o.bwd_peak if si == s.index else
                         (o.retained if si in part and part[si][0] > lo else 0.0)
                         for (si, _), o in zip(cols, opt)])
    rows.append(list(R))
    A = np.array(rows, dtype=float)
    const = np.zeros(len(rows))
    const[-1] = start_const(run)
    groups = [[c for c, (si, _) in enumerate(cols) if si == s.index] for s in segs]
    picked, _ = run.timed(lambda limit: pick_options(
        A, const, np.array([o.cost for o in opt]), groups, budget, subject=label,
        solver=run.settings.solver, time_limit=limit, nodes=run.settings.combine_nodes, log=run.log))
    if picked is None:
        return None
    by_seg = {cols[c][0]: cols[c][1] for c in picked}
    return [by_seg[s.index] for s in segs]


def modeled_peak(run: Run, choice: dict) -> float:
    d = run.problem.decomposition
    pos = {s.index: i for i, s in enumerate(d.segs)}
    lo = {si: d.part[si][0] for si in d.part}
    peak = start_const(run) + sum(o.retained for o in choice.values())
    for si, o in choice.items():
        before = sum(choice[j].retained for j in choice if pos[j] < pos[si])
        peak = max(peak, o.fwd_peak + before)
        if si in lo:
            after = sum(choice[j].retained for j in choice if j in lo and lo[j] > lo[si])
            peak = max(peak, o.bwd_peak + after)
    return float(peak)


def kept_of(run: Run, choice: dict) -> set[int]:
    d = run.problem.decomposition
    kept = set(run.problem.decisions) - {x for s in d.segs for x in s.decisions}
    for o in choice.values():
        kept |= set(o.kept)
    return kept


# ---------------------------------------------------------------- more options where the combine looks


def densify(run: Run, choice: dict) -> bool:
    """Add options next to the ones the combine chose (kept sizes halfway to
    the neighbouring options).  Returns whether any option was added."""
    options = run.memo.options

    def one(run: Run, inst: list[Segment]) -> bool:
        canon = inst[0]
        have = sorted({o.retained for o in options[canon.index]})
        chosen = sorted({choice[s.index].retained for s in inst if s.index in choice})
        caps = set()
        for r in chosen:
            i = have.index(r) if r in have else bisect_left(have, r)
            if i > 0:
                caps.add((have[i - 1] + r) / 2)
            if i + 1 < len(have):
                caps.add((r + have[i + 1]) / 2)
        caps = {c for c in caps if not any(abs(c - h) < 1 for h in have)}
        solves = [(f"kept<={human_bytes(c)}", dict(R=c + 0.5)) for c in sorted(caps)]
        return add_options(run, canon, inst, solves)

    classes = [inst for inst in run.problem.decomposition.classes.values() if inst[0].decisions]
    return any(per_class(run, one, classes))


def fit_options(run: Run, budget: float, frontier, choice: dict | None = None) -> bool:
    """Options cut to the room the chain leaves each segment.  The first
    option sets sample kept size and transient peak on fixed levels; the
    cheapest plan often pairs a segment's cheaper, larger-peak option with
    smaller kept sizes before it.  The chain DP's frontier before each
    segment lists the kept sizes S that can precede it, so solve each class
    again with its peak capped at budget - S (a few such S per class, spread
    over the frontier), and the tightest room the chosen plan (`choice`)
    leaves an instance of the class.  Returns whether any option was added."""
    if frontier is None:
        return False
    segs_dp, steps = frontier
    n_per = run.settings.fit_per_class
    classes = run.problem.decomposition.classes
    caps: dict[str, set] = {}
    tightest: dict[str, float] = {}
    before = 0.0  # bytes the chosen plan's segments before this one keep
    for k, s in enumerate(segs_dp):
        if choice is not None and s.decisions and before < budget:
            tightest[s.signature] = min(tightest.get(s.signature, budget), budget - before)
        if choice is not None and s.index in choice:
            before += choice[s.index].retained
        if not s.decisions or k >= len(steps) + 1:
            continue
        prefixes = {0.0} if k == 0 else set(steps[k - 1][:, 0].tolist())
        caps.setdefault(s.signature, set()).update(budget - S for S in prefixes if S < budget)

    def one(run: Run, item) -> bool:
        sig, cs = item
        inst = classes[sig]
        cs = sorted(cs)
        if len(cs) > n_per:
            cs = [cs[round(i * (len(cs) - 1) / (n_per - 1))] for i in range(n_per)]
        if sig in tightest:
            cs = sorted(set(cs) | {tightest[sig]})
        solves = [(f"peak<={human_bytes(cap)} (room)", dict(B=cap)) for cap in dict.fromkeys(cs)]
        bound = run.memo.peak_bounds.get(sig)
        if bound is not None:
            # Below the class's proven least peak: infeasible without a solve
            # (an infeasible MILP is among the slowest to end).
            for label, cap in solves:
                if cap["B"] < bound:
                    run.solves.append(SolveRecord(OPTION, f"{inst[0].name} {label}", "infeasible", 0.0,
                                                  method="bound"))
            solves = [(label, cap) for label, cap in solves if cap["B"] >= bound]
        return add_options(run, inst[0], inst, solves)

    return any(per_class(run, one, list(caps.items())))


# ---------------------------------------------------------------- the searches


def first_fit(run: Run, budget: int):
    """The combine's plan at `budget` from the options at hand, tightened
    until it really fits (simulated): the combine's model is approximate.
    Returns (plan, choice, the combine's target, frontier) or None."""
    target = float(budget)
    for it in range(8):
        got = combine(run, target, f"budget {human_bytes(budget)}" + (f" (try {it + 1})" if it else ""))
        if got is None:
            return None
        kept, modeled, choice, frontier = got
        plan = run.evaluate(kept)
        run.say(f"  plan: modeled {human_bytes(modeled)}, simulated {human_bytes(plan.peak)}, "
                f"+{run.problem.cost_text(plan.cost)}")
        if plan.peak <= budget:
            return plan, choice, target, frontier
        over = plan.peak - budget
        target = min(target - over, modeled - over) - 1
    return None


def search(run: Run, budget: int) -> Plan | None:
    """The cheapest plan the combine finds that really fits (simulated),
    improved with denser options around the chosen ones."""
    ensure_options(run)
    st = run.settings
    cost_text = run.problem.cost_text
    best = first_fit(run, budget)
    if best is None:
        return None
    plan, choice, target, frontier = best
    for _ in range(st.densify_rounds):
        if plan.cost <= 0 or run.out_of_time() or not densify(run, choice):
            break
        got = combine(run, target, f"budget {human_bytes(budget)} (denser options)")
        if got is None:
            break
        kept, modeled, ch2, fr2 = got
        p2 = run.evaluate(kept)
        run.say(f"  denser: simulated {human_bytes(p2.peak)}, +{cost_text(p2.cost)}")
        if p2.peak <= budget and p2.cost < plan.cost:
            gain = plan.cost - p2.cost
            plan, choice, frontier = p2, ch2, fr2
            if gain < 0.002 * plan.cost:
                break  # diminishing returns
        else:
            break
    if plan.cost > 0 and not run.out_of_time() and fit_options(run, budget, frontier, choice):
        got = combine(run, target, f"budget {human_bytes(budget)} (options fitted to the room)")
        if got is not None:
            kept, modeled, ch2, _ = got
            p2 = run.evaluate(kept)
            run.say(f"  fitted: simulated {human_bytes(p2.peak)}, +{cost_text(p2.cost)}")
            if p2.peak <= budget and p2.cost < plan.cost:
                plan, choice = p2, ch2
    if plan.cost > 0:
        plan = refine_windows(run, plan, budget)
    return plan


def refine_windows(run: Run, plan: Plan, budget: int) -> Plan:
    """Re-solve the decisions of two adjacent segments at a time with the
    exact (flat) memory model, every other decision held at `plan`'s: the
    segment models and the combine only approximate what segments cost each
    other.  Each window keeps the cheaper plan that fits.  With
    `all_windows` every window is solved; otherwise only a window that holds
    every decision (two segments: the flat MILP itself), since on longer
    chains each window costs seconds.  (No warm start: cvxpy's HiGHS
    interface only reuses a previous solve of the same problem object, and
    each window is a new one.)"""
    segs = [s for s in run.problem.decomposition.segs if s.decisions]
    if len(segs) < 2 or (not run.settings.all_windows and len(segs) > 2):
        return plan
    decisions = run.problem.decisions
    for i in range(len(segs) - 1):
        if plan.cost <= 0 or run.out_of_time():
            break
        window = set(segs[i].decisions) | set(segs[i + 1].decisions)
        kept = {d for d in decisions if plan.keep[d]}
        fixed = {d: int(d in kept) for d in decisions if d not in window}
        c = KeepModel(run.a, fixed=fixed).build().compile("cost")
        c.B.value = float(budget)
        if c.y is None:
            continue
        got, _ = run.solve(c, WINDOW, f"{segs[i].name}+{segs[i + 1].name}", nodes=run.settings.window_nodes)
        if got is None:
            continue
        p2 = run.evaluate(set(got) | {d for d, v in fixed.items() if v})
        run.say(f"  window {segs[i].name}+{segs[i + 1].name}: simulated {human_bytes(p2.peak)}, "
                f"+{run.problem.cost_text(p2.cost)}")
        if p2.peak <= budget and p2.cost < plan.cost:
            plan = p2
    return plan


def floor(run: Run) -> Plan:
    """The least peak the combine reaches (then the least recompute), from
    the floor's options only."""
    ensure_options(run, floor_only=True)
    st, memo = run.settings, run.memo
    if st.peak_gap > st.option_gap and not memo.floor_options_proven:
        # The least-peak option MILPs stopped at the looser gap; the floor is
        # decided by them, so solve them to the option gap too: every class
        # but one whose least-peak MILPs did more than `floor_resolve_work`
        # (on such a class, solving again costs seconds for a fraction of
        # its gap: docs/02), once per model (`_shared`: the ladder's rungs).
        memo.floor_options_proven = True

        def one(run: Run, inst: list[Segment]) -> None:
            canon = inst[0]
            seen, index = _shared(run, canon)
            if "for the floor" in seen:  # (solved for another graph of the model)
                kept = None if seen["for the floor"] is None else {index[n] for n in seen["for the floor"]}
            elif run.out_of_time():
                return
            else:
                kept, _ = solve_class(run, canon, "peak", "min peak (for the floor)")
                seen["for the floor"] = None if kept is None else frozenset(run.a.fwd[i].name for i in kept)
            if kept is not None:
                evaluate_options(run, canon, inst, [frozenset(kept)])

        per_class(run, one, [inst for inst in run.problem.decomposition.classes.values() if inst[0].decisions
                             and memo.peak_work.get(inst[0].signature, 0) <= st.floor_resolve_work])
    got = combine(run, None, "least peak")
    cands = []
    if got is not None:
        kept, modeled, _, _ = got
        plan = run.evaluate(kept)
        cands.append(plan)
        # The model is approximate: try to close the gap with budgets just
        # below the first plan's simulated peak, from the same options.
        if plan.peak > modeled:
            got = first_fit(run, int(modeled))
            if got is not None:
                cands.append(got[0])
    cands.append(run.keep_all())
    cands.append(run.evaluate(kept_of(run, {})))  # checkpoint every segment
    return min(cands, key=lambda p: (p.peak, p.cost))
