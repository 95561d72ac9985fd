"""Checking a plan's graph rewrites, independently of the code that made them.

A plan's header lists the rewrites applied to the traced step
(`Header.rewrites`).  The runtime proves the graph is this model's (it
traces the model again and replays the list); this module proves, from the
plan alone, that each rewritten region computes what the region it stands
for computed:

* ``chunked_loss:K``: exactly K `nll_loss_forward` nodes, each summing
  `log_softmax` (over the last dim) of one chunk's logits, a chunk being
  rows [a, b) of one activation `x` times the transpose of one weight (plus
  one bias), or rows [a, b) of one logits tensor, with rows [a, b) of one
  target; the chunks' rows are disjoint and cover every row once; the loss is
  the sum of the K chunk losses, each counted once, over the sum of the K
  target counts (for a mean).  In backward, each chunk's logits gradient is
  the loss backward of that chunk (the same scaled loss gradient for all);
  the activation's gradient concatenates, in row order, one `g_i @ W` per
  chunk; the weight's gradient is `g_0.T @ x_0` accumulated in place with
  `g_i.T @ x_i` for every other chunk once (the bias's: the row sums).
* ``chunked_loss:K:late``: the same, except for the weight's gradient: each
  chunk's logits gradient is made again in backward, by the same ops on the
  same operands (the chunk's logits, or its rows of `x` times the weight's
  transpose, its `log_softmax`, its loss backward with the same arguments),
  and `g_i.T @ x_i` of every chunk is added once, in place, into one
  weight-shaped tensor whose final value is the weight's gradient output
  (the embedding's gradient of a tied weight).
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

from remat_ir.ir.types import BACKWARD, FORWARD, GRAD, DType, Program, Ref, Seq, node_inputs

__all__ = ["check_rewrites"]

_KNOWN = ("batchnorm_split", "chunked_loss", "chunked_attention")


def check_rewrites(program: Program) -> list[tuple[tuple, str]]:
    """Every way in which `program`'s rewritten regions differ from what
    its header's rewrites promise; [] when none."""
    errors: list[tuple[tuple, str]] = []
    line = program.header.lines.get("rewrites", 0)
    for spec in program.header.rewrites:
        name, _, arg = spec.partition(":")
        k, _, late = arg.partition(":")
        region = None
        if name == "chunked_loss" and k.isdigit() and int(k) >= 2 and late in ("", "late"):
            region = _Chunks(program, int(k), bool(late))
        elif name == "chunked_attention" and arg.isdigit() and int(arg) >= 2:
            region = _Attention(program, int(arg))
        if region is not None:  # an error not at a node is the header's
            errors += [(("header", -1, line), f"rewrite {spec}: {m}") if loc is None else (loc, m)
                       for loc, m in region.check()]
        elif name == "batchnorm_split" and not arg:
            errors += _batchnorm(program)
        else:
            errors.append((("header", -1, line), f"unknown rewrite {spec!r}: remat-ir knows "
                                                 f"{', '.join(_KNOWN)} (chunked_loss:K or chunked_loss:K:late, "
                                                 "chunked_attention:K, K >= 2 chunks)"))
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


