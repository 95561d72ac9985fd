"""The chunked loss: cross-entropy in row chunks, eager's bits, no
logits-sized tensor kept for backward.

A language model's step ends with `logits = x @ W.T (+ b)` over the whole
vocabulary, `log_softmax` and `nll_loss`; eager keeps the logits or their
log-probabilities for backward, and backward makes the logits' gradient
beside them.  Recomputation cannot split an op, so two logits-sized tensors
at the loss set the step's floor once the blocks are checkpointed.  This
rewrite, `lm_head_nll:R`, puts remat-ir's own ops in their place
(`remat_ir/ir/ops.py`):

    forward     loss, total_weight, ... = remat.lm_head_nll(x, W.T, b, target, reduction, ignore_index, R)
    backward    g, ... = remat.lm_head_nll_backward(dloss, x, W.T, b, target, ..., total_weight, ..., R)

Forward computes the log-probabilities R rows at a time in one chunk-sized
scratch buffer and keeps only what `nll_loss` picks; backward computes them
again, chunk by chunk, straight into the rows of the logits' gradient `g`,
and writes the gradient over them.  Where the logits are read by nothing
else, the LM head's matmul moves into both ops (from `x`); where the caller
also receives the logits, the ops read them.  Every element gets eager's
bits (the ops' docstring says why; tests/test_ops.py compares them with
eager), and the rest of backward (the head's gradients `g @ W` and
`g.T @ x`, whole) is the traced graph's own: `BIT_EXACT` in
`remat_ir.rewrite` says so, and `--exact` allows it.  CPU only, as the ops.

`g` is still whole: the weight gradient is one matmul over it (chunking that
matmul changes its order of additions).  A head weight tied to the
embedding adds its gradient to the embedding's; the sum is written over the
embedding's in place (one addition per element, the same operands: the same
bits).  `lm_head_nll:R:late` goes further: the head's weight gradient is
not made in the head's backward, where it would be held through every
block's backward until the embedding's arrives, but just before the
embedding's gradient, from `g` made again by the same op on the same
operands (the same bits): the LM head's matmul and the log-softmax once
more, for a weight-sized tensor less through backward.

The region is recognized in the traced graph: `nll_loss_forward` (no class
weights, mean or sum) of `_log_softmax` over the last dim of 2-D logits,
through views from an `mm`/`addmm` when nothing else reads the logits; in
backward, the loss's backward (`remat.nll_log_softmax_backward`, or
`nll_loss_backward` then `_log_softmax_backward_data`) reading the
log-probabilities, which nothing else reads.  `region()` says why a graph
has none.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from remat_ir.ir import (
    BACKWARD, FORWARD, GRAD, PARAM, RESULT, DType, Node, Program, Ref, Seq, contiguous_stride, node_inputs,
)
from remat_ir.ir.ops import MIN_LOSS_ROWS, loss_rows, loss_spans

NAME = "lm_head_nll"

OP = "remat.lm_head_nll.default"
BACKWARD_OP = "remat.lm_head_nll_backward.default"
_VIEWS = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.alias.default")
_ALIASES = ("aten.detach.default", "aten.alias.default")  # how backward reads a saved value
_NLL = "aten.nll_loss_forward.default"
_LOG_SOFTMAX = "aten._log_softmax.default"
_FUSED_BWD = "remat.nll_log_softmax_backward.default"
_NLL_BWD = "aten.nll_loss_backward.default"
_LSM_BWD = "aten._log_softmax_backward_data.default"
_MEAN, _SUM = 1, 2


class NotApplicable(ValueError):
    """The graph holds no region this rewrite applies to (the message says why)."""


@dataclass
class Region:
    x: str  # what the ops start from: the head's input [N, d] (`weight_t` set) or the logits [N, V]
    weight_t: str | None  # the head's W.T [d, V], when its matmul moves into the ops
    bias: str | None
    target: str  # [N] class indices
    reduction: int
    ignore_index: int
    loss: str  # nll_loss_forward's loss and total weight: the new op's, by the same names
    total_weight: str
    grad_out: str  # the loss's gradient, as backward receives it
    grad: str  # the logits' gradient: the new backward op's, by the same name
    dim: int
    dtype: str
    forward_nodes: list[str]  # removed: the loss (and the head's matmul, with its views)
    backward_nodes: list[str]  # removed: the loss's backward and backward's views of the log-probabilities
    rows: int  # N
    vocab: int
    module: str


def _int_shape(v) -> bool:
    return all(type(s) is int for s in v.shape)


def region(program: Program) -> Region:
    """The loss this rewrite applies to; NotApplicable says why there is none."""
    device = (program.header.device or "cpu").split(":")[0]
    if device != "cpu":
        raise NotApplicable(f"remat.lm_head_nll is checked bit-equal to eager on CPU only, not {device}")
    values = program.value_map()
    producer = program.producer_map()
    readers: dict[str, list[Node]] = {}
    for n in program.nodes:
        for r in node_inputs(n):
            readers.setdefault(r, []).append(n)
    aliases: dict[str, list[str]] = {}  # storage -> the values that view it
    for v in program.values:
        aliases.setdefault(v.storage, []).append(v.name)

    nlls = [n for n in program.nodes if n.op == _NLL and n.phase == FORWARD]
    if len(nlls) != 1:
        raise NotApplicable(f"the step has {len(nlls)} nll_loss ops; the rewrite takes one")
    nll = nlls[0]
    if nll.kwargs or len(nll.args) != 5:
        raise NotApplicable("the nll_loss call is not nll_loss_forward(log_probs, target, weight, reduction, "
                            "ignore_index)")
    lp_ref, target_ref, weight_arg, reduction, ignore_index = nll.args
    if weight_arg is not None:
        raise NotApplicable("the loss has class weights")
    if reduction not in (_MEAN, _SUM):
        raise NotApplicable("the loss is not reduced to a scalar (reduction none)")
    if len(nll.outputs) < 2 or not nll.outputs[1]:
        raise NotApplicable("the loss's total weight is not read by its backward")
    lsm = producer.get(lp_ref.name)
    if lsm is None or lsm.op != _LOG_SOFTMAX or lsm.kwargs or lsm.args[1:] not in ([1, False], [-1, False]):
        raise NotApplicable("the loss does not read a log_softmax over the last dim")
    logits = lsm.args[0].name
    lv = values[logits]
    if len(lv.shape) != 2 or not _int_shape(lv) or lv.stride != contiguous_stride(lv.shape):
        raise NotApplicable("the log_softmax is not over contiguous 2-D logits of fixed sizes")
    if not lv.dtype.startswith(("float", "bfloat")):
        raise NotApplicable("the logits are not floating point")
    n_rows, vocab = lv.shape
    target = target_ref.name
    if values[target].shape != [n_rows]:
        raise NotApplicable("the targets are not one per row")
    loss, total_weight = nll.outputs[:2]
    for name in (loss, total_weight):
        if any(values[m].storage == values[name].storage for n in program.nodes for m in n.mutates if m in values):
            # (`loss += coef * aux_loss` of a mixture of experts)
            raise NotApplicable("the loss is changed in place after nll_loss")
    lp = lp_ref.name

    # Backward: the loss's backward reads the log-probabilities (or backward's
    # detached views of them); nothing else reads them.
    lp_views = set(aliases[values[lp].storage])
    removed_views, loss_bwd = [], []
    for name in sorted(lp_views, key=lambda v: program.nodes.index(producer[v])):
        for rd in readers.get(name, []):
            if rd is nll:
                continue
            if rd.phase == BACKWARD and rd.op in _ALIASES and rd.outputs[0] in lp_views:
                removed_views.append(rd)
            elif rd.phase == BACKWARD and rd.op in (_FUSED_BWD, _NLL_BWD):
                if rd not in loss_bwd:
                    loss_bwd.append(rd)
            else:
                raise NotApplicable(f"{rd.name} reads the log-probabilities beside the loss")
    if len(loss_bwd) != 1:
        raise NotApplicable(f"the loss has {len(loss_bwd)} backward ops, not one")
    (b,) = loss_bwd
    view_refs = [Ref(v) for v in lp_views]
    want = [target_ref, None, reduction, ignore_index, Ref(total_weight)]
    if b.kwargs or b.args[1] not in view_refs or b.args[2:7] != want:
        raise NotApplicable(f"{b.name} is not the backward of this loss")
    grad_out = b.args[0]
    if not isinstance(grad_out, Ref):
        raise NotApplicable(f"{b.name} does not read the loss's gradient as a tensor")
    bwd_nodes = [b]
    if b.op == _FUSED_BWD:
        if len(b.args) != 10 or b.args[7] not in view_refs:
            raise NotApplicable(f"{b.name} does not write the log_softmax backward of the same log-probabilities")
        dim, dtype = b.args[8], b.args[9]
    else:
        gn = b.outputs[0]
        after = readers.get(gn, [])
        if (len(b.args) != 7 or len(after) != 1 or after[0].op != _LSM_BWD or after[0].kwargs
                or len(after[0].args) != 4 or after[0].args[0] != Ref(gn)
                or after[0].args[1] not in view_refs):
            raise NotApplicable(f"{b.name} is not followed by the log_softmax backward of the same log-probabilities")
        bwd_nodes.append(after[0])
        dim, dtype = after[0].args[2], after[0].args[3]
    if dim not in (1, -1) or not isinstance(dtype, DType):
        raise NotApplicable("the log_softmax backward is not over the last dim")
    grad = bwd_nodes[-1].outputs[0]

    # The LM head's matmul moves into the ops when nothing but the loss reads
    # the logits (or a view of them): the head's input is then what they read.
    results = {o.value for o in program.outputs if o.kind == RESULT}
    chain, v = [], logits
    while producer.get(v) is not None and producer[v].op in _VIEWS:
        chain.append(producer[v])
        v = producer[v].args[0].name
    mm = producer.get(v)
    x, weight_t, bias, fwd_nodes = logits, None, None, [lsm, nll]
    if mm is not None and mm.op in ("aten.mm.default", "aten.addmm.default") and not mm.kwargs:
        head = [mm] + chain[::-1]
        names = {n.name for n in head} | {lsm.name}
        storage = values[mm.outputs[0]].storage
        alone = all(a not in results and all(rd.name in names for rd in readers.get(a, []))
                    for a in aliases[storage])
        args = mm.args
        if mm.op == "aten.addmm.default":
            ok = len(args) == 3 and isinstance(args[0], Ref) and values[args[0].name].shape == [vocab]
            b_, x_, wt_ = args if ok else (None, None, None)
        else:
            ok = len(args) == 2
            b_, (x_, wt_) = None, (args if ok else (None, None))
        if alone and ok:
            xv, wv = values[x_.name], values[wt_.name]
            if (len(xv.shape) == 2 and xv.shape[0] == n_rows and xv.stride == contiguous_stride(xv.shape)
                    and wv.shape == [xv.shape[1], vocab] and xv.dtype == lv.dtype):
                x, weight_t, bias = x_.name, wt_.name, b_.name if b_ is not None else None
                fwd_nodes = head + [lsm, nll]
    return Region(x=x, weight_t=weight_t, bias=bias, target=target, reduction=reduction,
                  ignore_index=ignore_index, loss=loss, total_weight=total_weight, grad_out=grad_out.name,
                  grad=grad, dim=dim, dtype=dtype.name, forward_nodes=[n.name for n in fwd_nodes],
                  backward_nodes=[n.name for n in removed_views + bwd_nodes], rows=n_rows, vocab=vocab,
                  module=(mm.module if weight_t is not None else lsm.module) or nll.module)


def rows_of(program: Program) -> int | None:
    """The rows a chunk of this rewrite takes on `program` (about a 1 MiB
    scratch: `remat_ir.ir.ops.loss_rows`); None when it does not apply, or
    when the loss's rows make one chunk (a scratch the logits' size saves
    nothing: a classifier's few rows)."""
    try:
        r = region(program)
    except NotApplicable:
        return None
    itemsize = 2 if "16" in r.dtype else 8 if "64" in r.dtype else 4
    rows = loss_rows(r.rows, r.vocab, itemsize)
    return rows if len(loss_spans(r.rows, rows)) >= 2 else None


