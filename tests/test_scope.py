"""One meaning of a budget: every entry point that takes a budget measures it
in the same scope unless told otherwise, `DEFAULT_SCOPE` ("activations")."""
from __future__ import annotations

import inspect

import pytest
import torch

import remat_ir
from remat_ir import adopt, pipeline
from remat_ir.cli.commands import _compile_parser
from remat_ir.ir.types import DEFAULT_SCOPE, SCOPES


def _scope_default(fn):
    return inspect.signature(fn).parameters["scope"].default


def test_the_default_scope_is_activations():
    assert DEFAULT_SCOPE == "activations" and DEFAULT_SCOPE in SCOPES
    assert pipeline.DEFAULT_SCOPE is DEFAULT_SCOPE and pipeline.SCOPES is SCOPES


def test_every_entry_point_shares_the_default():
    from remat_ir.optimize import family, ladder, pareto, search

    entry_points = {
        "remat_ir.wrap": remat_ir.wrap, "AutoRemat": adopt.AutoRemat, "remat_ir.compile": remat_ir.compile,
        "pipeline.fit": pipeline.fit, "pipeline.budget_bytes": pipeline.budget_bytes,
        "search.Problem.of": search.Problem.of,
        "search.resolve_budget": search.resolve_budget, "search.unoptimized_peak": search.unoptimized_peak,
        "family.Analysis": family.Analysis, "ladder.floor": ladder.floor, "ladder.optimize": ladder.optimize,
        "pareto.sweep": pareto.sweep, "pareto.plot": pareto.plot,
    }
    defaults = {name: _scope_default(fn) for name, fn in entry_points.items()}
    assert defaults == dict.fromkeys(entry_points, DEFAULT_SCOPE)
    # remat-compile --scope (remat-bench and remat-show take no --scope).
    (action,) = [a for a in _compile_parser()._actions if "--scope" in a.option_strings]
    assert action.default == DEFAULT_SCOPE and tuple(action.choices) == SCOPES


def test_a_budget_without_a_scope_is_in_the_default_scope():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    program = pipeline.trace(net, (torch.randn(16, 8),), loss=lambda out, x: out.square().mean())
    plan = pipeline.fit(program, "floor")
    assert plan.header.budget.scope == DEFAULT_SCOPE
    assert plan.header.budget.bytes == pipeline.budget_bytes(program, "floor", DEFAULT_SCOPE)
    assert pipeline.budget_bytes(program, 0.5) == pipeline.budget_bytes(program, 0.5, scope=DEFAULT_SCOPE)
    assert pipeline.budget_bytes(program, 0.5) != pipeline.budget_bytes(program, 0.5, scope="total")


@pytest.mark.parametrize("scope", SCOPES)
def test_every_scope_is_accepted_by_the_cli(scope):
    assert _compile_parser().parse_args(["mlp", "-o", "p.rir", "--scope", scope]).scope == scope
