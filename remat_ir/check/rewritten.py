"""Checking a plan's graph rewrites, independently of the code that made them.

A plan's header lists the rewrites applied to the traced step
(`Header.rewrites`).  The runtime proves the graph is this model's (it
traces the model again and replays the list); this module proves, from the
plan alone, that each rewritten region computes what the region it stands
for computed:

* ``lm_head_nll:R``: the chunked loss (remat-ir's own ops, eager's bits by
  their definition, `remat_ir/ir/ops.py`): exactly one `remat.lm_head_nll`,
  in forward, taking R rows a chunk (R at least 16) and reducing to a
  scalar, from 2-D rows (the head's input and its weight's transpose and
  bias, or the logits alone) and one target per row; and exactly one
  `remat.lm_head_nll_backward`, in backward, reading the same operands, the
  forward's total weight and R, over the last dim in the rows' dtype, from
  a tangent or a gradient made in backward.  What each op returns beyond
  the loss, its total weight and the logits' gradient is its own working
  memory, which nothing reads.
* ``lm_head_nll:R:late``: the same, and a second `remat.lm_head_nll_backward`
  with the same operands (the logits' gradient made again); the head's
  weight gradient is one `mm` of the head's input with it (none with the
  loss's own), added once to a weight-shaped tensor of its own (the tied
  weight's other gradient) into the weight's gradient output.
* ``chunked_loss:K``: the earlier chunked loss, refused by name: compile
  the plan again.
* ``chunked_attention:K``: each forward `cat` of K chunk matmuls `d_i @ v_i`
  is an attention in K chunks: chunk i reads rows [a_i, b_i) of one q, one
  k.T and one v (disjoint, covering every row once, in order); its scores
  are `q_i @ kt_i` times one constant, masked with one mask where there is
  one, softmaxed over the last dim, and multiplied by `dropout_scale` of
  its rows of one random draw over every row, where there is dropout.  In
  backward each chunk has exactly autograd's gradients of those ops (on its
  own probabilities and scale, or the same ops on the same operands made
  again, and on rows of one output gradient), and the
  gradients of q, k.T and v each concatenate the chunks' in row order, once.
* ``batchnorm_split``: every `batch_norm_update_stats` (the running-stat
  update) has a `native_batch_norm` on the same input, in training, with
  the same momentum, that reads no running statistics.

    check_rewrites(program) -> [(loc, message)]      loc: (section, index, line)
"""
from __future__ import annotations

from remat_ir.ir.header import retired_rewrite
from remat_ir.ir.ops import MIN_LOSS_ROWS
from remat_ir.ir.types import BACKWARD, FORWARD, GRAD, TANGENT, DType, Program, Ref, Seq, node_inputs

__all__ = ["check_rewrites"]

_KNOWN = ("batchnorm_split", "lm_head_nll", "chunked_attention")
_LOSS_OP = "remat.lm_head_nll.default"
_LOSS_BWD = "remat.lm_head_nll_backward.default"


def check_rewrites(program: Program) -> list[tuple[tuple, str]]:
    """Every way in which `program`'s rewritten regions differ from what
    its header's rewrites promise; [] when none."""
    errors: list[tuple[tuple, str]] = []
    line = program.header.lines.get("rewrites", 0)
    for spec in program.header.rewrites:
        name, _, arg = spec.partition(":")
        k, _, late = arg.partition(":")
        region = None
        if name == "lm_head_nll" and k.isdigit() and late in ("", "late"):
            region = _Loss(program, int(k), bool(late))
        elif name == "chunked_attention" and arg.isdigit() and int(arg) >= 2:
            region = _Attention(program, int(arg))
        if region is not None:  # an error not at a node is the header's
            errors += [(("header", -1, line), f"rewrite {spec}: {m}") if loc is None else (loc, m)
                       for loc, m in region.check()]
        elif name == "batchnorm_split" and not arg:
            errors += _batchnorm(program)
        elif retired_rewrite(spec):
            errors.append((("header", -1, line), retired_rewrite(spec)))
        else:
            errors.append((("header", -1, line), f"unknown rewrite {spec!r}: remat-ir knows "
                                                 f"{', '.join(_KNOWN)} (lm_head_nll:R or lm_head_nll:R:late, R rows a "
                                                 "chunk; chunked_attention:K, K >= 2 chunks)"))
    return errors


def _loc(n) -> tuple:
    return ("nodes", -1, n.line)


