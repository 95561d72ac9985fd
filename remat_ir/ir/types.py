"""The IR: the one contract between remat-ir's stages.

A `Program` is a graph (what every value is and how it is computed) plus a
schedule (when each value exists).  The tracer builds both; the optimizer only
rewrites the schedule; the verifier checks the schedule against the graph; the
interpreter executes the schedule.  Everything here is a plain msgspec Struct so
a program also round-trips through JSON and msgpack.

Memory is accounted per *storage*: a view names the value that owns its
storage in `Value.storage` and owns no bytes itself.
"""
from __future__ import annotations

from typing import Union

import msgspec

FORMAT_VERSION = 1

COST_FLOPS = "flops"
COST_PROFILE = "profile"
COST_MODELS = (COST_FLOPS, COST_PROFILE)

# State tensors an optimizer keeps per trainable parameter, each of the
# parameter's shape and dtype: SGD with momentum one (the momentum buffer),
# Adam two (first and second moments).  `Header.optimizer` names a row; the
# simulator predicts these bytes and the runtime allocates these tensors.
OPTIMIZER_STATES = {"none": 0, "sgd": 1, "adam": 2}

# What a budget measures (`Budget.scope`).  "activations": what the step adds
# on top of parameters, gradients and optimizer state, the part recomputation
# can shrink (what a budget fraction means in activation checkpointing);
# "total": everything live in the step.  DEFAULT_SCOPE is the default of every
# entry point that takes a budget: compile, fit, budget_bytes, wrap, the
# optimizer's functions and remat-compile --scope.
SCOPES = ("total", "activations")
DEFAULT_SCOPE = "activations"

# ---------------------------------------------------------------- arguments


class Ref(msgspec.Struct, tag="ref", frozen=True):
    """A tensor operand: the name of a value."""

    name: str


class DType(msgspec.Struct, tag="dtype", frozen=True):
    name: str  # torch attribute name: "float32", "int64", "bool"


class Device(msgspec.Struct, tag="device", frozen=True):
    name: str  # "cpu", "cuda", "cuda:0"


class Layout(msgspec.Struct, tag="layout", frozen=True):
    name: str  # "strided"


class MemoryFormat(msgspec.Struct, tag="memory_format", frozen=True):
    name: str  # "contiguous_format", "preserve_format", ...


class Special(msgspec.Struct, tag="special", frozen=True):
    """A float JSON cannot carry: "inf", "-inf" or "nan"."""

    name: str


class Sym(msgspec.Struct, tag="sym", frozen=True):
    """An integer argument that depends on sizes varying between calls: an
    expression over the header's size symbols (`B*T`; `remat_ir.ir.sizes`)."""

    expr: str


class Seq(msgspec.Struct, tag="list", frozen=True):
    """A list argument (`[128]`, a list of tensors, ...)."""

    items: list[Arg]


Arg = Union[Ref, DType, Device, Layout, MemoryFormat, Special, Sym, Seq, bool, int, float, str, None]

# ------------------------------------------------------------------- values

# Kinds of values that exist before the step starts (graph inputs).
INPUT = "input"  # an argument of the model's forward
PARAM = "param"  # an nn.Parameter
BUFFER = "buffer"  # a registered buffer (BatchNorm running stats, ...)
TANGENT = "tangent"  # the gradient of a forward result, given by loss.backward()
VALUE = "value"  # produced by a node of the graph
VALUE_KINDS = (INPUT, PARAM, BUFFER, TANGENT, VALUE)


class Value(msgspec.Struct, omit_defaults=True):
    name: str
    kind: str
    dtype: str  # torch attribute name, e.g. "float32"
    # A dimension, stride or byte count is an int, or in a symbolic plan an
    # expression over its size symbols ("B*T"; `remat_ir.ir.sizes`).
    shape: list[int | str]
    stride: list[int | str]
    storage: str  # name of the value owning the storage; == name for an owner
    nbytes: int | str  # bytes of the storage this value owns (0 for a view)
    source: str = ""  # params/buffers: the module attribute path; inputs: the argument name
    requires_grad: bool = False
    aliases: list[str] = []  # other attribute paths of a tied parameter
    # The 1-based `.rir` line that declares it (a value declared on a node line: that
    # node's line); 0 when made in memory.  Like `Instr.line`, only for messages.
    line: int = 0


# -------------------------------------------------------------------- nodes

FORWARD = "forward"
BACKWARD = "backward"


class Node(msgspec.Struct, omit_defaults=True):
    """One aten op call.  Its outputs are values; "" marks a non-tensor output."""

    name: str
    op: str  # "aten.addmm.default"
    args: list[Arg]
    kwargs: dict[str, Arg]
    outputs: list[str]
    phase: str  # FORWARD or BACKWARD
    module: str = ""  # module path the op ran in ("transformer.h.0.attn")
    random: bool = False  # draws from the RNG: a recompute must replay its state
    mutates: list[str] = []  # operands written in place
    flops: float = 0.0  # cost model: floating point operations
    time_us: float = 0.0  # cost model: measured run time in microseconds (0: not measured)
    line: int = 0  # the 1-based `.rir` line it is on (0: made in memory); only for messages


