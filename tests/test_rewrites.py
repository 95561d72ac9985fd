"""Graph rewrites below the recompute floor: the chunked loss, chunked
attention, the BatchNorm split.  Each rewritten plan verifies, runs on the
model it was made for (the runtime replays the rewrites on a fresh trace),
gives gradients bitwise (the chunked loss, the BatchNorm split) or within
tolerance (chunked attention), and the verifier's own check of a rewrite
rejects a region that no longer computes what it stood for.  The chunked
loss is also the torch.compile backend's: its tests here run it both ways."""
from __future__ import annotations

import msgspec
import pytest
import torch

import remat_ir
from remat_ir.check.rewritten import check_rewrites
from remat_ir.check.verify import verify
from remat_ir.ir import Ref
from remat_ir.ir.fingerprint import fingerprint
from remat_ir.ir.parser import parse_program
from remat_ir.ir.printer import format_program
from remat_ir.models import build_builtin
from remat_ir.pipeline import fit
from remat_ir.optimize.search import Infeasible, floor, unoptimized_peak
from remat_ir.rewrite import NotApplicable, apply, region
from remat_ir.runtime.load import LoadedModel, load_model
from remat_ir.runtime.run import GRAD_RTOL, relative_difference, run_plan

SCOPE = "activations"


def _copy(p):
    return msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=type(p))


def _grads(module, inputs, plan=None, steps=1):
    """Loss and parameter gradients of `steps` SGD steps, eager or by `plan`."""
    model = remat_ir.wrap(module, plan) if plan is not None else module
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        torch.manual_seed(step)
        loss = model(*inputs)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in module.parameters()],
                    [b.clone() for b in module.buffers()]))
        opt.step()
        opt.zero_grad()
    return out


@pytest.fixture(scope="module")
def tiny():
    module, inputs = build_builtin("gpt2-tiny")
    return module, inputs, remat_ir.compile(module, inputs)


# ------------------------------------------------------------- the chunked loss


def _lm(head: str):
    """(model, (idx, targets)): a GPT of 2 layers, d=128, sequences of 64
    (batch 4) over a 2048-token vocabulary, so that the loss sets the floor
    (its logits' gradient, [256, 2048], is twice the head's weight);
    its LM head tied to the embedding (the GPT's own, `mm`) or untied with
    a bias (`addmm`); a quarter of the targets are the loss's ignore_index
    (-1); reduction mean.  The same weights and batch at every call."""
    from remat_ir.models import GPT, GPTConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=2048, block_size=64)).train()
        if head == "untied":
            model.lm_head = torch.nn.Linear(128, 2048, bias=True)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 2048, (4, 64), generator=g)
    targets = torch.randint(0, 2048, (4, 64), generator=g)
    targets[:, ::4] = -1
    return model, (idx, targets)


def _floor_plan(program):
    """The floor plan under `exact`, and the graph's own floor (recomputation alone)."""
    from remat_ir.optimize.ladder import LadderMemo

    memo = LadderMemo()
    plan = fit(program, "floor", scope=SCOPE, exact=True, memo=memo)
    own = min(f for rung, f in memo.floors.items() if not any(s.startswith("lm_head_nll") for s in rung))
    return plan, own


