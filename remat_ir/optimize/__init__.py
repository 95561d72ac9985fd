"""Planning: rewrite a program's schedule to fit a memory budget at the least
recompute (plan family, MILPs, decomposition into blocks, budget sweeps).

The only package of remat-ir that imports numpy, scipy or cvxpy.
"""
from __future__ import annotations

from remat_ir.optimize.search import Infeasible, floor, optimize, resolve_budget  # noqa: F401
