"""Chunked attention: the [B, H, T, T] score tensors are never whole.

Written out (as the built-in GPT does, and as `F.scaled_dot_product_attention`
decomposes on CPU), attention makes several tensors of B x H x T x T
elements: the scores, the scaled and masked scores, the probabilities, the
dropout mask and the dropped probabilities, and as many again in backward.
Recomputation cannot split an op, so once the blocks are checkpointed a
block's attention backward (three or four of them live at once) sets the
memory floor of a long-sequence model.  Every op between the two batched
matmuls works on each of the B x H matrices alone, so this rewrite splits
the region over those rows (dim 0 of the [B*H, T, hd] operands) into K
chunks:

    once        keep = dropout_keep(<a [B, H, T, T] view>, p)   the whole draw, as eager
    chunk i     q_i, kt_i, v_i = rows [a_i, b_i) of q, k.T, v
                s_i = q_i @ kt_i;  m_i = masked_fill(s_i * c, mask, -inf)
                p_i = softmax(m_i);  d_i = p_i * dropout_scale(rows of keep)
                y_i = d_i @ v_i
                y = cat(y_0, ...)
    backward    dy_i = rows of dy
                dv_i = d_i.T @ dy_i;  da_i = dy_i @ v_i.T
                ds_i = masked_fill(softmax_backward(da_i * scale_i, p_i), mask, 0) * c
                dq_i = ds_i @ kt_i.T;  dkt_i = q_i.T @ ds_i
                dq, dkt, dv = cat(dq_0, ...), cat(dkt_0, ...), cat(dv_0, ...)

The dropout mask is drawn whole, once, where eager draws it, so the random
stream and the mask are eager's; each chunk scales its rows of it.  Each
chunk's probabilities are values of their own, so the optimizer can free
them after the chunk's matmul and recompute them in backward, one chunk at
a time.  The per-element ops are eager's; whether a batched matmul over
fewer matrices gives the same bits is the BLAS library's choice, so the
rewrite does not claim eager's bits (`BIT_EXACT` in `remat_ir.rewrite`).

The region is recognized in the traced graph: `bmm(q, k.T)`, a view to
[B, H, T, T], `mul` by a constant, an optional `masked_fill` with a mask of
at most two dims, `_softmax` over the last dim, optional dropout
(`remat.dropout_keep` / `remat.dropout_scale` / `mul`), a view back to
[B*H, T, T] and `bmm` with `v`; in backward, exactly autograd's gradients of
those ops, up to the gradients of q, k.T and v.  Anything else reading the
region leaves that attention as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from remat_ir.ir import BACKWARD, FORWARD, DType, Node, Program, Ref, Seq, node_inputs
from remat_ir.rewrite.chunk_loss import NotApplicable  # one error for every rewrite

NAME = "chunked_attention"

_BMM = "aten.bmm.default"
_RESHAPES = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
_MUL = "aten.mul.Tensor"
_FILL = "aten.masked_fill.Scalar"
_SOFTMAX = "aten._softmax.default"
_SOFTMAX_BWD = "aten._softmax_backward_data.default"
_KEEP = "remat.dropout_keep.default"
_SCALE = "remat.dropout_scale.default"
_PASS = ("aten.transpose.int", "aten.detach.default", "aten.alias.default", "aten.t.default") + _RESHAPES


class _NotAttention(NotApplicable):
    """This matmul does not start a softmax attention (another matmul)."""


@dataclass
class Attention:
    q: str  # [BH, T, hd], the first matmul's left operand
    kt: str  # [BH, hd, T2], its right operand
    v: str  # [BH, T2, hd], the second matmul's right operand
    scale: float
    mask: str | None  # masked with `fill` where true
    fill: float
    p: float | None  # dropout's keep probability, when there is dropout
    dtype: str  # the probabilities' dtype
    out: str  # the second matmul's result, [BH, T, hd]
    dy: str  # its gradient
    frontier: dict[str, str]  # gradient value read outside -> "q", "kt" or "v"
    bwd_fill: object  # the value backward's masked_fill writes (0)
    forward_nodes: list[str]
    backward_nodes: list[str]
    rows: int  # BH
    shape4: list[int]  # [B, H, T, T2]
    module: str
    keep: str | None  # the dropout draw's value


def regions(program: Program) -> list[Attention]:
    """Every chunkable attention of `program`, in program order; NotApplicable
    (saying why the first candidate failed) when there is none."""
    values = program.value_map()
    readers: dict[str, list[Node]] = {}
    for n in program.nodes:
        for r in node_inputs(n):
            readers.setdefault(r, []).append(n)
    found, why = [], "the step has no batched matmul of q and k.T followed by a softmax"
    for n in program.nodes:
        if n.op != _BMM or n.phase != FORWARD:
            continue
        try:
            found.append(_region(program, n, values, readers))
        except _NotAttention:
            pass
        except NotApplicable as e:
            why = str(e)
    if not found:
        raise NotApplicable(why)
    return found


def _region(program: Program, s: Node, values, readers) -> Attention:
    def one(v: str, ops, err=NotApplicable) -> Node:
        fwd = [r for r in readers.get(v, []) if r.phase == FORWARD]
        if len(fwd) != 1 or fwd[0].op not in ops:
            raise err(f"{v} is read by {[r.op for r in fwd]} in forward, not only by one of {ops}")
        return fwd[0]

    q, kt = (a.name for a in s.args[:2])
    bh, t, t2 = values[s.outputs[0]].shape
    fwd = [s]
    v4 = one(s.outputs[0], _RESHAPES, _NotAttention)
    shape4 = values[v4.outputs[0]].shape
    if len(shape4) != 4 or shape4[0] * shape4[1] != bh or shape4[2:] != [t, t2]:
        raise _NotAttention(f"{v4.name} is not a view of the scores as [B, H, T, T]")
    m = one(v4.outputs[0], (_MUL,), _NotAttention)
    if len(m.args) != 2 or not isinstance(m.args[1], float) or m.args[0] != Ref(v4.outputs[0]):
        raise _NotAttention(f"{m.name} does not scale the scores by a constant")
    fwd += [v4, m]
    cur, mask, fill = m.outputs[0], None, 0.0
    nxt = one(cur, (_FILL, _SOFTMAX), _NotAttention)
    if nxt.op == _FILL:
        if (not isinstance(nxt.args[1], Ref) or len(values[nxt.args[1].name].shape) > 2
                or values[nxt.args[1].name].dtype != "bool"):
            raise NotApplicable(f"{nxt.name}: the mask is not a boolean of at most two dims")
        mask, fill = nxt.args[1].name, nxt.args[2]
        fwd.append(nxt)
        cur = nxt.outputs[0]
        nxt = one(cur, (_SOFTMAX,), _NotAttention)
    sm = nxt
    if sm.args[1] not in (-1, 3) or sm.args[2] is not False:
        raise NotApplicable(f"{sm.name} is not a softmax over the last dim")
    fwd.append(sm)
    p = None
    cur = sm.outputs[0]
    fwd_readers = [r for r in readers.get(cur, []) if r.phase == FORWARD]
    keep_name = None
    if any(r.op == _KEEP for r in fwd_readers):
        keep = next(r for r in fwd_readers if r.op == _KEEP)
        scale = one(keep.outputs[0], (_SCALE,))
        dm = one(scale.outputs[0], (_MUL,))
        if (len(fwd_readers) != 2 or dm not in fwd_readers or dm.args != [Ref(cur), Ref(scale.outputs[0])]
                or scale.args[1] != keep.args[1]):
            raise NotApplicable(f"{keep.name}: the dropout is not p * dropout_scale(keep)")
        p, keep_name = keep.args[1], keep.outputs[0]
        fwd += [keep, scale, dm]
        cur = dm.outputs[0]
    nxt = one(cur, ("aten.expand.default",) + _RESHAPES)
    if nxt.op == "aten.expand.default":
        if nxt.args[1] != Seq(list(shape4)) and list(getattr(nxt.args[1], "items", [])) != shape4:
            raise NotApplicable(f"{nxt.name} is not an expand to the same shape")
        fwd.append(nxt)
        nxt = one(nxt.outputs[0], _RESHAPES)
    if values[nxt.outputs[0]].shape != [bh, t, t2]:
        raise NotApplicable(f"{nxt.name} is not a view of the probabilities as [B*H, T, T]")
    fwd.append(nxt)
    att3 = nxt.outputs[0]
    b2 = one(att3, (_BMM,))
    if b2.args[0] != Ref(att3):
        raise NotApplicable(f"{b2.name} does not multiply the probabilities on the left")
    v = b2.args[1].name
    fwd.append(b2)
    out = b2.outputs[0]
    region_vals = {o for n in fwd for o in n.outputs if o} - {out}
    for o in region_vals:
        for r in readers.get(o, []):
            if r.phase == FORWARD and r not in fwd:
                raise NotApplicable(f"{o} is read outside the attention ({r.name})")
    ext = {q: "q", kt: "kt", v: "v"}

    # Backward: dv = bmm(T(att3), dy) names dy; then every op reading the
    # region or dy, up to the gradients of q, kt and v.
    producer = program.producer_map()
    ext_views: dict[str, str] = dict(ext)
    reg_views: set[str] = set(region_vals)
    dy = None
    for n in program.nodes:
        if n.phase != BACKWARD:
            continue
        ins = node_inputs(n)
        if n.op in _PASS and ins and ins[0] in ext_views:
            ext_views[n.outputs[0]] = ext_views[ins[0]]
        if n.op in _PASS and ins and ins[0] in reg_views:
            reg_views.add(n.outputs[0])
        if n.op == _BMM and isinstance(n.args[0], Ref) and n.args[0].name in reg_views and isinstance(
                n.args[1], Ref) and n.args[1].name not in reg_views:
            if _views_of(n.args[0].name, att3, producer):
                dy = n.args[1].name
    if dy is None:
        raise NotApplicable(f"no gradient of {out} (the attention's backward is not autograd's)")
    if values[dy].shape != values[out].shape:
        raise NotApplicable(f"{dy} is not shaped like {out}")
    bvals = set(region_vals) | {dy}
    bwd, frontier, counts = [], {}, {}
    for n in program.nodes:
        if n.phase != BACKWARD:
            continue
        ins = node_inputs(n)
        if not any(i in bvals for i in ins):
            continue  # (views of q, kt and v that only the region read are dropped as dead views)
        kind = ""
        if n.op == _BMM:
            a, b = ins[0], ins[-1]
            ka, kb = ext_views.get(a), ext_views.get(b)
            if a in bvals and a != dy and kb == "kt":
                kind = "q"
            elif ka == "q" and b in bvals:
                kind = "kt"
            elif a in bvals and b == dy and a != dy:
                kind = "v"
            elif a == dy and kb == "v":
                kind = ""
            else:
                raise NotApplicable(f"{n.name}: a matmul in the attention's backward that autograd does not make")
        bwd.append(n)
        if n.op not in _PASS:
            counts[n.op] = counts.get(n.op, 0) + 1
        for o in n.outputs:
            if o:
                (frontier.__setitem__(o, kind) if kind else bvals.add(o))
    want = {_BMM: 4, _SOFTMAX_BWD: 1, _MUL: 2 if p is not None else 1}
    if mask is not None:
        want[_FILL] = 1
    if counts != want:
        raise NotApplicable(f"the attention's backward makes {counts}, not autograd's {want}")
    bwd_names = {n.name for n in bwd}
    bwd_fill = 0
    for n in bwd:
        if n.op == _FILL:
            if n.args[1] != Ref(mask):
                raise NotApplicable(f"{n.name} masks with another mask")
            bwd_fill = n.args[2]
        if n.op == _MUL and len(n.args) == 2 and not isinstance(n.args[1], Ref) and n.args[1] != m.args[1]:
            raise NotApplicable(f"{n.name} scales by another constant")
        if n.op == _SOFTMAX_BWD and (n.args[2] not in (-1, 3) or not _views_of(n.args[1].name, sm.outputs[0],
                                                                                 producer)):
            raise NotApplicable(f"{n.name} is not the softmax's backward")
        for o in n.outputs:
            if o and o in bvals and any(r.name not in bwd_names for r in readers.get(o, [])):
                raise NotApplicable(f"backward value {o} is read outside the attention's backward")
    if sorted(frontier.values()) != ["kt", "q", "v"]:
        raise NotApplicable("the attention's backward does not give the gradients of q, k.T and v")
    return Attention(q=q, kt=kt, v=v, scale=m.args[1], mask=mask, fill=fill, p=p,
                     dtype=values[sm.outputs[0]].dtype, out=out, dy=dy, frontier=frontier, bwd_fill=bwd_fill,
                     forward_nodes=[n.name for n in fwd], backward_nodes=[n.name for n in bwd], rows=bh,
                     shape4=list(shape4), module=sm.module, keep=keep_name)


def _views_of(name: str, target: str, producer) -> bool:
    """Whether `name` is `target` or a chain of pass-through views of it."""
    while name != target and producer.get(name) is not None and producer[name].op in _PASS:
        name = producer[name].args[0].name
    return name == target


def chunk_choices(program: Program, most: int = 8) -> list[int]:
    """Chunk counts worth trying, fewest first (2, 4, ... up to `most` and
    the fewest rows of any attention); [] when there is no attention to chunk."""
    try:
        rows = min(r.rows for r in regions(program))
    except NotApplicable:
        return []
    out, k = [], 2
    while k <= min(most, rows):
        out.append(k)
        k *= 2
    return out


def chunk_attention(program: Program, chunks: int) -> Program:
    """`program` with every chunkable attention split into `chunks` row
    chunks, and the unoptimized schedule for the new graph.  Raises NotApplicable."""
    from remat_ir.rewrite.build import GraphEdit, matmul_flops, without_dead_views

    regs = regions(program)
    if not 2 <= chunks <= min(r.rows for r in regs):
        raise NotApplicable(f"chunks must be between 2 and the {min(r.rows for r in regs)} attention rows, "
                            f"not {chunks}")
    values = program.value_map()
    g = GraphEdit(program)
    instead: dict[str, list[Node]] = {}  # a node dropped -> the new nodes placed where it was
    gone: set[str] = set()

    def add(node, to):
        to.append(node)
        return node.outputs[0]

    for r in regs:
        mod = r.module
        bounds = [(i * r.rows // chunks, (i + 1) * r.rows // chunks) for i in range(chunks)]
        _, t, hd = values[r.q].shape
        t2 = values[r.kt].shape[2]
        fwd, bwd = [], []
        keep3 = None
        if r.p is not None:
            draw = add(g.node(f"{mod}.draw_shape", "aten.as_strided.default",
                              [Ref(r.q), Seq(list(r.shape4)), Seq([0, 0, 0, 0])], FORWARD, mod), fwd)
            # The whole draw, as eager's: random, so a recompute replays its RNG state.
            kmod = program.producer_map()[r.keep].module
            node = g.node(g.release(r.keep), _KEEP, [Ref(draw), r.p], FORWARD, kmod, flops=float(r.rows * t * t2))
            keep = add(msgspec.structs.replace(node, random=True), fwd)
            keep3 = add(g.node(f"{r.keep}_rows", "aten.view.default", [Ref(keep), Seq([r.rows, t, t2])], FORWARD,
                               kmod), fwd)

        def probs(i: int, c: str, phase: str, to: list) -> tuple:
            """Chunk i's probabilities, its dropout scale and the dropped
            probabilities (the same ops on the same operands in either phase)."""
            a, b = bounds[i]
            qi, kti, _, ki = rows[i]
            si = add(g.node(f"{c}.bmm", _BMM, [Ref(qi), Ref(kti)], phase, mod,
                            flops=matmul_flops((b - a) * t, hd, t2)), to)
            x = add(g.node(f"{c}.mul", _MUL, [Ref(si), r.scale], phase, mod), to)
            if r.mask is not None:
                x = add(g.node(f"{c}.masked_fill", _FILL, [Ref(x), Ref(r.mask), r.fill], phase, mod), to)
            pi = add(g.node(f"{c}._softmax", _SOFTMAX, [Ref(x), -1, False], phase, mod), to)
            if ki is None:
                return pi, None, pi
            sci = add(g.node(f"{c}.dropout_scale", _SCALE, [Ref(ki), r.p, DType(r.dtype)], phase, mod), to)
            return pi, sci, add(g.node(f"{c}.dropout", _MUL, [Ref(pi), Ref(sci)], phase, mod), to)

        rows, ys = [], []
        for i, (a, b) in enumerate(bounds):
            c = f"{mod}.chunk{i}"
            rows.append(tuple(add(g.node(f"{c}.{k}", "aten.slice.Tensor", [Ref(src), 0, a, b], FORWARD, mod), fwd)
                              if src else None for k, src in (("q", r.q), ("kt", r.kt), ("v", r.v), ("keep", keep3))))
            _, _, di = probs(i, c, FORWARD, fwd)
            ys.append(add(g.node(f"{c}.bmm_1", _BMM, [Ref(di), Ref(rows[i][2])], FORWARD, mod,
                                 flops=matmul_flops((b - a) * t, t2, hd)), fwd))
        add(g.node(g.release(r.out), "aten.cat.default", [Seq([Ref(y) for y in ys]), 0], FORWARD, mod), fwd)

        # Backward makes each chunk's probabilities again, just before its
        # gradients (as FlashAttention does): forward's are then read only in
        # forward, so no block holds all its chunks' between a recompute of its
        # output (for the layers after it) and its own backward.
        grads = {"q": [], "kt": [], "v": []}
        for i, (a, b) in enumerate(bounds):
            c = f"d.{mod}.chunk{i}"
            n = b - a
            qi, kti, vi, _ = rows[i]
            dyi = add(g.node(f"{c}.dy", "aten.slice.Tensor", [Ref(r.dy), 0, a, b], BACKWARD, mod), bwd)
            pi, sci, di = probs(i, f"{mod}.chunk{i}.again", BACKWARD, bwd)
            dt = add(g.node(f"{c}.dropout_t", "aten.transpose.int", [Ref(di), 1, 2], BACKWARD, mod), bwd)
            grads["v"].append(add(g.node(f"{c}.v", _BMM, [Ref(dt), Ref(dyi)], BACKWARD, mod,
                                         flops=matmul_flops(n * t2, t, hd)), bwd))
            vt = add(g.node(f"{c}.v_t", "aten.transpose.int", [Ref(vi), 1, 2], BACKWARD, mod), bwd)
            # Each gradient is named for the value it is the gradient of (d.<value>).
            x = add(g.node(f"{c}.dropout" if sci is not None else f"{c}._softmax", _BMM, [Ref(dyi), Ref(vt)],
                           BACKWARD, mod, flops=matmul_flops(n * t, hd, t2)), bwd)
            if sci is not None:
                x = add(g.node(f"{c}._softmax", _MUL, [Ref(x), Ref(sci)], BACKWARD, mod), bwd)
            x = add(g.node(f"{c}.masked_fill" if r.mask is not None else f"{c}.mul", _SOFTMAX_BWD,
                           [Ref(x), Ref(pi), -1, DType(r.dtype)], BACKWARD, mod), bwd)
            if r.mask is not None:
                x = add(g.node(f"{c}.mul", _FILL, [Ref(x), Ref(r.mask), r.bwd_fill], BACKWARD, mod), bwd)
            ds = add(g.node(f"{c}.bmm", _MUL, [Ref(x), r.scale], BACKWARD, mod), bwd)
            ktt = add(g.node(f"{c}.kt_t", "aten.transpose.int", [Ref(kti), 1, 2], BACKWARD, mod), bwd)
            grads["q"].append(add(g.node(f"{c}.q", _BMM, [Ref(ds), Ref(ktt)], BACKWARD, mod,
                                         flops=matmul_flops(n * t, t2, hd)), bwd))
            qt = add(g.node(f"{c}.q_t", "aten.transpose.int", [Ref(qi), 1, 2], BACKWARD, mod), bwd)
            grads["kt"].append(add(g.node(f"{c}.kt", _BMM, [Ref(qt), Ref(ds)], BACKWARD, mod,
                                          flops=matmul_flops(n * hd, t, t2)), bwd))
        # The gradients read outside keep their names (views of them name them as their storage).
        for name, kind in r.frontier.items():
            cat = add(g.node(g.release(name), "aten.cat.default", [Seq([Ref(x) for x in grads[kind]]), 0], BACKWARD,
                             mod), bwd)
            if g.values[cat].shape != values[name].shape or g.values[cat].stride != values[name].stride:
                raise NotApplicable(f"the gradient {name} has a layout the rewrite cannot make")

        # Forward: where the second matmul was.  Backward: before the first
        # region node that reads dy (dy exists there, and nothing outside has
        # read the region's gradients yet).
        instead[r.forward_nodes[-1]] = fwd
        first = next(n for n in program.nodes if n.name in set(r.backward_nodes) and r.dy in node_inputs(n))
        instead[first.name] = bwd
        gone |= set(r.forward_nodes) | set(r.backward_nodes)

    nodes: list[Node] = []
    for n in program.nodes:
        if n.name in instead:
            nodes += instead[n.name]
        if n.name not in gone:
            nodes.append(n)
    # (backward's transposes of q, k.T and v that only the removed backward read)
    nodes = without_dead_views(nodes, {o.value for o in program.outputs}, _PASS, BACKWARD)
    return g.program_of(nodes, list(program.outputs), f"{NAME}:{chunks}")
