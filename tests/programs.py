"""Random *valid* programs that look like a traced training step.

`random_program(rng_or_draw, n_forward=...)` builds a forward DAG over inputs,
parameters and a buffer (matmuls, elementwise ops, views and transposes that
alias their input's storage, random dropout nodes with an (out, mask) pair,
dropouts as make_fx traces them (empty_like, then bernoulli_ and div_ updating
that temporary in place),
layer norms with saved statistics, an in-place buffer update), a scalar loss
that sums every leaf, the loss's tangent, a backward graph derived from the
forward one (reading the tangent, backward temporaries and saved forward
values, accumulating gradients of values used twice, producing one gradient
output per trainable parameter, some of them views), and the default schedule.

Ops are plausible strings only; these programs are never executed.

`programs()` is the hypothesis strategy wrapping it.  Both are meant to be
reused by the optimizer's property tests.
"""
from __future__ import annotations

import random as _random

from remat_ir.ir import (
    BACKWARD, BUFFER, DTYPE_BYTES, FORWARD, GRAD, INPUT, PARAM, RESULT, TANGENT, VALUE, Header,
    Node, Output, Program, Ref, Seq, Value, contiguous_stride, from_msgpack, to_msgpack,
)
from remat_ir.ir.schedule import default_schedule

DIMS = (4, 8, 16, 32)


def _rng(draw_or_rng) -> _random.Random:
    if draw_or_rng is None:
        return _random.Random(0)
    if isinstance(draw_or_rng, _random.Random):
        return draw_or_rng
    if isinstance(draw_or_rng, int):
        return _random.Random(draw_or_rng)
    if callable(draw_or_rng):  # a hypothesis `draw`
        from hypothesis import strategies as st
        return draw_or_rng(st.randoms(use_true_random=False))
    raise TypeError(f"expected a random.Random, a seed, or a hypothesis draw, got {draw_or_rng!r}")


def _nbytes(shape, stride, dtype) -> int:
    if any(d == 0 for d in shape):
        return 0
    return (1 + sum((d - 1) * s for d, s in zip(shape, stride))) * DTYPE_BYTES[dtype]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _Builder:
    def __init__(self, rng: _random.Random):
        self.rng = rng
        self.values: list[Value] = []
        self.vmap: dict[str, Value] = {}
        self.nodes: list[Node] = []
        self.names: set[str] = set()
        self.node_names: set[str] = set()

    def unique(self, base: str, names: set[str]) -> str:
        name, i = base, 1
        while name in names:
            name = f"{base}_{i}"
            i += 1
        names.add(name)
        return name

    def value(self, base: str, kind: str, shape, *, dtype="float32", stride=None, view_of=None,
              requires_grad=False, source="") -> str:
        name = self.unique(base, self.names)
        shape = list(shape)
        stride = list(stride) if stride is not None else contiguous_stride(shape)
        if view_of is None:
            storage, nbytes = name, _nbytes(shape, stride, dtype)
        else:
            storage, nbytes = self.vmap[view_of].storage, 0
        v = Value(name=name, kind=kind, dtype=dtype, shape=shape, stride=stride, storage=storage,
                  nbytes=nbytes, source=source, requires_grad=requires_grad)
        self.values.append(v)
        self.vmap[name] = v
        return name

    def node(self, base: str, op: str, args, outputs, phase, *, random=False, mutates=(),
             flops=0.0, module="") -> str:
        name = self.unique(base, self.node_names)
        self.nodes.append(Node(name=name, op=op, args=list(args), kwargs={}, outputs=list(outputs),
                               phase=phase, module=module, random=random, mutates=list(mutates),
                               flops=float(flops)))
        return name

    def shape(self, name):
        return self.vmap[name].shape

    def contiguous(self, name) -> bool:
        v = self.vmap[name]
        return v.stride == contiguous_stride(v.shape)


