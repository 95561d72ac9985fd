"""AOTAutograd's joint graph to an IR program.

`torch.compile` hands a compiled region to AOTAutograd, which traces the
region's forward and backward into one joint aten graph: its placeholders are
the region's inputs (`primals_*`: the parameters and buffers dynamo lifted,
and the tensors the region was called with) and the tangents of its
differentiable outputs (`tangents_*`); its output is a flat list, the
forward outputs (`num_fwd_outputs` of them) and then one gradient per primal
(None where there is none).

`joint_program` reads that graph as `remat_ir.trace.tracer._to_program` reads
the graph of a traced step (a copy of the joint graph with its placeholders
put in the tracer's order and its output split into results and gradients),
so the program has the names, sizes, phases and schedule a traced step has.
It marks each fx node of the joint graph with the program's names of its
node and value (`meta["remat_node"]`, `meta["remat_value"]`), which is how
the backend (`remat_ir.torch_compile`) maps a plan back onto the graph.
"""
from __future__ import annotations

import contextlib
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from remat_ir.ir import Program
from remat_ir.ir.fingerprint import fingerprint
from remat_ir.trace.tracer import TraceError, _storage_key, _to_program

PARAM = "param"
BUFFER = "buffer"
INPUT = "input"


@dataclass
class Primal:
    """What one primal placeholder of the joint graph is: a parameter, a
    buffer or an input of the compiled region, its name (a module path for
    parameters and buffers, the argument's name for inputs) and the example
    tensor (real or fake) it was compiled for."""

    kind: str
    name: str
    example: torch.Tensor


_TOKEN = re.compile(r"\[\s*'([^']*)'\s*\]|\[\s*\"([^\"]*)\"\s*\]|\[(\d+)\]|\.?(\w+)")
_CONTAINERS = {"_modules", "_parameters", "_buffers"}


def path_of(source: str) -> list[str]:
    """The parts of a dynamo source name, without its root and the
    nn.Module containers: "L['self']._modules['h']._modules['0']._parameters['weight']"
    "L['self'].h[0].weight" and "L['self'].h.0.weight" give ["self", "h", "0", "weight"]."""
    parts = []
    for m in _TOKEN.finditer(source):
        tok = next(g for g in m.groups() if g is not None)
        parts.append(tok)
    if parts and parts[0] in ("L", "G"):
        parts = parts[1:]
    return [p for p in parts if p not in _CONTAINERS]


def clean_name(parts: list[str], fallback: str) -> str:
    """A `.rir` name from path parts (letters, digits, `_`, joined by `.`)."""
    out = [re.sub(r"\W", "_", p) for p in parts if p]
    if not out:
        return fallback
    if not re.match(r"[A-Za-z_]", out[0]):
        out[0] = "_" + out[0]
    return ".".join(out)


def primals_of(gm: fx.GraphModule, example_inputs) -> list[Primal]:
    """The primals AOTAutograd will give the joint graph of dynamo's graph
    `gm` (what `aot_module_simplified` flattens: `gm`'s own parameters and
    buffers, then its placeholders), each named after its dynamo source."""
    out: list[Primal] = []
    for name, p in gm.named_parameters(remove_duplicate=False):
        out.append(Primal(PARAM, clean_name(name.split("."), name), p))
    for name, b in gm.named_buffers(remove_duplicate=False):
        out.append(Primal(BUFFER, clean_name(name.split("."), name), b))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise TraceError(f"dynamo's graph has {len(placeholders)} inputs but was called with "
                         f"{len(example_inputs)}")
    for n, x in zip(placeholders, example_inputs):
        arg = n.meta.get("grapharg")
        source = arg.source.name if arg is not None and arg.source is not None else ""
        source = source() if callable(source) else source
        parts = path_of(source) if source else []
        if "_parameters" in source or isinstance(x, torch.nn.Parameter):
            kind = PARAM
        elif "_buffers" in source:
            kind = BUFFER
        else:
            kind = INPUT
        if kind == INPUT:
            parts = parts[1:] if parts[:1] == ["kwargs"] else parts
        else:
            parts = _without_self(parts)
        out.append(Primal(kind, clean_name(parts, n.name), x))
    return out


