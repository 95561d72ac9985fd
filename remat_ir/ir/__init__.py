"""The IR: the types every stage shares (`types`), and the `.rir` text that
people read and edit.

This package imports nothing else of remat-ir: every other stage depends on
it, and it on none of them.
"""
from __future__ import annotations

from remat_ir.ir.types import (  # noqa: F401 - the package's face
    BACKWARD, BUFFER, COMPUTE, COST_FLOPS, COST_MODELS, COST_PROFILE, DTYPE_BYTES, DTYPE_LONG,
    DTYPE_SHORT, FORMAT_VERSION, FORWARD, FREE, GRAD, INPUT, INSTR_KINDS, MAX_NESTING, NODE_INSTRS, OFFLOAD,
    PARAM, RECOMPUTE, RELOAD, RESULT, TANGENT, TRANSFER_INSTRS, VALUE, VALUE_KINDS, WAIT, Arg, Budget, Device,
    DType, Header, Instr, Layout, MemoryFormat, Node, Output, Program, Ref, Seq, Special, Sym, Value, arg_depth,
    arg_refs, contiguous_stride, from_json, from_msgpack, hand_overs, node_inputs, to_json, to_msgpack,
)
