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

The ops are real aten ops, and every value's dtype, shape, strides, bytes and
storage owner are what the op gives it: the builder runs each op under
FakeTensorMode, as the tracer does, so the programs pass the verifier's type
check of the graph (`remat_ir.check.typecheck`).  They are never executed.

`programs()` is the hypothesis strategy wrapping it.  Both are meant to be
reused by the optimizer's property tests.
"""
from __future__ import annotations

import random as _random

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat_ir.ir import (
    BACKWARD, BUFFER, DTYPE_BYTES, FORWARD, GRAD, INPUT, PARAM, RESULT, TANGENT, VALUE, Header,
    Node, Output, Program, Ref, Seq, Value, contiguous_stride, from_msgpack, to_msgpack,
)
from remat_ir.ir.ops import fake_kernels
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


def _resolve(op: str):
    ns, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


class _Builder:
    """Declares graph inputs, and adds nodes whose outputs' facts come from
    running the op on fake tensors (the tracer's way)."""

    def __init__(self, rng: _random.Random):
        self.rng = rng
        self.values: list[Value] = []
        self.vmap: dict[str, Value] = {}
        self.nodes: list[Node] = []
        self.names: set[str] = set()
        self.node_names: set[str] = set()
        self.mode = FakeTensorMode()
        self.fake: dict[str, torch.Tensor] = {}  # value name -> its fake tensor
        self.owner_of: dict[int, str] = {}  # fake storage id -> owner value

    def unique(self, base: str, names: set[str]) -> str:
        name, i = base, 1
        while name in names:
            name = f"{base}_{i}"
            i += 1
        names.add(name)
        return name

    def _declare(self, base: str, kind: str, t: torch.Tensor, **kw) -> str:
        name = self.unique(base, self.names)
        st = t.untyped_storage()
        owner = self.owner_of.get(st._cdata)
        if owner is None:
            self.owner_of[st._cdata] = name
            storage, nbytes = name, int(st.nbytes())
        else:
            storage, nbytes = owner, 0
        v = Value(name=name, kind=kind, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                  stride=list(t.stride()), storage=storage, nbytes=nbytes, **kw)
        self.values.append(v)
        self.vmap[name] = v
        self.fake[name] = t
        return name

    def value(self, base: str, kind: str, shape, *, dtype="float32", requires_grad=False, source="") -> str:
        """A graph input (input, param, buffer, tangent): a contiguous tensor."""
        with self.mode:
            t = torch.empty(list(shape), dtype=getattr(torch, dtype))
        return self._declare(base, kind, t, source=source, requires_grad=requires_grad)

    def node(self, op: str, args, out_bases, phase, *, name: str | None = None, random=False, mutates=(),
             flops=0.0, module="") -> list[str]:
        """Run `op` on `args` (Refs name values) and declare its outputs:
        `out_bases[k]` names output k (None: not used, `_`).  The node is
        named `name`, or after its first output.  Returns the output names
        ("" for None)."""
        def conv(a):
            if isinstance(a, Ref):
                return self.fake[a.name]
            if isinstance(a, Seq):
                return [conv(x) for x in a.items]
            return a

        with self.mode, fake_kernels("cpu"):  # the tracer's fake kernels, with eager's strides
            got = _resolve(op)(*[conv(a) for a in args])
        got = list(got) if isinstance(got, (tuple, list)) else [got]
        outs = [self._declare(b, VALUE, t) if b is not None else "" for b, t in zip(out_bases, got)]
        while outs and not outs[-1]:
            outs.pop()
        name = self.unique(name if name is not None else outs[0], self.node_names)
        self.nodes.append(Node(name=name, op=op, args=list(args), kwargs={}, outputs=outs, phase=phase,
                               module=module, random=random, mutates=list(mutates), flops=float(flops)))
        return outs

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

    def last() -> str:
        return b.nodes[-1].name

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
                (wt,) = b.node("aten.t.default", [Ref(w)], [f"{w}.t"], FORWARD)
                rg[wt] = trainable
                recipes.append(("t", last(), [w], [wt], None))
                w_operand = wt
            else:
                w = new_param([k, m], trainable)
                params_by_rows.setdefault(k, []).append(w)
                w_operand = w
        m = b.shape(w_operand)[1]
        (out,) = b.node("aten.mm.default", [Ref(a), Ref(w_operand)], [f"mm{len(b.nodes)}"], FORWARD,
                        flops=2 * n * k * m)
        rg[out] = rg[a] or rg[w_operand]
        recipes.append(("mm", last(), [a, w_operand], [out], None))
        return out

    def emit_unary(a: str):
        op = rng.choice(("relu", "gelu", "tanh"))
        (out,) = b.node(f"aten.{op}.default", [Ref(a)], [f"{op}{len(b.nodes)}"], FORWARD,
                        flops=_numel(b.shape(a)))
        rg[out] = rg[a]
        recipes.append((op, last(), [a], [out], None))
        return out

    def emit_binary(a: str):
        same = [c for c in pool[-16:] if b.shape(c) == b.shape(a)]
        op = rng.choice(("add", "mul"))
        if op == "mul":
            same = [c for c in same if c != a]
        if not same:
            return emit_unary(a)
        c = rng.choice(same)
        (out,) = b.node(f"aten.{op}.Tensor", [Ref(a), Ref(c)], [f"{op}{len(b.nodes)}"], FORWARD,
                        flops=_numel(b.shape(a)))
        rg[out] = rg[a] or rg[c]
        recipes.append((op, last(), [a, c], [out], None))
        return out

    def emit_view(a: str):
        n, k = b.shape(a)
        if rng.random() < 0.5 or not b.contiguous(a) or k % 2:
            (out,) = b.node("aten.t.default", [Ref(a)], [f"t{len(b.nodes)}"], FORWARD)
            rg[out] = rg[a]
            recipes.append(("t", last(), [a], [out], None))
            return out
        shape = [n * 2, k // 2]
        (out,) = b.node("aten.view.default", [Ref(a), Seq(list(shape))], [f"view{len(b.nodes)}"], FORWARD)
        rg[out] = rg[a]
        recipes.append(("view", last(), [a], [out], None))
        return out

    def emit_dropout(a: str):
        base = f"drop{len(b.nodes)}"
        out, mask = b.node("aten.native_dropout.default", [Ref(a), 0.1, True], [f"{base}:0", f"{base}:1"],
                           FORWARD, name=base, random=True, flops=_numel(b.shape(a)))
        rg[out] = rg[a]
        rg[mask] = False
        recipes.append(("dropout", last(), [a], [out, mask], None))
        return out

    def emit_inplace_dropout(a: str):
        """Dropout as make_fx traces it: empty_like, bernoulli_ (random, in place), div_ (in place), mul."""
        base = f"idrop{len(b.nodes)}"
        shape = b.shape(a)
        (e,) = b.node("aten.empty_like.default", [Ref(a)], [f"{base}.empty_like"], FORWARD)
        (bern,) = b.node("aten.bernoulli_.float", [Ref(e), 0.9], [f"{base}.bernoulli_"], FORWARD, random=True,
                         mutates=[e], flops=_numel(shape))
        (d,) = b.node("aten.div_.Scalar", [Ref(bern), 0.9], [f"{base}.div_"], FORWARD, mutates=[bern],
                      flops=_numel(shape))
        (out,) = b.node("aten.mul.Tensor", [Ref(a), Ref(d)], [f"{base}.mul"], FORWARD, flops=_numel(shape))
        rg[e] = rg[bern] = rg[d] = False
        rg[out] = rg[a]
        recipes.append(("inplace_dropout", last(), [a], [out], d))
        return out

    def emit_layernorm(a: str):
        n, k = b.shape(a)
        w = new_param([k], True, prefix="ln_w")
        bias = new_param([k], True, prefix="ln_b")
        base = f"ln{len(b.nodes)}"
        out, mean, rstd = b.node("aten.native_layer_norm.default",
                                 [Ref(a), Seq([k]), Ref(w), Ref(bias), 1e-5],
                                 [f"{base}:0", f"{base}:1", f"{base}:2"], FORWARD, name=base, flops=5 * n * k)
        rg[out] = True
        rg[mean] = rg[rstd] = False
        recipes.append(("layernorm", last(), [a, w, bias], [out, mean, rstd], k))
        return out

    def emit_buffer_update(a: str):
        """out = a + buf (buf read before its update); buf += mean(a) in place."""
        n, k = b.shape(a)
        buf = b.value(f"running{len(b.nodes)}", BUFFER, [k], source=f"norm.running{len(b.nodes)}")
        rg[buf] = False
        (out,) = b.node("aten.add.Tensor", [Ref(a), Ref(buf)], [f"shift{len(b.nodes)}"], FORWARD, flops=n * k)
        rg[out] = rg[a]
        recipes.append(("add", last(), [a, buf], [out], None))
        (stat,) = b.node("aten.mean.dim", [Ref(a), Seq([0])], [f"stat{len(b.nodes)}"], FORWARD, flops=n * k)
        rg[stat] = False
        (upd,) = b.node("aten.add_.Tensor", [Ref(buf), Ref(stat)], [f"{buf}.updated"], FORWARD, mutates=[buf],
                        flops=k)
        rg[upd] = False
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
        (s,) = b.node("aten.sum.default", [Ref(leaf)], [f"sum.{leaf}"], FORWARD, flops=_numel(b.shape(leaf)))
        rg[s] = rg[leaf]
        recipes.append(("sum", last(), [leaf], [s], None))
        sums.append(s)
    loss = sums[0]
    for i, s in enumerate(sums[1:]):
        is_last = i == len(sums) - 2
        (out,) = b.node("aten.add.Tensor", [Ref(loss), Ref(s)], ["loss" if is_last else f"loss.{i}"], FORWARD)
        rg[out] = rg[loss] or rg[s]
        recipes.append(("add", last(), [loss, s], [out], None))
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
            (g,) = b.node("aten.add.Tensor", [Ref(g), Ref(other)], [f"d.{v}.acc"], BACKWARD,
                          flops=_numel(b.shape(v)))
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
            (d,) = b.node("aten.expand.default", [Ref(g), Seq(list(b.shape(leaf)))], [f"d.{leaf}"], BACKWARD)
            give(leaf, d)
        elif kind == "mm":
            a, w = ins
            n, k = b.shape(a)
            m = b.shape(w)[1]
            if rg[a]:  # da = g @ w.T
                (wt,) = b.node("aten.t.default", [Ref(w)], [f"d.{nname}.{w}.t"], BACKWARD)
                (da,) = b.node("aten.mm.default", [Ref(g), Ref(wt)], [f"d.{a}"], BACKWARD, name=f"d.{nname}",
                               flops=2 * n * k * m)
                give(a, da)
            if rg[w]:  # dw = a.T @ g
                (at,) = b.node("aten.t.default", [Ref(a)], [f"d.{nname}.{a}.t"], BACKWARD)
                (dw,) = b.node("aten.mm.default", [Ref(at), Ref(g)], [f"d.{w}"], BACKWARD, name=f"d.{nname}",
                               flops=2 * n * k * m)
                give(w, dw)
        elif kind in ("relu", "gelu", "tanh"):
            a = ins[0]
            if rg[a]:
                if kind == "relu":
                    op, args = "aten.threshold_backward.default", [Ref(g), Ref(outs[0]), 0]
                elif kind == "gelu":
                    op, args = "aten.gelu_backward.default", [Ref(g), Ref(a)]
                else:
                    op, args = "aten.tanh_backward.default", [Ref(g), Ref(outs[0])]
                (da,) = b.node(op, args, [f"d.{a}"], BACKWARD, name=f"d.{nname}", flops=_numel(b.shape(a)))
                give(a, da)
        elif kind == "mul":
            a, c = ins
            for v, other in ((a, c), (c, a)):
                if rg[v]:
                    (d,) = b.node("aten.mul.Tensor", [Ref(g), Ref(other)], [f"d.{v}"], BACKWARD,
                                  name=f"d.{nname}", flops=_numel(b.shape(a)))
                    give(v, d)
        elif kind == "view":
            a = ins[0]
            op = "aten.view.default" if b.contiguous(g) else "aten.reshape.default"
            (d,) = b.node(op, [Ref(g), Seq(list(b.shape(a)))], [f"d.{a}"], BACKWARD, name=f"d.{nname}",
                          flops=0 if b.contiguous(g) else _numel(b.shape(a)))
            give(a, d)
        elif kind == "t":
            a = ins[0]
            (d,) = b.node("aten.t.default", [Ref(g)], [f"d.{a}"], BACKWARD, name=f"d.{nname}")
            give(a, d)
        elif kind == "dropout":
            a = ins[0]
            (da,) = b.node("aten.native_dropout_backward.default", [Ref(g), Ref(outs[1]), 1.0 / 0.9],
                           [f"d.{a}"], BACKWARD, name=f"d.{nname}", flops=_numel(b.shape(a)))
            give(a, da)
        elif kind == "inplace_dropout":
            a = ins[0]
            (da,) = b.node("aten.mul.Tensor", [Ref(g), Ref(extra)], [f"d.{a}"], BACKWARD, name=f"d.{nname}",
                           flops=_numel(b.shape(a)))
            give(a, da)
        elif kind == "layernorm":
            a, w, bias = ins
            da, dw, db = b.node("aten.native_layer_norm_backward.default",
                                [Ref(g), Ref(a), Seq([extra]), Ref(outs[1]), Ref(outs[2]), Ref(w), Ref(bias),
                                 Seq([bool(rg[a]), True, True])],
                                [f"d.{a}" if rg[a] else None, f"d.{w}", f"d.{bias}"], BACKWARD,
                                name=f"d.{nname}", flops=8 * _numel(b.shape(a)))
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

    # A loss is the step's one result (the tracer's rule, which the verifier
    # checks): a program with an extra result is a model without one.
    has_loss = sum(1 for o in outputs if o.kind == RESULT) == 1
    program = Program(header=Header(model="random", has_loss=has_loss), values=b.values, nodes=b.nodes,
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