def _without_self(parts: list[str]) -> list[str]:
    """A path without the module itself at its root: `self`, or `args[0]`
    where a decorator of the forward passes it on positionally."""
    if parts[:1] == ["self"]:
        return parts[1:]
    if parts[:2] == ["args", "0"]:
        return parts[2:]
    return parts


def module_path(stack: dict | None) -> str:
    """The innermost module of dynamo's `nn_module_stack` metadata as a
    module path ("L['self'].transformer.h[0].attn" -> "transformer.h.0.attn")."""
    if not stack:
        return ""
    value = list(stack.values())[-1]
    text = value[0] if isinstance(value, tuple) else str(value)
    parts = _without_self(path_of(text))
    return clean_name(parts, "")


def _is_tangent(n: fx.Node) -> bool:
    return n.op == "placeholder" and n.name.startswith("tangents")


def joint_program(joint: fx.GraphModule, primals: list[Primal], num_fwd_outputs: int, *,
                  model_name: str = "") -> Program:
    """The IR program of AOTAutograd's joint graph `joint` (see the module
    docstring); `primals` says what each of its primal placeholders is.
    Marks the fx nodes of `joint` with their program names."""
    graph = joint.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    prim_nodes = [n for n in placeholders if not _is_tangent(n)]
    tangents = [n for n in placeholders if _is_tangent(n)]
    if len(prim_nodes) != len(primals):
        raise TraceError(f"the joint graph has {len(prim_nodes)} primal inputs, the region {len(primals)}")
    for n in placeholders:
        if not isinstance(n.meta.get("val"), torch.Tensor):
            raise TraceError(f"input {n.name} of the compiled region is not a tensor "
                             "(dynamic shapes are not supported: compile with dynamic=False)")
    out_node = next(n for n in graph.nodes if n.op == "output")
    hold_gradients(joint, num_fwd_outputs)
    flat_out = list(out_node.args[0])
    results, grads = flat_out[:num_fwd_outputs], flat_out[num_fwd_outputs:]
    if len(grads) != len(prim_nodes):
        raise TraceError(f"the joint graph returns {len(grads)} gradients for {len(prim_nodes)} inputs")

    # The tracer's order: parameters, buffers, inputs, tangents.
    order = {PARAM: 0, BUFFER: 1, INPUT: 2}
    ranked = sorted(range(len(primals)), key=lambda i: order[primals[i].kind])
    params = [(primals[i].name, _with_grad(primals[i], grads[i]), []) for i in ranked if primals[i].kind == PARAM]
    buffers = [(primals[i].name, primals[i].example, []) for i in ranked if primals[i].kind == BUFFER]
    inputs = [_with_grad(primals[i], grads[i]) for i in ranked if primals[i].kind == INPUT]
    in_names = [primals[i].name for i in ranked if primals[i].kind == INPUT]
    pos_param = [i for i in ranked if primals[i].kind == PARAM]
    pos_input = [i for i in ranked if primals[i].kind == INPUT]
    trainable = [k for k, i in enumerate(pos_param) if grads[i] is not None]
    grad_inputs = [k for k, i in enumerate(pos_input) if grads[i] is not None]
    wrt_grads = [grads[pos_param[k]] for k in trainable] + [grads[pos_input[k]] for k in grad_inputs]
    diff = _tangent_results(results, tangents)

    # A copy of the graph in that order; its nodes keep the joint graph's names.
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in [prim_nodes[i] for i in ranked] + tangents:
        env[n] = g.node_copy(n, lambda a: env[a])
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        c = g.node_copy(n, lambda a: env[a])
        c.meta = dict(n.meta)
        path = module_path(n.meta.get("nn_module_stack"))
        c.meta["nn_module_stack"] = {path: (path, "")} if path else {}
        # A node without an autograd sequence number (one a graph pass made) gets
        # one of its own, so the tracer names it after its module or operands.
        c.meta.setdefault("seq_nr", -2 - len(env))
        env[n] = c
    g.output(([env[r] if isinstance(r, fx.Node) else r for r in results],
              [env[x] if isinstance(x, fx.Node) else x for x in wrt_grads]))
    copy = fx.GraphModule(joint, g)
    _refresh_values(copy)
    _, spec = pytree.tree_flatten([0] * len(results))
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the partitioner runs in AOTAutograd's fake mode; constants are real
        program = _to_program(copy, params, buffers, inputs, in_names, trainable, grad_inputs, diff, spec,
                              False, model_name)
    program.header.comment.append("the joint graph of a torch.compile region (AOTAutograd)")
    program.header.held_gradients = True
    program.header.fingerprint = fingerprint(program)
    for n, c in env.items():
        for key in ("remat_node", "remat_value"):
            if key in c.meta:
                n.meta[key] = c.meta[key]
    return program


