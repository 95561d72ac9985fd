"""Graph rewrites below the recompute floor: the chunked LM head and loss,
the BatchNorm split.  Each rewritten plan verifies, runs on the model it was
made for (the runtime replays the rewrites on a fresh trace), gives
gradients within tolerance (chunks: float sums in another order) or bitwise
(BatchNorm split), and the verifier's own check of a rewrite rejects a
region that no longer computes what it stood for."""
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
from remat_ir.runtime.load import load_model
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


@pytest.mark.parametrize("spec", ["chunked_loss:4", "chunked_loss:4:late"])
def test_chunked_loss_verifies_round_trips_and_trains_within_tolerance(tiny, spec):
    _, inputs, program = tiny
    plan = apply(program, [spec])
    assert plan.header.rewrites == [spec]
    assert verify(plan).ok, verify(plan)
    text = format_program(plan)
    assert f"rewrites {spec}\n" in text
    assert format_program(parse_program(text)) == text
    assert sum(n.op == "aten.nll_loss_forward.default" for n in plan.nodes) == 4
    # late: no head weight gradient of its own; four in-place sums into the embedding's
    assert sum(n.op == "aten.addmm_.default" for n in plan.nodes) == (4 if spec.endswith("late") else 3)
    eager = _grads(build_builtin("gpt2-tiny")[0], inputs, steps=2)
    chunked = _grads(build_builtin("gpt2-tiny")[0], inputs, plan, steps=2)  # the model is checked: replayed
    worst = max(relative_difference(a, b) for (_, ga, _), (_, gb, _) in zip(chunked, eager)
                for a, b in zip(ga, gb))
    assert 0 < worst < GRAD_RTOL  # not eager's bits, within the documented tolerance
    assert all(relative_difference(a[0], b[0]) < GRAD_RTOL for a, b in zip(chunked, eager))


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
    with pytest.raises(Infeasible):
        fit(program, f0 - 1, scope=SCOPE, exact=True)  # exact: no chunks
    plan = fit(program, f0 - 1, scope=SCOPE)
    assert plan.header.rewrites and plan.header.rewrites[0].startswith("chunked_loss:")
    assert any("graph rewrites" in c for c in plan.header.comment)
    v = verify(plan)
    assert v.ok and v.report.activation_peak_bytes <= f0 - 1
    from remat_ir.runtime.load import LoadedModel

    r = run_plan(plan, LoadedModel(name="wide", module=_wide_head()[0], inputs=inputs, loss=None), steps=2, check=True)
    assert r.within_tolerance() and r.grads_match and not r.grads_bitwise


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
    ("drop a chunk from the sum", "no sum of the chunk losses"),
    ("overlap", "must cover rows"),
    ("count", "not 3 chunks"),
    ("unknown", "unknown rewrite"),
    ("other weight", "the weight gradient must"),
    ("late, other rows", "must be made again in backward exactly once"),
    ("late, other targets", "must be made again in backward exactly once"),
    ("late, a chunk twice", "every chunk's contribution exactly once"),
    ("late, not the gradient", "must be the gradient output"),
    ("late, not late", "every chunk's contribution exactly once"),
])
def test_the_verifier_rejects_a_chunked_region_that_is_not_the_loss(tiny, mutation, message):
    _, _, program = tiny
    plan = _copy(apply(program, ["chunked_loss:4:late" if mutation.startswith("late") else "chunked_loss:4"]))
    nodes = plan.node_map()
    if mutation == "drop a chunk from the sum":
        n = nodes["lm_head.loss_sum_1"]
        n.args = [n.args[0], Ref("lm_head.chunk1.nll:0")]  # chunk 2 never counted, chunk 1 twice
    elif mutation == "overlap":
        for name in ("lm_head.chunk1.x", "lm_head.chunk1.target"):
            nodes[name].args = nodes[name].args[:2] + [31, 64]
    elif mutation == "count":
        plan.header.rewrites = ["chunked_loss:3"]
    elif mutation == "unknown":
        plan.header.rewrites = ["fuse_everything"]
    elif mutation == "late, other rows":
        nodes["lm_head.late2.logits"].args = [Ref("lm_head.chunk1.x"), nodes["lm_head.late2.logits"].args[1]]
    elif mutation == "late, other targets":
        n = nodes["d.lm_head.late1.logits"]
        n.args = [n.args[0], n.args[1], Ref("lm_head.chunk0.target")] + n.args[3:]
    elif mutation == "late, a chunk twice":
        n = nodes["d.lm_head.weight_acc_1"]
        n.args = [n.args[0], Ref("d.lm_head.late0.logits_t"), Ref("lm_head.chunk0.x")]
    elif mutation == "late, not the gradient":
        plan.outputs = [o for o in plan.outputs if o.value != "d.lm_head.add"]
    elif mutation == "late, not late":
        plan.header.rewrites = ["chunked_loss:4"]
    else:
        n = nodes["d.lm_head.weight_acc"]
        n.args = [n.args[0], n.args[1], Ref("lm_head.chunk0.x")]  # chunk 1's gradient times chunk 0's rows
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
        apply(program, ["chunked_loss"])
    with pytest.raises(NotApplicable, match="chunks must be between"):
        apply(program, ["chunked_loss:64"])
    with pytest.raises(NotApplicable, match="unknown rewrite"):
        apply(program, ["chunked_loss:4:soon"])
    with pytest.raises(NotApplicable, match="not tied"):  # the mlp's head has a weight of its own
        apply(program, ["chunked_loss:4:late"])