# ----------------------------------------------------------------- schedule

COMPUTE = "compute"
RECOMPUTE = "recompute"
FREE = "free"
# Offload: a value's storage copied to host memory and back
# (`remat_ir.check.simulate` states what each does).  `offload V` starts the
# copy of V to a host buffer, `reload V` starts the copy back into a fresh
# device storage, and `wait V` ends the copy in flight (after an offload, V's
# device storage is released; after a reload, V is readable again).
OFFLOAD = "offload"
RELOAD = "reload"
WAIT = "wait"
INSTR_KINDS = (COMPUTE, RECOMPUTE, FREE, OFFLOAD, RELOAD, WAIT)
NODE_INSTRS = (COMPUTE, RECOMPUTE)  # name a node; the others name a value
TRANSFER_INSTRS = (OFFLOAD, RELOAD, WAIT)


class Instr(msgspec.Struct, omit_defaults=True):
    """`compute`/`recompute` name a node; `free`, `offload`, `reload` and
    `wait` name a value.

    `line` is the 1-based line in the `.rir` text it was parsed from (0 when
    the instruction was made in memory); it exists so errors can name it.
    """

    kind: str
    target: str
    line: int = 0


# ------------------------------------------------------------------ outputs

RESULT = "result"  # a forward output handed to the caller
GRAD = "grad"  # the gradient of a parameter or an input


class Output(msgspec.Struct, omit_defaults=True):
    """`result` outputs are keyed by position ("0"), `grad` outputs by the
    parameter or input value they are the gradient of."""

    kind: str
    key: str
    value: str
    line: int = 0


# ------------------------------------------------------------------ program


class Budget(msgspec.Struct, omit_defaults=True):
    bytes: int
    # One of SCOPES.  This default belongs to the JSON and msgpack forms (they
    # leave a "total" scope out), not to the entry points (DEFAULT_SCOPE).
    scope: str = "total"


class Header(msgspec.Struct, omit_defaults=True):
    version: int = FORMAT_VERSION
    model: str = ""
    fingerprint: str = ""  # hash of parameter names, shapes, dtypes and of the graph
    device: str = "cpu"
    # What the optimizer minimizes: "flops" (Node.flops) or "profile" (Node.time_us, measured
    # on `device`).
    cost: str = "flops"
    # The training optimizer (torch.optim) whose state the prediction and a total budget
    # include: none, sgd, adam (OPTIMIZER_STATES), and the bytes of that state.
    optim: str = "none"
    optim_state_bytes: int = 0
    budget: Budget | None = None
    # Bytes of host memory the plan's offloaded copies may hold at once (`host_budget N bytes`);
    # None: no host budget.  Like `budget`, the schedule's business, not the model's.
    host_budget: int | None = None
    output_spec: str = ""  # torch.utils._pytree treespec of the forward results, serialized
    has_loss: bool = False  # the program includes the loss function given at compile time
    # Graph rewrites applied to the traced step, in order (`remat_ir.rewrite`):
    # "batchnorm_split", "chunked_loss:8".  Applying them to a fresh trace of
    # the model gives this graph again.
    rewrites: list[str] = []
    # The caller's `torch.autocast` the step was traced under: "<device type>:<dtype>"
    # ("cpu:bfloat16"); empty when none was on.  The step runs only under the same.
    autocast: str = ""
    # A compiled backward (`remat_ir.backend`): it returns its gradients together
    # when it ends, so each is held from its computation until then
    # (`remat_ir.trace.joint.hold_gradients`), and the simulator counts the
    # storage a gradient output views as gradients, not as step memory, from
    # its allocation: a budget in scope "activations" leaves them out.
    held_gradients: bool = False
    # The call's non-tensor arguments, each "name=literal" (a Python literal:
    # "scale=2.0", "use_cache=False"); a call with other values is another step.
    constants: list[str] = []
    # Decisions the model's code took on the values of its inputs (an all-ones
    # mask), each "expression == literal" over the inputs' names, aten ops only
    # (`remat_ir.trace.guards`): the step is this graph only while they hold.
    guards: list[str] = []
    # A symbolic plan (`remat_ir.ir.sizes`): each size symbol and the range of
    # sizes the plan covers, "T=32..128"; and the conditions on the sizes the
    # traced code assumed ("T <= 128").  Empty: every size is a number.
    sizes: list[str] = []
    size_guards: list[str] = []
    comment: list[str] = []  # free text printed as `#` lines at the top
    # Header line name (`rir`, `model`, `fingerprint`, `device`, `cost`, `optimizer`,
    # `budget`, `host_budget`, `has_loss`, `output_spec`, ...) -> its 1-based `.rir` line, for messages;
    # empty when made in memory.  Never printed.
    lines: dict[str, int] = {}


