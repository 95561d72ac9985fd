"""A torch.compile backend whose recomputation decision is a plan.

    model = torch.compile(model, backend=remat_ir.backend(budget=0.5, inner="aot_eager"))

Dynamo captures each region of the model's code, AOTAutograd traces the
region's forward and backward into one joint graph and asks a partitioner
which forward values backward reads and which it recomputes.  This backend is
that partitioner: it reads the joint graph as an IR program
(`remat_ir.trace.joint`), plans it to the budget (`remat_ir.pipeline.fit`,
verified), and builds the forward and backward graphs the plan schedules, in
its instruction order, so the generated code frees what the plan frees.  The
inner compiler ("aot_eager" or "inductor") compiles the two graphs.

Each compiled region gets its own plan (`Backend.plans`, and `.rir` files in
`plan_dir`); a fraction budget is a fraction of that region's unoptimized
activation peak, what its caller holds kept whole (`resolve_budget`).  Plans are cached as `wrap` caches them (in
`remat_ir.adopt.cache_dir()`, written atomically): a region whose joint
graph (its program's fingerprint), options and versions match a cached plan
loads it, verified again, instead of planning.  A random op (dropout) the plan recomputes in backward
replays the RNG state forward drew it with (aot_eager), as the interpreter
does.  Inductor's dropout is `inductor_random` over seeds drawn once in
forward, which recomputes to the same numbers; an op that draws from a
generator is not replayed under inductor: its recompute is priced out of
the plan (a plan that would still recompute one is refused with a message).

The joint graph is rewritten where that keeps eager's bits (CPU): the
loss's backward and backward's sums are written in place, and below what
recomputation alone reaches the plan chunks the loss (`lm_head_nll`, the
graph rewrite `wrap` uses, `remat_ir.rewrite`), which the joint graph then
follows (`remat_ir.trace.joint.follow_rewrites`); on CPU inductor is given
the loss's ops undecomposed so that the same rewrites apply there.
"""
from __future__ import annotations

import heapq
import operator
import os
from typing import Any

import torch
import torch.fx as fx

from remat_ir.ir import RECOMPUTE, TANGENT, Program, node_inputs
from remat_ir.ir.types import DEFAULT_SCOPE, SCOPES
from remat_ir.trace.device import fuse_cross_entropy_backward
from remat_ir.trace.joint import accumulate_in_place, follow_rewrites, joint_program, primals_of

# The graph rewrites this backend runs: the joint graph follows them (the
# ladder under `exact` may pick no other that the backend has met).
RUNS = ("lm_head_nll",)

INNERS = ("aot_eager", "inductor")


class BackendError(ValueError):
    """The backend cannot plan a region (the message says why); `floor_bytes`:
    the region's floor when the budget was below it and the floor is known."""

    floor_bytes: int | None = None


def backend(budget=None, *, inner: str = "aot_eager", scope: str = DEFAULT_SCOPE,
            plan_dir: str | os.PathLike | None = None, model_name: str = "", cache: bool = True) -> "Backend":
    """A `torch.compile` backend that plans each compiled region's
    recomputation to `budget` (a fraction of the region's unoptimized peak in
    `scope`, such as 0.5 or "0.5"; bytes, "1.5GiB"; None: plan nothing, the
    step as autograd runs it).  `inner` compiles the planned graphs:
    "aot_eager" (eager kernels, gradients bitwise equal to eager's) or
    "inductor".  The plans are `Backend.plans` (one per compiled region, in
    compile order) and, with `plan_dir`, `.rir` files there.  `cache=False`
    keeps plans off the plan cache (`remat_ir.adopt.cache_dir()`: the
    directory `$REMAT_IR_CACHE`, else the user's cache directory)."""
    return Backend(budget, inner=inner, scope=scope, plan_dir=plan_dir, model_name=model_name, cache=cache)


