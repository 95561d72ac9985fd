"""Chunked LM head and cross-entropy: the logits are never whole.

A language model's step ends with `logits = x @ W.T (+ b)` over the whole
vocabulary, `log_softmax`, and `nll_loss`; backward holds a logits-sized
gradient beside the saved log-probabilities.  Recomputation cannot split an
op, so these two or three logits-sized tensors set the step's memory floor
once the blocks are checkpointed.  This rewrite splits the region over its
rows (the tokens) into K chunks:

    forward, chunk i     x_i = x[a_i:b_i]          t_i = target[a_i:b_i]
                         logits_i = x_i @ W.T (+ b)    (or logits[a_i:b_i], when the
                                                        caller also receives the logits)
                         lp_i = log_softmax(logits_i)
                         loss_i, n_i = nll_loss(lp_i, t_i, reduction=sum)
                         loss = (loss_0 + ... ) / (n_0 + ...)   (reduction=mean; sum: no division)
    backward, chunk i    g_i = d loss_i / d logits_i            (nll + log_softmax backward)
                         dx_i = g_i @ W
                         dW  = g_0.T @ x_0, then dW += g_i.T @ x_i (in place)
                         db  = sum of g_i over rows
                         dx = cat(dx_0, ...)

Each chunk's logits and log-probabilities are values of their own, so the
optimizer can free them after the chunk's loss and recompute them in
backward, one chunk at a time.  The sums change float summation order: the
loss and the head's weight gradient are no longer eager's bits
(`BIT_EXACT` in `remat_ir.rewrite` says so; `--exact` forbids it).

The region is recognized in the traced graph, not in the model's code:
`mm`/`addmm` of a 2-D activation with the transpose of a parameter, views,
`_log_softmax` over the last dim, `nll_loss_forward` without class weights;
and in backward every op that reads them, up to the gradients of the
activation, of the weight and of the bias.  Anything else reading the
region (label smoothing's extra terms, a second loss on the logits) leaves
the graph as it is, and `region()` says why.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from remat_ir.ir import (
    BACKWARD, FORWARD, GRAD, PARAM, RESULT, DType, Node, Program, Ref, Seq, contiguous_stride, node_inputs,
)

NAME = "chunked_loss"

_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.alias.default")
_NLL = "aten.nll_loss_forward.default"
_LOG_SOFTMAX = "aten._log_softmax.default"
_NLL_BWD = ("aten.nll_loss_backward.default", "remat.nll_log_softmax_backward.default")
_GRAD_VIEWS = _VIEWS + ("aten.t.default", "aten.detach.default")
_MEAN, _SUM = 1, 2


class NotApplicable(ValueError):
    """The graph holds no region this rewrite can chunk (the message says why)."""


@dataclass
class Region:
    x: str  # the activation, [N, d]
    weight: str  # the parameter W, [V, d]
    weight_t: str  # the view W.T the matmul reads
    bias: str | None
    target: str  # [N] class indices
    logits: str  # the logits as log_softmax reads them, [N, V] (`kept`: the caller receives them too)
    kept: bool
    reduction: int
    ignore_index: int
    loss: str  # nll_loss_forward's loss value
    grad_in: str  # the loss's gradient, as backward receives it
    loss_backward: str  # the node that reads it
    fused: bool  # backward used remat.nll_log_softmax_backward
    forward_nodes: list[str]
    backward_nodes: list[str]
    frontier: dict[str, str]  # value read outside the region -> "x", "weight" or "bias"
    rows: int
    vocab: int
    module: str


def region(program: Program) -> Region:
    """The chunkable LM head and loss of `program`; NotApplicable says why there is none."""
    values = program.value_map()
    producer = program.producer_map()
    readers: dict[str, list[Node]] = {}
    for n in program.nodes:
        for r in node_inputs(n):
            readers.setdefault(r, []).append(n)

    def storage(name):
        return values[name].storage

    nlls = [n for n in program.nodes if n.op == _NLL and n.phase == FORWARD]
    if len(nlls) != 1:
        raise NotApplicable(f"the step has {len(nlls)} nll_loss ops; one is chunked")
    nll = nlls[0]
    lp_ref, target_ref, weight_arg, reduction, ignore_index = nll.args[:5]
    if weight_arg is not None:
        raise NotApplicable("the loss has class weights")
    if reduction not in (_MEAN, _SUM):
        raise NotApplicable("the loss is not reduced to a scalar (reduction none)")
    lsm = producer.get(lp_ref.name)
    if lsm is None or lsm.op != _LOG_SOFTMAX or lsm.args[2] is not False:
        raise NotApplicable("the loss does not read a log_softmax")
    logits2d = lsm.args[0].name
    n_rows, vocab = (values[logits2d].shape + [0, 0])[:2] if len(values[logits2d].shape) == 2 else (0, 0)
    if not n_rows or lsm.args[1] not in (1, -1):
        raise NotApplicable("the log_softmax is not over the last dim of 2-D logits")
    chain, v = [], logits2d
    while producer.get(v) is not None and producer[v].op in _VIEWS:
        chain.append(producer[v])
        v = producer[v].args[0].name
    mm = producer.get(v)
    if mm is None or mm.op not in ("aten.mm.default", "aten.addmm.default") or mm.kwargs:
        raise NotApplicable("the logits are not a matmul's result (through views)")
    bias = None
    if mm.op == "aten.addmm.default":
        bias_ref, x_ref, wt_ref = mm.args[:3]
        if len(mm.args) > 3 or values[bias_ref.name].kind != PARAM or values[bias_ref.name].shape != [vocab]:
            raise NotApplicable("the head's addmm is not x @ W.T + bias")
        bias = bias_ref.name
    else:
        x_ref, wt_ref = mm.args
    x, wt = x_ref.name, wt_ref.name
    w = values[storage(wt)]
    xv = values[x]
    if (w.kind != PARAM or len(w.shape) != 2 or values[wt].shape != w.shape[::-1]
            or values[wt].stride != w.stride[::-1] or w.stride != [w.shape[1], 1]):
        raise NotApplicable("the head's matmul does not read a parameter's transpose")
    if len(xv.shape) != 2 or xv.shape[0] != n_rows or w.shape != [vocab, xv.shape[1]]:
        raise NotApplicable("the head's shapes are not [N, d] @ [d, V]")
    target = target_ref.name
    if values[target].shape != [n_rows]:
        raise NotApplicable("the targets are not one per row")
    loss_storage = storage(nll.outputs[0])
    if any(storage(m) == loss_storage for n in program.nodes for m in n.mutates if m in values):
        # (`loss += coef * aux_loss` of a mixture of experts: the chunks' sum would be another storage)
        raise NotApplicable("the loss is changed in place after nll_loss")
    forward = [mm] + chain[::-1] + [lsm, nll]
    fwd_names = {n.name for n in forward}
    outs = {o for n in forward for o in n.outputs if o}
    results = {o.value for o in program.outputs if o.kind == RESULT}
    logits_storage = storage(mm.outputs[0])
    kept = False
    for o in outs:
        outside = [r for r in readers.get(o, []) if r.phase == FORWARD and r.name not in fwd_names]
        if o == nll.outputs[0]:
            continue  # the loss itself: renamed, readers keep reading it
        if storage(o) == logits_storage and (o in results or outside):
            kept = True  # the caller (or another forward op) reads the logits: slice them
        elif o in results or outside:
            raise NotApplicable(f"{o} is read outside the head and loss")
    # Backward: every op reading the region, up to the gradients of x, W and
    # b (`frontier`) and the views of those.
    region_vals = set(outs)
    bwd, frontier = [], {}
    grad_in = loss_backward = None
    for n in program.nodes:
        if n.phase != BACKWARD:
            continue
        ins = node_inputs(n)
        if n.op in _GRAD_VIEWS and ins and ins[0] in frontier:
            bwd.append(n)
            frontier[n.outputs[0]] = frontier[ins[0]]
            continue
        if not any(i in region_vals for i in ins):
            continue
        if n.op in _NLL_BWD:
            if n.args[1].name != lp_ref.name:
                raise NotApplicable(f"{n.name} is a second loss backward")
            grad_in, loss_backward = n.args[0].name, n.name
        bwd.append(n)
        kind = _terminal(n, values, x, w.name, region_vals)
        for o in n.outputs:
            if o:
                (frontier.__setitem__(o, kind) if kind else region_vals.add(o))
    if grad_in is None:
        raise NotApplicable("no backward of the loss")
    bwd_names = {n.name for n in bwd}
    grads = {o.value for o in program.outputs if o.kind == GRAD}
    wanted = {}
    for n in bwd:
        for o in n.outputs:
            if o and (o in grads or any(rd.name not in bwd_names for rd in readers.get(o, []))):
                if o not in frontier:
                    raise NotApplicable(f"backward value {o} is read outside the head's backward")
                wanted[o] = frontier[o]
    kinds = set(wanted.values())
    if "x" not in kinds or "weight" not in kinds or (bias is not None) != ("bias" in kinds):
        raise NotApplicable("the head's backward does not give the gradients of x, W and b")
    # With the logits kept for the caller, the matmul and its views stay and the chunks slice them.
    fwd_nodes = [lsm, nll] if kept else forward
    return Region(x=x, weight=w.name, weight_t=wt, bias=bias, target=target, logits=logits2d,
                  kept=kept, reduction=reduction, ignore_index=ignore_index, loss=nll.outputs[0],
                  grad_in=grad_in, loss_backward=loss_backward, fused=any(n.op == _NLL_BWD[1] for n in bwd),
                  forward_nodes=[n.name for n in fwd_nodes], backward_nodes=[n.name for n in bwd],
                  frontier=wanted, rows=n_rows, vocab=vocab, module=mm.module)


def _terminal(n: Node, values, x: str, weight: str, region_vals: set) -> str:
    """Which gradient `n` computes ("x", "weight", "bias"), or "" when none."""
    ins = node_inputs(n)
    if n.op == "aten.mm.default" and len(ins) == 2:
        a, b = ins
        sa, sb = values[a].storage, values[b].storage
        if a in region_vals and sb == weight:
            return "x"
        if a in region_vals and sb == values[x].storage:
            return "weight"
        if b in region_vals and sa == values[x].storage:
            return "weight"
    if (n.op == "aten.sum.dim_IntList" and ins and ins[0] in region_vals and isinstance(n.args[1], Seq)
            and n.args[1].items == [0]):
        return "bias"
    return ""


def chunk_loss(program: Program, chunks: int, late: bool = False) -> Program:
    """`program` with its LM head and loss split into `chunks` row chunks,
    and the unoptimized schedule for the new graph.  With `late` (a head
    weight tied to the embedding), the head's weight gradient is made at the
    end of backward instead.  Raises NotApplicable."""
    from remat_ir.rewrite.build import GraphEdit, matmul_flops, without_dead_views

    r = region(program)
    if not 2 <= chunks <= r.rows:
        raise NotApplicable(f"chunks must be between 2 and the {r.rows} rows, not {chunks}")
    values = program.value_map()
    tied_add = _tied_add(program, r, values)
    if late and tied_add is None:
        raise NotApplicable("late: the head's weight is not tied (its gradient is not added to another "
                            "gradient of the same weight)")
    if late and [v for v, k in r.frontier.items() if k == "weight"] != [tied_add[1]]:
        raise NotApplicable("late: the head's weight gradient is read by more than the tied sum")
    g = GraphEdit(program)
    mod = r.module or "head"
    d = values[r.x].shape[1]
    lp_dtype = values[program.producer_map()[r.loss].args[0].name].dtype
    bounds = [(i * r.rows // chunks, (i + 1) * r.rows // chunks) for i in range(chunks)]
    fwd, bwd = [], []

    def add(node, to):
        to.append(node)
        return node.outputs

    def logits(i: int, c: str, phase: str, to: list) -> str:
        """Chunk i's logits: rows of the kept logits, or its rows of x times W.T (+ b)."""
        a, b = bounds[i]
        if r.kept:  # the caller keeps the logits whole: backward reads forward's slice of them
            return lis[i] if phase == BACKWARD else add(
                g.node(f"{c}.logits", "aten.slice.Tensor", [Ref(r.logits), 0, a, b], phase, mod), to)[0]
        if r.bias is None:
            return add(g.node(f"{c}.logits", "aten.mm.default", [Ref(xs[i]), Ref(r.weight_t)], phase, mod,
                              flops=matmul_flops(b - a, d, r.vocab)), to)[0]
        return add(g.node(f"{c}.logits", "aten.addmm.default", [Ref(r.bias), Ref(xs[i]), Ref(r.weight_t)],
                          phase, mod, flops=matmul_flops(b - a, d, r.vocab)), to)[0]

    xs, ts, lps, nlls, lis = [], [], [], [], []
    for i, (a, b) in enumerate(bounds):
        c = f"{mod}.chunk{i}"
        xs.append(add(g.node(f"{c}.x", "aten.slice.Tensor", [Ref(r.x), 0, a, b], FORWARD, mod), fwd)[0])
        ts.append(add(g.node(f"{c}.target", "aten.slice.Tensor", [Ref(r.target), 0, a, b], FORWARD, mod),
                      fwd)[0])
        li = logits(i, c, FORWARD, fwd)
        lis.append(li)
        lps.append(add(g.node(f"{c}.log_softmax", _LOG_SOFTMAX, [Ref(li), 1, False], FORWARD, mod), fwd)[0])
        nlls.append(add(g.node(f"{c}.nll", _NLL, [Ref(lps[i]), Ref(ts[i]), None, _SUM, r.ignore_index],
                               FORWARD, mod, flops=b - a), fwd))
    total, count = nlls[0][0], nlls[0][1]
    for i in range(1, chunks):
        total = add(g.node(f"{mod}.loss_sum", "aten.add.Tensor", [Ref(total), Ref(nlls[i][0])], FORWARD, mod),
                    fwd)[0]
        count = add(g.node(f"{mod}.count", "aten.add.Tensor", [Ref(count), Ref(nlls[i][1])], FORWARD, mod),
                    fwd)[0]
    if r.reduction == _MEAN:
        loss = add(g.node(f"{mod}.loss", "aten.div.Tensor", [Ref(total), Ref(count)], FORWARD, mod), fwd)[0]
        gs = add(g.node(f"d.{mod}.loss", "aten.div.Tensor", [Ref(r.grad_in), Ref(count)], BACKWARD, mod),
                 bwd)[0]
    else:
        loss, gs = total, r.grad_in

    def grad_logits(i: int, c: str, to: list, lp: str | None = None) -> str:
        """Chunk i's logits gradient, from its log-probabilities (`lp`, when
        they are made again) and the loss gradient."""
        a, b = bounds[i]
        lp, t, n_i = lp or lps[i], ts[i], nlls[i][1]
        if r.fused:
            return add(g.node(f"{c}.logits", "remat.nll_log_softmax_backward.default",
                              [Ref(gs), Ref(lp), Ref(t), None, _SUM, r.ignore_index, Ref(n_i), Ref(lp), 1,
                               DType(lp_dtype)], BACKWARD, mod, flops=2 * (b - a) * r.vocab), to)[0]
        gn = add(g.node(f"{c}.nll", _NLL_BWD[0], [Ref(gs), Ref(lp), Ref(t), None, _SUM, r.ignore_index,
                                                  Ref(n_i)], BACKWARD, mod), to)[0]
        return add(g.node(f"{c}.logits", "aten._log_softmax_backward_data.default",
                          [Ref(gn), Ref(lp), 1, DType(lp_dtype)], BACKWARD, mod), to)[0]

    dw = None

    def weight_grad(i: int, gl: str, c: str, to: list, name: str = "", module: str = mod) -> None:
        nonlocal dw
        a, b = bounds[i]
        glt = add(g.node(f"{c}.logits_t", "aten.t.default", [Ref(gl)], BACKWARD, mod), to)[0]
        if dw is None:
            dw = add(g.node(f"d.{mod}.weight", "aten.mm.default", [Ref(glt), Ref(xs[i])], BACKWARD, mod,
                            flops=matmul_flops(r.vocab, b - a, d)), to)[0]
        else:
            dw = add(g.node(name or f"d.{mod}.weight_acc", "aten.addmm_.default", [Ref(dw), Ref(glt), Ref(xs[i])],
                            BACKWARD, module, mutates=[dw], flops=matmul_flops(r.vocab, b - a, d)), to)[0]

    dxs, db = [], None
    for i, (a, b) in enumerate(bounds):
        c = f"d.{mod}.chunk{i}"
        gl = grad_logits(i, c, bwd)
        dxs.append(add(g.node(f"{c}.x", "aten.mm.default", [Ref(gl), Ref(r.weight)], BACKWARD, mod,
                              flops=matmul_flops(b - a, r.vocab, d)), bwd)[0])
        if not late:
            weight_grad(i, gl, c, bwd)
        if r.bias is not None:
            s_ = add(g.node(f"{c}.bias", "aten.sum.dim_IntList", [Ref(gl), Seq([0])], BACKWARD, mod), bwd)[0]
            db = s_ if db is None else add(g.node(f"d.{mod}.bias", "aten.add.Tensor", [Ref(db), Ref(s_)],
                                                  BACKWARD, mod), bwd)[0]
    dx = add(g.node(f"d.{mod}.x", "aten.cat.default", [Seq([Ref(v) for v in dxs]), 0], BACKWARD, mod), bwd)[0]
    new = {"x": dx, "weight": dw, "bias": db}

    # The values read outside the region keep their names: each is made again
    # as a view of the new gradient it stood for.
    replaced = []
    for name, kind in r.frontier.items():
        if late and kind == "weight":
            continue  # made at the tied sum, below
        old = values[name]
        src = g.values[new[kind]]
        if old.shape == src.shape and old.stride == src.stride:
            op, args = "aten.alias.default", [Ref(new[kind])]
        elif old.shape == src.shape[::-1] and old.stride == src.stride[::-1]:
            op, args = "aten.t.default", [Ref(new[kind])]
        elif old.stride == contiguous_stride(old.shape):
            op, args = "aten.view.default", [Ref(new[kind]), Seq(list(old.shape))]
        else:
            raise NotApplicable(f"the gradient {name} has a layout the rewrite cannot make")
        node = g.node(g.release(name), op, args, BACKWARD, mod)
        replaced.append(node)
    bwd += replaced

    # A tied weight (the embedding's) sums the head's gradient with the
    # embedding's at the end of backward: three weight-sized tensors at once,
    # which sets the floor once the logits are chunked.  Adding the head's
    # into the embedding's in place (the same bits: addition commutes) leaves two.
    #
    # `late`: the head's weight gradient is not made in the head's backward at
    # all, where it would be held beside every block's backward until the
    # embedding's arrives.  Where the sum was, each chunk's logits gradient is
    # made again (logits, log_softmax, loss backward) and added into the
    # embedding's gradient in place: a logits-chunk of work more per chunk
    # for a weight-sized tensor less through backward.
    swapped: dict[str, list[Node]] = {}
    if tied_add is not None:
        add_node, name, other = tied_add
        out = g.release(add_node.outputs[0])
        if not late:
            swapped[add_node.name] = [g.node(out, "aten.add_.Tensor", [Ref(other), Ref(name)], BACKWARD,
                                             add_node.module, mutates=[other], flops=add_node.flops)]
        else:
            tail: list[Node] = []
            dw = other
            for i in range(chunks):
                c = f"{mod}.late{i}"
                lp = add(g.node(f"{c}.log_softmax", _LOG_SOFTMAX, [Ref(logits(i, c, BACKWARD, tail)), 1, False],
                                BACKWARD, mod), tail)[0]
                weight_grad(i, grad_logits(i, f"d.{c}", tail, lp), f"d.{c}", tail,
                            name=out if i == chunks - 1 else "", module=add_node.module)
            swapped[add_node.name] = tail

    # Splice: the region's nodes go; the new ones stand where the loss was
    # computed in forward and where its backward began, when every operand
    # they read exists; the old loss value is the new one's.
    gone = set(r.forward_nodes) | set(r.backward_nodes)
    at = {FORWARD: r.forward_nodes[-1], BACKWARD: r.loss_backward}
    rename = {r.loss: loss}
    nodes: list[Node] = []
    for n in program.nodes:
        if n.name == at[n.phase]:
            nodes += fwd if n.phase == FORWARD else bwd
        if n.name not in gone:
            nodes += swapped.get(n.name) or [_renamed(n, rename)]
    nodes = without_dead_views(nodes, {o.value for o in program.outputs}, _GRAD_VIEWS)
    outputs = [msgspec.structs.replace(o, value=rename.get(o.value, o.value)) for o in program.outputs]
    return g.program_of(nodes, outputs, f"{NAME}:{chunks}" + (":late" if late else ""))