@pytest.mark.parametrize("head", ["tied", "untied"])
@pytest.mark.parametrize("path", ["wrap", "backend"])
def test_chunked_loss_gives_eager_bits_below_the_recompute_floor(path, head, tmp_path, monkeypatch):
    """The chunked loss (`lm_head_nll:R`) is the floor plan under `exact`,
    below what recomputation alone reaches; run by `wrap` (remat-run's
    check: each step's loss, gradients and buffers against eager's) and by
    the torch.compile backend (the joint graph follows the plan), every step
    is eager's bits and the measured peak the predicted one."""
    model, inputs = _lm(head)
    if path == "backend":
        from sides import check_memory, train_side_by_side

        monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
        torch._dynamo.reset()
        be = remat_ir.backend(budget="floor", inner="aot_eager")
        compiled = train_side_by_side(model, inputs, be, steps=2)
        (plan,) = be.plans
        assert plan.header.rewrites == ["lm_head_nll:16"] and verify(plan).ok
        check_memory(model, compiled, inputs, plan)
        torch._dynamo.reset()
        return
    program = remat_ir.compile(model, inputs)
    plan, own = _floor_plan(program)
    (spec,) = plan.header.rewrites
    assert spec.startswith("lm_head_nll:16")
    assert spec.endswith(":late") == (head == "tied")  # the tied head's weight gradient is not held through backward
    v = verify(plan)
    assert v.ok, v.errors
    assert v.report.activation_peak_bytes < own
    text = format_program(plan)
    assert f"rewrites {spec}\n" in text and format_program(parse_program(text)) == text
    ops = {n.op for n in plan.nodes}
    assert not ops & {"aten._log_softmax.default", "aten.nll_loss_forward.default",
                      "remat.nll_log_softmax_backward.default"}
    r = run_plan(plan, LoadedModel(name=head, module=_lm(head)[0], inputs=inputs, loss=None), steps=3,
                 check=True)  # the model checked: the rewrite replayed on a fresh trace
    assert r.loss_bitwise and r.grads_bitwise, r.checks
    # (At most 4 bytes above, in a mean's loss backward: `nll_loss_backward`'s
    # own 0-dim temporary, grad_output / total_weight, a kernel's temporary
    # no plan counts; the graph without the rewrite measures the same.)
    assert 0 <= r.measured_first_peak - r.predicted_first.peak_bytes <= 4
    assert 0 <= r.measured_peak - r.predicted.peak_bytes <= 4


def _wide_head():
    """A one-block GPT whose vocabulary dwarfs its width: the LM head and
    loss set the recompute floor."""
    from remat_ir.models import GPT, GPTConfig

    torch.manual_seed(0)
    module = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=2048, block_size=32)).train()
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, 2048, (2, 32), generator=g), torch.randint(0, 2048, (2, 32), generator=g))
    return module, inputs


def test_the_plan_of_a_chunked_loss_fits_where_recomputation_alone_cannot():
    module, inputs = _wide_head()
    program = remat_ir.compile(module, inputs)
    f0 = floor(program, scope=SCOPE).predicted_peak
    plan = fit(program, f0 - 1, scope=SCOPE, exact=True)  # eager's bits: allowed under exact
    assert plan.header.rewrites and plan.header.rewrites[0].startswith("lm_head_nll:")
    assert any("graph rewrites" in c and "remat.lm_head_nll" in c for c in plan.header.comment)
    v = verify(plan)
    assert v.ok and v.report.activation_peak_bytes <= f0 - 1
    from remat_ir.runtime.load import LoadedModel

    r = run_plan(plan, LoadedModel(name="wide", module=_wide_head()[0], inputs=inputs, loss=None), steps=2, check=True)
    assert r.grads_bitwise and r.loss_bitwise


def test_a_budget_below_every_rung_is_refused_with_the_lowest_floor():
    from remat_ir.optimize.ladder import LadderMemo

    module, inputs = _wide_head()
    program = remat_ir.compile(module, inputs)
    memo = LadderMemo()  # the floor's ladder serves the refusal's
    low = verify(fit(program, "floor", scope=SCOPE, memo=memo)).report.activation_peak_bytes
    with pytest.raises(Infeasible) as e:
        fit(program, low - 1, scope=SCOPE, memo=memo)
    assert e.value.floor_bytes == low and "with rewrites" in str(e.value)


def test_a_budget_the_graph_fits_gets_no_rewrite(tiny):
    _, _, program = tiny
    assert fit(program, 0.8, scope=SCOPE).header.rewrites == []