# ------------------------------------------------------------------ attention


def test_chunked_attention_verifies_round_trips_and_runs_as_predicted(tiny):
    from remat_ir.runtime.load import LoadedModel

    _, inputs, program = tiny
    plan = apply(program, ["chunked_loss:4:late", "chunked_attention:2"])
    assert plan.header.rewrites == ["chunked_loss:4:late", "chunked_attention:2"]
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
def test_transformers_heads_are_chunked_with_their_logits_kept(kind):
    model, kwargs = _hf(kind)
    program = remat_ir.compile(model, (), kwargs)
    r = region(program)
    assert r.kept  # the caller receives the logits: the chunks slice them
    assert (r.bias is not None) == (kind == "bert") and r.ignore_index == -100
    plan = apply(program, ["chunked_loss:4"])
    assert verify(plan).ok, verify(plan)
    grads = []
    for m in (model, remat_ir.wrap(model, plan)):
        torch.manual_seed(0)
        m(**kwargs).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        model.zero_grad()
    assert len(grads[0]) == len(grads[1])
    assert max(relative_difference(a, b) for a, b in zip(grads[1], grads[0])) < GRAD_RTOL


@pytest.mark.parametrize("late", [True, False])
def test_a_tied_gradient_summed_in_place_is_taken_by_autograd_as_predicted(late):
    # The chunked head adds its weight gradient into the embedding's in place
    # (late: each chunk's share, at the end of backward): the sum is the
    # embedding gradient's own tensor.  On the first step (no `.grad`)
    # autograd must take that storage, not clone it, or the measured peak
    # exceeds the prediction by a weight.  Here the sum is the step's peak: a
    # one-block GPT with a wide vocabulary, at its floor.
    from remat_ir.runtime.load import LoadedModel

    module, inputs = _wide_head()
    program = remat_ir.compile(module, inputs)
    lowest = fit(program, "floor", scope=SCOPE)
    (spec,) = lowest.header.rewrites  # chunked attention, last on the ladder, lowers this floor no further
    assert spec.startswith("chunked_loss:") and spec.endswith(":late")  # the lowest floor's
    plan = fit(apply(program, [spec]), "floor", scope=SCOPE)
    if not late:
        plain = fit(apply(program, [spec.removesuffix(":late")]), "floor", scope=SCOPE)
        assert verify(plan).report.activation_peak_bytes < verify(plain).report.activation_peak_bytes
        plan = plain
        assert any(n.op == "aten.add_.Tensor" and n.phase == "backward" for n in plan.nodes)
    r = run_plan(plan, LoadedModel(name="wide", module=_wide_head()[0], inputs=inputs, loss=None), steps=2)
    assert r.measured_first_peak - r.predicted_first.peak_bytes <= 8
    assert r.measured_peak - r.predicted.peak_bytes <= 8