def _refresh_values(gm: fx.GraphModule) -> None:
    """Run `gm` on its placeholders' fake tensors again, so that every node's
    `meta["val"]` is what the op returns, views sharing their base's storage
    (a graph pass, such as inductor's joint-graph passes, may leave a view's
    value a tensor of its own)."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    args = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(args)
    if mode is None:
        return
    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)


def hold_gradients(joint: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Make each gradient the joint graph returns an `aten.alias` of it taken
    at the end of backward.  A compiled backward returns its gradients
    together, when it ends, and only then does autograd accumulate them into
    `.grad`: until then each is held.  The program's memory model hands a
    gradient output to autograd at the instruction that computes it, so the
    alias, computed last, is that instruction, and the gradient it views is
    held until then, as the compiled backward holds it.  (A view: no bytes,
    no copy, and autograd steals it into `.grad` as it would the gradient.)"""
    graph = joint.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    flat = list(out_node.args[0])
    alias = torch.ops.aten.alias.default
    for i in range(num_fwd_outputs):
        # A region that returns one of its inputs: the program's results are
        # computed values, so it returns a view of it (AOTAutograd's runtime
        # rebuilds such an output from the input itself).
        r = flat[i]
        if isinstance(r, fx.Node) and r.op == "placeholder" and isinstance(r.meta.get("val"), torch.Tensor):
            with graph.inserting_before(out_node):
                a = graph.call_function(alias, (r,))
            a.meta = {"val": alias(r.meta["val"]), "partitioner_tag": "is_forward"}
            flat[i] = a
    for i in range(num_fwd_outputs, len(flat)):
        g = flat[i]
        if not isinstance(g, fx.Node) or (g.target is alias and g.meta.get("remat_hold")):
            continue
        with graph.inserting_before(out_node):
            a = graph.call_function(alias, (g,))
        a.meta = {k: v for k, v in g.meta.items() if k in ("seq_nr", "nn_module_stack", "stack_trace")}
        a.meta["val"] = alias(g.meta["val"])
        a.meta["partitioner_tag"] = "is_backward"
        a.meta["remat_hold"] = True
        flat[i] = a
    out_node.args = (type(out_node.args[0])(flat),) + tuple(out_node.args[1:])