def tied(program: Program) -> bool:
    """Whether the head's weight gradient is summed with another gradient of
    the same weight (tied to the embedding).  Raises NotApplicable."""
    return _tied_add(program, region(program), program.value_map()) is not None


def _tied_add(program: Program, r: Region, values) -> tuple | None:
    """(node, head gradient, embedding gradient) when the head's weight
    gradient is read by one `add` with another gradient of the same weight
    (a weight tied to the embedding) that gives the weight's gradient output
    and that nothing else reads; else None."""
    grads = {o.value for o in program.outputs if o.kind == GRAD}
    gone = set(r.forward_nodes) | set(r.backward_nodes)
    for name, kind in r.frontier.items():
        if kind != "weight":
            continue
        users = [n for n in program.nodes if name in node_inputs(n) and n.name not in gone]
        if len(users) != 1:
            continue
        n = users[0]
        other = [a.name for a in n.args if isinstance(a, Ref) and a.name != name]
        if (n.op != "aten.add.Tensor" or len(n.args) != 2 or n.kwargs or len(other) != 1
                or n.outputs[0] not in grads):
            continue
        e = values[other[0]]
        if (e.storage == e.name and e.shape == values[name].shape and e.stride == values[name].stride
                and not any(e.name in node_inputs(m) for m in program.nodes if m is not n)):
            return n, name, e.name
    return None


def _renamed(n: Node, rename: dict) -> Node:
    if not rename:
        return n

    def fix(a):
        if isinstance(a, Ref):
            return Ref(rename.get(a.name, a.name))
        if isinstance(a, Seq):
            return Seq([fix(x) for x in a.items])
        return a

    return msgspec.structs.replace(n, args=[fix(a) for a in n.args],
                                   kwargs={k: fix(v) for k, v in n.kwargs.items()},
                                   mutates=[rename.get(m, m) for m in n.mutates])

