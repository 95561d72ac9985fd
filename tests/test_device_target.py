"""Plans traced for the device they run on, checked on CPU: a CUDA plan made
on a CPU-only build is device-neutral (CUDA's dropout, SDPA's math backend,
no CPU-only or unproven fused ops); retargeting and wrapping refuse CPU-only
ops; a plan runs only under the autocast it was traced under; profiling leaves the RNG stream alone."""
from __future__ import annotations

import textwrap

import pytest
import torch

from remat_ir import ir
from remat_ir.ir.ops import CPU_ONLY_OPS, cpu_only, device_problems
from remat_ir.runtime.bind import PlanMismatch
from remat_ir.runtime.interpret import wrap
from remat_ir.runtime.load import load_model
from remat_ir.trace.device import DeviceError, device_neutral, is_neutral, retarget
from remat_ir.pipeline import trace_builtin
from remat_ir.trace.tracer import trace_module

# With a CUDA device, a CUDA trace is made under fake CUDA tensors, not device-neutral.
neutral = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the trace made without a CUDA device")


def _devices(p) -> set[str]:
    def walk(a):
        if isinstance(a, ir.Device):
            yield a.name
        elif isinstance(a, ir.Seq):
            for x in a.items:
                yield from walk(x)

    return {d for n in p.nodes for a in list(n.args) + list(n.kwargs.values()) for d in walk(a)}


def _assert_cuda_plan(p):
    ops = [n.op for n in p.nodes]
    assert p.header.device == "cuda" and is_neutral(p)
    assert device_problems(ops, "cuda") == []
    assert not any(op.startswith("remat.") for op in ops), "a fusion unproven on CUDA"
    assert "aten.native_dropout.default" in ops and "aten.bernoulli_.float" not in ops
    assert _devices(p) <= {"cuda:0"}


def test_cpu_only_ops_by_name():
    assert cpu_only("aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert cpu_only("aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
    assert cpu_only("aten.mkldnn_convolution.default")
    assert all(cpu_only(op) for op in CPU_ONLY_OPS)
    assert not cpu_only("aten.native_dropout.default") and not cpu_only("aten.mm.default")
    assert device_problems(["remat.dropout_keep.default", "aten.mm.default"], "cpu") == []


def test_cpu_plans_keep_their_fusions():
    ops = {n.op for n in trace_builtin("gpt2-tiny", fake=True).nodes}
    assert {"remat.dropout_keep.default", "remat.nll_log_softmax_backward.default"} <= ops


@neutral
def test_builtin_gpt2_cuda_plan_is_device_neutral():
    m = load_model("gpt2-tiny", fake=True)
    p = trace_module(m.module, m.inputs, loss_fn=m.loss, model_name="gpt2-tiny", fake=True, device="cuda")
    _assert_cuda_plan(p)
    # Without fusions the CPU trace of the same model keeps eager CPU's dropout chain.
    eager_cpu = trace_module(m.module, m.inputs, loss_fn=m.loss, fake=True, fuse=False)
    assert "aten.bernoulli_.float" in {n.op for n in eager_cpu.nodes}


def _hf_model_file(tmp_path, attn_pdrop=0.1):
    pytest.importorskip("transformers")
    f = tmp_path / "hf_sdpa.py"
    f.write_text(textwrap.dedent(f"""
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        class WithLoss(torch.nn.Module):
            def __init__(self, config):
                super().__init__()
                self.model = GPT2LMHeadModel(config)
                self.model.loss_type = "ForCausalLM"

            def forward(self, input_ids, labels):
                return self.model(input_ids=input_ids, labels=labels).loss

        def build(batch: int = 2, seq: int = 32, seed: int = 0):
            config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop={attn_pdrop},
                                bos_token_id=255, eos_token_id=255, attn_implementation="sdpa")
            torch.manual_seed(seed)
            ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))
            return WithLoss(config).train(), (ids, ids.clone())
    """))
    return f


@neutral
def test_transformers_sdpa_cuda_plan_is_device_neutral(tmp_path):
    m = load_model(str(_hf_model_file(tmp_path)), fake=True)
    cpu = trace_module(m.module, m.inputs, fake=True)
    p = trace_module(m.module, m.inputs, fake=True, device="cuda")
    _assert_cuda_plan(p)
    # SDPA's attention dropout is a native_dropout of its own: 2 blocks x 3 + the embedding's.
    assert sum(n.op == "aten.native_dropout.default" for n in p.nodes) == 7
    assert "aten._safe_softmax.default" in {n.op for n in p.nodes}
    assert {n.op for n in cpu.nodes} != {n.op for n in p.nodes}


@neutral
def test_sdpa_flash_for_cpu_is_refused_for_cuda():
    """A CPU trace whose SDPA took CPU's flash kernel cannot be pointed at CUDA."""
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(16, 16)

        def forward(self, x):
            q = self.w(x).view(2, 2, 8, 8)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

    x = torch.randn(2, 8, 16)
    cpu = trace_module(Attn(), (x,), fake=True)
    assert any(cpu_only(n.op) for n in cpu.nodes)
    with pytest.raises(DeviceError, match="_for_cpu"):
        retarget(cpu, "cuda")
    p = trace_module(Attn(), (x,), fake=True, device="cuda")
    assert device_problems([n.op for n in p.nodes], "cuda") == []
    # The math backend it records instead gives SDPA's values.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from remat_ir.trace.device import _sdpa_math

    q = torch.randn(2, 2, 8, 8)
    m = torch.rand(8, 8) > 0.3
    with sdpa_kernel(SDPBackend.MATH):
        for kw in ({"is_causal": True}, {"attn_mask": m}, {"attn_mask": torch.randn(8, 8)}, {"scale": 0.3}):
            assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, q, q, **kw),
                               _sdpa_math(q, q, q, **kw))