class Backend:
    """See `backend`."""

    def __init__(self, budget=None, *, inner: str = "aot_eager", scope: str = DEFAULT_SCOPE,
                 plan_dir=None, model_name: str = "", cache: bool = True):
        from remat_ir.pipeline import check_budget

        if inner not in INNERS:
            raise ValueError(f"inner must be one of {', '.join(INNERS)}, not {inner!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, not {scope!r}")
        check_budget(budget)
        self.budget = budget
        self.inner = inner
        self.scope = scope
        self.plan_dir = os.fspath(plan_dir) if plan_dir is not None else None
        self.model_name = model_name
        self.cache = cache
        self.plans: list[Program] = []
        self.paths: list[str] = []
        self.solves = 0  # regions planned by the optimizer
        self.cached: list[str] = []  # the cache files of the regions whose plans were loaded

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Any:
        primals = primals_of(gm, example_inputs)
        if self.inner == "aot_eager":
            from torch._dynamo.backends.debugging import boxed_nop
            from torch._functorch.aot_autograd import aot_module_simplified

            def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
                return self.partition(joint, primals, num_fwd_outputs, replay=True)

            return aot_module_simplified(gm, example_inputs, fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                         partition_fn=partition, keep_inference_input_mutations=True)
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.decomposition import select_decomp_table

        # On CPU the loss's ops stay aten kernels, not decomposed: the plan can
        # then write the loss's backward in place and chunk it, as with
        # aot_eager (those rewrites are checked on CPU's kernels only).
        decompositions = select_decomp_table()
        if all(t.device.type == "cpu" for t in example_inputs if isinstance(t, torch.Tensor)):
            decompositions = {k: v for k, v in decompositions.items() if k not in _LOSS_OPS}
            _loss_ops_fall_back()
        return compile_fx(gm, example_inputs, decompositions=decompositions,
                          config_patches={"custom_partitioner_fn": _inductor_partitioner(self, primals),
                                          # each compile plans: no graph cache keyed on the partitioner
                                          "fx_graph_cache": False})

    # ------------------------------------------------------------ the partition

    def plan(self, joint: fx.GraphModule, primals, num_fwd_outputs: int) -> Program:
        """The verified plan of one region's joint graph (marks the graph's
        nodes with their program names).  Where recomputation alone cannot
        fit the budget, the plan chunks the loss (the graph rewrite
        `lm_head_nll`, the same bits) and the joint graph is rewritten to
        follow it."""
        from remat_ir.ir.budgets import is_floor
        from remat_ir.ir.files import load_cached

        region = len(self.plans)
        name = f"{self.model_name or 'torch.compile'} region {region}"
        # Cross-entropy's backward writes its second kernel's result over the
        # first's, as a traced step does on CPU: the same bits, one
        # logits-sized tensor fewer at the loss, often a region's floor.
        fuse_cross_entropy_backward(joint)
        # A tensor used twice (a tied LM head) sums its gradients in
        # place, as eager autograd does: the same bits, one tensor fewer.
        accumulate_in_place(joint)
        program = joint_program(joint, primals, num_fwd_outputs, model_name=name)
        if self.inner != "aot_eager":
            _price_out_draws(program, joint)

        path = self.cache_path(program) if self.cache else None
        cached = load_cached(path) if path is not None else None
        if cached is not None:
            # The key is the region's own graph; a plan that rewrites it is of the rewritten graph.
            plan = _usable_cached(path, cached, program, self._asked(program))
            if plan is not None:
                self.cached.append(str(path))
                return self._keep(self._follow(joint, program, plan, name), region)
        # A fraction is of the region's own graph, with its loss chunked or not;
        # "floor": the least any plan of this region reaches.
        plan = self._fit(program, self.budget, name)
        self.solves += 1
        self._follow(joint, program, plan, name)
        plan.header.comment.append(f"torch.compile backend, inner compiler {self.inner}")
        if path is not None:
            _store(path, plan)
        return self._keep(plan, region)

    def _follow(self, joint: fx.GraphModule, program: Program, plan: Program, name: str) -> Program:
        """`plan`, the joint graph (read as `program`) rewritten to follow its rewrites."""
        other = [r for r in plan.header.rewrites if r.partition(":")[0] not in RUNS]
        if other:
            raise BackendError(f"{name}: budget {self.budget!r} is below what recomputation alone reaches; "
                               f"the plan would rewrite the graph ({', '.join(other)}), which this backend "
                               "does not run")
        if plan.header.rewrites:
            follow_rewrites(joint, program, plan)
        return plan

    def _asked(self, program: Program) -> tuple[str, int | None] | None:
        """What this backend asks of `program`'s plan: None (no budget), else
        (scope, bytes: the budget resolved on it; None for "floor", which only
        a search finds)."""
        from remat_ir.ir.budgets import is_floor
        from remat_ir.pipeline import budget_bytes

        if self.budget is None:
            return None
        return self.scope, None if is_floor(self.budget) else budget_bytes(program, self.budget, self.scope)

    def _fit(self, program: Program, budget, name: str) -> Program:
        from remat_ir.optimize.search import Infeasible
        from remat_ir.pipeline import fit

        try:
            # exact: graph rewrites that keep eager's bits only.
            return fit(program, budget, scope=self.scope, exact=True)
        except Infeasible as e:
            raise self._below_floor(name, e) from e

    def _below_floor(self, name: str, e) -> BackendError:
        floor = (f"{e.floor_bytes} bytes ({e.floor_bytes / 2**20:.2f} MiB)" if e.floor_bytes
                 else "unknown (the search found no plan)")
        err = BackendError(
            f"{name}: budget {self.budget!r} is below the floor of this region, {floor}, "
            f"in scope {self.scope} (a fraction budget is per compiled region): {e}")
        err.floor_bytes = e.floor_bytes or None
        return err

    def _keep(self, plan: Program, region: int) -> Program:
        self.plans.append(plan)
        if self.plan_dir is not None:
            from remat_ir.ir.files import save_plan

            os.makedirs(self.plan_dir, exist_ok=True)
            path = os.path.join(self.plan_dir, f"region{region}.rir")
            save_plan(plan, path)
            self.paths.append(path)
        return plan

    def cache_path(self, program: Program):
        """The plan cache's file for `program` (a region's joint graph) with
        this backend's options: named by a hash of the program's fingerprint,
        the budget, scope and inner compiler, and the versions of torch and
        remat-ir."""
        import hashlib
        import json

        from remat_ir.adopt import cache_dir
        from remat_ir.version import __version__

        facts = {"fingerprint": program.header.fingerprint, "budget": repr(self.budget), "scope": self.scope,
                 "inner": self.inner, "exact": True, "torch": torch.__version__, "remat_ir": __version__}
        key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]
        return cache_dir() / f"torch-compile-{key}.rir"

    def partition(self, joint: fx.GraphModule, primals, num_fwd_outputs: int, *, replay: bool):
        plan = self.plan(joint, primals, num_fwd_outputs)
        return build_modules(joint, plan, num_fwd_outputs, replay=replay)