class _Region:
    """What every rewritten region's check reads of the plan, and its errors."""

    def __init__(self, program: Program, k: int):
        self.p, self.k = program, k
        self.values = program.value_map()
        self.producer = program.producer_map()
        self.readers: dict[str, list] = {}
        for n in program.nodes:
            for r in node_inputs(n):
                self.readers.setdefault(r, []).append(n)
        self.errors: list = []

    def fail(self, message: str, node=None):
        self.errors.append((None if node is None else _loc(node), message))

    def made_by(self, value, op: str, nargs: int | None = None):
        """The node making `value` when it calls `op` (with `nargs`
        positional arguments and no keyword ones), else None."""
        if not isinstance(value, Ref):
            return None
        n = self.producer.get(value.name)
        if n is None or n.op != op or n.kwargs or (nargs is not None and len(n.args) != nargs):
            return None
        return n

    def rows(self, value):
        """(source, a, b) when `value` is rows [a, b) of `source`."""
        n = self.made_by(value, "aten.slice.Tensor", 4)
        if n is None or n.args[1] != 0 or not isinstance(n.args[0], Ref):
            return None
        return n.args[0].name, n.args[2], n.args[3]


class _Loss(_Region):
    """``lm_head_nll:R``: see the module's docstring."""

    def __init__(self, program: Program, rows: int, late: bool = False):
        super().__init__(program, rows)
        self.late = late

    def check(self) -> list:
        rows = self.k
        if rows < MIN_LOSS_ROWS:
            self.fail(f"a chunk takes at least {MIN_LOSS_ROWS} rows (fewer rows of a matmul are not checked to "
                      f"give eager's bits), not {rows}")
            return self.errors
        fwd = [n for n in self.p.nodes if n.op == _LOSS_OP]
        if len(fwd) != 1 or fwd[0].phase != FORWARD:
            self.fail(f"the graph has {len(fwd)} remat.lm_head_nll nodes, not one in forward")
            return self.errors
        (f,) = fwd
        if f.kwargs or len(f.args) != 7:
            self.fail(f"{f.name}: remat.lm_head_nll takes 7 arguments", f)
            return self.errors
        x, wt, bias, target, reduction, ignore_index, r = f.args
        if r != rows or reduction not in (1, 2) or not isinstance(ignore_index, int):
            self.fail(f"{f.name}: the chunked loss must take {rows} rows a chunk and reduce to a scalar "
                      "(mean or sum)", f)
            return self.errors
        if not isinstance(x, Ref) or not isinstance(target, Ref) or (wt is None and bias is not None):
            self.fail(f"{f.name}: the chunked loss must read one input, its weight's transpose and bias "
                      "(or the logits alone) and the targets", f)
            return self.errors
        xv = self.values[x.name]
        if len(xv.shape) != 2 or self.values[target.name].shape != xv.shape[:1]:
            self.fail(f"{f.name}: the chunked loss must read 2-D rows and one target per row", f)
            return self.errors
        self.unread(f, f.outputs[2:])
        bwd = [n for n in self.p.nodes if n.op == _LOSS_BWD]
        want = 2 if self.late else 1
        if len(bwd) != want:
            self.fail(f"the graph has {len(bwd)} remat.lm_head_nll_backward nodes, not {want}"
                      + (" (the loss's backward, and the logits' gradient made again for the tied weight's)"
                         if self.late else ""))
            return self.errors
        same = list(f.args[:6]) + [Ref(f.outputs[1])]
        for b in bwd:
            if (b.phase != BACKWARD or b.kwargs or len(b.args) != 11 or b.args[1:8] != same or b.args[10] != rows
                    or b.args[8] not in (1, -1) or b.args[9] != DType(xv.dtype)):
                self.fail(f"{b.name}: the loss's backward must read what its forward {f.name} read, its total "
                          f"weight, {rows} rows a chunk, over the last dim in {xv.dtype}", b)
                return self.errors
            g = b.args[0]
            gv = self.values.get(g.name) if isinstance(g, Ref) else None
            if gv is None or not (gv.kind == TANGENT or (g.name in self.producer
                                                        and self.producer[g.name].phase == BACKWARD)):
                self.fail(f"{b.name}: the loss's gradient must be a tangent or made in backward", b)
                return self.errors
            self.unread(b, b.outputs[1:])
        if self.late and not self.errors:
            if bwd[0].args != bwd[1].args:
                self.fail(f"{bwd[1].name}: the logits' gradient made again must be made by the same op on the "
                          f"same operands as {bwd[0].name}", bwd[1])
            elif wt is None:
                self.fail(f"{f.name}: late, the chunked loss must start from the head's input and weight", f)
            else:
                self.check_late(bwd, x.name, wt.name)
        return self.errors

    def unread(self, n, outputs) -> None:
        for o in outputs:
            if o and self.readers.get(o):
                self.fail(f"{n.name}: {o} is the op's own working memory; nothing may read it", n)

    def views_of(self, name: str) -> set[str]:
        """The values whose storage is `name`'s."""
        s = self.values[name].storage
        return {v.name for v in self.p.values if v.storage == s}

    def check_late(self, bwd, x: str, wt: str) -> None:
        """The head's weight gradient is made only from the logits' gradient
        made again (`bwd[1]`): one `mm` of it with the head's input, summed
        with a weight-shaped tensor of its own into the weight's gradient."""
        weight = self.values[wt].storage
        heads = {}
        for k, b in enumerate(bwd):
            g = self.views_of(b.outputs[0])
            heads[k] = [n for n in self.p.nodes if n.phase == BACKWARD and n.op == "aten.mm.default"
                        and len(n.args) == 2 and Ref(x) in n.args
                        and any(isinstance(a, Ref) and a.name in g for a in n.args)]
        if heads[0] or len(heads[1]) != 1:
            self.fail(f"late: the head's weight gradient must be one matmul of the head's input with the logits' "
                      f"gradient made again ({bwd[1].name}), and none with the loss's own")
            return
        mm = heads[1][0]
        made = self.views_of(mm.outputs[0])
        sums = [n for n in self.p.nodes if n.phase == BACKWARD and n.op in ("aten.add_.Tensor", "aten.add.Tensor")
                and not n.kwargs and len(n.args) == 2 and sum(isinstance(a, Ref) and a.name in made
                                                              for a in n.args) == 1]
        if len(sums) != 1:
            self.fail(f"{mm.name}: late, the head's weight gradient must be added once to the weight's other "
                      "gradient", mm)
            return
        add = sums[0]
        other = next(a.name for a in add.args if a.name not in made)
        if not self.tied_base(other, weight, add):
            return
        if not any(o.kind == GRAD and o.key == weight and o.value == add.outputs[0] for o in self.p.outputs):
            self.fail(f"{add.outputs[0]}: the late weight gradient's sum must be the gradient output of {weight}",
                      add)

    def tied_base(self, name: str, weight: str, n) -> bool:
        """Whether `name`, which the late weight gradient is added to, is a
        weight-shaped tensor of its own (the tied weight's other gradient)."""
        v, w = self.values.get(name), self.values[weight]
        if v is None or v.storage != v.name or v.shape != w.shape or v.dtype != w.dtype:
            self.fail(f"{n.name}: the late weight gradient must be added to a tensor of its own shaped "
                      f"like {weight}", n)
            return False
        return True