@pytest.mark.parametrize("mutation, message", [
    ("backward reads other targets", "must read what its forward"),
    ("backward reads another total weight", "must read what its forward"),
    ("backward sums", "must read what its forward"),
    ("other rows", "must take 32 rows a chunk"),
    ("too few rows", "at least 16 rows"),
    ("working memory read", "nothing may read it"),
    ("unknown", "unknown rewrite"),
    ("retired", "the earlier chunked loss"),
    ("late, made again otherwise", "made by the same op on the same operands"),
    ("late, from the loss's own gradient", "none with the loss's own"),
    ("late, not the gradient", "must be the gradient output"),
    ("late, not late", "not 1"),
    ("not late, late", "not 2"),
])
def test_the_verifier_rejects_a_chunked_loss_that_is_not_the_loss(tiny, mutation, message):
    _, _, program = tiny
    late = mutation.startswith("late")
    plan = _copy(apply(program, ["lm_head_nll:16:late" if late else "lm_head_nll:16"]))
    nodes = plan.node_map()
    fwd, bwd = nodes["lm_head.lm_head_nll"], nodes["d.lm_head.lm_head_nll_backward"]
    if mutation == "backward reads other targets":
        bwd.args = bwd.args[:4] + [Ref("idx")] + bwd.args[5:]
    elif mutation == "backward reads another total weight":
        bwd.args = bwd.args[:7] + [Ref(fwd.outputs[0])] + bwd.args[8:]
    elif mutation == "backward sums":
        bwd.args = bwd.args[:5] + [2] + bwd.args[6:]  # forward takes the mean
    elif mutation == "other rows":
        plan.header.rewrites = ["lm_head_nll:32"]
    elif mutation == "too few rows":
        plan.header.rewrites = ["lm_head_nll:8"]
    elif mutation == "working memory read":
        n = nodes["d.lm_head.mm_1"]
        n.args = [Ref(bwd.outputs[1])] + n.args[1:]
    elif mutation == "unknown":
        plan.header.rewrites = ["fuse_everything"]
    elif mutation == "retired":
        plan.header.rewrites = ["chunked_loss:4"]
    elif mutation == "late, made again otherwise":
        again = nodes["d.lm_head.late.lm_head_nll_backward"]
        again.args = again.args[:8] + [-1] + again.args[9:]  # the same op over dim -1: not the same call
    elif mutation == "late, from the loss's own gradient":
        n = nodes["d.lm_head.mm.late"]
        n.args = [Ref("d.lm_head.view")] + n.args[1:]
    elif mutation == "late, not the gradient":
        plan.outputs = [o for o in plan.outputs if o.value != "d.lm_head.add"]
    elif mutation == "late, not late":
        plan.header.rewrites = ["lm_head_nll:16"]
    else:
        plan.header.rewrites = ["lm_head_nll:16:late"]
    _assert_rejected(plan, message)


def _assert_rejected(plan, message: str) -> None:
    """The verifier's rewrite check, and so the verifier, refuse `plan`, saying `message`."""
    plan.header.fingerprint = fingerprint(plan)  # as if compiled so: only the rewrite check can object
    errors = [m for _, m in check_rewrites(plan)]
    assert any(message in m for m in errors), errors
    assert not verify(plan).ok


def test_an_unknown_or_inapplicable_rewrite_is_refused_by_name():
    module, inputs = build_builtin("mlp")
    program = remat_ir.compile(module, inputs)
    with pytest.raises(NotApplicable, match="unknown rewrite"):
        apply(program, ["lm_head_nll"])
    with pytest.raises(NotApplicable, match="unknown rewrite"):
        apply(program, ["lm_head_nll:16:soon"])
    with pytest.raises(NotApplicable, match="at least 16 rows"):
        apply(program, ["lm_head_nll:8"])
    with pytest.raises(NotApplicable, match="not tied"):  # the mlp's head has a weight of its own
        apply(program, ["lm_head_nll:16:late"])
    with pytest.raises(NotApplicable, match="the earlier chunked loss"):
        apply(program, ["chunked_loss:4"])