# FLOPs a plan is told a random draw costs where the backend cannot replay it
# (inductor): the optimizer keeps such a draw rather than recompute it.
NO_REPLAY_FLOPS = 1e15


def _price_out_draws(program: Program, joint: fx.GraphModule) -> None:
    """Make recomputing a random op that draws (inductor's `inductor_seeds`)
    cost NO_REPLAY_FLOPS in `program`: under inductor the backend does not
    replay a generator, and a draw is a few bytes to keep."""
    draws = {n.meta["remat_node"] for n in joint.graph.nodes
             if "remat_node" in n.meta and n.op == "call_function" and not _draws_nothing(n)}
    for node in program.nodes:
        if node.random and node.name in draws:
            node.flops = NO_REPLAY_FLOPS


_LOSS_OPS = frozenset({
    torch.ops.aten._log_softmax.default, torch.ops.aten._log_softmax_backward_data.default,
    torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss_backward.default,
})


def _loss_ops_fall_back() -> None:
    """Registers inductor's fallback to the aten kernel for the loss's ops
    left undecomposed.  Inductor makes this same fallback by itself for an op
    it has no lowering for, except where the environment sets CI: there it
    refuses ops that have a decomposition (a guard for its own development),
    and a training job run under CI would fail.  Contiguous inputs, as
    inductor requires of its implicit aten fallbacks in backward."""
    from torch._inductor import lowering

    for op in sorted(_LOSS_OPS, key=str):
        if op not in lowering.lowerings:
            lowering.make_fallback(op, layout_constraint=lowering.require_contiguous, warn=False,
                                   override_decomp=True)


def _usable_cached(path, plan: Program, program: Program, asked) -> Program | None:
    """The cached `plan` when it serves `program` for what is `asked`
    (`Backend._asked`), else None, saying on stderr why: it schedules the same
    graph (fingerprint) with the same costs, its header's budget is the one
    asked, in bytes, its simulated peak fits those bytes, and it verifies.  A
    file of the cache is any request's plan, or edited: its name proves
    nothing."""
    import sys

    from remat_ir.check.simulate import simulate
    from remat_ir.check.verify import verify

    def why() -> str | None:
        nonlocal program
        if plan.header.rewrites:
            from remat_ir.rewrite import NotApplicable, apply

            try:
                program = apply(program, plan.header.rewrites)  # (what the plan schedules)
            except NotApplicable as e:
                return f"its rewrites do not apply to this graph: {e}"
        if plan.header.fingerprint != program.header.fingerprint:
            return "made for another graph"
        if [n.flops for n in plan.nodes] != [n.flops for n in program.nodes]:
            return "made with other costs (another inner compiler)"
        have = plan.header.budget
        made = "without a budget" if have is None else f"for a budget of {have.bytes} bytes ({have.scope})"
        if asked is None and have is not None:
            return f"made {made}, asked for no budget"
        scope, nbytes = asked or (None, None)
        if asked is not None and (have is None or have.scope != scope or nbytes not in (None, have.bytes)):
            return f"made {made}, asked {f'{nbytes} bytes' if nbytes is not None else 'the floor'} ({scope})"
        if have is not None:
            try:
                peak = max(simulate(plan, grads_present=gp, top_k=0).scope_peak(scope) for gp in (True, False))
            except ValueError:
                peak = 0  # (a schedule the simulator refuses: the verifier says why)
            if peak > have.bytes:
                return f"its simulated peak is {peak} bytes ({scope}), over the {have.bytes} bytes asked"
        verdict = verify(plan)  # a file on disk can have been edited
        return None if verdict.ok else f"it does not verify: {verdict.errors[0]}"

    problem = why()
    if problem is not None:
        print(f"remat-ir: the cached plan {path} does not serve this call ({problem}): planning it again",
              file=sys.stderr)
        return None
    return plan