def chunk_loss(program: Program, rows: int, late: bool = False) -> Program:
    """`program` with its loss computed `rows` rows at a time by
    `remat.lm_head_nll` and its backward (see the module docstring), and
    the unoptimized schedule of the new graph.  With `late` (a head weight
    tied to the embedding), the head's weight gradient is made just before
    the embedding's, from the logits' gradient made again.  Raises
    NotApplicable."""
    from remat_ir.rewrite.build import GraphEdit, matmul_flops, without_dead_views

    r = region(program)
    if rows < MIN_LOSS_ROWS:
        raise NotApplicable(f"a chunk takes at least {MIN_LOSS_ROWS} rows (fewer rows of a matmul are not "
                            f"checked to give eager's bits), not {rows}")
    values = program.value_map()
    tied = _tied(program, r, values)
    if late and tied is None:
        raise NotApplicable("late: the head's weight is not tied (its gradient is not added to another "
                            "gradient of the same weight), or the ops do not start from the head's input")
    g = GraphEdit(program)
    mod = r.module or "loss"
    n, v = r.rows, r.vocab
    if r.weight_t is not None:
        d = values[r.x].shape[1]
        flops = matmul_flops(n, d, v) + (n * v if r.bias else 0) + n * v  # the matmul, its bias, the log-softmax
    else:
        flops = float(n * v)
    ref = (lambda name: Ref(name) if name is not None else None)
    common = [ref(r.x), ref(r.weight_t), ref(r.bias), Ref(r.target), r.reduction, r.ignore_index]
    fwd = g.node(f"{mod}.lm_head_nll", OP, common + [rows], FORWARD, mod, flops=flops)
    bwd_args = ([Ref(r.grad_out)] + common + [Ref(fwd.outputs[1]), r.dim, DType(r.dtype), rows])
    bwd = g.node(f"d.{mod}.lm_head_nll_backward", BACKWARD_OP, bwd_args, BACKWARD, mod, flops=flops + n * v)
    # The loss and the logits' gradient are the new ops' (readers outside
    # the region read them by their new names).
    rename = {r.loss: fwd.outputs[0], r.grad: bwd.outputs[0]}
    for name, new in rename.items():
        was, now = values[name], g.values[new]
        if (now.shape, now.stride, now.dtype) != (was.shape, was.stride, was.dtype):
            raise NotApplicable(f"{name}: the chunked loss gives {now.dtype}{now.shape}, the graph has "
                                f"{was.dtype}{was.shape}")

    swapped: dict[str, list[Node]] = {}  # node -> the nodes in its place
    gone = set(r.forward_nodes) | set(r.backward_nodes)
    swapped[r.forward_nodes[-1]] = [fwd]
    swapped[r.backward_nodes[-1]] = [bwd]
    if tied is not None:
        add, head_grad, other, chain = tied
        out = g.release(add.outputs[0])
        if late:
            # The head's weight gradient from `g` made again, just before the
            # embedding's gradient is made: the same ops on the same operands.
            again = g.node(f"d.{mod}.late.lm_head_nll_backward", BACKWARD_OP, bwd_args, BACKWARD, mod,
                           flops=flops + n * v)
            copied = {r.grad: again.outputs[0]}  # (the chain as the graph has it: the old names)
            tail = [again]
            for c in chain:
                node = g.node(f"{c.name}.late", c.op, [_renamed_arg(a, copied) for a in c.args], BACKWARD,
                              c.module, flops=c.flops)
                copied.update(zip(c.outputs, node.outputs))
                tail.append(node)
            head_grad = copied[head_grad]
            maker = program.producer_map()[other]
            swapped[maker.name] = tail + [_renamed(maker, rename)]
            # The old chain goes where nothing else reads it (its views, below).
            read_elsewhere = {i for m in program.nodes if m.name not in gone and m is not add
                              and m.name not in {c.name for c in chain} for i in node_inputs(m)}
            for c in reversed(chain):
                if not any(o in read_elsewhere for o in c.outputs if o):
                    gone.add(c.name)
                else:
                    read_elsewhere.update(node_inputs(c))
        swapped[add.name] = [g.node(out, "aten.add_.Tensor", [Ref(other), Ref(head_grad)], BACKWARD, add.module,
                                    mutates=[other], flops=add.flops, names={0: out})]
        gone.add(add.name)

    nodes: list[Node] = []
    for node in program.nodes:
        if node.name in swapped:
            nodes += swapped[node.name]
        elif node.name not in gone:
            nodes.append(_renamed(node, rename))
    g.restore(rename)
    outputs = [msgspec.structs.replace(o, value=rename.get(o.value, o.value)) for o in program.outputs]
    nodes = without_dead_views(nodes, {o.value for o in outputs}, _VIEWS + _ALIASES + ("aten.t.default",))
    return g.program_of(nodes, outputs, f"{NAME}:{rows}" + (":late" if late else ""))


