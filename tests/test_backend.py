"""remat_ir.backend: torch.compile with the recomputation decided by a plan.

Each test compiles a small model with `torch.compile(model,
backend=remat_ir.backend(...))` and checks it against the same model run
eagerly from the same weights and seeds: gradients (bitwise with aot_eager),
buffers, the activation peak the plan predicts against the one the
storage-tracking dispatch mode measures, and the plan as a file.
"""
from __future__ import annotations

import copy

import pytest
import torch

import remat_ir
from remat_ir.torch_compile import BackendError
from remat_ir.check.simulate import simulate
from remat_ir.check.verify import verify
from remat_ir.ir.files import load_plan
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.models.gpt import GPT, GPTConfig
from remat_ir.runtime.memtrack import measure_step
from remat_ir.runtime.run import matches
from sides import check_memory, train_side_by_side  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo(tmp_path_factory, monkeypatch):
    # Each test plans from an empty plan cache of its own.
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path_factory.mktemp("plan-cache")))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def gpt(layers=4, dropout=0.1, vocab=64, batch=16, seq=64, width=64, seed=0):
    """A gpt2-tiny-sized GPT (4 heads) and a batch: (model, (idx, targets)).
    Narrow and with a small vocabulary, so that activations, not the
    gradients a compiled backward holds until it returns, set the floor, and
    a budget of 0.3 is above it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=width, vocab_size=vocab, block_size=seq,
                              dropout=dropout)).train()
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    return model, (idx, targets)


def check_plan_file(plan, tmp_path=None):
    text = format_program(plan)
    assert text.startswith("#") or "rir 1" in text
    back = parse_program(text)
    assert format_program(back) == text
    for p in (plan, back):
        verdict = verify(p)
        assert verdict.ok, verdict.errors


@pytest.mark.slow
@pytest.mark.parametrize("budget,dropout", [(0.7, 0.1), ("0.5", 0.0), (0.3, 0.1)])
def test_aot_eager_bitwise_and_predicted_peak(budget, dropout, tmp_path):
    model, inputs = gpt(dropout=dropout)
    be = remat_ir.backend(budget=budget, inner="aot_eager", plan_dir=tmp_path)
    compiled = train_side_by_side(model, inputs, be)
    assert len(be.plans) == 1, "one compiled region, one plan"
    plan = be.plans[0]
    # The plan fits its budget (a fraction of the region's unoptimized activation peak).
    assert plan.header.budget is not None and plan.header.budget.scope == "activations"
    assert simulate(plan).activation_peak_bytes <= plan.header.budget.bytes
    recomputed = {i.target for i in plan.backward if i.kind == "recompute"}
    if float(budget) < 0.7:
        assert recomputed, "a low budget recomputes"
    random = [n.name for n in plan.nodes if n.random and n.name in recomputed]
    print(f"budget {budget}: {len(recomputed)} nodes recomputed, {len(random)} of them random (replayed)")
    figures = check_memory(model, compiled, inputs, plan)
    print(f"budget {budget}: predicted / measured bytes above the baseline: without .grad "
          f"{figures[0]} / {figures[1]}, with .grad {figures[2]} / {figures[3]}")
    check_plan_file(plan)
    saved = load_plan(be.paths[0])
    assert format_program(saved) == format_program(plan)


@pytest.mark.slow
def test_budget_below_the_floor_names_it():
    model, inputs = gpt(layers=1, batch=2, seq=32)
    be = remat_ir.backend(budget="1KiB", inner="aot_eager")
    compiled = torch.compile(model, backend=be, dynamic=False)
    err = backend_error(lambda: compiled(*inputs).backward())
    msg = str(err)
    assert "below the floor" in msg
    floor = err.__cause__.floor_bytes
    assert floor > 1024 and str(floor) in msg


def backend_error(step) -> BackendError:
    """The BackendError `step()` raises, from under dynamo's wrapping."""
    with pytest.raises(Exception) as info:
        step()
    err = info.value
    while err is not None and not isinstance(err, BackendError):
        err = err.__cause__ or err.__context__
    assert isinstance(err, BackendError), info.value
    return err


