"""BatchNorm in training, split so its output can be recomputed.

`native_batch_norm(x, w, b, running_mean, running_var, training=True, ...)`
normalizes `x` by its batch statistics and updates the running statistics in
place.  An update can never run twice, so the op is never recomputed, and
every BatchNorm's output (usually a ReLU's input) stays alive into backward.
The rewrite makes it two nodes:

    bn.batch_norm_update_stats   = batch_norm_update_stats(x, running_mean, running_var, momentum)
    bn.native_batch_norm         = native_batch_norm(x, w, b, None, None, True, momentum, eps)

The first updates the running statistics (once, in forward); the second
reads no running statistics, so it is pure and can be recomputed in backward
like any other op.  The second recomputes the batch statistics rather than
reading the saved ones: ATen has no CPU kernel that normalizes by given
statistics with the training kernel's bits, and computing them again from
the same input gives the same bits, so the output, the saved mean and invstd
and the running statistics are all eager's, bit for bit
(tests/test_rewrites.py checks it).  The cost is one more pass over `x` in
forward.
"""
from __future__ import annotations

import math

import msgspec

from remat_ir.ir import FORWARD, Program, Ref

NAME = "batchnorm_split"
_BN = "aten.native_batch_norm.default"


def candidates(program: Program) -> list[str]:
    """Names of the BatchNorm nodes in training mode that update running statistics."""
    return [n.name for n in program.nodes
            if n.op == _BN and n.phase == FORWARD and n.args[5] is True and n.mutates
            and isinstance(n.args[3], Ref) and isinstance(n.args[4], Ref)]


def split_batchnorm(program: Program) -> Program:
    """`program` with every training BatchNorm split (see the module's
    docstring), and the unoptimized schedule for the new graph."""
    from remat_ir.rewrite.build import GraphEdit

    todo = set(candidates(program))
    g = GraphEdit(program)
    nodes = []
    for n in program.nodes:
        if n.name not in todo:
            nodes.append(n)
            continue
        x, w, b, rm, rv, _, momentum, eps = n.args[:8]
        stats = g.node(f"{n.module or n.name}.batch_norm_update_stats", "aten.batch_norm_update_stats.default",
                       [x, rm, rv, momentum], FORWARD, n.module, mutates=[rm.name, rv.name],
                       flops=math.prod(g.values[x.name].shape))
        nodes.append(stats)
        nodes.append(msgspec.structs.replace(n, args=[x, w, b, None, None, True, momentum, eps], mutates=[]))
    return g.program_of(nodes, list(program.outputs), NAME)
