"""One line in a training loop: `remat_ir.wrap(model, budget=...)`.

A transformers causal LM called with keyword arguments trains as eager
(bitwise, dropout on), a batch of another size gets its own plan, a second
process finds the plan in the cache without running the optimizer, a
compiled plan file verifies and trains, and transformers' Trainer trains the
wrapped model as it trains the model itself.  The wrapper's manners (dtype
changes, eval mode, pickling, None arguments) are checked on a small module.
"""
from __future__ import annotations

import copy
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import remat_ir
from remat_ir.runtime.bind import PlanMismatch

ROOT = Path(__file__).resolve().parent.parent
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _example():
    spec = importlib.util.spec_from_file_location("trainer_gpt2", ROOT / "examples" / "trainer_gpt2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _batch(n: int, seq: int, seed: int):
    ids = torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _train(model, batches, seed: int = 0):
    """AdamW steps on keyword batches; the outputs of the last step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = None
    for i, b in enumerate(batches):
        torch.manual_seed(seed + i)  # the same dropout masks for eager and wrapped
        out = model(**b)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return out


def _same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# A script for a fresh process: the first training step with a cached plan.
_SECOND_RUN = """
import json, sys, time
t0 = time.perf_counter()
import torch, remat_ir
sys.path.insert(0, {tests!r})
from test_adopt import _batch, _example, _train
model = remat_ir.wrap(_example().build_model(), budget=0.6)
_train(model, [_batch(2, 32, 0)])
print(json.dumps({{"first_step_s": time.perf_counter() - t0,
                   "optimizer_imported": "remat_ir.optimize" in sys.modules}}))
"""


def test_budget_wrap_trains_a_causal_lm_as_eager_and_caches_its_plans(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    ex = _example()
    eager, model = ex.build_model(), ex.build_model()
    wrapped = remat_ir.wrap(model, budget=0.6)
    batches = [_batch(2, 32, s) for s in range(3)]
    out_e, out_w = _train(eager, batches), _train(wrapped, batches)
    assert type(out_w) is type(out_e) and out_w.logits.shape == out_e.logits.shape
    assert torch.equal(out_w.loss, out_e.loss)
    assert _same_parameters(model, eager)
    plan = next(iter(remat_ir.planner(wrapped).plans.values())).program
    assert plan.header.budget is not None and plan.header.budget.scope == "activations"
    assert [v.source for v in plan.values if v.kind == "input"] == ["input_ids", "attention_mask", "labels"]

    # A smaller last batch: a plan of its own, the same training.
    _train(eager, [_batch(1, 32, 9)], seed=9)
    _train(wrapped, [_batch(1, 32, 9)], seed=9)
    assert _same_parameters(model, eager)
    assert len(remat_ir.planner(wrapped).plans) == 2 and len(list(tmp_path.glob("*.rir"))) == 2

    # A second process finds the plan on disk: the optimizer is not even imported.
    r = subprocess.run([sys.executable, "-c", _SECOND_RUN.format(tests=str(ROOT / "tests"))],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "REMAT_IR_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    second = json.loads(r.stdout.strip().splitlines()[-1])
    assert second["optimizer_imported"] is False, second
    # On a loaded machine the trace alone can outlast the progress message's
    # delay; the message then names the cached plan.
    assert "planning" not in r.stderr or "(the plan cached in" in r.stderr, r.stderr
    assert len(list(tmp_path.glob("*.rir"))) == 2


def test_compiled_plan_file_verifies_and_trains_as_eager(tmp_path):
    ex = _example()
    eager, model = ex.build_model(), ex.build_model()
    batch = _batch(2, 16, 0)
    plan = remat_ir.compile(model, (), batch)
    path = tmp_path / "gpt2.rir"
    remat_ir.save_plan(plan, path)
    verify = ROOT / ".venv" / "bin" / "remat-verify"
    cmd = [str(verify)] if verify.exists() else [sys.executable, "-m", "remat_ir.cli.commands", "verify"]
    r = subprocess.run(cmd + [str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wrapped = remat_ir.wrap(model, remat_ir.load_plan(path))
    _train(eager, [batch] * 2)
    _train(wrapped, [batch] * 2)
    assert _same_parameters(model, eager)
    # Positional or keyword, the same plan: inputs are named by the forward's parameters.
    torch.manual_seed(0)
    wrapped(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss.backward()
    # A tensor where the plan had None is another call.
    with pytest.raises(PlanMismatch, match="position_ids"):
        wrapped(**batch, position_ids=torch.arange(16).expand(2, 16))
    with pytest.raises(PlanMismatch, match="no tensor for attention_mask"):
        wrapped(input_ids=batch["input_ids"], labels=batch["labels"])


def test_trainer_trains_the_wrapped_model_as_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    ex = _example()
    wrapped = ex.train(steps=3, budget=0.6)
    eager = ex.train(steps=3, eager=True)
    assert _same_parameters(wrapped, eager)
    assert not _same_parameters(wrapped, ex.build_model())  # it trained


# ------------------------------------------------------------ manners


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x, mask=None, *, scale: float = 1.0):
        h = self.drop(torch.relu(self.fc1(x)))
        if mask is not None:
            h = h * mask
        return {"out": self.fc2(h) * scale, "h": h}


def _loss(out, *args, **kwargs):
    return out["out"].square().mean()


def test_wrapper_manners(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    w = remat_ir.wrap(net, loss=_loss)  # no budget: the unoptimized plan, planned at the first call
    x, mask = torch.randn(4, 8), torch.ones(4, 16)
    for kwargs in ({}, {"mask": mask}, {"mask": mask, "scale": 2.0}):
        torch.manual_seed(1)
        w(x, **kwargs).backward()
        torch.manual_seed(1)
        _loss(ref(x, **kwargs)).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters()))
    assert len(remat_ir.planner(w).plans) == 3  # None, a tensor, another constant: three signatures
    small = remat_ir.wrap(Net(), loss=_loss, max_plans=2, dynamic=False)  # a plan per batch size
    for n in (1, 2, 3, 1):
        small(torch.randn(n, 8)).backward()
    # The least recently used plan (batch 2) went.
    assert [next(v.shape for v in r.program.values if v.kind == "input")
            for r in remat_ir.planner(small).plans.values()] == [[3, 8], [1, 8]]
    import inspect

    assert list(inspect.signature(w.forward).parameters) == ["x", "mask", "scale"]

    # In eval mode it runs eagerly, with the loss it was wrapped with (as a training call).
    assert w is net and isinstance(w, Net) and list(w.state_dict()) == list(ref.state_dict())
    net.eval()
    assert torch.equal(w(x), _loss(ref.eval()(x)))
    net.train()
    ref.train()

    # Pickles (the compiled code is made again from the plan), and trains after loading.
    buf = io.BytesIO()
    torch.save(w, buf)
    w2 = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    torch.manual_seed(1)
    w2(x).backward()
    copy.deepcopy(w)(x).backward()
    lam = remat_ir.wrap(Net(), loss=lambda out, x: out["out"].sum())
    with pytest.raises(TypeError, match=r"save the model's state_dict\(\) \(or remat_ir.unwrap"):
        torch.save(lam, io.BytesIO())

    # A dtype change after wrapping is named, not an aten error.
    other = copy.deepcopy(ref)
    plan = remat_ir.compile(other, (x,), loss=_loss)
    wp = remat_ir.wrap(other, plan, loss=_loss)
    wp.double()
    with pytest.raises(PlanMismatch, match="fc1.weight is float64.*compiled for float32"):
        wp(x.double())
    # The budget wrapper plans for the model as it is now, and refuses its float32 plan.
    w.double()
    w(x.double()).backward()
    with pytest.raises(PlanMismatch, match="fc1.weight is float64"):
        w(x)


# -------------------------------------------- the cache checks what it loads


def _deep():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())])


def _sum_loss(out, x):
    return out.sum()


def _wrapped_step(cache: Path, budget, **options):
    """A fresh wrap of `_deep()` for `budget` after one training step: its
    plan, and the cache file that step wrote or read."""
    before = set(cache.glob("*.rir"))
    w = remat_ir.wrap(_deep(), loss=_sum_loss, budget=budget, **options)
    w(torch.randn(32, 64, generator=torch.Generator().manual_seed(0))).backward()
    (runner,) = remat_ir.planner(w).plans.values()
    new = set(cache.glob("*.rir")) - before
    return runner.program, (new.pop() if new else None)


def _recomputes(plan) -> int:
    return sum(i.kind == "recompute" for i in plan.forward + plan.backward)


def test_a_cached_plan_made_for_another_budget_is_not_used(tmp_path, monkeypatch, capsys):
    # A cache file replaced by the same model's plan for another request (the
    # same fingerprint) was used as it was: budget=0.8 ran the unoptimized plan.
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    plain, plain_file = _wrapped_step(tmp_path, None)
    fitted, fitted_file = _wrapped_step(tmp_path, 0.8)
    nbytes = fitted.header.budget.bytes
    sized, sized_file = _wrapped_step(tmp_path, nbytes + 1000)
    floor, floor_file = _wrapped_step(tmp_path, "floor", scope="total")
    assert None not in (plain_file, fitted_file, sized_file, floor_file)
    assert plain.header.budget is None and _recomputes(fitted) > 0
    capsys.readouterr()
    texts = {f: f.read_text() for f in (plain_file, fitted_file, sized_file, floor_file)}

    # Each file holding another request's plan: said on one line, planned again, the file rewritten.
    for victim, impostor, says in (
            (fitted_file, plain_file, "made without a budget, asked budget 0.8 (activations)"),
            (plain_file, fitted_file, f"made for a budget of {nbytes} bytes (activations), asked for no budget"),
            (sized_file, fitted_file, f"made for a budget of {nbytes} bytes (activations), asked budget "
                                      f"{nbytes + 1000} (activations): {nbytes + 1000} bytes"),
            (floor_file, fitted_file, f"made for a budget of {nbytes} bytes (activations), asked budget "
                                      f"'floor' (total)")):
        victim.write_text(texts[impostor])
        budget, options = {plain_file: (None, {}), fitted_file: (0.8, {}), sized_file: (nbytes + 1000, {}),
                           floor_file: ("floor", {"scope": "total"})}[victim]
        plan, written = _wrapped_step(tmp_path, budget, **options)
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"remat-ir: the cached plan {victim} does not serve this call ({says}): planning it "
                       "again"], err
        assert written is None and victim.read_text() == texts[victim]  # the right plan, in its file
        assert plan.header.budget == remat_ir.load_plan(victim).header.budget

    # The right plans are used quietly.
    plan, _ = _wrapped_step(tmp_path, 0.8)
    assert _recomputes(plan) > 0 and capsys.readouterr().err == ""


def test_a_cached_plan_for_another_fraction_or_an_edited_budget_is_planned_again(tmp_path, monkeypatch, capsys):
    # Swapping the files of budget=0.8 and 0.95 ran the 0.95 plan for 0.8 (a
    # fraction's bytes were not checked), and an edited budget line was trusted.
    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    low, low_file = _wrapped_step(tmp_path, 0.8)
    high, high_file = _wrapped_step(tmp_path, 0.95)
    assert _recomputes(low) > _recomputes(high)
    texts = {f: f.read_text() for f in (low_file, high_file)}
    capsys.readouterr()

    low_file.write_text(texts[high_file])
    high_file.write_text(texts[low_file])
    for file, budget, plan in ((low_file, 0.8, low), (high_file, 0.95, high)):
        again, _ = _wrapped_step(tmp_path, budget)
        theirs = remat_ir.load_plan(file).header.budget.bytes  # (rewritten with the right plan)
        mine = plan.header.budget.bytes
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0].startswith(f"remat-ir: the cached plan {file} does not serve this call (made for a budget "
                                 f"of "), err
        assert err[0].endswith(f"asked budget {budget} (activations): {mine} bytes): planning it again"), err
        assert again.header.budget.bytes == mine == theirs and _recomputes(again) == _recomputes(plan)

    # A budget line edited to more than the plan was made for: planned again.
    text = low_file.read_text()
    edited = text.replace(f"budget {low.header.budget.bytes} ", "budget 999999999 ", 1)
    assert edited != text
    low_file.write_text(edited)
    again, _ = _wrapped_step(tmp_path, 0.8)
    err = capsys.readouterr().err
    assert f"does not serve this call (made for a budget of 999999999 bytes (activations)" in err, err
    assert again.header.budget == low.header.budget and low_file.read_text() == text

    # The budget line right, the schedule another's (a peak over it): planned again, by the simulator.
    edited = texts[high_file].replace(f"budget {high.header.budget.bytes} ", f"budget {low.header.budget.bytes} ", 1)
    low_file.write_text(edited)
    again, _ = _wrapped_step(tmp_path, 0.8)
    err = capsys.readouterr().err
    assert f"remat-ir: the cached plan {low_file} does not serve this call (" in err, err
    assert again.header.budget == low.header.budget and _recomputes(again) == _recomputes(low)


def test_cache_mismatch_names_the_optimizer_and_cost_model():
    from remat_ir.adopt import _cache_mismatch
    from remat_ir.ir.types import Budget, Header

    asked = dict(budget="1KiB", scope="activations")
    fits = Header(budget=Budget(1024, "activations"), optim="adam", cost="flops")
    assert _cache_mismatch(fits, Header(optim="adam"), asked) is None
    assert _cache_mismatch(fits, Header(optim="sgd"), asked) == "made for optimizer adam, asked sgd"
    assert _cache_mismatch(fits, Header(optim="adam", cost="profile"), asked) == \
        "made for cost model flops, asked profile"
    assert _cache_mismatch(fits, Header(optim="adam"), dict(budget=0.5, scope="activations")) is None
    assert _cache_mismatch(fits, Header(optim="adam"), dict(budget="2KiB", scope="activations")) == \
        "made for a budget of 1024 bytes (activations), asked budget '2KiB' (activations): 2048 bytes"


def test_the_cache_directory(monkeypatch, tmp_path):
    import platformdirs

    from remat_ir.adopt import cache_dir

    monkeypatch.setenv("REMAT_IR_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("REMAT_IR_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert str(cache_dir()) == platformdirs.user_cache_dir("remat-ir", appauthor=False)
    if sys.platform.startswith("linux"):
        assert cache_dir() == tmp_path / "xdg" / "remat-ir"


def test_planning_that_takes_a_while_says_so(monkeypatch, capsys):
    from remat_ir import adopt

    monkeypatch.setattr(adopt, "_PROGRESS_AFTER_S", 0.0)
    with adopt._Progress("remat-ir: planning a step") as p:
        p.note = " (a note)"
        time.sleep(0.2)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "remat-ir: planning a step ..." and err[1].startswith("remat-ir: done in ")
    assert err[1].endswith(" s (a note)")
    with pytest.raises(RuntimeError), adopt._Progress("remat-ir: planning another"):
        time.sleep(0.2)
        raise RuntimeError("no")
    assert capsys.readouterr().err.splitlines()[1].startswith("remat-ir: failed in ")