def test_names_from_dynamo_sources():
    from remat_ir.trace.joint import module_path, path_of

    assert path_of("L['self']._modules['h']._modules['0']._parameters['weight']") == ["self", "h", "0", "weight"]
    assert path_of("L['self'].h[0].weight") == ["self", "h", "0", "weight"]
    assert path_of("L['kwargs']['input_ids']") == ["kwargs", "input_ids"]
    assert module_path({"k": ("L['self'].transformer.h.0.attn", object)}) == "transformer.h.0.attn"
    assert module_path({"k": ("L['args'][0].model.layers.1.mlp", object)}) == "model.layers.1.mlp"
    assert module_path({}) == ""


def test_bad_arguments_are_refused_before_compiling():
    with pytest.raises(ValueError, match="inner"):
        remat_ir.backend(budget=0.5, inner="eager")
    with pytest.raises(ValueError, match="scope"):
        remat_ir.backend(budget=0.5, scope="weights")
    with pytest.raises(ValueError):
        remat_ir.backend(budget=-1)


class TwoHalves(torch.nn.Module):
    """An MLP with a graph break in the middle, and a BatchNorm whose running
    statistics the step updates."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                     torch.nn.Dropout(0.1), torch.nn.Linear(256, 256), torch.nn.GELU())
        self.b = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                     torch.nn.Tanh(), torch.nn.Linear(256, 10))

    def forward(self, x, y):
        h = self.a(x)
        torch._dynamo.graph_break()
        return torch.nn.functional.cross_entropy(self.b(h), y)


@pytest.mark.slow
def test_graph_break_gives_a_plan_per_region(tmp_path):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TwoHalves().train()
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g))
    be = remat_ir.backend(budget=0.9, inner="aot_eager", plan_dir=tmp_path)
    train_side_by_side(model, inputs, be, steps=2)
    assert len(be.plans) == 2, [p.header.model for p in be.plans]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["region0.rir", "region1.rir"]
    assert int(model.a[1].num_batches_tracked) == 2  # updated once a step
    for plan in be.plans:
        check_plan_file(plan)


@pytest.mark.slow
def test_inductor_step_within_tolerance():
    pytest.importorskip("torch._inductor")
    model, inputs = gpt(layers=2, dropout=0.0, seq=32)
    eager = copy.deepcopy(model)
    be = remat_ir.backend(budget=0.7, inner="inductor")
    compiled = torch.compile(model, backend=be, dynamic=False)
    loss = compiled(*inputs)
    loss.backward()
    want = eager(*inputs)
    want.backward()
    assert len(be.plans) == 1 and verify(be.plans[0]).ok
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=f"gradient of {name}")


@pytest.mark.slow
def test_transformers_llama_called_with_keywords_fits_03():
    """The small transformers Llama (attention mask, labels), called as users
    call it: one region, bitwise gradients, the predicted activation peak.
    The region returns the logits and the key/value cache, and AOTAutograd
    hands backward zero gradients for them: what the caller holds under any
    plan is kept whole and 0.3 is of the rest (that is 31.5% of the whole
    peak, this region's floor when a fraction was of the whole)."""
    from remat_ir.check.simulate import caller_held_bytes
    from remat_ir.optimize.search import unoptimized_peak

    plan = _llama_side_by_side("llama", 0.3)
    names = {v.name for v in plan.values}
    assert "input_ids" in names and "model.embed_tokens.weight" in names, sorted(names)[:8]
    own = plan
    if plan.header.rewrites:  # (the fraction is of the region's own graph, which a backend without a budget plans)
        from remat_ir.models import families

        model, kwargs = families.FAMILIES["llama"](0)
        torch._dynamo.reset()
        be = remat_ir.backend(budget=None, inner="aot_eager")
        torch.compile(model.train(), backend=be, dynamic=False)(**kwargs).loss.backward()
        (own,) = be.plans
    held, peak = caller_held_bytes(own), unoptimized_peak(own)
    assert 0 < held < peak
    assert plan.header.budget.bytes == round(held + 0.3 * (peak - held))
    assert simulate(plan).activation_peak_bytes <= plan.header.budget.bytes


def test_transformers_llama_without_its_cache_fits_03():
    """Called with `use_cache=False`, as training scripts set it, the region
    returns no key/value cache: 0.3 fits, bitwise, as predicted."""
    plan = _llama_side_by_side("llama-nocache", 0.3)
    assert simulate(plan).activation_peak_bytes <= plan.header.budget.bytes
    tangents = [v.name for v in plan.values if v.kind == "tangent"]
    assert len(tangents) <= 2, tangents  # the loss's and the logits'; no cache


def _llama_side_by_side(family: str, budget):
    """Two steps of `families.FAMILIES[family]` eager and compiled with the
    backend at `budget` (aot_eager): losses and gradients bitwise, the plan a
    file, the step's peak as predicted.  Returns the plan."""
    pytest.importorskip("transformers")
    from remat_ir.models import families

    model, kwargs = families.FAMILIES[family](0)
    model.train()
    eager = copy.deepcopy(model)
    be = remat_ir.backend(budget=budget, inner="aot_eager")
    compiled = torch.compile(model, backend=be, dynamic=False)
    for step in range(2):
        losses = []
        for run in (eager, compiled):
            torch.manual_seed(step)
            out = run(**kwargs)
            out.loss.backward()
            losses.append(out.loss.detach())
        assert torch.equal(*losses)
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: the gradient of {name} differs from eager's"
    assert len(be.plans) == 1
    plan = be.plans[0]
    check_plan_file(plan)
    params = list(model.parameters())

    def step():
        torch.manual_seed(9)
        out = compiled(**kwargs)
        out.loss.backward()
        return out.loss.detach()

    tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    mem = measure_step(step, pre_existing={"params": params, "buffers": list(model.buffers()), "inputs": tensors,
                                           "grads": [p.grad for p in params]})
    predicted = simulate(plan, grads_present=True).step_peak_bytes
    print(f"{family} budget {budget}: predicted / measured activation peak {predicted} / {mem.peak_above_baseline}")
    assert matches(predicted, mem.peak_above_baseline), (predicted, mem.peak_above_baseline)
    return plan


@pytest.mark.slow
def test_inductor_dropout_recomputed_from_its_seed():
    """Inductor draws dropout as `inductor_random(seed)` from seeds drawn
    once in forward: the plan may recompute it (the same numbers), and the
    gradients are stock inductor's (same seeds), within tolerance."""
    pytest.importorskip("torch._inductor")
    model, inputs = gpt(layers=2, dropout=0.1, seq=32)
    be = beside_stock_inductor(model, inputs, 0.5, seed=3)
    recomputed = {i.target for i in be.plans[0].backward if i.kind == "recompute"}
    assert any("inductor_random" in r for r in recomputed), sorted(recomputed)[:10]


def beside_stock_inductor(model, inputs, budget, seed=None):
    """One step of `model` compiled with the backend (inductor) at `budget`
    and one of a copy under stock `torch.compile(backend="inductor")`, from
    the same seed: loss and gradients within tolerance.  Returns the backend."""
    stock_model = copy.deepcopy(model)
    be = remat_ir.backend(budget=budget, inner="inductor")
    compiled = torch.compile(model, backend=be, dynamic=False)
    stock = torch.compile(stock_model, backend="inductor", dynamic=False)
    losses = []
    for run in (compiled, stock):
        if seed is not None:
            torch.manual_seed(seed)
        loss = run(*inputs)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), stock_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=f"gradient of {name}")
    return be

class ReturnsItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        return torch.tanh(self.lin(x)).sum(), x


@pytest.mark.slow
def test_region_returning_its_input():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ReturnsItsInput()
    eager = copy.deepcopy(model)
    x = torch.randn(64, 32)
    be = remat_ir.backend(budget=None)  # plans nothing: the step as autograd runs it
    loss, same = torch.compile(model, backend=be, dynamic=False)(x)
    loss.backward()
    eager(x)[0].backward()
    assert same is x
    assert torch.equal(model.lin.weight.grad, eager.lin.weight.grad)
    check_plan_file(be.plans[0])


@pytest.mark.slow
def test_dynamic_shapes_are_refused_with_the_way_out():
    """A second sequence length makes dynamo recompile the region with symbolic
    sizes, which this version refuses, saying to compile with dynamic=False."""
    model, (idx, targets) = gpt(layers=1, dropout=0.0)
    be = remat_ir.backend(budget=0.9)
    compiled = torch.compile(model, backend=be)
    compiled(idx, targets).backward()
    with pytest.raises(Exception, match="dynamic=False"):
        compiled(idx[:, :32].contiguous(), targets[:, :32].contiguous()).backward()
    assert len(be.plans) == 1


@pytest.mark.slow
def test_plan_cache(capsys):
    """A region compiled again with the same graph and options loads its plan
    from the cache (no solve), and runs as the planned one did; other options
    plan again; a cached file that no longer verifies is planned again."""
    model, inputs = gpt(layers=1, batch=4)

    def compile_once(budget, **kw):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        be = remat_ir.backend(budget=budget, inner="aot_eager", **kw)
        c = torch.compile(m, backend=be, dynamic=False)
        torch.manual_seed(3)
        c(*inputs).backward()
        return be, [p.grad for p in m.parameters()]

    first, grads = compile_once(0.8)
    assert first.solves == 1 and first.cached == []
    from remat_ir.adopt import cache_dir

    files = sorted(cache_dir().glob("torch-compile-*.rir"))
    assert len(files) == 1
    again, grads_again = compile_once(0.8)
    assert again.solves == 0 and again.cached == [str(files[0])]
    assert format_program(again.plans[0]) == format_program(first.plans[0])
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    # Another budget, and cache=False, plan.
    other, _ = compile_once(0.7)
    assert other.solves == 1 and len(list(cache_dir().glob("*.rir"))) == 2
    off, _ = compile_once(0.8, cache=False)
    assert off.solves == 1 and off.cached == []
    # A cached plan edited so that it frees a value backward still reads: refused, planned again.
    text = files[0].read_text()
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("backward"))
    frees = [i for i, line in enumerate(lines) if i > at and line.strip().startswith("free ")]
    assert frees, "the plan's backward frees values"
    lines.insert(at + 1, lines[frees[-1]])  # the last value freed, freed first
    files[0].write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    redone, _ = compile_once(0.8)
    assert redone.solves == 1 and redone.cached == []
    assert "does not verify" in capsys.readouterr().err