def test_a_plan_of_the_earlier_chunked_loss_is_refused_at_load_in_one_line(tiny, tmp_path, capsys):
    """`chunked_loss:K` (the earlier chunked loss, not eager's bits) is no
    longer run: a plan naming it is refused when it is read, saying to
    compile it again."""
    from remat_ir.cli.commands import verify_main
    from remat_ir.ir.parser import RirSyntaxError

    _, _, program = tiny
    text = format_program(apply(program, ["lm_head_nll:16"]))
    text = text.replace("rewrites lm_head_nll:16", "rewrites chunked_loss:4")
    with pytest.raises(RirSyntaxError, match="compile the plan again"):
        parse_program(text)
    f = tmp_path / "old.rir"
    f.write_text(text)
    assert verify_main([str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rewrite chunked_loss:4: the earlier chunked loss" in err[0], err


# ------------------------------------------------------------------ attention


def test_chunked_attention_verifies_round_trips_and_runs_as_predicted(tiny):
    from remat_ir.runtime.load import LoadedModel

    _, inputs, program = tiny
    plan = apply(program, ["lm_head_nll:16:late", "chunked_attention:2"])
    assert plan.header.rewrites == ["lm_head_nll:16:late", "chunked_attention:2"]
    assert verify(plan).ok, verify(plan)
    text = format_program(plan)
    assert format_program(parse_program(text)) == text
    # Per block: two chunks of scores, made in forward and again in backward;
    # one dropout draw over both (as eager's).
    assert sum(n.op == "aten._softmax.default" for n in plan.nodes) == 2 * 2 * 2
    assert sum(n.op == "remat.dropout_keep.default" and n.module.endswith("attn.attn_dropout")
               for n in plan.nodes) == 2
    optimized = fit(plan, 0.6, scope=SCOPE)  # recomputes chunks of the rewritten graph
    assert optimized.header.rewrites == plan.header.rewrites and verify(optimized).ok
    r = run_plan(optimized, LoadedModel(name="gpt2-tiny", module=build_builtin("gpt2-tiny")[0], inputs=inputs,
                                        loss=None), steps=2, check=True)
    assert r.grads_match and r.within_tolerance()  # dropout on: the draw replays eager's mask
    assert abs(r.measured_peak - r.predicted.peak_bytes) <= 8


def test_chunked_attention_without_dropout_in_uneven_chunks():
    from remat_ir.models import GPT, GPTConfig

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=128, block_size=16, dropout=0.0)).train()

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, 128, (3, 16), generator=g), torch.randint(0, 128, (3, 16), generator=g))
    plan = apply(remat_ir.compile(build(), inputs), ["chunked_attention:4"])  # 6 matrices: rows 0-1, 1-3, ...
    assert verify(plan).ok, verify(plan)
    assert not any(n.op == "remat.dropout_keep.default" for n in plan.nodes)
    eager = _grads(build(), inputs)
    chunked = _grads(build(), inputs, plan)
    assert max(relative_difference(a, b) for a, b in zip(chunked[0][1], eager[0][1])) < GRAD_RTOL


@pytest.mark.parametrize("mutation, message", [
    ("other rows of v", "dropout_scale of the chunk's rows [0, 4)"),  # the rows of v say which chunk it is
    ("other rows of q", "must multiply rows [4, 8) of q"),
    ("another chunk's draw", "dropout_scale of the chunk's rows"),
    ("another chunk's probabilities", "softmax backward must read its own probabilities"),
    ("gradient of q out of order", "must concatenate the chunks' in row order"),
    ("count", "not 4"),
])
def test_the_verifier_rejects_a_chunked_attention_that_is_not_the_attention(tiny, mutation, message):
    _, _, program = tiny
    plan = _copy(apply(program, ["chunked_attention:2"]))
    nodes = plan.node_map()
    a = "transformer.h.1.attn"
    if mutation == "other rows of v":
        nodes[f"{a}.chunk1.v"].args = nodes[f"{a}.chunk1.v"].args[:2] + [0, 4]
    elif mutation == "other rows of q":
        nodes[f"{a}.chunk1.q"].args = nodes[f"{a}.chunk1.q"].args[:2] + [0, 4]
    elif mutation == "another chunk's draw":
        n = nodes[f"{a}.chunk1.dropout_scale"]
        n.args = [Ref(f"{a}.chunk0.keep")] + n.args[1:]
    elif mutation == "another chunk's probabilities":
        n = nodes[f"d.{a}.chunk1.masked_fill"]
        n.args = [n.args[0], Ref(f"{a}.chunk0._softmax")] + n.args[2:]
    elif mutation == "gradient of q out of order":
        n = nodes[f"d.{a}.bmm_3"]
        n.args = [type(n.args[0])(n.args[0].items[::-1]), 0]
    else:
        plan.header.rewrites = ["chunked_attention:4"]
    _assert_rejected(plan, message)


# ------------------------------------------------------------------ BatchNorm


@pytest.fixture(scope="module")
def resnet():
    module, inputs = build_builtin("resnet-mini")
    return inputs, remat_ir.compile(module, inputs)