def _batchnorm(program: Program) -> list:
    errors = []
    nodes = program.nodes
    for n in nodes:
        if n.op != "aten.batch_norm_update_stats.default":
            continue
        x, rm, rv, momentum = n.args[:4]
        pure = [m for m in nodes if m.op == "aten.native_batch_norm.default" and m.args[0] == x
                and m.args[3] is None and m.args[4] is None and m.args[5] is True and m.args[6] == momentum
                and not m.mutates]
        if len(pure) != 1:
            errors.append((_loc(n), f"rewrite batchnorm_split: {n.name} updates the running statistics, but "
                                    f"there is not exactly one native_batch_norm of the same input in training "
                                    f"with momentum {momentum} reading no running statistics"))
        if set(n.mutates) != {r.name for r in (rm, rv) if isinstance(r, Ref)}:
            errors.append((_loc(n), f"rewrite batchnorm_split: {n.name} must update exactly its running "
                                    "statistics"))
    return errors


class _Attention(_Region):
    """``chunked_attention:K``: see the module's docstring."""

    def transposed(self, value):
        """The value `value` is the (1, 2) transpose of, else None."""
        n = self.made_by(value, "aten.transpose.int", 3)
        return n.args[0] if n is not None and n.args[1:] == [1, 2] else None

    def same(self, a, b) -> bool:
        """Whether `b` is the value `a`, or is made again from the same
        operands by the same ops (none random: a second draw differs)."""
        if a == b:
            return True
        if not isinstance(a, Ref) or not isinstance(b, Ref):
            return False
        pa, pb = self.producer.get(a.name), self.producer.get(b.name)
        if (pa is None or pb is None or pa.random or pb.random or pa.mutates or pb.mutates or pa.op != pb.op
                or pa.kwargs != pb.kwargs or len(pa.args) != len(pb.args)
                or pa.outputs.index(a.name) != pb.outputs.index(b.name)):
            return False
        return all(self.same(x, y) if isinstance(x, Ref) else x == y for x, y in zip(pa.args, pb.args))

    def reader(self, value: str, op: str, phase: str, where) -> list:
        return [n for n in self.readers.get(value, []) if n.op == op and n.phase == phase and where(n)]

    def check(self) -> list:
        groups = []
        for n in self.p.nodes:
            if n.op != "aten.cat.default" or n.phase != FORWARD or not isinstance(n.args[0], Seq):
                continue
            parts = [self.made_by(r, "aten.bmm.default", 2) for r in n.args[0].items]
            if parts and all(p is not None and self.rows(p.args[1]) for p in parts):
                groups.append((n, parts))
        if not groups:
            return [(None, "no chunked attention (a forward cat of chunk matmuls with rows of one value)")]
        for cat, parts in groups:
            if len(parts) != self.k or (len(cat.args) > 1 and cat.args[1] != 0):
                self.fail(f"{cat.name} concatenates {len(parts)} attention chunks on dim 0, not {self.k}", cat)
                continue
            chunks = [self.forward_chunk(p) for p in parts]
            if any(c is None for c in chunks):
                continue
            first = chunks[0]
            for c in chunks[1:]:
                for key in ("q", "kt", "v", "scale", "mask", "fill", "p", "keep", "dtype"):
                    if c[key] != first[key]:
                        self.fail(f"{c['y'].name} reads another {key} than {first['y'].name}", c["y"])
            edge, total = 0, self.values[first["v"]].shape[0]
            for c in chunks:
                if c["a"] != edge or c["b"] <= c["a"]:
                    self.fail(f"{c['y'].name} covers rows [{c['a']}, {c['b']}); the chunks must cover rows "
                              f"0..{total} each once, in order, and the next starts at {edge}", c["y"])
                    break
                edge = c["b"]
            else:
                if edge != total:
                    self.fail(f"{cat.name}: the chunks cover rows 0..{edge} of {total}", cat)
            if first["keep"] is not None:
                keep = self.producer[first["keep"]]
                if not keep.random or self.values[first["keep"]].shape[0] * self.values[first["keep"]].shape[1] \
                        != total:
                    self.fail(f"{keep.name}: the dropout must be one random draw over every row", keep)
            if not self.errors:
                self.check_backward(chunks)
        return self.errors

    def forward_chunk(self, y):
        """The chunk whose output matmul is `y`, as a dict, or None (and an error)."""
        def bad(what: str) -> None:
            self.fail(f"{y.name}: {what}", y)
        v = self.rows(y.args[1])
        d = y.args[0]
        c = {"y": y, "v": v[0], "a": v[1], "b": v[2], "keep": None, "p": None, "sc": None, "d": d.name}
        p = d
        mul = self.made_by(d, "aten.mul.Tensor", 2)
        if mul is not None:
            sc = self.made_by(mul.args[1], "remat.dropout_scale.default", 3)
            kr = self.rows(sc.args[0]) if sc is not None else None
            view = self.made_by(Ref(kr[0]), "aten.view.default", 2) if kr else None
            keep = self.made_by(view.args[0], "remat.dropout_keep.default", 2) if view else None
            if keep is None or (kr[1], kr[2]) != (c["a"], c["b"]) or sc.args[1] != keep.args[1]:
                return bad("the dropped probabilities must be the chunk's probabilities times dropout_scale of "
                           f"the chunk's rows [{c['a']}, {c['b']}) of one dropout draw")
            c.update(keep=keep.outputs[0], p=keep.args[1], sc=sc.outputs[0])
            p = mul.args[0]
        sm = self.made_by(p, "aten._softmax.default", 3)
        if sm is None or sm.args[1] != -1 or sm.args[2] is not False:
            return bad("the probabilities must be a softmax over the last dim")
        c.update(prob=sm.outputs[0], dtype=self.values[sm.outputs[0]].dtype)
        x = sm.args[0]
        fill = self.made_by(x, "aten.masked_fill.Scalar", 3)
        c.update(mask=None, fill=None)
        if fill is not None:
            if not isinstance(fill.args[1], Ref):
                return bad("the mask must be a tensor")
            c.update(mask=fill.args[1].name, fill=fill.args[2])
            x = fill.args[0]
        m = self.made_by(x, "aten.mul.Tensor", 2)
        s = self.made_by(m.args[0], "aten.bmm.default", 2) if m is not None else None
        if s is None or not isinstance(m.args[1], float):
            return bad("the scores must be a matmul scaled by a constant")
        q, kt = self.rows(s.args[0]), self.rows(s.args[1])
        if q is None or kt is None or (q[1], q[2]) != (c["a"], c["b"]) or (kt[1], kt[2]) != (c["a"], c["b"]):
            return bad(f"the scores must multiply rows [{c['a']}, {c['b']}) of q and of k.T, the rows of v it reads")
        c.update(q=q[0], kt=kt[0], scale=m.args[1], qi=s.args[0], kti=s.args[1], vi=y.args[1])
        return c

    def check_backward(self, chunks) -> None:
        B = BACKWARD
        outs = {"q": [], "kt": [], "v": []}
        dys = set()
        for c in chunks:
            y = c["y"]
            dvs = [n for n in self.p.nodes if n.op == "aten.bmm.default" and n.phase == B and len(n.args) == 2
                   and self.same(self.transposed(n.args[0]), Ref(c["d"]))]
            if len(dvs) != 1 or self.rows(dvs[0].args[1]) is None:
                self.fail(f"{y.name}: one gradient of v (the dropped probabilities' transpose times rows of the "
                          "output's gradient) per chunk", y)
                return
            dy = self.rows(dvs[0].args[1])
            dys.add(dy[0])
            if (dy[1], dy[2]) != (c["a"], c["b"]):
                self.fail(f"{dvs[0].name}: the output's gradient must be read at the chunk's rows", dvs[0])
                return
            das = [n for n in self.p.nodes if n.op == "aten.bmm.default" and n.phase == B and len(n.args) == 2
                   and self.rows(n.args[0]) == dy and self.transposed(n.args[1]) == c["vi"]]
            if len(das) != 1:
                self.fail(f"{y.name}: one gradient of the dropped probabilities (the output's gradient times the "
                          "chunk's v transposed) per chunk", y)
                return
            g = das[0].outputs[0]
            if c["sc"] is not None:
                ms = self.reader(g, "aten.mul.Tensor", B, lambda n: n.args[0] == Ref(g)
                                 and self.same(n.args[1], Ref(c["sc"])))
                if len(ms) != 1:
                    self.fail(f"{das[0].name}: its dropout backward must multiply by the chunk's dropout_scale",
                              das[0])
                    return
                g = ms[0].outputs[0]
            sb = self.reader(g, "aten._softmax_backward_data.default", B,
                             lambda n: n.args[0] == Ref(g) and self.same(n.args[1], Ref(c["prob"]))
                             and n.args[2:] == [-1, DType(c["dtype"])])
            if len(sb) != 1:
                self.fail(f"{y.name}: the chunk's softmax backward must read its own probabilities", y)
                return
            g = sb[0].outputs[0]
            if c["mask"] is not None:
                fs = self.reader(g, "aten.masked_fill.Scalar", B,
                                 lambda n: n.args[:2] == [Ref(g), Ref(c["mask"])] and n.args[2] == 0)
                if len(fs) != 1:
                    self.fail(f"{sb[0].name}: the masked scores' gradient must be zero where the mask is", sb[0])
                    return
                g = fs[0].outputs[0]
            ss = self.reader(g, "aten.mul.Tensor", B, lambda n: n.args == [Ref(g), c["scale"]])
            if len(ss) != 1:
                self.fail(f"{y.name}: the scores' gradient must be scaled by the same constant", y)
                return
            ds = ss[0].outputs[0]
            dq = self.reader(ds, "aten.bmm.default", B, lambda n: n.args[0] == Ref(ds)
                             and self.transposed(n.args[1]) == c["kti"])
            dkt = self.reader(ds, "aten.bmm.default", B, lambda n: n.args[1] == Ref(ds)
                              and self.transposed(n.args[0]) == c["qi"])
            if len(dq) != 1 or len(dkt) != 1:
                self.fail(f"{ss[0].name}: the chunk's gradients of q and k.T must be its scores' gradient times "
                          "its k.T and q, transposed", ss[0])
                return
            outs["q"].append(dq[0].outputs[0])
            outs["kt"].append(dkt[0].outputs[0])
            outs["v"].append(dvs[0].outputs[0])
        if len(dys) != 1:
            self.fail(f"{chunks[0]['y'].name}: the chunks read different output gradients", chunks[0]["y"])
            return
        for kind, parts in outs.items():
            want = Seq([Ref(x) for x in parts])
            cats = [n for n in self.p.nodes if n.op == "aten.cat.default" and n.phase == B and n.args[0] == want
                    and (len(n.args) == 1 or n.args[1] == 0)]
            if len(cats) != 1:
                self.fail(f"{chunks[0]['y'].name}: the gradient of {kind} must concatenate the chunks' in row "
                          "order, once", chunks[0]["y"])