def _store(path, plan: Program) -> None:
    import sys

    from remat_ir.ir.files import save_plan

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_plan(plan, path)  # atomically: a temporary file, then a rename
    except OSError as e:
        # The step still runs; only the next compile plans again.
        print(f"remat-ir: cannot cache the plan in {path.parent} ({e}); set REMAT_IR_CACHE to a "
              "writable directory", file=sys.stderr)


def _inductor_partitioner(owner: Backend, primals):
    """Inductor's `custom_partitioner_fn`: the plan's partition of the joint
    graph (which inductor's joint-graph passes have run on)."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class Partitioner(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return owner.partition(gm, primals, kwargs["num_fwd_outputs"], replay=False)

        def uuid(self):
            return None  # never cached: each compile plans

    return Partitioner()


# ----------------------------------------------------------- graphs from a plan


def saved_values(plan: Program) -> list[str]:
    """The values backward reads that it does not compute itself: what
    forward keeps for it (recomputed values are computed in backward)."""
    values = plan.value_map()
    nodes = plan.node_map()
    produced = {v.name for v in plan.values if v.kind == TANGENT}
    saved: dict[str, None] = {}
    for ins in plan.backward:
        if ins.kind == "free":
            continue
        node = nodes[ins.target]
        for r in node_inputs(node):
            if r not in produced and values[r].kind != TANGENT:
                saved.setdefault(r, None)
        produced.update(o for o in node.outputs if o)
    return list(saved)


def _rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator a random op on `device` draws from (a CPU
    tensor for every device: CUDA's is its seed and offset)."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _draw(state: torch.Tensor, device: torch.device, op, *args, **kwargs):
    """`op(*args, **kwargs)`: a random op in forward, which passes along the
    state it draws from so that backward can replay it."""
    return op(*args, **kwargs)


def _replay(state: torch.Tensor, device: torch.device, op, *args, **kwargs):
    """`op(*args, **kwargs)` drawn from the RNG state `state` of `device`'s
    generator, that generator left as it was (a random op recomputed in
    backward)."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        if cuda:
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        return op(*args, **kwargs)


def _random_device(node: fx.Node) -> torch.device:
    """The device whose generator `node` (a random op) draws from: its
    first tensor result's, else its first tensor operand's.  The backend
    replays the CPU and CUDA generators; another device's is refused, as is
    an op whose device the graph does not say (replaying the wrong generator
    would give wrong gradients silently)."""
    found = []
    for x in [node] + [a for a in node.all_input_nodes]:
        vals = x.meta.get("val")
        found += [v.device for v in (vals if isinstance(vals, (tuple, list)) else (vals,))
                  if isinstance(v, torch.Tensor)]
    if not found:
        raise BackendError(f"the plan recomputes the random op {node.name}, whose device the joint graph "
                           "does not record: raise the budget")
    if found[0].type not in ("cpu", "cuda"):
        raise BackendError(f"the plan recomputes the random op {node.name} on {found[0]}, whose generator "
                           "this backend does not replay (CPU and CUDA only): raise the budget")
    return found[0]