def test_batchnorm_split_gives_eager_bits(resnet):
    inputs, program = resnet
    split = apply(program, ["batchnorm_split"])
    assert verify(split).ok, verify(split)
    assert sum(n.op == "aten.batch_norm_update_stats.default" for n in split.nodes) == \
        sum(n.op == "aten.native_batch_norm.default" for n in program.nodes)
    eager = _grads(build_builtin("resnet-mini")[0], inputs, steps=2)
    got = _grads(build_builtin("resnet-mini")[0], inputs, split, steps=2)
    for (la, ga, ba), (lb, gb, bb) in zip(got, eager):
        assert torch.equal(la, lb)
        assert all(torch.equal(a, b) for a, b in zip(ga, gb))
        assert all(torch.equal(a, b) for a, b in zip(ba, bb))  # running statistics updated once
    # Recomputation alone cannot reach 0.4 of the activation peak; the split plan does (below).
    assert floor(program, scope=SCOPE).predicted_peak > 0.4 * unoptimized_peak(program, SCOPE)


def test_resnet_at_0_4_runs_bitwise_and_as_predicted(resnet):
    _, program = resnet
    plan = fit(program, 0.4, scope=SCOPE, exact=True)
    assert plan.header.rewrites == ["batchnorm_split"]
    r = run_plan(plan, load_model("resnet-mini"), steps=2, check=True)
    assert r.within_tolerance() and r.grads_bitwise and r.loss_bitwise


def test_the_verifier_rejects_a_split_that_still_reads_running_stats(resnet):
    _, program = resnet
    plan = _copy(apply(program, ["batchnorm_split"]))
    bn = next(n for n in plan.nodes if n.op == "aten.native_batch_norm.default")
    stats = next(n for n in plan.nodes if n.op == "aten.batch_norm_update_stats.default")
    bn.args = bn.args[:3] + stats.args[1:3] + bn.args[5:]
    plan.header.fingerprint = fingerprint(plan)
    assert any("batchnorm_split" in m for _, m in check_rewrites(plan))


# -------------------------------------------------------- transformers heads


def _hf(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(vocab_size=300, max_position_embeddings=64)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2,
                                                                      vocab_size=300, n_positions=64))
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=2, **small))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, **small))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    if kind == "bert":
        labels[:, ::3] = -100
    return model.train(), dict(input_ids=ids, labels=labels)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_transformers_heads_keep_their_logits_and_eagers_bits(kind):
    """The caller receives the logits: the chunked loss reads them (the
    head's matmul stays whole), with the models' ignore_index (-100)."""
    model, kwargs = _hf(kind)
    program = remat_ir.compile(model, (), kwargs)
    r = region(program)
    assert r.weight_t is None and r.ignore_index == -100  # the logits, not the head's input
    plan = apply(program, ["lm_head_nll:16"])
    assert verify(plan).ok, verify(plan)
    grads = []
    for m in (model, remat_ir.wrap(model, plan)):
        torch.manual_seed(0)
        m(**kwargs).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        model.zero_grad()
    assert len(grads[0]) == len(grads[1])
    assert all(torch.equal(a, b) for a, b in zip(grads[1], grads[0]))


@pytest.mark.parametrize("late", [True, False])
def test_a_tied_gradient_summed_in_place_is_taken_by_autograd_as_predicted(late):
    # The chunked loss adds the head's weight gradient into the embedding's
    # in place (late: made again just before the embedding's): the sum is
    # the embedding gradient's own tensor.  On the first step (no `.grad`)
    # autograd must take that storage, not clone it, or the measured peak
    # exceeds the prediction by a weight.  Here the sum is the step's peak: a
    # one-block GPT with a wide vocabulary, at its floor.
    from remat_ir.runtime.load import LoadedModel

    module, inputs = _wide_head()
    program = remat_ir.compile(module, inputs)
    spec = f"lm_head_nll:16{':late' if late else ''}"
    plan = fit(apply(program, [spec]), "floor", scope=SCOPE)
    assert any(n.op == "aten.add_.Tensor" and n.phase == "backward" for n in plan.nodes)
    r = run_plan(plan, LoadedModel(name="wide", module=_wide_head()[0], inputs=inputs, loss=None), steps=2)
    assert 0 <= r.measured_first_peak - r.predicted_first.peak_bytes <= 4  # (see above)
    assert 0 <= r.measured_peak - r.predicted.peak_bytes <= 4