def _renamed(n: Node, rename: dict) -> Node:
    if not any(r in rename for r in node_inputs(n)):
        return n
    return msgspec.structs.replace(n, args=[_renamed_arg(a, rename) for a in n.args],
                                   kwargs={k: _renamed_arg(a, rename) for k, a in n.kwargs.items()},
                                   mutates=[rename.get(m, m) for m in n.mutates])


def _renamed_arg(a, rename: dict):
    if isinstance(a, Ref):
        return Ref(rename.get(a.name, a.name))
    if isinstance(a, Seq):
        return Seq([_renamed_arg(x, rename) for x in a.items])
    return a


def tied(program: Program) -> bool:
    """Whether `lm_head_nll:R:late` applies: the ops start from the head's
    input and the head's weight gradient is added to another gradient of
    the same weight (tied to the embedding).  Raises NotApplicable."""
    r = region(program)
    return _tied(program, r, program.value_map()) is not None


def _tied(program: Program, r: Region, values) -> tuple | None:
    """(the add, the head's weight gradient it reads, the other gradient it
    adds, the backward nodes from the logits' gradient to the head's, in
    order) when the head's weight gradient is read by one `add` with another
    gradient of the same weight that gives the weight's gradient output and
    that nothing else reads; else None."""
    if r.weight_t is None:
        return None
    weight = values[values[r.weight_t].storage]
    if weight.kind != PARAM:
        return None
    grads = {o.value: o for o in program.outputs if o.kind == GRAD}
    producer = program.producer_map()
    gs, xs = values[r.grad].storage, values[r.x].storage
    head = [m for m in program.nodes if m.phase == BACKWARD and m.op == "aten.mm.default" and len(m.args) == 2
            and all(isinstance(a, Ref) for a in m.args)
            and sorted(values[a.name].storage for a in m.args) == sorted([gs, xs])]
    if len(head) != 1:
        return None
    made = values[head[0].outputs[0]].storage
    index = {m.name: i for i, m in enumerate(program.nodes)}
    for add in program.nodes:
        if (add.phase != BACKWARD or add.op != "aten.add.Tensor" or add.kwargs or len(add.args) != 2
                or not all(isinstance(a, Ref) for a in add.args) or add.outputs[0] not in grads
                or grads[add.outputs[0]].key != weight.name):
            continue
        mine = [a.name for a in add.args if values[a.name].storage == made]
        other = [a.name for a in add.args if values[a.name].storage != made]
        if len(mine) != 1 or len(other) != 1:
            continue
        h, e = values[mine[0]], values[other[0]]
        if (e.storage != e.name or e.shape != h.shape or e.stride != h.stride or e.dtype != h.dtype
                or any(e.name in node_inputs(m) for m in program.nodes if m is not add)
                or producer.get(e.name) is None or index[producer[e.name].name] < index[head[0].name]):
            continue
        # The nodes from the logits' gradient to the head's weight gradient.
        chain, todo = [], [h.name]
        while todo:
            p = producer.get(todo.pop())
            if p is None or p.name in {c.name for c in chain} or p.phase != BACKWARD:
                continue
            if r.grad in p.outputs:
                continue  # the loss's backward: made again in its place
            if p.random or p.mutates:
                return None
            ins = node_inputs(p)
            if not any(_reaches(i, gs, values, producer) for i in ins):
                continue
            chain.append(p)
            todo += ins
        chain.sort(key=lambda c: index[c.name])
        return add, h.name, e.name, chain
    return None


def _reaches(name: str, storage: str, values, producer) -> bool:
    """Whether the value `name` is (a view of) `storage`, or is made from one by backward nodes."""
    seen, todo = set(), [name]
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if values[v].storage == storage:
            return True
        p = producer.get(v)
        if p is not None and p.phase == BACKWARD:
            todo += node_inputs(p)
    return False