def accumulate_in_place(joint: fx.GraphModule) -> list[str]:
    """A backward `add(a, b)` where `a` is a backward intermediate that
    nothing but that add reads (through views only) becomes `a.add_(b)`: the
    sum written over the partial sum, as eager autograd accumulates the
    gradients of a tensor used twice (a tied LM head and embedding, logits
    both returned and fed to the loss) in place.  The same bits (one
    addition per element, the same operands); one tensor fewer, and the
    partial's storage is the sum's from its allocation, which is how the
    memory model counts it (a gradient's, where the sum is a parameter's
    gradient).  Returns the names of the rewritten nodes."""
    aten = torch.ops.aten
    graph = joint.graph
    backward: set[fx.Node] = set()  # the nodes that read a tangent, directly or not
    for n in graph.nodes:
        if _is_tangent(n) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    done = []
    for g in list(graph.nodes):
        if not (g in backward and g.target is aten.add.Tensor and not g.kwargs and len(g.args) == 2
                and all(isinstance(a, fx.Node) for a in g.args)):
            continue
        gv = g.meta.get("val")
        for k, x in enumerate(g.args):
            y = g.args[1 - k]
            xv, yv = x.meta.get("val"), y.meta.get("val")
            if not (isinstance(xv, torch.Tensor) and isinstance(gv, torch.Tensor) and isinstance(yv, torch.Tensor)
                    and xv.shape == gv.shape and xv.stride() == gv.stride() and xv.dtype == gv.dtype
                    and xv.device == gv.device and _covers_storage(xv)) or _storage_key(x) == _storage_key(y):
                continue
            base = x
            while base.op == "call_function" and getattr(base.target, "is_view", False):
                base = base.args[0]
            if not (base.op == "call_function" and base in backward and not getattr(base.target, "is_view", False)
                    and isinstance(base.meta.get("val"), torch.Tensor)):
                continue
            # Every reader of the base's storage is a view on the way to `x`, or the add itself.
            readers, ok = [base], True
            while readers and ok:
                r = readers.pop()
                for u in r.users:
                    if u is g:
                        continue
                    if u.op == "call_function" and getattr(u.target, "is_view", False) and u.args[0] is r:
                        readers.append(u)
                    else:
                        ok = False
            if not ok:
                continue
            with graph.inserting_before(g):
                acc = graph.call_function(aten.add_.Tensor, (x, y))
            acc.meta = dict(g.meta)
            acc.meta["val"] = xv  # the same storage: the sum is `x`
            g.replace_all_uses_with(acc)
            graph.erase_node(g)
            backward.add(acc)
            done.append(acc.name)
            break
    if done:
        graph.lint()
        joint.recompile()
    return done


def _covers_storage(t: torch.Tensor) -> bool:
    """Whether `t` spans its whole storage (a sum written over a part of a
    larger tensor would keep all of it alive)."""
    try:
        return t.untyped_storage().nbytes() == t.numel() * t.element_size()
    except Exception:  # noqa: BLE001 - no storage to speak of
        return False


def _with_grad(primal: Primal, grad) -> torch.Tensor:
    """The example tensor, its `requires_grad` as the joint graph has it (a gradient or none)."""
    t = primal.example
    want = grad is not None
    if t.requires_grad == want:
        return t
    return _Flag(t, want)


class _Flag:
    """Stands for a tensor where `_to_program` reads only `requires_grad`."""

    def __init__(self, t, requires_grad):
        self.t, self.requires_grad = t, requires_grad


def _tangent_results(results, tangents) -> list[int]:
    """Which forward result each tangent is the gradient of: AOTAutograd's
    tangents follow the differentiable outputs in order, each of its
    output's shape and dtype."""
    diff, k = [], 0
    for t in tangents:
        tv = t.meta.get("val")
        while k < len(results):
            r = results[k]
            rv = r.meta.get("val") if isinstance(r, fx.Node) else None
            k += 1
            if isinstance(rv, torch.Tensor) and isinstance(tv, torch.Tensor) and \
                    list(rv.shape) == list(tv.shape) and rv.dtype == tv.dtype:
                diff.append(k - 1)
                break
        else:
            diff.append(len(diff))
    return diff