class Program(msgspec.Struct, omit_defaults=True):
    header: Header
    values: list[Value]
    nodes: list[Node]
    forward: list[Instr]
    backward: list[Instr]
    outputs: list[Output]

    # Lookups are rebuilt on demand; Programs are small enough that a dict per
    # call site is cheaper than keeping caches coherent under edits.
    def value_map(self) -> dict[str, Value]:
        return {v.name: v for v in self.values}

    def node_map(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def producer_map(self) -> dict[str, Node]:
        """Value name -> the node that produces it."""
        return {o: n for n in self.nodes for o in n.outputs if o}


# -------------------------------------------------------------- arg helpers


# How deep list arguments may nest (`[1]` is 1 deep, `[[1]]` 2).  The ops a
# plan calls take flat lists (`int[]`, `Tensor?[]`); the `.rir` reader
# refuses deeper lists at their line, the verifier those of a program built
# in memory, and the printer does not write them, so code that walks an
# argument recursively (the type checker's fake run, the code generator)
# never meets more.  The walkers here are iterative: they take any depth.
MAX_NESTING = 32


def arg_refs(arg: Arg) -> list[str]:
    """Names of the values an argument refers to, in order."""
    if isinstance(arg, Ref):
        return [arg.name]
    if not isinstance(arg, Seq):
        return []
    out: list[str] = []
    stack = [iter(arg.items)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, Ref):
                out.append(item.name)
            elif isinstance(item, Seq):
                stack.append(iter(item.items))
                break
        else:
            stack.pop()
    return out


def arg_depth(arg: Arg, limit: int | None = None) -> int:
    """How deep lists nest in `arg`: 0 for a scalar, 1 for `[1, 2]`, 2 for
    `[[1], []]`.  With `limit`, stops counting past it (returns limit + 1)."""
    depth, level = 0, [arg]
    while True:
        lists = [a for a in level if isinstance(a, Seq)]
        if not lists:
            return depth
        depth += 1
        if limit is not None and depth > limit:
            return depth
        level = [item for a in lists for item in a.items]


def node_inputs(node: Node) -> list[str]:
    """Distinct value names a node reads, in first-use order."""
    seen: dict[str, None] = {}
    for a in list(node.args) + list(node.kwargs.values()):
        for r in arg_refs(a):
            seen.setdefault(r, None)
    return list(seen)


def hand_overs(program: "Program") -> dict[int, list[str]]:
    """When each gradient output goes to autograd: backward instruction index
    -> the gradient values handed over right after it.  That is the last
    instruction that writes the gradient's storage: the one computing it, or
    a later one updating it in place (a chunked loss allocates the weight's
    gradient and fills it slice by slice with `mm(..., out=rows)`), so every
    write lands before autograd takes it.  Stated once, for the simulator,
    the verifier and the interpreter alike."""
    values = program.value_map()
    nodes = program.node_map()
    grads = {o.value for o in program.outputs if o.kind == GRAD}
    by_storage: dict[str, list[str]] = {}
    for g in grads:
        if g in values:
            by_storage.setdefault(values[g].storage, []).append(g)
    last: dict[str, int] = {}
    for i, ins in enumerate(program.backward):
        node = nodes.get(ins.target) if ins.kind in NODE_INSTRS else None
        if node is None:
            continue
        for o in node.outputs:
            if o in grads:
                last[o] = i
        for m in node.mutates:
            if m in values:
                for g in by_storage.get(values[m].storage, ()):
                    if g in last:
                        last[g] = i
    at: dict[int, list[str]] = {}
    for g, i in sorted(last.items(), key=lambda kv: kv[1]):
        at.setdefault(i, []).append(g)
    return at


# ------------------------------------------------------------- serialization

_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder(Program)
_msgpack_encoder = msgspec.msgpack.Encoder()
_msgpack_decoder = msgspec.msgpack.Decoder(Program)


def to_json(program: Program) -> bytes:
    return _json_encoder.encode(program)


def from_json(data: bytes | str) -> Program:
    return _json_decoder.decode(data)


def to_msgpack(program: Program) -> bytes:
    return _msgpack_encoder.encode(program)


def from_msgpack(data: bytes) -> Program:
    return _msgpack_decoder.decode(data)


# ------------------------------------------------------------------- dtypes

# Short names shown in `.rir` text, and their element sizes.
DTYPE_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8",
    "bool": "b8", "complex64": "c64", "complex128": "c128",
    "float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2",
}
DTYPE_LONG = {v: k for k, v in DTYPE_SHORT.items()}
DTYPE_BYTES = {
    "float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def contiguous_stride(shape: list[int]) -> list[int]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return stride[::-1]
