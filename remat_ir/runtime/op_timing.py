"""Measure each op's run time on the target device: the `profile` cost model
(`Node.time_us`, read by the optimizer when the header says `cost profile`)."""
from __future__ import annotations

import statistics
import time

import msgspec

from remat_ir.ir import (
    BUFFER, COMPUTE, COST_PROFILE, INPUT, PARAM, TANGENT, Node, Program, Ref, Seq,
)


class ProfileError(ValueError):
    """The program cannot be profiled with the model and inputs given."""



def profile_costs(program: Program, module, inputs, *, repeats: int = 5, warmup: int = 1,
                  pool: bool = True) -> Program:
    """`program` with `Node.time_us` measured for every node and `cost profile`.

    Runs the default schedule (graph order, each value freed after its last
    use, so memory stays at the unoptimized peak) op by op on `module`'s
    parameters and buffers and on `inputs`, on the device they live on; each
    op is run `warmup` times untimed, then `repeats` times, and its cost is
    the median.  With `pool`, ops with the same call signature (op, operand
    shapes, dtypes, strides, other arguments) share the median of all their
    runs: repeated blocks then get identical costs and timing noise shrinks.

    Tangents (the gradient of each forward result) are ones.  Ops that update
    a tensor in place see the same input on every run (it is restored
    between runs), and the model's own buffers are never updated.  The RNG
    state is forked, so profiling draws nothing from the model's stream.  On
    CUDA each op is timed with CUDA events, synchronized once at the end: a
    host timer around a device sync would add the sync's own latency to
    every op.
    """
    import torch

    from remat_ir.runtime.interpret import resolve_op
    from remat_ir.ir.ops import torch_arg
    from remat_ir.ir.schedule import default_schedule

    if repeats < 1 or warmup < 0:
        raise ProfileError(f"repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    values = program.value_map()
    graph_inputs = [v for v in program.values if v.kind == INPUT]
    if len(graph_inputs) != len(inputs):
        raise ProfileError(f"the program takes {len(graph_inputs)} inputs "
                           f"({', '.join(v.name for v in graph_inputs)}); got {len(inputs)}")
    mutated = {values[m].storage for n in program.nodes for m in n.mutates}

    env: dict[str, torch.Tensor] = {}
    for v in program.values:
        t = None
        if v.kind == PARAM:
            t = module.get_parameter(v.source)
        elif v.kind == BUFFER:
            t = module.get_buffer(v.source)
        if t is not None:
            t = t.detach()
            # A copy, so profiling never updates the model (BatchNorm running stats).
            env[v.name] = t.clone() if v.storage in mutated else t
    for v, x in zip(graph_inputs, inputs):
        if not isinstance(x, torch.Tensor) or list(x.shape) != v.shape:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ProfileError(f"input {v.name}: the program was traced with {v.dtype}{v.shape}, got {got}")
        if x.device.type == "meta" or type(x).__name__ == "FakeTensor":
            raise ProfileError(f"input {v.name} is a fake tensor: profiling needs real tensors "
                               "(trace without --fake)")
        env[v.name] = x.detach().clone() if v.storage in mutated else x.detach()
    device = next(iter(env.values())).device if env else torch.device(program.header.device)
    for v in program.values:
        if v.kind == TANGENT:
            env[v.name] = torch.empty_strided(v.shape, v.stride, dtype=getattr(torch, v.dtype),
                                              device=device).fill_(1)

    cuda = device.type == "cuda"

    def arg(a):
        return torch_arg(a, env.__getitem__)

    samples: dict[str, list] = {}  # seconds, or CUDA (start, end) event pairs until the end
    nodes = program.node_map()
    fwd, bwd = default_schedule(program)
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if cuda else []):
        for ins in fwd + bwd:
            if ins.kind != COMPUTE:
                env.pop(ins.target, None)
                continue
            node = nodes[ins.target]
            op = resolve_op(node.op)
            args = [arg(a) for a in node.args]
            kwargs = {k: arg(a) for k, a in node.kwargs.items()}
            saved = [(env[m], env[m].clone()) for m in dict.fromkeys(node.mutates)]
            times = []
            out = None
            for r in range(warmup + repeats):
                for t, copy in saved:
                    t.copy_(copy)
                out = None  # the previous run's outputs are freed before the next one allocates
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = op(*args, **kwargs)
                    end.record()
                    if r >= warmup:
                        times.append((start, end))
                else:
                    t0 = time.perf_counter()
                    out = op(*args, **kwargs)
                    if r >= warmup:
                        times.append(time.perf_counter() - t0)
            del saved, args, kwargs
            samples[node.name] = times
            outs = node.outputs
            if len(outs) == 1 and isinstance(out, torch.Tensor):
                env[outs[0]] = out
            else:
                for k, o in enumerate(outs):
                    if o:
                        env[o] = out[k]
            del out
    env.clear()
    if cuda:
        torch.cuda.synchronize(device)
        samples = {nm: [a.elapsed_time(b) / 1e3 for a, b in ts] for nm, ts in samples.items()}

    cost: dict[str, float] = {}
    if pool:
        groups: dict[tuple, list[str]] = {}
        for n in program.nodes:
            groups.setdefault(_signature(n, values), []).append(n.name)
        for names in groups.values():
            med = statistics.median(t for nm in names for t in samples[nm])
            for nm in names:
                cost[nm] = med
    else:
        cost = {nm: statistics.median(ts) for nm, ts in samples.items()}
    # Rounded to the nanosecond so the plan text stays short; never 0, which means "not measured".
    new_nodes = [msgspec.structs.replace(n, time_us=max(round(cost[n.name] * 1e6, 3), 0.001))
                 for n in program.nodes]
    header = msgspec.structs.replace(program.header, cost=COST_PROFILE,
                                     comment=list(program.header.comment))
    return msgspec.structs.replace(program, header=header, nodes=new_nodes)


def _signature(node: Node, values) -> tuple:
    """What a node's run time depends on: the op, its operands' layouts and
    its other arguments (not the operands' names or contents)."""
    def sig(a):
        if isinstance(a, Ref):
            v = values[a.name]
            return ("T", v.dtype, tuple(v.shape), tuple(v.stride))
        if isinstance(a, Seq):
            return ("S",) + tuple(sig(x) for x in a.items)
        return repr(a)

    return (node.op, tuple(sig(a) for a in node.args),
            tuple(sorted((k, sig(a)) for k, a in node.kwargs.items())))