def test_attention_without_dropout_draws_nothing():
    """An attention op PyTorch tags random (it takes a dropout_p) draws nothing
    at dropout_p 0.0: the backend recomputes it as any op (no RNG state
    replayed; allowed under inductor); dropout itself still draws."""
    from remat_ir.torch_compile import _draws_nothing

    aten = torch.ops.aten
    g = torch.fx.Graph()
    q = g.placeholder("q")
    nodes = {p: g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, p))
             for p in (0.0, 0.1)}
    default = g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q))
    drop = g.call_function(aten.native_dropout.default, (q, 0.0, True))
    assert _draws_nothing(nodes[0.0]) and _draws_nothing(default)
    assert not _draws_nothing(nodes[0.1])
    assert not _draws_nothing(drop)  # native_dropout's probability is `p`, and dropout draws


def test_held_gradients_count_as_gradients_not_step_memory():
    """A compiled backward holds each gradient until it returns: the plan says
    so (`held_gradients true`), and the simulator counts those bytes as
    gradients from their allocation.  The step's peak does not move; the
    activation peak a budget in scope "activations" reads leaves them out."""
    model, inputs = gpt(layers=1, dropout=0.0, vocab=256, batch=2, seq=16, width=128)
    be = remat_ir.backend(budget=None, inner="aot_eager")
    torch.compile(model, backend=be, dynamic=False)(*inputs).backward()
    plan = be.plans[0]
    assert plan.header.held_gradients
    text = format_program(plan)
    assert "\nheld_gradients true\n" in text and format_program(parse_program(text)) == text
    assert verify(plan).ok
    unheld = copy.deepcopy(plan)
    unheld.header.held_gradients = False
    held_bytes = sum(v.nbytes for v in plan.values if v.kind == "param" and v.requires_grad)
    for gp in (True, False):
        a = simulate(plan, grads_present=gp, keep_timeline=True)
        b = simulate(unheld, grads_present=gp, keep_timeline=True)
        assert a.peak_bytes == b.peak_bytes and a.step_peak_bytes == b.step_peak_bytes
        moved = [ea.by_category["gradients"] - eb.by_category["gradients"] for ea, eb in zip(a.timeline, b.timeline)]
        for ea, eb, m in zip(a.timeline, b.timeline, moved):
            assert ea.total == eb.total
            assert eb.by_category["temporaries"] - ea.by_category["temporaries"] == m >= 0
        # All of them at once, at the end of backward.
        assert max(moved) == held_bytes
        assert a.activation_peak_bytes < b.activation_peak_bytes