class _Chunks(_Region):
    def __init__(self, program: Program, k: int, late: bool = False):
        super().__init__(program, k)
        self.late = late
        self.count = None  # the mean's divisor: the sum of the chunks' target counts

    def check(self) -> list:
        nlls = [n for n in self.p.nodes if n.op == "aten.nll_loss_forward.default" and n.phase == FORWARD]
        if len(nlls) != self.k:
            self.fail(f"the graph has {len(nlls)} nll_loss_forward nodes, not {self.k} chunks")
            return self.errors
        chunks = []
        for n in nlls:
            c = self.chunk(n)
            if c is None:
                return self.errors
            chunks.append(c)
        first = chunks[0]
        for c in chunks[1:]:
            for key in ("x", "weight_t", "bias", "logits", "target", "ignore_index", "mode"):
                if c[key] != first[key]:
                    self.fail(f"chunk {c['node'].name} reads another {key} than {first['node'].name}", c["node"])
                    return self.errors
        chunks.sort(key=lambda c: c["a"])
        n_rows = self.values[first["target"]].shape[0]
        edge = 0
        for c in chunks:
            if c["a"] != edge or c["b"] <= c["a"]:
                self.fail(f"chunk {c['node'].name} covers rows [{c['a']}, {c['b']}); the chunks must cover "
                          f"rows 0..{n_rows} each once, in pieces, and the next starts at {edge}", c["node"])
                return self.errors
            edge = c["b"]
        if edge != n_rows:
            self.fail(f"the chunks cover rows 0..{edge} of {n_rows}")
            return self.errors
        self.check_loss(chunks)
        if not self.errors:
            self.check_backward(chunks)
        return self.errors

    def chunk(self, nll):
        lp, target, weight, reduction, ignore_index = nll.args[:5]
        if weight is not None or reduction != 2:
            self.fail(f"{nll.name} must sum (reduction 2) without class weights", nll)
            return None
        lsm = self.made_by(lp, "aten._log_softmax.default")
        if lsm is None or lsm.args[1] not in (1, -1) or lsm.args[2] is not False:
            self.fail(f"{nll.name} does not read a log_softmax over the last dim", nll)
            return None
        t = self.rows(target)
        logits = lsm.args[0]
        mm = self.made_by(logits, "aten.mm.default") or self.made_by(logits, "aten.addmm.default")
        c = {"node": nll, "lsm": lsm, "ignore_index": ignore_index, "bias": None, "weight_t": None,
             "logits": None, "x": None}
        if mm is not None:
            bias, x, wt = (mm.args[0], mm.args[1], mm.args[2]) if mm.op == "aten.addmm.default" else (
                None, *mm.args[:2])
            xr = self.rows(x)
            if xr is None or len(mm.args) > (3 if bias is not None else 2):
                self.fail(f"{mm.name}: a chunk's logits must be rows [a, b) of one activation times a "
                          "weight's transpose", mm)
                return None
            c.update(mode="matmul", x=xr[0], weight_t=wt.name, bias=bias.name if bias else None, a=xr[1],
                     b=xr[2], mm=mm)
        else:
            lr = self.rows(logits)
            if lr is None:
                self.fail(f"{lsm.name}: a chunk's logits must be a matmul of rows of one activation, or "
                          "rows of one logits tensor", lsm)
                return None
            c.update(mode="slice", logits=lr[0], a=lr[1], b=lr[2])
        if t is None or (t[1], t[2]) != (c["a"], c["b"]):
            self.fail(f"{nll.name}: the targets must be the same rows [{c['a']}, {c['b']}) as the logits", nll)
            return None
        c["target"], c["target_chunk"] = t[0], target.name
        return c

    def sum_of(self, value: str) -> list[str] | None:
        """The leaves of the tree of `aten.add.Tensor` that makes `value`."""
        n = self.producer.get(value)
        if n is None or n.op != "aten.add.Tensor" or len(n.args) != 2:
            return [value]
        out = []
        for a in n.args:
            if not isinstance(a, Ref):
                return None
            sub = self.sum_of(a.name)
            if sub is None:
                return None
            out += sub
        return out

    def check_loss(self, chunks):
        losses = sorted(c["node"].outputs[0] for c in chunks)
        counts = sorted(c["node"].outputs[1] if len(c["node"].outputs) > 1 else "" for c in chunks)
        readers = self.readers
        # The loss: the add tree over every chunk loss, maybe divided by the count tree.
        top = None
        for n in self.p.nodes:
            if n.phase != FORWARD or n.op not in ("aten.add.Tensor", "aten.div.Tensor"):
                continue
            leaves = self.sum_of(n.outputs[0]) if n.op == "aten.add.Tensor" else None
            if n.op == "aten.add.Tensor" and leaves is not None and sorted(leaves) == losses:
                top = n
        if top is None:
            self.fail("no sum of the chunk losses with each chunk counted once")
            return
        self.count = None
        divs = [n for n in readers.get(top.outputs[0], []) if n.op == "aten.div.Tensor" and n.phase == FORWARD]
        if divs:
            d = divs[0]
            if not (isinstance(d.args[1], Ref) and sorted(self.sum_of(d.args[1].name) or []) == counts):
                self.fail(f"{d.name}: a mean loss divides the sum by the sum of every chunk's target count", d)
                return
            self.count = d.args[1].name

    def check_backward(self, chunks):
        producer = self.producer
        grads, per_chunk, late = set(), {}, {}
        for c in chunks:
            lp = c["lsm"].outputs[0]
            gl = [n for n in self.p.nodes if n.phase == BACKWARD and n.op in (
                "remat.nll_log_softmax_backward.default", "aten.nll_loss_backward.default")
                and len(n.args) > 2 and n.args[1] == Ref(lp)]
            if len(gl) != 1:
                self.fail(f"chunk {c['node'].name} has {len(gl)} loss backward nodes, not one", c["node"])
                return
            per_chunk[c["a"]] = []
            for g in gl:
                if g.args[2] != Ref(c["target_chunk"]):
                    self.fail(f"{g.name}: the chunk's loss backward must read the chunk's own targets", g)
                    return
                if g.args[4] != 2 or g.args[5] != c["ignore_index"]:
                    self.fail(f"{g.name}: the chunk's loss backward must sum with ignore_index "
                              f"{c['ignore_index']}", g)
                    return
                grads.add(g.args[0].name if isinstance(g.args[0], Ref) else "")
                if g.op == "aten.nll_loss_backward.default":
                    nxt = [n for n in self.p.nodes if n.op == "aten._log_softmax_backward_data.default"
                           and n.args[0] == Ref(g.outputs[0]) and n.args[1] == Ref(lp)]
                    if len(nxt) != 1:
                        self.fail(f"{g.name}: no log_softmax backward of this chunk follows", g)
                        return
                    g = nxt[0]
                per_chunk[c["a"]].append(g.outputs[0])
            if self.late:
                made = self.made_again(c, gl[0])
                if made is None:
                    return
                late[c["a"]] = [made]
        if len(grads) != 1:
            self.fail("the chunks' loss backward nodes read different loss gradients")
            return
        (gs,) = grads
        if self.count is not None:
            d = producer.get(gs)
            if d is None or d.op != "aten.div.Tensor" or d.args[1] != Ref(self.count):
                self.fail("a mean loss's chunks must take the loss gradient over the target count")
                return
        if chunks[0]["mode"] == "matmul":
            weight, x_name = self.values[chunks[0]["weight_t"]].storage, chunks[0]["x"]
        else:
            # Sliced logits (the caller receives them whole): the gradients
            # flow to that one matmul's activation and weight.
            found = self._slice_head(chunks)
            if found is None:
                return
            weight, x_name = found
        order = [per_chunk[c["a"]] for c in chunks]  # each chunk's logits gradients
        # dx: cat of g_i @ W in row order.
        cats = [n for n in self.p.nodes if n.op == "aten.cat.default" and n.phase == BACKWARD
                and isinstance(n.args[0], Seq) and len(n.args[0].items) == len(order)]
        ok = False
        for n in cats:
            parts = [producer.get(r.name) if isinstance(r, Ref) else None for r in n.args[0].items]
            if (all(p is not None and p.op == "aten.mm.default" and p.args[1] == Ref(weight) for p in parts)
                    and all(isinstance(p.args[0], Ref) and p.args[0].name in gs_
                            for p, gs_ in zip(parts, order))
                    and (len(n.args) < 2 or n.args[1] == 0)):
                ok = True
        if not ok:
            self.fail("the activation's gradient must concatenate, in row order, each chunk's "
                      "logits gradient times the weight")
        # dW: one mm then one in-place addmm per other chunk, each chunk once
        # (late: an in-place addmm per chunk into the tied weight's other gradient).
        bounds = {c["a"]: c["b"] for c in chunks}
        source = {g: a for a, gs_ in list(per_chunk.items()) + list(late.items()) for g in gs_}
        seen = []
        for n in self.p.nodes:
            if n.phase != BACKWARD:
                continue
            if n.op in ("aten.mm.default", "aten.addmm_.default"):
                lhs, rhs = (n.args[0], n.args[1]) if n.op == "aten.mm.default" else (n.args[1], n.args[2])
                t = producer.get(lhs.name) if isinstance(lhs, Ref) else None
                if t is not None and t.op == "aten.t.default" and isinstance(t.args[0], Ref) and (
                        t.args[0].name in source):
                    a = source[t.args[0].name]
                    if (t.args[0].name in late.get(a, ())) != self.late:
                        self.fail(f"{n.name}: the weight gradient must take each chunk's logits gradient "
                                  + ("made again at the end of backward" if self.late else "of the loss"), n)
                        return
                    if self.rows(rhs) != (x_name, a, bounds[a]):
                        self.fail(f"{n.name}: chunk rows [{a}, {bounds[a]}) of the weight gradient must "
                                  "multiply the same rows of the activation", n)
                        return
                    into = seen[-1][1] if seen else None
                    if n.op == "aten.mm.default":
                        ok = into is None and not self.late
                    else:
                        ok = isinstance(n.args[0], Ref) and (self.late if into is None else n.args[0].name == into)
                    if not ok:
                        self.fail(f"{n.name}: the weight gradient must accumulate in place into one tensor", n)
                        return
                    if into is None and self.late and not self.tied_base(n.args[0].name, weight, n):
                        return
                    seen.append((a, n.outputs[0]))
        if sorted(a for a, _ in seen) != sorted(per_chunk):
            self.fail("the weight gradient must take every chunk's contribution exactly once")
        elif self.late and not any(o.kind == GRAD and o.key == weight and o.value == seen[-1][1]
                                   for o in self.p.outputs):
            self.fail(f"{seen[-1][1]}: the late weight gradient's sum must be the gradient output of {weight}")

    def made_again(self, c, g):
        """The logits gradient of chunk `c` made again in backward by the same
        ops on the same operands as its loss backward `g`; None (and an
        error) when there is not exactly one."""
        lp = c["lsm"].outputs[0]
        found = []
        for n in self.p.nodes:
            if n.phase != BACKWARD or n.op != g.op or len(n.args) != len(g.args) or n is g:
                continue
            lsm = self.producer.get(n.args[1].name) if isinstance(n.args[1], Ref) else None
            if lsm is None or lsm.phase != BACKWARD or lsm.op != c["lsm"].op or lsm.args[1:] != c["lsm"].args[1:]:
                continue
            again = Ref(lsm.outputs[0])
            if [again if a == Ref(lp) else a for a in g.args] != n.args:
                continue
            logits = lsm.args[0]
            if c["mode"] == "matmul":
                mm = self.producer.get(logits.name) if isinstance(logits, Ref) else None
                if mm is None or mm.op != c["mm"].op or mm.args != c["mm"].args or mm.kwargs:
                    continue
            elif logits != c["lsm"].args[0]:
                continue
            if n.op == "aten.nll_loss_backward.default":
                nxt = [m for m in self.p.nodes if m.op == "aten._log_softmax_backward_data.default"
                       and m.args[0] == Ref(n.outputs[0]) and m.args[1] == again]
                if len(nxt) != 1:
                    continue
                n = nxt[0]
            found.append(n.outputs[0])
        if len(found) != 1:
            self.fail(f"chunk {c['node'].name}: late, its logits gradient must be made again in backward "
                      f"exactly once, by the same ops on the same operands (found {len(found)})", c["node"])
            return None
        return found[0]

    def tied_base(self, name: str, weight: str, n) -> bool:
        """Whether `name`, which the late weight gradient accumulates into,
        is a weight-shaped tensor of its own (the tied weight's other gradient)."""
        v, w = self.values.get(name), self.values[weight]
        if v is None or v.storage != v.name or v.shape != w.shape or v.dtype != w.dtype:
            self.fail(f"{n.name}: the late weight gradient must accumulate into a tensor of its own shaped "
                      f"like {weight}", n)
            return False
        return True


    def _slice_head(self, chunks):
        """(weight, activation) of the one matmul whose result the chunks slice."""
        logits = self.values[chunks[0]["logits"]].storage
        mms = [n for n in self.p.nodes if n.phase == FORWARD and n.op in ("aten.mm.default", "aten.addmm.default")
               and self.values[n.outputs[0]].storage == logits]
        if len(mms) != 1:
            self.fail("the sliced logits are not one matmul's result")
            return None
        x, wt = mms[0].args[-2], mms[0].args[-1]
        return self.values[wt.name].storage, x.name


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