def random_program(draw_or_rng=None, n_forward: int = 12, *, p_dropout: float = 0.12,
                   p_view: float = 0.18, p_layernorm: float = 0.08, p_frozen: float = 0.1,
                   p_param_reuse: float = 0.25, p_transposed_weight: float = 0.2,
                   with_buffer: bool | None = None, extra_result: bool | None = None) -> Program:
    """A valid program with about `n_forward` forward ops (plus the loss)."""
    rng = _rng(draw_or_rng)
    b = _Builder(rng)
    if with_buffer is None:
        with_buffer = rng.random() < 0.5
    if extra_result is None:
        extra_result = rng.random() < 0.3
    batch = rng.choice((2, 4, 8))

    rg: dict[str, bool] = {}  # value -> requires grad
    x = b.value("x", INPUT, [batch, rng.choice(DIMS)], source="x")
    rg[x] = False
    pool: list[str] = [x]  # differentiable-looking forward values, 2-D
    consumed: set[str] = set()
    params_by_rows: dict[int, list[str]] = {}  # [k, m] weights by k (for reuse)
    n_param = 0
    # Backward recipe per forward node: (kind, fwd node name, inputs, outputs, extra)
    recipes: list[tuple] = []

    def new_param(shape, trainable=True, prefix="w") -> str:
        nonlocal n_param
        n_param += 1
        name = b.value(f"{prefix}{n_param}", PARAM, shape, requires_grad=trainable,
                       source=f"layers.{n_param}.{'weight' if prefix == 'w' else prefix}")
        rg[name] = trainable
        return name

    def pick() -> str:
        if rng.random() < 0.75:
            return rng.choice(pool[-8:])
        return rng.choice(pool)

    def emit_mm(a: str, force_trainable=False):
        n, k = b.shape(a)
        w = None
        reuse = params_by_rows.get(k)
        if reuse and not force_trainable and rng.random() < p_param_reuse:
            w = rng.choice(reuse)
        w_operand = w
        if w is None:
            m = rng.choice(DIMS)
            trainable = force_trainable or rng.random() >= p_frozen
            if rng.random() < p_transposed_weight:
                w = new_param([m, k], trainable)
                wt = b.value(f"{w}.t", VALUE, [k, m], stride=list(reversed(b.vmap[w].stride)), view_of=w)
                rg[wt] = trainable
                tn = b.node(f"{w}.t", "aten.t.default", [Ref(w)], [wt], FORWARD)
                recipes.append(("t", tn, [w], [wt], None))
                w_operand = wt
            else:
                w = new_param([k, m], trainable)
                params_by_rows.setdefault(k, []).append(w)
                w_operand = w
        m = b.shape(w_operand)[1]
        out = b.value(f"mm{len(b.nodes)}", VALUE, [n, m])
        rg[out] = rg[a] or rg[w_operand]
        nn = b.node(out, "aten.mm.default", [Ref(a), Ref(w_operand)], [out], FORWARD, flops=2 * n * k * m)
        recipes.append(("mm", nn, [a, w_operand], [out], None))
        return out

    def emit_unary(a: str):
        op = rng.choice(("relu", "gelu", "tanh"))
        out = b.value(f"{op}{len(b.nodes)}", VALUE, b.shape(a))
        rg[out] = rg[a]
        nn = b.node(out, f"aten.{op}.default", [Ref(a)], [out], FORWARD, flops=_numel(b.shape(a)))
        recipes.append((op, nn, [a], [out], None))
        return out

    def emit_binary(a: str):
        same = [c for c in pool[-16:] if b.shape(c) == b.shape(a)]
        op = rng.choice(("add", "mul"))
        if op == "mul":
            same = [c for c in same if c != a]
        if not same:
            return emit_unary(a)
        c = rng.choice(same)
        out = b.value(f"{op}{len(b.nodes)}", VALUE, b.shape(a))
        rg[out] = rg[a] or rg[c]
        nn = b.node(out, f"aten.{op}.Tensor", [Ref(a), Ref(c)], [out], FORWARD, flops=_numel(b.shape(a)))
        recipes.append((op, nn, [a, c], [out], None))
        return out

    def emit_view(a: str):
        n, k = b.shape(a)
        if rng.random() < 0.5 or not b.contiguous(a) or k % 2:
            out = b.value(f"t{len(b.nodes)}", VALUE, [k, n], stride=list(reversed(b.vmap[a].stride)),
                          view_of=a)
            rg[out] = rg[a]
            nn = b.node(out, "aten.t.default", [Ref(a)], [out], FORWARD)
            recipes.append(("t", nn, [a], [out], None))
            return out
        shape = [n * 2, k // 2]
        out = b.value(f"view{len(b.nodes)}", VALUE, shape, view_of=a)
        rg[out] = rg[a]
        nn = b.node(out, "aten.view.default", [Ref(a), Seq(list(shape))], [out], FORWARD)
        recipes.append(("view", nn, [a], [out], None))
        return out

    def emit_dropout(a: str):
        base = f"drop{len(b.nodes)}"
        out = b.value(f"{base}:0", VALUE, b.shape(a))
        mask = b.value(f"{base}:1", VALUE, b.shape(a), dtype="bool")
        rg[out] = rg[a]
        rg[mask] = False
        nn = b.node(base, "aten.native_dropout.default", [Ref(a), 0.1, True], [out, mask], FORWARD,
                    random=True, flops=_numel(b.shape(a)))
        recipes.append(("dropout", nn, [a], [out, mask], None))
        return out

    def emit_inplace_dropout(a: str):
        """Dropout as make_fx traces it: empty_like, bernoulli_ (random, in place), div_ (in place), mul."""
        base = f"idrop{len(b.nodes)}"
        shape = b.shape(a)
        e = b.value(f"{base}.empty_like", VALUE, shape)
        b.node(e, "aten.empty_like.default", [Ref(a)], [e], FORWARD)
        bern = b.value(f"{base}.bernoulli_", VALUE, shape, view_of=e)
        b.node(bern, "aten.bernoulli_.float", [Ref(e), 0.9], [bern], FORWARD, random=True, mutates=[e],
               flops=_numel(shape))
        d = b.value(f"{base}.div_", VALUE, shape, view_of=e)
        b.node(d, "aten.div_.Scalar", [Ref(bern), 0.9], [d], FORWARD, mutates=[bern], flops=_numel(shape))
        out = b.value(f"{base}.mul", VALUE, shape)
        rg[e] = rg[bern] = rg[d] = False
        rg[out] = rg[a]
        nn = b.node(out, "aten.mul.Tensor", [Ref(a), Ref(d)], [out], FORWARD, flops=_numel(shape))
        recipes.append(("inplace_dropout", nn, [a], [out], d))
        return out

    def emit_layernorm(a: str):
        n, k = b.shape(a)
        w = new_param([k], True, prefix="ln_w")
        bias = new_param([k], True, prefix="ln_b")
        base = f"ln{len(b.nodes)}"
        out = b.value(f"{base}:0", VALUE, [n, k])
        mean = b.value(f"{base}:1", VALUE, [n, 1])
        rstd = b.value(f"{base}:2", VALUE, [n, 1])
        rg[out] = True
        rg[mean] = rg[rstd] = False
        nn = b.node(base, "aten.native_layer_norm.default", [Ref(a), Seq([k]), Ref(w), Ref(bias), 1e-5],
                    [out, mean, rstd], FORWARD, flops=5 * n * k)
        recipes.append(("layernorm", nn, [a, w, bias], [out, mean, rstd], k))
        return out

    def emit_buffer_update(a: str):
        """out = a + buf (buf read before its update); buf += mean(a) in place."""
        n, k = b.shape(a)
        buf = b.value(f"running{len(b.nodes)}", BUFFER, [k], source=f"norm.running{len(b.nodes)}")
        rg[buf] = False
        out = b.value(f"shift{len(b.nodes)}", VALUE, [n, k])
        rg[out] = rg[a]
        nn = b.node(out, "aten.add.Tensor", [Ref(a), Ref(buf)], [out], FORWARD, flops=n * k)
        recipes.append(("add", nn, [a, buf], [out], None))
        stat = b.value(f"stat{len(b.nodes)}", VALUE, [k])
        rg[stat] = False
        b.node(stat, "aten.mean.dim", [Ref(a), Seq([0])], [stat], FORWARD, flops=n * k)
        upd = b.value(f"{buf}.updated", VALUE, [k], view_of=buf)
        rg[upd] = False
        b.node(upd, "aten.add_.Tensor", [Ref(buf), Ref(stat)], [upd], FORWARD, mutates=[buf], flops=k)
        return out

    # ------------------------------------------------------------ forward
    buffer_done = not with_buffer
    main_nodes = 0
    first = True
    while main_nodes < max(1, n_forward):
        before = len(b.nodes)
        a = pick()
        r = rng.random()
        if first:
            out = emit_mm(a, force_trainable=True)
            first = False
        elif not buffer_done and rng.random() < 0.1:
            out = emit_buffer_update(a)
            buffer_done = True
        elif r < p_dropout:
            out = emit_dropout(a) if rng.random() < 0.6 else emit_inplace_dropout(a)
        elif r < p_dropout + p_view:
            out = emit_view(a)
        elif r < p_dropout + p_view + p_layernorm:
            out = emit_layernorm(a)
        elif r < 0.65:
            out = emit_mm(a)
        elif r < 0.82:
            out = emit_unary(a)
        else:
            out = emit_binary(a)
        for n in b.nodes[before:]:
            for arg in n.args:
                if isinstance(arg, Ref):
                    consumed.add(arg.name)
        pool.append(out)
        main_nodes += len(b.nodes) - before
    if not buffer_done:
        a = pick()
        before = len(b.nodes)
        pool.append(emit_buffer_update(a))
        consumed.add(a)

    # ------------------------------------------------------------ loss
    leaves = [v for v in pool if v not in consumed and b.vmap[v].kind == VALUE]
    sums = []
    for leaf in leaves:
        s = b.value(f"sum.{leaf}", VALUE, [])
        rg[s] = rg[leaf]
        nn = b.node(s, "aten.sum.default", [Ref(leaf)], [s], FORWARD, flops=_numel(b.shape(leaf)))
        recipes.append(("sum", nn, [leaf], [s], None))
        sums.append(s)
    loss = sums[0]
    for i, s in enumerate(sums[1:]):
        last = i == len(sums) - 2
        out = b.value("loss" if last else f"loss.{i}", VALUE, [])
        rg[out] = rg[loss] or rg[s]
        nn = b.node(out, "aten.add.Tensor", [Ref(loss), Ref(s)], [out], FORWARD)
        recipes.append(("add", nn, [loss, s], [out], None))
        loss = out
    outputs = [Output(RESULT, "0", loss)]
    if extra_result:
        cands = [v for v in pool if b.vmap[v].kind == VALUE]
        if cands:
            outputs.append(Output(RESULT, "1", rng.choice(cands)))

    # ------------------------------------------------------------ backward
    tangent = b.value("d.loss", TANGENT, [])
    contrib: dict[str, list[str]] = {loss: [tangent]}

    def accumulate(v: str) -> str | None:
        gs = contrib.get(v)
        if not gs:
            return None
        g = gs[0]
        for other in gs[1:]:
            acc = b.value(f"d.{v}.acc", VALUE, b.shape(v))
            b.node(acc, "aten.add.Tensor", [Ref(g), Ref(other)], [acc], BACKWARD, flops=_numel(b.shape(v)))
            g = acc
        contrib[v] = [g]
        return g

    def give(v: str, g: str) -> None:
        if rg.get(v):
            contrib.setdefault(v, []).append(g)

    for kind, nname, ins, outs, extra in reversed(recipes):
        g = accumulate(outs[0])
        if g is None:
            continue
        if kind == "add":
            for v in ins:
                give(v, g)
        elif kind == "sum":
            leaf = ins[0]
            shape = b.shape(leaf)
            d = b.value(f"d.{leaf}", VALUE, shape, stride=[0] * len(shape), view_of=g)
            b.node(d, "aten.expand.default", [Ref(g), Seq(list(shape))], [d], BACKWARD)
            give(leaf, d)
        elif kind == "mm":
            a, w = ins
            douts, reads = [], [Ref(g)]
            if rg[w]:
                reads.append(Ref(a))
            if rg[a]:
                reads.append(Ref(w))
            da = b.value(f"d.{a}", VALUE, b.shape(a)) if rg[a] else ""
            dw = b.value(f"d.{w}", VALUE, b.shape(w)) if rg[w] else ""
            douts = [da, dw]
            while douts and not douts[-1]:
                douts.pop()
            if douts:
                n, k = b.shape(a)
                b.node(f"d.{nname}", "aten.mm_backward", reads, douts, BACKWARD,
                       flops=2 * n * k * b.shape(w)[1] * (2 if (da and dw) else 1))
                if da:
                    give(a, da)
                if dw:
                    give(w, dw)
        elif kind in ("relu", "gelu", "tanh"):
            a = ins[0]
            if rg[a]:
                saved = ins[0] if kind == "gelu" else outs[0]
                da = b.value(f"d.{a}", VALUE, b.shape(a))
                b.node(f"d.{nname}", f"aten.{kind}_backward.default", [Ref(g), Ref(saved)], [da], BACKWARD,
                       flops=_numel(b.shape(a)))
                give(a, da)
        elif kind == "mul":
            a, c = ins
            douts = [b.value(f"d.{v}", VALUE, b.shape(v)) if rg[v] else "" for v in (a, c)]
            if douts[-1] == "":
                douts.pop()
            b.node(f"d.{nname}", "aten.mul_backward", [Ref(g), Ref(a), Ref(c)], douts, BACKWARD,
                   flops=2 * _numel(b.shape(a)))
            for v, d in zip((a, c), douts):
                if d:
                    give(v, d)
        elif kind == "view":
            a = ins[0]
            if b.contiguous(g):
                d = b.value(f"d.{a}", VALUE, b.shape(a), view_of=g)
                b.node(f"d.{nname}", "aten.view.default", [Ref(g), Seq(list(b.shape(a)))], [d], BACKWARD)
            else:
                d = b.value(f"d.{a}", VALUE, b.shape(a))
                b.node(f"d.{nname}", "aten.reshape.default", [Ref(g), Seq(list(b.shape(a)))], [d], BACKWARD,
                       flops=_numel(b.shape(a)))
            give(a, d)
        elif kind == "t":
            a = ins[0]
            gv = b.vmap[g]
            d = b.value(f"d.{a}", VALUE, b.shape(a), stride=list(reversed(gv.stride)), view_of=g)
            b.node(f"d.{nname}", "aten.t.default", [Ref(g)], [d], BACKWARD)
            give(a, d)
        elif kind == "dropout":
            a = ins[0]
            da = b.value(f"d.{a}", VALUE, b.shape(a))
            b.node(f"d.{nname}", "aten.native_dropout_backward.default", [Ref(g), Ref(outs[1]), 1.0 / 0.9],
                   [da], BACKWARD, flops=_numel(b.shape(a)))
            give(a, da)
        elif kind == "inplace_dropout":
            a = ins[0]
            da = b.value(f"d.{a}", VALUE, b.shape(a))
            b.node(f"d.{nname}", "aten.mul.Tensor", [Ref(g), Ref(extra)], [da], BACKWARD,
                   flops=_numel(b.shape(a)))
            give(a, da)
        elif kind == "layernorm":
            a, w, bias = ins
            k = extra
            da = b.value(f"d.{a}", VALUE, b.shape(a)) if rg[a] else ""
            dw = b.value(f"d.{w}", VALUE, [k])
            db = b.value(f"d.{bias}", VALUE, [k])
            b.node(f"d.{nname}", "aten.native_layer_norm_backward.default",
                   [Ref(g), Ref(a), Seq([k]), Ref(outs[1]), Ref(outs[2]), Ref(w), Ref(bias),
                    Seq([bool(da), True, True])], [da, dw, db], BACKWARD, flops=8 * _numel(b.shape(a)))
            if da:
                give(a, da)
            give(w, dw)
            give(bias, db)
        else:  # pragma: no cover
            raise AssertionError(kind)

    for v in b.values:
        if v.kind == PARAM and v.requires_grad:
            g = accumulate(v.name)
            assert g is not None, f"no gradient reaches {v.name}"
            outputs.append(Output(GRAD, v.name, g))

    program = Program(header=Header(model="random", has_loss=True), values=b.values, nodes=b.nodes,
                      forward=[], backward=[], outputs=outputs)
    program.forward, program.backward = default_schedule(program)
    return program


def programs(min_forward: int = 2, max_forward: int = 30, **kwargs):
    """Hypothesis strategy of valid random programs."""
    from hypothesis import strategies as st

    @st.composite
    def _programs(draw):
        n = draw(st.integers(min_forward, max_forward))
        return random_program(draw, n_forward=n, **kwargs)

    return _programs()


# ------------------------------------------------------------------ helpers


def copy_program(program: Program) -> Program:
    return from_msgpack(to_msgpack(program))


def assign_lines(program: Program, start: int = 100) -> Program:
    """Give every instruction and output a distinct line number (in place),
    as if the program had been parsed from a file; returns the program."""
    line = start
    for ins in program.forward:
        ins.line = line
        line += 1
    line += 1  # the `backward` header
    for ins in program.backward:
        ins.line = line
        line += 1
    line += 1
    for o in program.outputs:
        o.line = line
        line += 1
    return program