@pytest.mark.slow
def test_cross_entropy_backward_written_in_place_keeps_the_bits():
    """With aot_eager the joint graph's `nll_loss_backward` ->
    `_log_softmax_backward_data` runs as one op writing its result over the
    first kernel's (as a traced step does on CPU): one logits-sized tensor
    fewer at the loss, where a language model's floor often is, and the
    same bits as eager, measured as predicted."""
    model, inputs = gpt(layers=1, dropout=0.0, vocab=512, batch=4, seq=32, width=32)
    be = remat_ir.backend(budget=0.8, inner="aot_eager")
    compiled = train_side_by_side(model, inputs, be)
    plan = be.plans[0]
    ops = {n.op for n in plan.nodes}
    assert "remat.nll_log_softmax_backward.default" in ops
    assert not ops & {"aten.nll_loss_backward.default", "aten._log_softmax_backward_data.default"}
    logits = 4 * 32 * 512 * 4
    # Three logits-sized tensors at the loss without the fusion: the floor is below that.
    assert simulate(plan).activation_peak_bytes < 3 * logits
    check_memory(model, compiled, inputs, plan)


def test_loss_in_row_chunks_below_what_recomputation_reaches(tmp_path):
    """Below the floor recomputation alone reaches (the log-probabilities
    and their gradient at the loss), the loss is chunked over rows
    (`remat.lm_head_nll`): the budget still a fraction of the region's own
    peak, eager's bits, measured as predicted, the plan a file, and cached."""
    model, inputs = gpt(layers=2, dropout=0.1, vocab=2048, batch=8, seq=64, width=64)
    logits = 8 * 64 * 2048 * 4
    be = remat_ir.backend(budget=0.45, inner="aot_eager", plan_dir=tmp_path)
    compiled = train_side_by_side(model, inputs, be)
    plan = be.plans[0]
    ops = {n.op for n in plan.nodes}
    assert {"remat.lm_head_nll.default", "remat.lm_head_nll_backward.default"} <= ops
    assert not ops & {"aten._log_softmax.default", "aten.nll_loss_forward.default",
                      "remat.nll_log_softmax_backward.default"}
    assert plan.header.rewrites == ["lm_head_nll:32"]  # the graph rewrite wrap uses
    lm_head_nll = next(n for n in plan.nodes if n.op == "remat.lm_head_nll.default")
    assert lm_head_nll.args[1] is not None  # the LM head's matmul moved into the op
    peak = simulate(plan).activation_peak_bytes
    assert peak <= plan.header.budget.bytes < 2 * logits, "below two logits-sized tensors"
    check_memory(model, compiled, inputs, plan)
    check_plan_file(plan)
    assert format_program(load_plan(be.paths[0])) == format_program(plan)
    torch._dynamo.reset()
    again = remat_ir.backend(budget=0.45, inner="aot_eager")
    step = torch.compile(copy.deepcopy(model), backend=again, dynamic=False)
    step(*inputs).backward()
    assert again.cached and again.solves == 0 and format_program(again.plans[0]) == format_program(plan)


def test_the_floor_chunks_the_loss_and_a_lower_budget_names_that_floor():
    model, inputs = gpt(layers=2, dropout=0.0, vocab=2048, batch=8, seq=64, width=64)
    be = remat_ir.backend(budget="floor", inner="aot_eager")
    train_side_by_side(model, inputs, be, steps=1)
    floor = simulate(be.plans[0]).activation_peak_bytes
    assert "remat.lm_head_nll.default" in {n.op for n in be.plans[0].nodes}
    torch._dynamo.reset()
    low = remat_ir.backend(budget=floor - 4096, inner="aot_eager")
    err = backend_error(lambda: torch.compile(model, backend=low, dynamic=False)(*inputs).backward())
    assert err.floor_bytes == floor, (err, floor)