def test_retarget_refuses_cpu_fusions_by_name():
    p = trace_builtin("gpt2-tiny", fake=True)
    with pytest.raises(DeviceError, match=r"remat\.dropout_keep\.default.*device='cuda'"):
        retarget(p, "cuda")


def test_wrap_refuses_a_cuda_plan_holding_cpu_only_ops():
    from remat_ir.ir.fingerprint import fingerprint

    m = load_model("mlp")
    p = trace_module(m.module, m.inputs, loss_fn=m.loss, model_name="mlp")
    p.header.device = "cuda"  # as an older retarget did, keeping CPU's fused dropout
    p.header.fingerprint = fingerprint(p)
    with pytest.raises(PlanMismatch, match=r"holds ops .*remat\.dropout_keep.*device=.cuda."):
        wrap(m.module, p, loss=m.loss, check_model=False)


def test_outer_autocast_other_than_the_plans_is_refused():
    m = load_model("mlp")
    p = trace_module(m.module, m.inputs, loss_fn=m.loss, model_name="mlp")
    w = wrap(m.module, p, loss=m.loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(PlanMismatch, match=r"the step runs under torch.autocast\('cpu', dtype=torch.bfloat16\) "
                                               "but the plan was made under no autocast"):
            w(*m.inputs)
        with torch.no_grad():
            w(*m.inputs)  # evaluation runs the model eagerly: autocast is the caller's business
    w(*m.inputs).backward()


def test_autocast_inside_forward_traces_and_runs():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = torch.relu(self.a(x))
            return self.b(h.float()).square().mean()

    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(8, 16)
    w = wrap(model, trace_module(model, (x,)))
    w(x).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))


@neutral
def test_recomputed_native_dropout_replays():
    """The CUDA plan at its floor recomputes native_dropout in backward;
    pointed back at CPU, it gives the gradients of eager run the same way."""
    pytest.importorskip("cvxpy")
    from remat_ir.ir import RECOMPUTE
    from remat_ir.pipeline import fit, trace

    m = load_model("mlp", fake=True)
    p = fit(trace(m.module, m.inputs, loss=m.loss, name="mlp", fake=True, device="cuda"), "floor",
            scope="activations")
    assert any(i.kind == RECOMPUTE and p.node_map()[i.target].op == "aten.native_dropout.default"
               for i in p.backward)
    retarget(p, "cpu")
    real = load_model("mlp")
    w = wrap(real.module, p, loss=real.loss)  # the model check retraces device-neutral too

    def grads(step):
        real.module.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        step().backward()
        return [q.grad.clone() for q in real.module.parameters()]

    def eager():
        with device_neutral():
            out = real.module(*real.inputs)
        return real.loss(out, *real.inputs) if real.loss is not None else out

    assert all(torch.equal(a, b) for a, b in zip(grads(eager), grads(lambda: w(*real.inputs))))


def test_profile_keeps_the_rng_stream():
    from remat_ir.runtime.op_timing import profile_costs

    m = load_model("mlp")
    p = trace_module(m.module, m.inputs, loss_fn=m.loss)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    q = profile_costs(p, m.module, m.inputs, repeats=1, warmup=0)
    assert torch.equal(before, torch.get_rng_state())
    assert all(n.time_us > 0 for n in q.nodes)
