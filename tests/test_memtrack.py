"""The storage tracker's exact live bytes, checked against hand counts,
saved_tensors_hooks and the profiler's allocation events."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat_ir.runtime.memtrack import StepMemory, StorageTracker, measure_step, storage_key
from remat_ir.models import build_builtin


def _pre(model, inputs, grads=False):
    pre = {"params": list(model.parameters()), "buffers": list(model.buffers()), "inputs": list(inputs)}
    if grads:
        pre["grads"] = [p.grad for p in model.parameters() if p.grad is not None]
    return pre


def test_simple_sequence_exact_bytes():
    tk = StorageTracker()
    with tk:
        a = torch.empty(100)  # 400 B
        assert tk.live_bytes == 400
        b = torch.ones(50, dtype=torch.float64)  # 400 B
        assert tk.live_bytes == 800 and tk.peak_bytes == 800
        del a
        assert tk.live_bytes == 400
        v = b[10:].view(8, 5)  # a view: no new memory
        w = b.unsqueeze(0)
        assert tk.live_bytes == 400
        del b
        assert tk.live_bytes == 400  # the views keep the storage alive
        del w
        assert tk.live_bytes == 400
        c = v * 2  # 320 B
        assert tk.live_bytes == 720
        del v
        assert tk.live_bytes == 320
    assert tk.peak_bytes == 800
    tk.reset_peak()
    assert tk.peak_bytes == 320
    del c  # frees after the mode exited are still seen
    assert tk.live_bytes == 0
    assert tk.n_allocations == 3 and tk.allocated_bytes == 1120


def test_views_and_inplace_of_registered_count_zero():
    w = torch.randn(64, 32)
    x = torch.randn(8, 32)
    tk = StorageTracker()
    assert tk.register([w, x], "params") == w.nbytes + x.nbytes
    assert tk.register(w[0], "params") == 0  # same storage: counted once
    with tk:
        views = [w.t(), w[3:], w.view(-1), w.reshape(32, 64), w.detach(), w.T]
        w.add_(1.0)
        w.mul_(0.5)
        x.t_()
        assert tk.live_bytes == 0
        y = x.t() @ w.t()  # (8, 64): one new storage
        assert tk.live_bytes == y.nbytes == 8 * 64 * 4
    assert tk.baseline_by_category() == {"params": w.nbytes + x.nbytes}
    assert tk.baseline_bytes == w.nbytes + x.nbytes
    del views


def test_views_of_unregistered_preexisting_count_zero():
    base = torch.randn(100)
    tk = StorageTracker()
    with tk:
        v = base[1:]
        v2 = base.view(10, 10).t()
        base.zero_()
        assert tk.live_bytes == 0 and tk.peak_bytes == 0
    del v, v2


def test_out_and_resize_tracked():
    tk = StorageTracker()
    with tk:
        out = torch.empty(0)
        torch.add(torch.ones(10), torch.ones(10), out=out)  # out resized to 40 B
        assert tk.live_bytes == out.untyped_storage().nbytes() == 40


def test_registered_storage_freed_lowers_total():
    g = torch.zeros(256)  # 1 KiB, e.g. a grad
    tk = StorageTracker()
    tk.register(g, "grads")
    with tk:
        a = torch.empty(512)  # 2 KiB
        del g  # the step frees a pre-existing storage
        assert tk.freed_baseline_bytes == 1024
        b = torch.empty(256)  # 1 KiB: reuses the freed room, peak above baseline stays 2 KiB
        assert tk.peak_bytes == 2048
        c = torch.empty(512)
        assert tk.peak_bytes == 2048 + 1024 + 2048 - 1024
    assert tk.baseline_by_category() == {}
    del a, b, c


def test_ignore_compile_internals():
    assert StorageTracker.ignore_compile_internals() is True


def test_backward_is_seen_and_grads_count():
    model, inputs = build_builtin("mlp")
    grad_bytes = sum(p.nbytes for p in model.parameters())
    tk = StorageTracker()
    tk.register(list(model.parameters()) + list(inputs), "pre")
    with tk:
        loss = model(*inputs)
        fwd = tk.live_bytes
        loss.backward()
        del loss
    assert tk.peak_bytes > fwd
    # first step: the gradients AccumulateGrad stole/created stay live, nothing else
    assert tk.live_bytes == grad_bytes
    assert all(tk.is_tracked(p.grad) for p in model.parameters())
    # second step, .grad registered: accumulated in place, nothing left
    sm = measure_step(lambda: model(*inputs).backward(), pre_existing=_pre(model, inputs, grads=True))
    assert sm.live_after_bytes == 0
    assert sm.baseline_by_category["grads"] == grad_bytes
    assert sm.peak_bytes == sm.baseline_bytes + sm.peak_above_baseline


def test_live_after_forward_matches_saved_tensors_hooks():
    model, inputs = build_builtin("gpt2-tiny")
    registered = list(model.parameters()) + list(model.buffers()) + list(inputs)
    reg_keys = {storage_key(t) for t in registered}
    saved = {}

    def pack(t):
        if storage_key(t) not in reg_keys:
            saved[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    tk = StorageTracker()
    tk.register(registered, "pre")
    with tk:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(*inputs)
        live_after_forward = tk.live_bytes
        loss.backward()
    loss_bytes = 0 if storage_key(loss) in saved else loss.untyped_storage().nbytes()
    assert live_after_forward == sum(saved.values()) + loss_bytes
    assert live_after_forward > 3 * 2**20  # ~3.7 MiB of saved activations


def _profiler_peak(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak, cur


@pytest.mark.parametrize("name,tolerance", [("mlp", 0), ("gpt2-tiny", 64)])
def test_matches_profiler_allocation_events(name, tolerance):
    # Tolerance: the profiler also sees a few 8-byte wrapped-number scalars that
    # kernels create from Python/C++ scalars without dispatching an op (16 B on gpt2-tiny).
    model, inputs = build_builtin(name)

    def step():
        model(*inputs).backward()

    step()  # warm up
    for first_step in (True, False):
        if first_step:
            model.zero_grad(set_to_none=True)
        prof_peak, prof_end = _profiler_peak(step)
        if first_step:
            model.zero_grad(set_to_none=True)
        sm = measure_step(step, pre_existing=_pre(model, inputs, grads=not first_step))
        assert abs(sm.peak_above_baseline - prof_peak) <= tolerance, (first_step, sm, prof_peak)
        assert sm.live_after_bytes == prof_end


def test_fake_mode_matches_real():
    model, inputs = build_builtin("gpt2-tiny")
    real = measure_step(lambda: model(*inputs).backward(), pre_existing=_pre(model, inputs))
    with FakeTensorMode():
        fmodel, finputs = build_builtin("gpt2-tiny")
        fake = measure_step(lambda: fmodel(*finputs).backward(), pre_existing=_pre(fmodel, finputs))
    assert isinstance(fake, StepMemory)
    assert fake.peak_above_baseline == real.peak_above_baseline
    assert fake.baseline_bytes == real.baseline_bytes
    assert fake.live_after_bytes == real.live_after_bytes == sum(p.nbytes for p in model.parameters())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_step_cuda():
    model, inputs = build_builtin("mlp", device="cuda")
    model(*inputs).backward()  # warm-up (cuBLAS workspace, first grads)
    torch.cuda.synchronize()
    sm = measure_step(lambda: model(*inputs).backward(), pre_existing=_pre(model, inputs, grads=True),
                      device="cuda")
    assert sm.peak_bytes >= sm.baseline_bytes > 0
    assert sm.peak_above_baseline > 0
    expected = sum(p.nbytes for p in model.parameters()) * 2
    assert sum(v for k, v in sm.baseline_by_category.items() if k in ("params", "grads")) == expected


def test_host_pool_is_counted_apart_from_the_device_pool():
    """Storages allocated inside `host_pool()` (offloaded copies) are the
    host pool's: never in live_bytes or peak_bytes; a copy into them, or a
    view of them, allocates nothing; they are released when they die."""
    from remat_ir.runtime.memtrack import host_pool

    tk = StorageTracker()
    with tk:
        a = torch.randn(100)  # 400 B, device
        with host_pool():
            h = torch.empty(400, dtype=torch.uint8)  # 400 B, host
        assert (tk.live_bytes, tk.host_live_bytes) == (400, 400)
        h.copy_(torch.empty(0, dtype=torch.uint8).set_(a.untyped_storage()))
        hv = h[:100]
        assert (tk.live_bytes, tk.host_live_bytes) == (400, 400)
        del a  # the device copy released: the host one stays
        assert (tk.live_bytes, tk.host_live_bytes) == (0, 400)
        b = torch.empty(400, dtype=torch.uint8)
        b.copy_(h)  # back on the device, outside host_pool(): device bytes
        assert (tk.live_bytes, tk.host_live_bytes) == (400, 400)
        del h, hv
        assert (tk.live_bytes, tk.host_live_bytes) == (400, 0)
        del b
    assert (tk.peak_bytes, tk.host_peak_bytes) == (400, 400)
    tk.reset_peak()
    assert (tk.peak_bytes, tk.host_peak_bytes) == (0, 0)


def test_measure_step_reports_the_host_pool():
    from remat_ir.runtime.memtrack import host_pool

    def step():
        x = torch.ones(64)  # 256 B on the device
        with host_pool():
            h = torch.empty(256, dtype=torch.uint8)
        del x
        y = torch.ones(32)  # 128 B
        return h, y

    m = measure_step(step)
    assert (m.peak_above_baseline, m.host_peak_bytes) == (256, 256)
    assert "host pool peak" in m.summary()