def test_tied_head_gradient_summed_in_place():
    """The GPT ties its LM head to the embedding: the two parts of that
    weight's gradient are summed in place into the head's, as eager autograd
    sums them (`accumulate_in_place`), so the head's partial gradient is
    counted as the gradient it becomes; eager's bits, the peak as measured."""
    model, inputs = gpt(layers=1, dropout=0.0, vocab=512, batch=4, seq=32, width=32)
    be = remat_ir.backend(budget=0.8, inner="aot_eager")
    compiled = train_side_by_side(model, inputs, be)
    plan = be.plans[0]
    values, producer = plan.value_map(), plan.producer_map()
    grad = next(o.value for o in plan.outputs if o.kind == "grad" and o.key == "transformer.wte.weight")
    storage = values[grad].storage
    assert producer[storage].op == "aten.mm.default", producer[storage]  # the head's partial gradient
    assert any(n.op == "aten.add_.Tensor" and n.mutates for n in plan.nodes)
    check_memory(model, compiled, inputs, plan)


@pytest.mark.slow
def test_inductor_loss_in_row_chunks_within_tolerance():
    """Under inductor the loss's ops stay aten kernels, so below what
    recomputation reaches the loss is chunked there too; the step is stock
    inductor's within tolerance and keeps what the plan saves."""
    pytest.importorskip("torch._inductor")
    model, inputs = gpt(layers=2, dropout=0.0, vocab=2048, batch=8, seq=64, width=64)
    be = beside_stock_inductor(model, inputs, 0.45)
    ops = {n.op for n in be.plans[0].nodes}
    assert {"remat.lm_head_nll.default", "remat.lm_head_nll_backward.default"} <= ops
    check_plan_file(be.plans[0])


def _deep():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())])


def test_a_cached_plan_for_another_request_or_an_edited_budget_is_planned_again(capsys):
    """The cache's files swapped between budgets 0.8 and 0.95, or a budget
    line edited, ran the plan found (the file's name was trusted): each is
    planned again, saying why on one line."""
    from remat_ir.adopt import cache_dir

    def compile_once(budget):
        torch._dynamo.reset()
        be = remat_ir.backend(budget=budget, inner="aot_eager")
        torch.compile(_deep(), backend=be, dynamic=False)(torch.randn(32, 64)).sum().backward()
        (path,) = [p for p in cache_dir().glob("torch-compile-*.rir") if p not in seen]
        return be, path

    seen: set = set()
    low, low_file = compile_once(0.8)
    seen.add(low_file)
    high, high_file = compile_once(0.95)
    recomputes = [sum(i.kind == "recompute" for i in be.plans[0].backward) for be in (low, high)]
    assert recomputes[0] > recomputes[1]
    texts = {low_file: low_file.read_text(), high_file: high_file.read_text()}
    seen = set()

    def again(budget, file, says):
        capsys.readouterr()
        torch._dynamo.reset()
        be = remat_ir.backend(budget=budget, inner="aot_eager")
        torch.compile(_deep(), backend=be, dynamic=False)(torch.randn(32, 64)).sum().backward()
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"remat-ir: the cached plan {file} does not serve this call ({says}): planning it again"]
        assert be.solves == 1 and be.cached == [] and file.read_text() == texts[file]
        return be

    nbytes = {f: load_plan(f).header.budget.bytes for f in texts}
    low_file.write_text(texts[high_file])
    high_file.write_text(texts[low_file])
    again(0.8, low_file, f"made for a budget of {nbytes[high_file]} bytes (activations), asked "
                         f"{nbytes[low_file]} bytes (activations)")
    again(0.95, high_file, f"made for a budget of {nbytes[low_file]} bytes (activations), asked "
                           f"{nbytes[high_file]} bytes (activations)")
    low_file.write_text(texts[low_file].replace(f"budget {nbytes[low_file]} ", "budget 999999999 ", 1))
    again(0.8, low_file, f"made for a budget of 999999999 bytes (activations), asked {nbytes[low_file]} bytes "
                         "(activations)")
    # The budget line right, the schedule another's: its simulated peak is over it.
    low_file.write_text(texts[high_file].replace(f"budget {nbytes[high_file]} ", f"budget {nbytes[low_file]} ", 1))
    peak = max(simulate(high.plans[0], grads_present=gp).scope_peak("activations") for gp in (True, False))
    again(0.8, low_file, f"its simulated peak is {peak} bytes (activations), over the {nbytes[low_file]} bytes asked")
