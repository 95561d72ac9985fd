"""CUDA: the plan runs on the GPU with gradients equal to eager and the
predicted peak measured by torch.cuda.max_memory_allocated.  Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", ["gpt2-tiny", "mlp"])
def test_cuda_run_matches_eager_and_prediction(name):
    from remat_ir.runtime.load import load_model
    from remat_ir.runtime.run import run_plan
    from remat_ir.trace.tracer import trace_module

    m = load_model(name, device="cuda")
    program = trace_module(m.module, m.inputs, loss_fn=m.loss, model_name=name)
    program.header.device = "cuda"
    r = run_plan(program, load_model(name, device="cuda"), steps=3, device="cuda", check=True)
    assert r.grads_match, [c for c in r.checks]
    assert r.within_tolerance(), (r.predicted.peak_bytes, r.measured_peak,
                                  r.predicted_first.peak_bytes, r.measured_first_peak)