def follow_rewrites(joint: fx.GraphModule, before: Program, after: Program) -> None:
    """Edit the joint graph `joint`, read as `before` (its fx nodes marked
    with `before`'s names by `joint_program`), so that it computes `after`:
    `before` with graph rewrites applied (`remat_ir.rewrite`), which keep
    the name of every node they leave as it is.  A node of `after` that
    `before` does not have (or has with another op or operands) becomes a
    call of its op on the fx nodes of its operands, its fake value made by
    running the op on theirs; a node `after` no longer has is erased; a
    value the rewrite renamed (a node of both, with the same op, reading at
    the same place a value only `before` has instead of one only `after`
    has) is read by its new name.  Every new fx node is marked with
    `after`'s names, so that a plan of `after` maps onto the graph."""
    from torch._guards import detect_fake_mode

    from remat_ir.ir import BACKWARD, FORWARD
    from remat_ir.ir.ops import resolve, torch_arg
    from remat_ir.ir.types import Ref, Seq

    graph = joint.graph
    by_node = {n.meta["remat_node"]: n for n in graph.nodes if "remat_node" in n.meta}
    env = {n.meta["remat_value"]: n for n in graph.nodes if "remat_value" in n.meta}
    old_nodes, old_values = before.node_map(), set(before.value_map())
    new_values = set(after.value_map())

    # Renames: a value only `before` has, read where `after` reads one only it has.
    rename: dict[str, str] = {}

    def pair(a, b) -> bool:
        if isinstance(a, Ref) and isinstance(b, Ref):
            if a.name == b.name:
                return True
            if a.name not in new_values and b.name not in old_values and rename.get(a.name, b.name) == b.name:
                rename[a.name] = b.name
                return True
            return False
        if isinstance(a, Seq) and isinstance(b, Seq):
            return len(a.items) == len(b.items) and all([pair(x, y) for x, y in zip(a.items, b.items)])
        return a == b

    kept = set()
    for n in after.nodes:
        o = old_nodes.get(n.name)
        if (o is not None and o.op == n.op and o.outputs == n.outputs and len(o.args) == len(n.args)
                and o.kwargs.keys() == n.kwargs.keys() and all([pair(a, b) for a, b in zip(o.args, n.args)])
                and all([pair(o.kwargs[k], n.kwargs[k]) for k in n.kwargs])
                and [rename.get(m, m) for m in o.mutates] == n.mutates):
            kept.add(n.name)
    for kind in ("result", "grad"):
        outs = {(o.kind, o.key): o.value for o in before.outputs if o.kind == kind}
        for o in after.outputs:
            was = outs.get((o.kind, o.key))
            if was is not None and was != o.value:
                rename.setdefault(was, o.value)

    mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    gone = [by_node[name] for name in old_nodes if name not in kept]
    template = {phase: next((by_node[o.name].meta for o in before.nodes if o.name not in kept and o.phase == phase),
                            {}) for phase in (FORWARD, BACKWARD)}
    made: dict[str, fx.Node] = {}  # value name -> its new fx node
    for n in after.nodes:
        if n.name in kept:
            continue
        look = {**env, **made}
        args = [torch_arg(a, lambda v: look[v]) for a in n.args]
        kwargs = {k: torch_arg(a, lambda v: look[v]) for k, a in n.kwargs.items()}
        inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, fx.Node)]
        order = {x: i for i, x in enumerate(graph.nodes)}
        anchor = max(inputs, key=lambda x: order[x]) if inputs else \
            [x for x in graph.nodes if x.op == "placeholder"][-1]
        while anchor.next.target is operator.getitem and anchor.next.args[0] is anchor:
            anchor = anchor.next  # (after the getitems of a call)
        op = resolve(n.op)
        with graph.inserting_after(anchor):
            call = graph.call_function(op, tuple(args), kwargs)
        fake = lambda x: x.meta["val"] if isinstance(x, fx.Node) else x  # noqa: E731
        with mode if mode is not None else contextlib.nullcontext():
            val = op(*pytree.tree_map(fake, args), **pytree.tree_map(fake, kwargs))
        call.meta = {k: v for k, v in template[n.phase].items() if not k.startswith("remat_")}
        call.meta.update(val=val, remat_node=n.name)
        if isinstance(val, torch.Tensor):
            call.meta["remat_value"] = n.outputs[0]
            made[n.outputs[0]] = call
            continue
        last = call
        for k, o in enumerate(n.outputs):
            if not o:
                continue
            with graph.inserting_after(last):
                item = graph.call_function(operator.getitem, (call, k))
            item.meta = {**call.meta, "val": val[k], "remat_value": o}
            item.meta.pop("remat_node")
            made[o] = item
            last = item
    # Readers of a value made anew, or renamed, read the new fx node.
    for name, node in made.items():
        if name in env and env[name] is not node:
            env[name].replace_all_uses_with(node)
    for old, new in rename.items():
        if old in env:
            env[old].replace_all_uses_with(made.get(new) or env[new])
    dead = set(gone)
    for g in gone:
        dead.update(u for u in g.users if u.target is operator.getitem)
    for x in reversed(list(graph.nodes)):
        if x in dead:
            graph.erase_node(x)
    graph.lint()
    joint.recompile()
