"""The golden plans in schedules/ stay readable, canonical and sound, and are
what the current code generates (when traced by the same torch version)."""
from __future__ import annotations

import glob
import os
import re

import pytest
import torch

from remat_ir.ir.files import load_plan
from remat_ir.ir.printer import format_program
from remat_ir.check.verify import verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANS = sorted(glob.glob(os.path.join(ROOT, "schedules", "*.rir")))


def test_there_are_golden_plans():
    assert len(PLANS) >= 3


@pytest.mark.parametrize("path", PLANS, ids=os.path.basename)
def test_golden_plan_is_canonical_and_sound(path):
    text = open(path).read()
    program = load_plan(path)
    assert format_program(program) == text
    verdict = verify(program)
    assert verdict.ok, str(verdict)


@pytest.mark.parametrize("path", PLANS, ids=os.path.basename)
def test_golden_plan_is_regenerated_identically(path):
    text = open(path).read()
    m = re.search(r"torch (\S+?)[,\n]", text)
    if not m or m.group(1) != torch.__version__.split("+")[0]:
        pytest.skip("golden plans were traced by another torch version")
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_schedules", os.path.join(ROOT, "tools", "make_schedules.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    name = os.path.basename(path)[:-4]
    model, budget = mod.PLANS[name]
    fresh = mod.build(model, budget)
    # The optimizer is deterministic (HiGHS stops at node limits, not time
    # limits): an optimized plan is regenerated to the same text too.
    assert fresh == text