def build_modules(joint: fx.GraphModule, plan: Program, num_fwd_outputs: int, *, replay: bool):
    """AOTAutograd's (forward, backward) graph modules for `plan`: forward
    computes the plan's forward instructions in order and returns the
    forward outputs and what backward reads; backward computes and
    recomputes the plan's backward instructions in order."""
    from torch._functorch.partitioners import _extract_fwd_bwd_modules

    graph = joint.graph
    by_node = {n.meta["remat_node"]: n for n in graph.nodes if "remat_node" in n.meta}
    by_value = {n.meta["remat_value"]: n for n in graph.nodes if "remat_value" in n.meta}
    pnodes = plan.node_map()
    recomputed = [ins.target for ins in plan.backward if ins.kind == RECOMPUTE]
    # A random op that draws nothing (an attention op with dropout_p 0.0, which
    # PyTorch still tags nondeterministic_seeded) recomputes as any other.
    random = [t for t in recomputed if pnodes[t].random and not _draws_nothing(by_node[t])]
    if random and not replay:
        raise BackendError(f"the plan recomputes random ops ({', '.join(random)}), which this backend "
                           "replays only with inner=\"aot_eager\": raise the budget")
    position = {n: i for i, n in enumerate(graph.nodes)}
    saved = [by_value[v] for v in saved_values(plan)]
    # The RNG state each recomputed random op was drawn with, saved for backward.
    states: dict[str, str] = {}
    for t in random:
        fxn = by_node[t]
        device = _random_device(fxn)
        with graph.inserting_before(fxn):
            s = graph.call_function(_rng_state, (device,))
        # (CUDA's state, read on the host: an 8-byte seed and an 8-byte offset.)
        s.meta["val"] = _rng_state(device) if device.type != "cuda" else torch.empty(16, dtype=torch.uint8)
        s.meta["partitioner_tag"] = "is_forward"
        states[fxn.name] = s.name
        saved.append(s)
        # Forward draws as before (the state is only passed along); backward replays it.
        fxn.args = (s, device, fxn.target) + tuple(fxn.args)
        fxn.target = _draw
    saved.sort(key=lambda n: position.get(n, -1))
    fw, bw = _extract_fwd_bwd_modules(joint, saved, saved_sym_nodes=[], num_fwd_outputs=num_fwd_outputs)
    for n in bw.graph.nodes:
        if n.target is _draw:
            n.target = _replay

    fwd_rank: dict[str, float] = {}
    for i, ins in enumerate(ins for ins in plan.forward if ins.kind != "free"):
        fwd_rank[by_node[ins.target].name] = i
    for fx_name, s in states.items():
        fwd_rank[s] = fwd_rank[fx_name] - 0.5
    bwd_rank: dict[str, float] = {}
    for i, ins in enumerate(ins for ins in plan.backward if ins.kind != "free"):
        bwd_rank[by_node[ins.target].name] = i
    _reorder(fw.graph, fwd_rank)
    _reorder(bw.graph, bwd_rank)
    fw.recompile()
    bw.recompile()
    return fw, bw


def _draws_nothing(node: fx.Node) -> bool:
    """Whether `node`, an op PyTorch tags random, takes a `dropout_p` that is 0
    (the attention ops: nothing is drawn then)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for i, a in enumerate(schema.arguments):
        if a.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", a.default_value)
            return isinstance(p, (int, float)) and p == 0
    return False


def _reorder(graph: fx.Graph, rank: dict[str, float]) -> None:
    """Put `graph`'s nodes in the order of `rank` (node name -> position),
    as far as their dependencies allow; a node without a rank (a getitem, a
    node the program does not name) goes right before its first user."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    if not nodes:
        return
    pos = {n: i for i, n in enumerate(nodes)}
    prio: dict[fx.Node, float] = {}
    for n in reversed(nodes):
        if n.name in rank:
            prio[n] = rank[n.name]
        else:
            users = [prio[u] for u in n.users if u in prio]
            prio[n] = min(users) - 1e-3 if users else float("inf")
    # Getitems follow their producer.
    for n in nodes:
        if n.target is operator.getitem and n.args[0] in prio:
            prio[n] = prio[n.args[0]] + 1e-6
    deps = {n: [a for a in n.all_input_nodes if a in pos] for n in nodes}
    waiting = {n: len(set(d)) for n, d in deps.items()}
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    for n, d in deps.items():
        for a in set(d):
            users[a].append(n)
    ready = [(prio[n], pos[n], n.name) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    by_name = {n.name: n for n in nodes}
    order = []
    while ready:
        _, _, name = heapq.heappop(ready)
        n = by_name[name]
        order.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (prio[u], pos[u], u.name))
    assert len(order) == len(nodes), "the graph has a cycle"
    cursor = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = cursor[-1] if cursor else None
    for n in order:
        if anchor is None:
            first = next(iter(graph.nodes))
            if first is not n:
                first.prepend(n)
        else:
            anchor.append(n)
        anchor = n
    graph.lint()
