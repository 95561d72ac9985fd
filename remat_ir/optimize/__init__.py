"""Planning: rewrite a program's schedule to fit a memory budget at the least
recompute (plan family, MILPs, decomposition into blocks, budget sweeps).

The only package of remat-ir that imports numpy, scipy or cvxpy.
"""
from __future__ import annotations

from remat_ir.optimize.search import (  # noqa: F401
    Infeasible, Memo, OptimizeResult, Problem, Settings, floor, optimize, resolve_budget,
)
