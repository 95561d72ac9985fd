"""Tracer: one training step (forward, loss, backward) to an IR program.

The step is traced with `make_fx` into a joint aten graph: parameters,
buffers, inputs and the tangents of the forward results are graph inputs; the
forward results and the gradients are its outputs.  Module paths are recorded
with forward hooks so values get names like `transformer.h.3.attn.softmax`.
With `fake=True` nothing is allocated: shapes come from FakeTensorMode, so a
GPT-2 medium step is planned in seconds on a laptop.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch
import torch.fx.traceback as fx_traceback
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry

from remat_ir import ir
from remat_ir.ir.ops import HIDDEN_MUTATORS, RANDOM_OPS, fake_kernels
from remat_ir.ir import (
    BACKWARD, BUFFER, FORWARD, GRAD, INPUT, PARAM, RESULT, TANGENT, VALUE, Header, Node, Output,
    Program, Value,
)
from remat_ir.ir.fingerprint import fingerprint
from remat_ir.ir.schedule import default_schedule
from remat_ir.ir.guards import GuardError, answers_of
from remat_ir.trace.guards import StepValues
from remat_ir.trace.symbolic import Symbolic, SymbolicError
from remat_ir.trace.device import NEUTRAL_NOTE, canonical_device, device_neutral, retarget, rewrite


class TraceError(ValueError):
    """The model cannot be traced into a program; the message says why and what to do."""


class NothingToTrain(TraceError):
    """No result of the step requires grad (every parameter it uses frozen,
    peft's `disable_adapter()`): there is no backward to plan."""


class NotReplayableError(TraceError):
    """The step does what a plan cannot replay (`remat_ir.trace.live`): at any sizes, in any trace."""


# Ops whose result depends on data the shapes don't tell: the program has
# static shapes and cannot replay them.
_UNSUPPORTED = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default"}


def trace_module(module: torch.nn.Module, example_inputs: tuple = (), *, kwargs: dict | None = None,
                 loss_fn: Callable | None = None, model_name: str = "", fake: bool = False,
                 device: str | None = None, fuse: bool = True, neutral: bool | None = None,
                 guards: list[str] | None = None, autocast: str | None = None,
                 as_called: bool = False, dynamic: dict[str, dict[int, str]] | None = None,
                 live: list | None = None) -> Program:
    """Trace one training step of `module(*example_inputs, **kwargs)`.

    The call's tensors are the plan's inputs, named after the forward's
    parameters; its other arguments (None, flags) are constants of the plan
    (see `remat_ir.trace.calls`).  `loss_fn(output, *args, **kwargs)`, when
    given, is traced as part of the step and its result is the forward
    result.  The module is put in train mode for the trace (its submodules
    too), or with `as_called` traced with each module in the mode it is in
    (as eager runs a training step of a model whose dropout was put in
    eval() alone); either way every module's mode is restored after.

    `device` is the device type the plan is for (default: where the
    parameters and inputs are); the step is traced as it runs there, with
    the fusions proven there (none when not `fuse`: eager's own ops).  For
    CUDA without a CUDA build of torch the trace is device-neutral (see
    `remat_ir.trace.device.device_neutral`) and its header says so;
    `neutral=True` traces so on any build (to compare with such a plan).

    The forward (and the loss) is traced under `autocast` ("cpu:bfloat16":
    as `torch.autocast("cpu", dtype=torch.bfloat16)` runs it; "" for none)
    and backward outside it, as eager runs a `loss.backward()` called after
    the autocast block; None: the autocast in effect where this is called,
    for the step's device type.  No other autocast is on during the trace.

    `torch.utils.checkpoint` calls in the model (transformers'
    `gradient_checkpointing_enable()`) run their function directly while it
    is traced (`remat_ir.trace.checkpoint`): the plan's own recomputation
    takes their place, with eager's values.

    What the model's code reads of its inputs' values (`torch.all(mask == 1)`)
    is answered from the call's real tensors and recorded in the header's
    guards, and tracing probes answer as in eager (`remat_ir.trace.guards`);
    with fake inputs, nothing is answered.  `guards`: answer from these
    instead (a plan's own, to check a model against it).

    `dynamic` makes a symbolic program (`remat_ir.ir.sizes`): for each input
    named there, the dimensions that vary between calls and the symbol each
    is ("input_ids": {0: "B", 1: "T"}).  The step is traced once with those
    sizes as symbols (make_fx's symbolic tracing), so the program holds for
    every size its `size_guards` allow; its range runs from the smallest
    size the trace assumes to the call's.

    The Python state the step reads (module attributes, hooks) is watched
    (`remat_ir.trace.live`): what it read is appended to `live` when given,
    and a step that does what a plan cannot replay (writes a module's
    attribute, draws from Python's `random`, a hook that keeps or prints
    what it sees) is refused, with the model left as it was.
    """
    from remat_ir.trace.calls import CallError, autocast_off, split_call
    from remat_ir.trace.checkpoint import inline_checkpoints
    from remat_ir.trace.live import NotReplayable, settle, watching

    try:
        call = split_call(module, example_inputs, kwargs)
    except CallError as e:
        raise TraceError(str(e)) from None
    if autocast is not None:
        call.autocast = autocast
    settle(module)
    modes = [(m, m.training) for m in module.modules()]
    if not as_called:
        module.train()
    try:
        # Checkpointed layers are traced as plain code: the plan decides what is recomputed.
        with torch.random.fork_rng(devices=[]), autocast_off(), inline_checkpoints(), watching(module, live):
            return _trace(module, call, loss_fn, model_name, fake, device, fuse, neutral, guards, dynamic)
    except NotReplayable as e:
        raise NotReplayableError(f"a plan cannot replay this step: {e}") from None
    except SymbolicError as e:
        raise TraceError(f"cannot trace one plan for every size: {e}") from None
    finally:
        for m, training in modes:
            m.training = training


def model_params(module: torch.nn.Module):
    """(name, tensor, aliases) for each distinct parameter, in registration order."""
    seen: dict[int, list] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            seen[id(p)][2].append(name)
        else:
            seen[id(p)] = [name, p, []]
    return [tuple(x) for x in seen.values()]


def model_buffers(module: torch.nn.Module):
    seen: dict[int, list] = {}
    for name, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in seen:
            seen[id(b)] = [name, b, []]
        else:
            seen[id(b)][2].append(name)
    return [tuple(x) for x in seen.values()]


def _trace(module, call, loss_fn, model_name, fake, device=None, fuse=True, neutral=None, guards=None,
           dynamic=None) -> Program:
    params = model_params(module)
    buffers = model_buffers(module)
    inputs = call.tensors
    in_names = call.names
    trainable = [i for i, (_, p, _) in enumerate(params) if p.requires_grad]
    grad_inputs = [i for i, x in enumerate(inputs) if x.requires_grad]

    # Which fake mode: the model's own (built inside FakeTensorMode) or a new one.
    existing = next((t.fake_mode for _, t, _ in params if isinstance(t, FakeTensor)), None)
    symbolic = Symbolic(call, dynamic) if dynamic else None
    if symbolic and existing is not None:
        raise TraceError("a model built inside FakeTensorMode is traced with the sizes it was built for; "
                         "trace a symbolic plan from a model with real parameters")
    mode = existing or FakeTensorMode(allow_non_fake_inputs=False, shape_env=symbolic and symbolic.env)
    if not fake and existing is None and any(t.is_meta for _, t, _ in params):
        raise TraceError("the model's parameters are on the meta device; build it inside FakeTensorMode instead")

    # Fake tensors on CUDA need a CUDA build; without one a CUDA plan is
    # traced on CPU, device-neutral.
    target = torch.device(device).type if device else _device_of(params, buffers, inputs)
    on_cpu = target == "cuda" and not torch.cuda.is_available()
    neutral = on_cpu if neutral is None else neutral or on_cpu
    move = None if on_cpu else canonical_device(target)
    autocast = _autocast_region(call.autocast, target, neutral)

    def fakeify(t, name=None):
        if isinstance(t, FakeTensor):
            f = t
        elif symbolic:  # only the dynamic dimensions of inputs are symbols
            f = mode.from_tensor(symbolic.own(t), **symbolic.context(name, t))
        else:
            f = mode.from_tensor(t)
        return f.to(move) if move and f.device.type != target else f

    with mode:
        f_params = [fakeify(p).detach().requires_grad_(p.requires_grad) for _, p, _ in params]
        f_bufs = [fakeify(b) for _, b, _ in buffers]
        f_inputs = [fakeify(x, n).detach().requires_grad_(x.requires_grad) for x, n in zip(inputs, in_names)]
    if symbolic:
        symbolic.name_symbols(f_inputs, in_names)

    names = [n for n, _, _ in params]
    bnames = [n for n, _, _ in buffers]
    values = _step_values(call, inputs, f_inputs, buffers, f_bufs, guards, symbolic)

    def run(ps, bs, xs):
        state = dict(zip(names, ps))
        state.update(zip(bnames, bs))
        args, kwargs = call.rebuild(xs)
        with device_neutral(neutral), values.answering() if values else contextlib.nullcontext():
            with autocast():
                out = torch.func.functional_call(module, state, args, kwargs, tie_weights=True, strict=False)
                if loss_fn is not None:
                    out = loss_fn(out, *args, **kwargs)
        return _without_caches(out)

    # A first pass to learn the forward results' structure and shapes.
    try:
        with mode, fake_kernels(target), _python_dispatcher() if symbolic else contextlib.nullcontext():
            probe = run(f_params, f_bufs, f_inputs)
    except Exception as e:  # noqa: BLE001 - the model's own code failed under fake tensors
        raise _explain(e) from e
    if loss_fn is not None and not (isinstance(probe, torch.Tensor) and probe.numel() == 1):
        raise TraceError(f"loss() returned {describe_result(probe)}; a loss must be one scalar tensor: "
                         "reduce it (e.g. with .mean() or .sum())")
    flat_probe, spec = pytree.tree_flatten(probe)
    for o in flat_probe:
        if not isinstance(o, torch.Tensor):
            raise TraceError(f"the forward returns a {type(o).__name__}; return tensors only "
                             "(a tensor, or a tuple/list/dict of tensors)")
    diff = [i for i, o in enumerate(flat_probe) if o.requires_grad]
    if not diff:
        raise NothingToTrain("no forward result requires grad: nothing to train")
    with mode:
        f_tangents = [torch.ones_like(flat_probe[i]) for i in diff]
    del probe, flat_probe

    np_, nb, ni = len(f_params), len(f_bufs), len(f_inputs)

    def step(*flat):
        ps = list(flat[:np_])
        bs = list(flat[np_:np_ + nb])
        xs = list(flat[np_ + nb:np_ + nb + ni])
        tans = flat[np_ + nb + ni:]
        out = run(ps, bs, xs)
        flat_out = pytree.tree_leaves(out)
        wrt = [ps[i] for i in trainable] + [xs[i] for i in grad_inputs]
        _tag_backward_ops([flat_out[i] for i in diff])
        grads = backward([flat_out[i] for i in diff], wrt, list(tans))
        return flat_out, list(grads)

    hooks = _install_module_hooks(module)
    try:
        with fx_traceback.preserve_node_meta(), mode, fake_kernels(target):
            # A symbolic trace runs composite ops' Python decompositions (pad's), which keep
            # sizes symbolic, as make_fx's "symbolic" mode does (which would fake the inputs again).
            with _python_dispatcher() if symbolic else contextlib.nullcontext():
                gm = make_fx(step, tracing_mode="real")(*f_params, *f_bufs, *f_inputs, *f_tangents)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - make_fx raises many kinds; say what failed
        raise _explain(e) from e
    finally:
        for h in hooks:
            h.remove()

    _drop_unused(gm)
    rewrite(gm, target, fuse and not neutral)  # a neutral trace holds no device's fusions
    program = _to_program(gm, params, buffers, inputs, in_names, trainable, grad_inputs, diff, spec,
                          loss_fn is not None, model_name, values.guards if values else [], symbolic)
    if call.constants or call.autocast:
        # The call's non-tensor arguments and its autocast: another value is another step.
        program.header.constants = list(call.constants)
        program.header.autocast = call.autocast
        program.header.fingerprint = fingerprint(program)
    if neutral:
        program.header.comment.append(NEUTRAL_NOTE)
        retarget(program, target)
    return program


# Composite ops whose Python decomposition (what the Python dispatcher runs)
# is another step than eager's C++ one.  `dropout`'s is `native_dropout`, whose
# backward scales by 1/(1-p) exactly, where eager's CPU dropout multiplies by
# its mask `bernoulli_(1-p).div_(1-p)`, which holds 1/(1-p) rounded to the
# tensor's dtype (bf16 under autocast: 1.109375 for p=0.1, not 1.1111).
_EAGER_COMPOSITES = (torch.ops.aten.dropout.default,)


@contextlib.contextmanager
def _python_dispatcher():
    """The Python dispatcher (a symbolic trace runs composite ops' Python
    decompositions, which keep sizes symbolic), except for the ops in
    `_EAGER_COMPOSITES`, which run their C++ composite, op for op as eager."""
    saved = []
    for op in _EAGER_COMPOSITES:
        keys = [k for k in (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd)
                if k in op.py_kernels]
        saved.append((op, {k: op.py_kernels.pop(k) for k in keys}))
        op._dispatch_cache.clear()
    try:
        with enable_python_dispatcher():
            yield
    finally:
        for op, kernels in saved:
            op.py_kernels.update(kernels)
            op._dispatch_cache.clear()


def _drop_unused(gm) -> None:
    """Remove ops whose results nothing reads and that change nothing: what
    the model computed only to read its values in Python (answered by
    `remat_ir.trace.guards`, not part of the step), and any other dead
    pure op.  Random ops stay: eager draws them."""
    for n in reversed(list(gm.graph.nodes)):
        if n.op != "call_function" or n.users:
            continue
        op = n.target
        if op is operator.getitem or isinstance(op, torch._ops.OpOverload) and not (
                _is_random(op) or op._schema.is_mutable or _mutated_args(n)):
            gm.graph.erase_node(n)


def _step_values(call, inputs, f_inputs, buffers, f_bufs, guards, symbolic=None) -> StepValues | None:
    """What answers the model's questions about its inputs' values in this
    trace: the call's real tensors, the plan's `guards`, or (fake inputs)
    nothing."""
    def real(t):
        return t if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and not t.is_meta else None

    if guards is not None:
        if not guards:
            return None
        answers = answers_of(guards)
    elif all(real(x) is not None for x in inputs):
        answers = None
    else:
        return None
    ins = {n: (f, real(x)) for n, f, x in zip(call.names, f_inputs, inputs)}
    bufs = {n: (f, real(b)) for (n, b, _), f in zip(buffers, f_bufs)}
    size_of = (lambda x: (symbolic.size(x), symbolic.hint(x))) if symbolic is not None else None
    return StepValues(ins, bufs, answers, size_of)


def _autocast_region(autocast: str, target: str, neutral: bool):
    """What the forward and the loss are traced under: `autocast` ("" for
    none), with autocast's cache of cast weights emptied on entering and on
    leaving, so that no pass reuses another's casts (nor the caller's
    region, whose cache an outer autocast keeps, ours)."""
    if not autocast:
        return contextlib.nullcontext
    from remat_ir.trace.calls import describe_autocast, parse_autocast

    try:
        device_type, dtype = parse_autocast(autocast)
    except ValueError as e:
        raise TraceError(str(e)) from None
    if device_type != target:
        raise TraceError(f"{describe_autocast(autocast)} is for {device_type}, but the step runs on {target}")
    from remat_ir.ir.header import autocast_problem

    if autocast_problem(autocast, target):  # (a dtype autocast does not take: it would run without)
        raise TraceError(f"autocast {autocast_problem(autocast, target)}")
    if neutral:
        raise TraceError(f"a step under {describe_autocast(autocast)} is traced where it runs: autocast "
                         f"casts other ops on CPU; trace it on a machine with {device_type}")

    @contextlib.contextmanager
    def region():
        torch.clear_autocast_cache()
        try:
            with torch.autocast(device_type, dtype=dtype):
                yield
        finally:
            torch.clear_autocast_cache()

    return region


def _without_caches(out):
    """`out` with generation caches (a transformers `Cache` a causal LM
    returns by default) set to None: a training step has no use for them,
    and keeping one would keep every layer's keys and values alive."""
    def drop(x):
        cache = any(c.__name__.endswith("Cache") and c.__module__.startswith("transformers")
                    for c in type(x).__mro__)
        return None if cache else x

    return pytree.tree_map(drop, out)


def describe_result(out) -> str:
    """`out`, what a forward or a loss returned, in a few words: "a tensor of
    shape [3, 4] (12 elements)", "a tuple of 2 tensors"."""
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {list(out.shape)} ({out.numel()} elements)"
    leaves = pytree.tree_leaves(out)
    if isinstance(out, (tuple, list, dict)) or len(leaves) != 1 or leaves[0] is not out:
        tensors = sum(isinstance(x, torch.Tensor) for x in leaves)
        return f"a {type(out).__name__} of {tensors} tensor{'s' if tensors != 1 else ''}" + (
            f" and {len(leaves) - tensors} other values" if tensors != len(leaves) else "")
    return f"a {type(out).__name__}"


def _explain(e: Exception) -> TraceError:
    """A TraceError naming the op when tracing hit one a static program cannot hold."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    if isinstance(e, GuardError):
        return TraceError(str(e))
    if isinstance(e, (DynamicOutputShapeException, DataDependentOutputException)):
        return TraceError(f"unsupported op {e.func}: its output depends on tensor values, which a plan "
                          "with static shapes cannot replay; rewrite the model without it (e.g. use "
                          "torch.where instead of boolean indexing)")
    name = type(e).__name__
    if "DataDependent" in name or "GuardOnDataDependent" in name:
        return TraceError(f"unsupported data-dependent operation: {str(e).splitlines()[0]}")
    return TraceError(f"tracing failed: {name}: {str(e).splitlines()[0] if str(e) else ''}")


def backward(results, wrt, tangents):
    """`torch.autograd.grad(results, wrt, tangents)`, accumulated as eager's
    `loss.backward()` is: a result that autograd reaches from another result
    (logits under the loss) gets its tangent added by a hook, after the
    gradients that flow into it from above, instead of as a root of the pass.
    As a root its tangent is the gradient's first term, and a sum's first
    term gives it its memory layout: CLIP's logits' gradient (the transposed
    image loss's plus the text loss's) would be row-major, not eager's
    column-major, and `logit_scale`'s gradient, a sum over it, would add in
    another order (1 ulp off)."""
    below, seen = set(), set()
    work = [r.grad_fn for r in results if r.grad_fn is not None]
    while work:
        fn = work.pop()
        if fn not in seen:
            seen.add(fn)
            below.update((f, nr) for f, nr in fn.next_functions if f is not None)
            work.extend(f for f, _ in fn.next_functions if f is not None)
    roots, root_tangents = [], []
    for r, t in zip(results, tangents):
        if r.grad_fn is not None and (r.grad_fn, r.output_nr) in below:
            r.register_hook(lambda g, t=t: t if g is None else g + t)
        else:
            roots.append(r)
            root_tangents.append(t)
    return torch.autograd.grad(roots, wrt, root_tangents, allow_unused=True)


def _tag_backward_ops(outputs) -> None:
    """Make each backward op carry the sequence number of the forward op it
    differentiates (`seq_nr` in fx metadata), so it can be named after it."""
    seen = set()
    work = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while work:
        fn = work.pop()
        if fn in seen:
            continue
        seen.add(fn)
        seq = fn._sequence_nr()

        def pre(grad_outputs, seq=seq):
            fx_traceback.set_grad_fn_seq_nr(seq)

        def post(grad_inputs, grad_outputs):
            fx_traceback.reset_grad_fn_seq_nr()

        fn.register_prehook(pre)
        fn.register_hook(post)
        work.extend(f for f, _ in fn.next_functions if f is not None)


def _install_module_hooks(module):
    """Record the path of the module each op runs in, as fx node metadata."""
    paths = {m: n for n, m in module.named_modules(remove_duplicate=False)}
    stack: list[str] = []

    def pre(mod, args):
        stack.append(paths.get(mod, ""))
        fx_traceback.current_meta["nn_module_stack"] = {p: (p, "") for p in stack}

    def post(mod, args, out):
        if stack:
            stack.pop()
        fx_traceback.current_meta["nn_module_stack"] = {p: (p, "") for p in stack}

    hooks = []
    for m in module.modules():
        hooks.append(m.register_forward_pre_hook(pre))
        hooks.append(m.register_forward_hook(post, always_call=True))
    return hooks


def _module_of(fx_node) -> str:
    stack = fx_node.meta.get("nn_module_stack") or {}
    return list(stack)[-1] if stack else ""


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _to_program(gm, params, buffers, inputs, in_names, trainable, grad_inputs, diff, spec, has_loss,
                model_name, guards=(), symbolic: Symbolic | None = None) -> Program:
    graph = gm.graph
    fx_nodes = list(graph.nodes)
    placeholders = [n for n in fx_nodes if n.op == "placeholder"]
    out_node = next(n for n in fx_nodes if n.op == "output")
    calls = [n for n in fx_nodes if n.op in ("call_function", "get_attr") and n.target is not operator.getitem
             and not _is_size(n)]
    for n in fx_nodes:
        if _is_size(n):
            if symbolic is None:
                raise TraceError(f"the traced graph computes a size ({n.target}) in a trace without symbols")
            continue
        if n.op == "get_attr":
            _constant_as_full(gm, n)
        elif n.op == "call_function" and n.target is not operator.getitem and not isinstance(
                n.target, torch._ops.OpOverload):
            raise TraceError(f"unsupported call {n.target} in the traced graph")

    values: list[Value] = []
    vmap: dict[str, Value] = {}
    owner_of_storage: dict[int, str] = {}
    fx_value_name: dict[Any, str] = {}  # (fx node, index or None) -> value name
    used_names: set[str] = set()

    def unique(base: str) -> str:
        name, i = base, 1
        while name in used_names:
            name = f"{base}_{i}"
            i += 1
        used_names.add(name)
        return name

    def add_value(name: str, kind: str, t: torch.Tensor, **kw) -> Value:
        st = t.untyped_storage()
        key = st._cdata
        owner = owner_of_storage.get(key)
        if owner is None:
            owner_of_storage[key] = name
            storage, nbytes = name, st.nbytes() if symbolic is not None else int(st.nbytes())
        else:
            storage, nbytes = owner, 0
        if symbolic is not None:
            shape, stride = [symbolic.size(d) for d in t.shape], [symbolic.size(d) for d in t.stride()]
            nbytes = symbolic.size(nbytes) if storage == name else 0
        else:
            shape, stride = list(t.shape), list(t.stride())
        v = Value(name=name, kind=kind, dtype=_dtype_name(t.dtype), shape=shape,
                  stride=stride, storage=storage, nbytes=nbytes, **kw)
        values.append(v)
        vmap[name] = v
        return v

    # Graph inputs, in the order `step` takes them.
    np_, nb, ni = len(params), len(buffers), len(inputs)
    for i, ph in enumerate(placeholders):
        t = ph.meta["val"]
        if i < np_:
            pname, p, aliases = params[i]
            name = unique(pname)
            add_value(name, PARAM, t, source=pname, requires_grad=bool(p.requires_grad), aliases=list(aliases))
        elif i < np_ + nb:
            bname, _, aliases = buffers[i - np_]
            name = unique(bname)
            add_value(name, BUFFER, t, source=bname, aliases=list(aliases))
        elif i < np_ + nb + ni:
            j = i - np_ - nb
            name = unique(in_names[j])
            add_value(name, INPUT, t, source=in_names[j], requires_grad=bool(inputs[j].requires_grad))
        else:
            j = i - np_ - nb - ni
            name = unique(f"d.result{diff[j]}" if len(diff) > 1 else "d.result")
            add_value(name, TANGENT, t, source=str(diff[j]))
        fx_value_name[(ph, None)] = name
    tangent_nodes = set(placeholders[np_ + nb + ni:])

    # Phase: forward = what the results need, plus what must happen in forward
    # (buffer updates, random draws, so RNG use matches eager), closed over inputs.
    depends_on_tangent: set = set()
    for n in fx_nodes:
        if n in tangent_nodes or any(a in depends_on_tangent for a in n.all_input_nodes):
            depends_on_tangent.add(n)
    result_fx = pytree.tree_leaves(out_node.args[0][0])
    seeds = [r for r in result_fx if isinstance(r, torch.fx.Node)]
    for n in calls:
        if n in depends_on_tangent:
            continue
        if _is_random(n.target) or _mutated_args(n):
            seeds.append(n)
    forward_set: set = set()

    def close(work):
        while work:
            n = work.pop()
            if n in forward_set or n.op == "placeholder":
                continue
            forward_set.add(n)
            work.extend(n.all_input_nodes)

    close(list(seeds))
    # A read of a value that forward later writes in place must run before
    # the write, so in forward too: autograd's copy of an in-place op's
    # original input (`a /= a.sum()` saves a clone of `a`) is read only by
    # backward, but it copies the value as it was before the write.
    order = {n: i for i, n in enumerate(fx_nodes)}
    while True:
        last_write: dict[int, int] = {}
        for n in forward_set:
            for a in _mutated_args(n):
                key = _storage_key(a)
                if key != -1:
                    last_write[key] = max(last_write.get(key, -1), order[n])
        early = [n for n in calls if n not in forward_set and n not in depends_on_tangent
                 and any(last_write.get(_storage_key(a), -2) > order[n] for a in n.all_input_nodes)]
        if not early:
            break
        close(early)

    # Names: module path + op; backward nodes: "d." + the module of the
    # forward values they read.
    module_of: dict = {}
    fwd_module_by_seq: dict[int, str] = {}
    for n in calls:
        if n in forward_set and _module_of(n):
            fwd_module_by_seq.setdefault(n.meta.get("seq_nr", -1), _module_of(n))
    nodes: list[Node] = []
    for n in calls:
        if n.target is operator.getitem:
            continue
        if n.op == "get_attr":
            n.meta.setdefault("nn_module_stack", _module_stack_of_users(n))
            opname = "constant"
        else:
            opname = n.target._opname
        phase = FORWARD if n in forward_set else BACKWARD
        if phase == FORWARD or n not in depends_on_tangent and _module_of(n):
            mod = _module_of(n)
        elif n.meta.get("seq_nr", -1) in fwd_module_by_seq:
            mod = fwd_module_by_seq[n.meta["seq_nr"]]
        else:
            mod = _backward_module(n, module_of, forward_set)
        module_of[n] = mod
        base = f"{mod}.{opname}" if mod else opname
        if phase == BACKWARD:
            base = "d." + base
        name = unique(base)
        n.meta["remat_node"] = name  # the program's name of this fx node (read by trace/joint.py)
        val = n.meta.get("val")
        outs: list[str] = []
        if isinstance(val, torch.Tensor):
            add_value(name, VALUE, val)
            fx_value_name[(n, None)] = name
            outs = [name]
        elif isinstance(val, (tuple, list)):
            getitems = {u.args[1]: u for u in n.users if u.target is operator.getitem}
            for k, item in enumerate(val):
                if isinstance(item, torch.Tensor) and k in getitems:
                    oname = unique(f"{name}:{k}")
                    add_value(oname, VALUE, item)
                    fx_value_name[(getitems[k], None)] = oname
                    outs.append(oname)
                else:
                    outs.append("")
            # Trailing unused outputs carry no information.
            while outs and outs[-1] == "":
                outs.pop()
        elif val is None:
            outs = []
        else:
            raise TraceError(f"{n.target} returns {type(val).__name__}, which a static program cannot hold")
        if str(n.target) in _UNSUPPORTED:
            raise TraceError(f"unsupported op {n.target} (data-dependent) at {mod or 'top level'}")
        if n.op == "get_attr":
            nodes.append(Node(name=name, op="aten.full.default", args=n.meta["full_args"],
                              kwargs=n.meta["full_kwargs"], outputs=outs, phase=phase, module=mod,
                              flops=float(val.numel())))
            continue
        nodes.append(Node(
            name=name, op=_op_string(n.target), args=[_arg(a, fx_value_name, symbolic) for a in n.args],
            kwargs={k: _arg(a, fx_value_name, symbolic) for k, a in n.kwargs.items()}, outputs=outs, phase=phase,
            module=mod, random=_is_random(n.target),
            mutates=[fx_value_name[(a, None)] for a in _mutated_args(n)],
            flops=_flops(n, symbolic),
        ))

    for (fxn, _), vname in fx_value_name.items():
        fxn.meta["remat_value"] = vname  # the program's value of this fx node (read by trace/joint.py)

    # Outputs: forward results, then gradients.
    outputs: list[Output] = []
    results_fx, grads_fx = out_node.args[0]
    for i, r in enumerate(results_fx):
        if not isinstance(r, torch.fx.Node) or r.op == "placeholder":
            raise TraceError(f"forward result {i} is an input or a constant; return computed tensors")
        outputs.append(Output(RESULT, str(i), fx_value_name[(r, None)]))
    wrt = [values[i].name for i in trainable] + [values[np_ + nb + j].name for j in grad_inputs]
    produced = set()
    for key, g in zip(wrt, grads_fx):
        if g is None:
            continue
        if not isinstance(g, torch.fx.Node) or g.op == "placeholder" or g in forward_set:
            raise TraceError(f"the gradient of {key} is not computed by the backward pass "
                             "(it is an input or forward value); this model is not supported")
        gname = fx_value_name[(g, None)]
        if gname in produced:
            raise TraceError(f"two gradients share the value {gname}; not supported")
        produced.add(gname)
        outputs.append(Output(GRAD, key, gname))

    # Keep graph order within each phase; forward first.
    nodes.sort(key=lambda nd: 0 if nd.phase == FORWARD else 1)
    header = Header(model=model_name, device=_device_of(params, buffers, inputs), output_spec=pytree.treespec_dumps(spec),
                    has_loss=has_loss, guards=list(guards))
    if symbolic is not None:
        header.sizes, header.size_guards = symbolic.header()
    program = Program(header=header, values=values, nodes=nodes, forward=[], backward=[], outputs=outputs)
    header.fingerprint = fingerprint(program)
    program.forward, program.backward = default_schedule(program)
    return program


def _storage_key(n) -> int:
    val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return val.untyped_storage()._cdata if isinstance(val, torch.Tensor) else -1


def _constant_as_full(gm, n) -> None:
    """A tensor constant the model makes in its forward (`torch.tensor(...)`)
    becomes an `aten.full` node when all its elements are equal; a program has
    no other way to hold data."""
    c = getattr(gm, n.target)
    flat = c.detach().reshape(-1)
    if flat.numel() and not bool((flat == flat[0]).all()):
        users = ", ".join(str(u.target) for u in n.users)
        raise TraceError(f"the model creates a non-uniform tensor constant of shape {list(c.shape)} in its "
                         f"forward (used by {users}); register it as a buffer instead")
    fill = flat[0].item() if flat.numel() else 0
    n.meta["val"] = c
    n.meta["full_args"] = [ir.Seq(list(c.shape)), _arg(fill, {})]
    n.meta["full_kwargs"] = {"dtype": ir.DType(_dtype_name(c.dtype)), "layout": ir.Layout("strided"),
                             "device": ir.Device(str(c.device)), "pin_memory": False}


def _module_stack_of_users(n) -> dict:
    for u in n.users:
        if u.meta.get("nn_module_stack"):
            return u.meta["nn_module_stack"]
    return {}


def _device_of(params, buffers, inputs) -> str:
    """Where the step runs: the device type of the first parameter, buffer or
    input tensor (fake tensors carry the device they stand for)."""
    for t in [p for _, p, _ in params] + [b for _, b, _ in buffers] + list(inputs):
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def _backward_module(n, module_of, forward_set) -> str:
    """Name a backward op after the forward op whose saved values it reads."""
    best = ""
    for a in n.all_input_nodes:
        if a in forward_set or (a.target is operator.getitem and a.args[0] in forward_set):
            src = a.args[0] if a.target is operator.getitem else a
            m = module_of.get(src, "")
            if len(m) > len(best):
                best = m
    if best:
        return best
    for a in n.all_input_nodes:
        src = a.args[0] if a.target is operator.getitem else a
        if src in module_of:
            return module_of[src]
    return ""


def _op_string(op: torch._ops.OpOverload) -> str:
    ns = op.namespace
    return f"{ns}.{op._opname}.{op._overloadname}"


def _is_random(op) -> bool:
    return isinstance(op, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in op.tags or op in RANDOM_OPS)


def _mutated_args(n) -> list:
    """The fx nodes `n` writes in place: its arguments the schema marks
    written (`Tensor(a!)`), positional or keyword (`out=` of an `.out`
    overload: trl's chunked loss writes `mm(..., out=rows)`), and those of
    the ops whose schemas hide a write (`HIDDEN_MUTATORS`)."""
    op = n.target
    if not isinstance(op, torch._ops.OpOverload):
        return []
    key = _op_string(op)
    if key in HIDDEN_MUTATORS:
        flag, idx = HIDDEN_MUTATORS[key]
        training = True if flag is None else n.args[flag] if len(n.args) > flag else False
        return [n.args[i] for i in idx if training and i < len(n.args) and isinstance(n.args[i], torch.fx.Node)]
    out = []
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        x = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
        if isinstance(x, torch.fx.Node):
            out.append(x)
    return out


def _is_size(n) -> bool:
    """An fx node that computes a size (sym_size, a product of sizes), not a tensor."""
    return n.op == "call_function" and isinstance(n.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat))


def _arg(a, names, symbolic=None) -> ir.Arg:
    if isinstance(a, torch.fx.Node) and symbolic is not None and _is_size(a):
        size = symbolic.size(a.meta["val"])
        return size if type(size) is int else ir.Sym(size)
    if isinstance(a, torch.SymInt) and symbolic is not None:
        size = symbolic.size(a)
        return size if type(size) is int else ir.Sym(size)
    if isinstance(a, torch.fx.Node):
        key = (a, None)
        if key not in names:
            raise TraceError(f"operand {a.name} has no tensor value")
        return ir.Ref(names[key])
    if isinstance(a, (list, tuple)):
        return ir.Seq([_arg(x, names, symbolic) for x in a])
    if isinstance(a, bool) or a is None or isinstance(a, (int, str)):
        return a
    if isinstance(a, float):
        if a != a:
            return ir.Special("nan")
        if a in (float("inf"), float("-inf")):
            return ir.Special("inf" if a > 0 else "-inf")
        return a
    if isinstance(a, torch.dtype):
        return ir.DType(_dtype_name(a))
    if isinstance(a, torch.device):
        return ir.Device(str(a))
    if isinstance(a, torch.layout):
        return ir.Layout(str(a).removeprefix("torch."))
    if isinstance(a, torch.memory_format):
        return ir.MemoryFormat(str(a).removeprefix("torch."))
    raise TraceError(f"unsupported operand {a!r} of type {type(a).__name__}")


def _flops(n, symbolic=None) -> float:
    """FLOPs of one op: torch's formulas for matmuls/convs/attention, one per
    output element for everything else, zero for views.  In a symbolic
    trace, at the traced call's sizes (a cost weight, not a size)."""
    if symbolic is not None:
        return _flops_of(n, symbolic.hint)
    return _flops_of(n, lambda x: x)


def _flops_of(n, hint) -> float:
    op = n.target
    val = n.meta.get("val")
    if "flops" in n.meta:  # set by a rewrite that fused several ops
        return n.meta["flops"]
    if op._overloadpacket in flop_registry:
        try:
            args = pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a, n.args)
            kwargs = pytree.tree_map(lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a,
                                     n.kwargs)
            return float(hint(flop_registry[op._overloadpacket](*args, **kwargs, out_val=val)))
        except Exception:  # noqa: BLE001 - fall back to the elementwise estimate
            pass
    if op.is_view or any(r.alias_info is not None for r in op._schema.returns):
        return 0.0
    outs = val if isinstance(val, (tuple, list)) else [val]
    return float(sum(hint(t.numel()) for t in outs if isinstance(t, torch.Tensor)))
