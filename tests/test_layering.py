"""The architecture's import rules, as a test.

A static check reads every module of `remat_ir` with `ast` and sees every
import statement, those inside functions, methods and `try` blocks included
(`from x import y` resolved to the module x.y when there is one, relative
imports resolved, `importlib.import_module("literal")` counted).  The rules
are the table `RULES` (direct imports of some modules), `CLOSURES` (what a
module may reach, following imports transitively, function-level ones too),
and two rules of every module: no import cycle between the modules of
`remat_ir`, nor between its packages (`check_cycles`), and no private name (a leading underscore)
imported from another package, by the package or by tools/ (`check_private`).

A package's lazy `__getattr__` (`remat_ir.__init__`) is a dispatcher: the
imports under `if name == "wrap":` run only when `remat_ir.wrap` is asked for,
so the closure follows them from a `from remat_ir import wrap` or a
`remat_ir.wrap` in the importing module, not from every import of a
submodule (which runs the package's `__init__` but not its `__getattr__`).

A dynamic check then runs the runtime path for real in a fresh interpreter.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "remat_ir"

NUMERIC = ("numpy", "scipy", "cvxpy")


@dataclass(frozen=True)
class Rule:
    """Modules under one of `applies` (less `exempt`) may import nothing under
    `forbid` unless it is under `allow`; with `public_only`, of the project
    only names without a leading underscore."""

    id: str
    text: str
    applies: tuple[str, ...]
    forbid: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()
    public_only: bool = False


@dataclass(frozen=True)
class Closure:
    """What the modules `roots` import, transitively (module- and
    function-level imports, and the `__init__` of every package on the way),
    reaches nothing under `forbid`.  A root that is a package stands for
    every module under it."""

    id: str
    text: str
    roots: tuple[str, ...]
    forbid: tuple[str, ...]


RULES = (
    Rule("a", "remat_ir.ir imports nothing of remat_ir outside remat_ir.ir",
         applies=("remat_ir.ir",), forbid=("remat_ir",), allow=("remat_ir.ir",)),
    Rule("b", "only remat_ir.optimize imports numpy, scipy or cvxpy",
         applies=("remat_ir",), exempt=("remat_ir.optimize",), forbid=NUMERIC),
    Rule("c", "remat_ir.check.verify imports of remat_ir only remat_ir.ir, remat_ir.check.simulate, "
              "remat_ir.check.typecheck, remat_ir.check.rewritten and remat_ir.check.ranges",
         applies=("remat_ir.check.verify",), forbid=("remat_ir",),
         allow=("remat_ir.ir", "remat_ir.check.simulate", "remat_ir.check.typecheck",
                "remat_ir.check.rewritten", "remat_ir.check.ranges")),
    Rule("c", "remat_ir.check.ranges imports of remat_ir only remat_ir.ir",
         applies=("remat_ir.check.ranges",), forbid=("remat_ir",), allow=("remat_ir.ir",)),
    Rule("c", "remat_ir.check.rewritten imports of remat_ir only remat_ir.ir (it checks a rewritten "
              "region without the code that rewrote it)",
         applies=("remat_ir.check.rewritten",), forbid=("remat_ir",), allow=("remat_ir.ir",)),
    Rule("f", "remat_ir.rewrite (graph rewrites: Program -> Program) imports of remat_ir only remat_ir.ir "
              "and itself, so the runtime can replay a plan's rewrites without the optimizer",
         applies=("remat_ir.rewrite",), forbid=("remat_ir",), allow=("remat_ir.ir", "remat_ir.rewrite")),
    Rule("c", "remat_ir.check.typecheck imports of remat_ir only remat_ir.ir (it re-derives the graph's "
              "facts with torch, not with the tracer)",
         applies=("remat_ir.check.typecheck",), forbid=("remat_ir",), allow=("remat_ir.ir",)),
    Rule("c", "remat_ir.check.simulate imports of remat_ir only remat_ir.ir",
         applies=("remat_ir.check.simulate",), forbid=("remat_ir",), allow=("remat_ir.ir",)),
    Rule("e", "every module of remat_ir.cli imports public names of remat_ir only (the commands call "
              "the API, not the stages' internals)",
         applies=("remat_ir.cli",), public_only=True),
    Rule("e", "no module of remat_ir.cli but remat-bench's (remat_ir.cli.bench, .methods, .measure, "
              ".bench_output) imports torch, numpy, scipy or cvxpy (they parse arguments, call the API, "
              "print; remat-bench runs eager PyTorch and torch.utils.checkpoint beside the plans it times)",
         applies=("remat_ir.cli",), forbid=("torch",) + NUMERIC,
         exempt=("remat_ir.cli.bench", "remat_ir.cli.methods", "remat_ir.cli.measure", "remat_ir.cli.bench_output")),
)

CLOSURES = (
    Closure("d", "the runtime path (loading a plan, wrapping a model, running a step: every module of "
                 "remat_ir.runtime) never imports the optimizer, cvxpy, scipy, or lark (the grammar's "
                 "test oracle)",
            roots=("remat_ir.runtime", "remat_ir.ir.files"),
            forbid=("remat_ir.optimize", "cvxpy", "scipy", "lark")),
)


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def under_any(name: str, prefixes) -> bool:
    return any(under(name, p) for p in prefixes)


# ------------------------------------------------------------------ the scan


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    path: str  # file, relative to the repository
    line: int
    target: str  # the module imported (dotted)
    names: tuple[str, ...] = ()  # `from target import names` (those that are not modules)
    in_function: bool = False
    lazy: str | None = None  # under `if name == lazy:` of a module-level __getattr__
    via: str = ""  # how an edge through a lazy export came about

    def where(self) -> str:
        how = " (inside a function)" if self.in_function else ""
        what = f"from {self.target} import {', '.join(self.names)}" if self.names else f"import {self.target}"
        if self.via:
            what = f"{self.via}, which imports {self.target}"
        return f"{self.path}:{self.line}: {self.importer}: {what}{how}"


@dataclass
class Module:
    name: str
    path: str
    is_package: bool
    imports: list[Import] = field(default_factory=list)
    # Attributes read off imported project packages (`remat_ir.wrap`): they
    # may trigger that package's lazy __getattr__.
    attributes: list[tuple[str, str, int]] = field(default_factory=list)  # (package, attribute, line)


def module_sources(root: Path = ROOT) -> dict[str, tuple[str, str, bool]]:
    """{module name: (path relative to the repository, source, is a package)}."""
    out = {}
    for f in sorted((root / PACKAGE).rglob("*.py")):
        rel = f.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        out[".".join(parts)] = (str(rel), f.read_text(), is_pkg)
    return out


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _lazy_branches(tree: ast.Module) -> dict[int, list[str]]:
    """{id(import node): exported names} for the imports under `if name ==
    "X":` / `if name in ("X", ...):` of a module-level `__getattr__`."""
    out: dict[int, list[str]] = {}
    for fn in tree.body:
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__"):
            continue
        for stmt in ast.walk(fn):
            if not isinstance(stmt, ast.If) or not isinstance(stmt.test, ast.Compare):
                continue
            cmp = stmt.test
            if len(cmp.ops) != 1 or not isinstance(cmp.ops[0], (ast.Eq, ast.In)):
                continue
            right = cmp.comparators[0]
            items = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [right]
            names = [c.value for c in items if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            for sub in stmt.body:
                for node in ast.walk(sub):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        out.setdefault(id(node), []).extend(names)
    return out


def _function_nodes(tree: ast.Module) -> set[int]:
    """ids of every node inside a function or lambda body."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for sub in ast.walk(node):
                if sub is not node:
                    inside.add(id(sub))
    return inside


def scan(sources: dict[str, tuple[str, str, bool]]) -> dict[str, Module]:
    """Every import of every module in `sources` (see `module_sources`)."""
    modules: dict[str, Module] = {}
    for name, (path, text, is_pkg) in sources.items():
        tree = ast.parse(text, filename=path)
        mod = Module(name, path, is_pkg)
        lazy = _lazy_branches(tree)
        in_fn = _function_nodes(tree)
        bound: dict[str, str] = {}  # local name -> project package it is bound to

        def add(node, target: str, names: tuple[str, ...] = ()):
            for lz in lazy.get(id(node)) or [None]:  # one entry per exported name
                mod.imports.append(Import(name, path, node.lineno, target, names, id(node) in in_fn, lz))

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    add(node, a.name)
                    if under(a.name, PACKAGE):
                        if a.asname:
                            bound[a.asname] = a.name
                        else:
                            bound[a.name.split(".")[0]] = a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = (_resolve_relative(name, is_pkg, node.level, node.module) if node.level
                        else node.module or "")
                plain = []
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in sources:  # `from pkg import module`
                        add(node, sub)
                        bound[a.asname or a.name] = sub
                    else:
                        plain.append(a.name)
                if plain or not node.names:
                    add(node, base, tuple(plain))
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                       or (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")))):
                add(node, node.args[0].value)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound):
                mod.attributes.append((bound[node.value.id], node.attr, node.lineno))
        modules[name] = mod
    return modules


# ------------------------------------------------------------------ the rules


@dataclass(frozen=True)
class Violation:
    rule: str
    text: str
    where: str  # file:line: module: the import
    chain: str = ""

    def __str__(self) -> str:
        s = f"{self.where}\n    breaks rule ({self.rule}): {self.text}"
        return s + (f"\n    import chain: {self.chain}" if self.chain else "")


def check_rules(modules: dict[str, Module], rules=RULES) -> list[Violation]:
    out = []
    for rule in rules:
        for mod in modules.values():
            if not under_any(mod.name, rule.applies) or under_any(mod.name, rule.exempt):
                continue
            for imp in mod.imports:
                if under_any(imp.target, rule.forbid) and not under_any(imp.target, rule.allow):
                    out.append(Violation(rule.id, rule.text, imp.where()))
                elif rule.public_only and under(imp.target, PACKAGE):
                    private = [p for p in imp.target.split(".") + list(imp.names) if p.startswith("_")]
                    if private:
                        out.append(Violation(rule.id, rule.text, imp.where() + f"  (private: {', '.join(private)})"))
            if rule.public_only:
                for pkg, attr, line in mod.attributes:
                    if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
                        out.append(Violation(rule.id, rule.text, f"{mod.path}:{line}: {mod.name}: {pkg}.{attr} "
                                                                 f"(private: {attr})"))
    return list(dict.fromkeys(out))  # an import under a lazy branch for two names: once


def _edges(modules: dict[str, Module], mod: Module) -> list[tuple[Import, str]]:
    """(import, module it runs) for everything importing `mod` runs: its
    imports but the lazy __getattr__ branches, the packages above each
    project module imported, and the lazy branches that the names it takes
    from a package select."""
    out = []
    for imp in mod.imports:
        if imp.lazy is not None:
            continue
        targets = [imp.target]
        if under(imp.target, PACKAGE):
            parts = imp.target.split(".")
            targets = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        out += [(imp, t) for t in targets]
        for n in imp.names:
            out += _lazy_edges(modules, mod, imp.target, n, imp.line, imp.in_function)
    for pkg_name, attr, line in mod.attributes:
        out += _lazy_edges(modules, mod, pkg_name, attr, line, True)
    return out


def _lazy_edges(modules, mod: Module, pkg_name: str, attr: str, line: int, in_function: bool):
    """The imports `pkg_name.attr` runs when it is a lazy export of the package."""
    pkg = modules.get(pkg_name)
    if pkg is None:
        return []
    return [(Import(mod.name, mod.path, line, lz.target, in_function=in_function,
                    via=f"{pkg_name}.{attr} (a lazy export: {lz.path}:{lz.line})"), lz.target)
            for lz in pkg.imports if lz.lazy == attr]


def _link(importer: str, imp: Import, target: str) -> str:
    return f"{imp.path}:{imp.line} {importer} -> {target}" + (f" (through {imp.via})" if imp.via else "")


def closure_roots(modules: dict[str, Module], rule: Closure) -> list[str]:
    """The modules `rule.roots` names: a package's modules all, itself first."""
    return list(dict.fromkeys(m for r in rule.roots for m in [r] + sorted(modules) if under(m, r)))


def check_closures(modules: dict[str, Module], closures=CLOSURES) -> list[Violation]:
    out = []
    for rule in closures:
        seen: set[Import] = set()  # each offending import once, from the first root reaching it
        for root in closure_roots(modules, rule):
            # Breadth first: the chain reported is a shortest one.
            # Importing the root runs the packages above it first.
            start = [".".join(root.split(".")[:i]) for i in range(1, root.count(".") + 2)]
            came: dict[str, tuple[str, Import] | None] = dict.fromkeys(start)
            todo = deque(start)
            while todo:
                name = todo.popleft()
                mod = modules.get(name)
                if mod is None:
                    continue
                for imp, target in _edges(modules, mod):
                    if under_any(target, rule.forbid):
                        # Every import of a forbidden module is reported, not only the first.
                        if imp not in seen:
                            seen.add(imp)
                            chain, at = [_link(name, imp, target)], name
                            while came[at] is not None:
                                prev, how = came[at]
                                chain.append(_link(prev, how, at))
                                at = prev
                            out.append(Violation(rule.id, rule.text, imp.where() + f"  (reached from {root})",
                                                 "; ".join(reversed(chain))))
                        continue
                    if target not in came:
                        came[target] = (name, imp)
                        todo.append(target)
    return out


CYCLE_TEXT = "no import cycle between modules of remat_ir (imports inside functions count)"
PACKAGE_CYCLE_TEXT = ("no import cycle between the packages of remat_ir (a module's package: the one it is in; "
                      "imports inside functions count)")
PRIVATE_TEXT = ("no module (of remat_ir, or of tools/) imports a private name (a leading underscore) of "
                "another package: a name other packages use is public")


def import_graph(modules: dict[str, Module]) -> dict[str, dict[str, Import]]:
    """{module: {project module it imports: the first such import}}: every
    import statement as written (top level, inside functions, under a
    package's lazy `__getattr__`), `from pkg import name` an edge to pkg."""
    graph: dict[str, dict[str, Import]] = {}
    for mod in modules.values():
        edges = graph.setdefault(mod.name, {})
        for imp in mod.imports:
            if imp.target in modules and imp.target != mod.name:
                edges.setdefault(imp.target, imp)
    return graph


def _cycles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One cycle (a shortest one through its first module) per strongly
    connected component of more than one module, as [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]  # iterative Tarjan
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        components.append(sorted(comp))
    out = []
    for comp in components:
        members, first = set(comp), comp[0]
        came: dict[str, str | None] = {first: None}
        todo = deque([first])
        end = None
        while todo and end is None:
            v = todo.popleft()
            for w in sorted(graph.get(v, ())):
                if w == first:
                    end = v
                    break
                if w in members and w not in came:
                    came[w] = v
                    todo.append(w)
        path = [first]
        at = end
        while at is not None and at != first:
            path.append(at)
            at = came[at]
        out.append([first] + list(reversed(path[1:])) + [first])
    return out


def package_graph(modules: dict[str, Module]) -> dict[str, dict[str, Import]]:
    """`import_graph` with each module replaced by its package (self-edges dropped)."""
    graph: dict[str, dict[str, Import]] = {}
    for a, edges in import_graph(modules).items():
        pa = package_of(modules, a)
        graph.setdefault(pa, {})
        for b, imp in edges.items():
            pb = package_of(modules, b)
            graph.setdefault(pb, {})
            if pa != pb:
                graph[pa].setdefault(pb, imp)
    return graph


def check_cycles(modules: dict[str, Module], packages: bool = False) -> list[Violation]:
    """Module cycles, or with `packages` cycles between packages; each named,
    with the import statement of every link."""
    graph = package_graph(modules) if packages else import_graph(modules)
    out = []
    for cycle in _cycles(graph):
        links = [graph[a][b] for a, b in zip(cycle, cycle[1:])]
        out.append(Violation("package cycle" if packages else "cycle", PACKAGE_CYCLE_TEXT if packages else CYCLE_TEXT,
                             " -> ".join(cycle),
                             "; ".join(_link(i.importer, i, i.target) for i in links)))
    return out


def package_of(modules: dict[str, Module], name: str) -> str:
    mod = modules.get(name)
    return name if mod is not None and mod.is_package else name.rpartition(".")[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def check_private(modules: dict[str, Module], importers: dict[str, Module] | None = None) -> list[Violation]:
    """Imports (and attributes read off imported project modules) of a
    private name whose module is in another package than the importer's."""
    out = []
    for mod in (importers if importers is not None else modules).values():
        home = package_of(modules, mod.name) if mod.name in modules else mod.name.rpartition(".")[0]
        found = []  # (line text, private name, the package that owns it)
        for imp in mod.imports:
            if not under(imp.target, PACKAGE):
                continue
            parts = imp.target.split(".")
            for i, part in enumerate(parts):
                if _private(part):
                    found.append((imp.where(), part, ".".join(parts[:i])))
            for n in imp.names:
                if _private(n):
                    found.append((imp.where(), n, package_of(modules, imp.target)))
        for target, attr, line in mod.attributes:
            if _private(attr):
                found.append((f"{mod.path}:{line}: {mod.name}: {target}.{attr}", attr, package_of(modules, target)))
        for where, name, owner in found:
            if owner != home:
                out.append(Violation("private", PRIVATE_TEXT, f"{where}  (private: {name}, of {owner})"))
    return list(dict.fromkeys(out))


def tool_sources(root: Path = ROOT) -> dict[str, tuple[str, str, bool]]:
    """tools/*.py, as modules `tools.x` (scripts that use the package)."""
    return {f"tools.{f.stem}": (str(f.relative_to(root)), f.read_text(), False)
            for f in sorted((root / "tools").glob("*.py"))}


@pytest.fixture(scope="module")
def modules():
    return scan(module_sources())


def test_scan_sees_every_kind_of_import(modules):
    # Not vacuous: the package is there, and the imports the rules hinge on are seen.
    assert {"remat_ir", "remat_ir.ir.types", "remat_ir.runtime.interpret", "remat_ir.runtime.bind",
            "remat_ir.optimize.search",
            "remat_ir.cli.commands", "remat_ir.pipeline"} <= set(modules)
    bind = modules["remat_ir.runtime.bind"]
    fn_level = {i.target for i in bind.imports if i.in_function}
    assert "remat_ir.trace.tracer" in fn_level  # check_parameters' import, inside a function
    assert any(i.target == "cvxpy" for i in modules["remat_ir.optimize.milp"].imports)
    lazy = {i.lazy: i.target for i in modules["remat_ir"].imports if i.lazy}
    assert lazy["wrap"] == "remat_ir.adopt" and lazy["compile"] == "remat_ir.pipeline"


def test_wrap_reaches_the_pipeline_only_when_it_plans(modules):
    """`remat_ir.wrap` is `remat_ir.adopt.wrap`: given a plan it runs it with
    the runtime alone; the pipeline (and with it the optimizer) is imported
    only inside the functions that plan, at a budgeted wrapper's first step."""
    adopt = modules["remat_ir.adopt"]
    at_import = [i for i in adopt.imports if not i.in_function and under(i.target, PACKAGE)]
    assert at_import and all(under_any(i.target, ("remat_ir.runtime", "remat_ir.ir")) for i in at_import), \
        "\n".join(i.where() for i in at_import)
    assert any(i.in_function and i.target == "remat_ir.pipeline" for i in adopt.imports)


@pytest.mark.parametrize("rule", sorted({r.id for r in RULES}))
def test_import_rule(modules, rule):
    bad = check_rules(modules, [r for r in RULES if r.id == rule])
    assert not bad, "\n" + "\n".join(map(str, bad))


@pytest.mark.parametrize("rule", [c.id for c in CLOSURES])
def test_import_closure(modules, rule):
    bad = check_closures(modules, [c for c in CLOSURES if c.id == rule])
    assert not bad, "\n" + "\n".join(map(str, bad))


def test_every_runtime_module_is_a_root_of_the_runtime_closure(modules):
    (d,) = [c for c in CLOSURES if c.id == "d"]
    roots = set(closure_roots(modules, d))
    runtime = {m for m in modules if under(m, "remat_ir.runtime")}
    assert {"remat_ir.runtime.fsdp", "remat_ir.runtime.op_timing", "remat_ir.runtime.load",
            "remat_ir.runtime.bind", "remat_ir.ir.files"} <= roots
    assert runtime <= roots


def test_no_import_cycle(modules):
    graph = import_graph(modules)
    # Not vacuous: function-level and lazy imports are edges.
    assert "remat_ir.trace.tracer" in graph["remat_ir.runtime.bind"]
    assert "remat_ir.pipeline" in graph["remat_ir.adopt"] and "remat_ir.adopt" in graph["remat_ir"]
    bad = check_cycles(modules)
    assert not bad, "\n" + "\n".join(map(str, bad))


def test_no_import_cycle_between_packages(modules):
    graph = package_graph(modules)
    assert "remat_ir.trace" in graph["remat_ir.runtime"] and "remat_ir.optimize" in graph["remat_ir"]
    bad = check_cycles(modules, packages=True)
    assert not bad, "\n" + "\n".join(map(str, bad))


def test_no_private_name_crosses_packages(modules):
    importers = {**modules, **scan(tool_sources())}
    assert "tools.gpu_check" in importers
    bad = check_private(modules, importers)
    assert not bad, "\n" + "\n".join(map(str, bad))


# ------------------------------------------------- the checker catches breaks


def _with(extra: dict[str, tuple[str, str]], packages=()) -> dict[str, Module]:
    """The real package, with some modules added or replaced (name -> (path, source))."""
    sources = module_sources()
    for name, (path, text) in extra.items():
        sources[name] = (path, text, name in packages)
    return scan(sources)


def test_checker_reports_a_function_level_import_into_another_stage():
    mods = _with({"remat_ir.ir.x": ("remat_ir/ir/x.py",
                                    "def f():\n    from remat_ir.check import verify\n    return verify\n")})
    bad = [v for v in check_rules(mods) if v.where.startswith("remat_ir/ir/x.py")]
    assert [(v.rule, v.where) for v in bad] == [
        ("a", "remat_ir/ir/x.py:2: remat_ir.ir.x: import remat_ir.check.verify (inside a function)")]
    # Relative, too: `from ..check import simulate` in remat_ir/ir/y.py.
    mods = _with({"remat_ir.ir.y": ("remat_ir/ir/y.py", "def g():\n    from ..check import simulate\n")})
    assert [v.where for v in check_rules(mods) if v.where.startswith("remat_ir/ir/y.py")] == [
        "remat_ir/ir/y.py:2: remat_ir.ir.y: import remat_ir.check.simulate (inside a function)"]


def test_checker_reports_cvxpy_on_the_runtime_path():
    path, text, _ = module_sources()["remat_ir.runtime.interpret"]
    n = len(text.splitlines())
    # Directly, inside a function ...
    mods = _with({"remat_ir.runtime.interpret": (path, text + "\n\ndef _solve():\n    import cvxpy\n")})
    rules = {(v.rule, v.where.split(": ")[0]) for v in check_rules(mods)}
    assert ("b", f"{path}:{n + 4}") in rules
    closure = [v for v in check_closures(mods) if v.where.startswith(f"{path}:{n + 4}:")]
    assert [v.rule for v in closure] == ["d"] and "import cvxpy" in closure[0].where
    # ... and through a helper module the interpreter imports relatively.
    mods = _with({
        "remat_ir.runtime.interpret": (path, text + "\n\ndef _plan():\n    from . import helper\n"),
        "remat_ir.runtime.helper": ("remat_ir/runtime/helper.py",
                                    "def h():\n    from ..optimize.search import optimize\n"),
    })
    closure = check_closures(mods)
    assert closure and all(v.rule == "d" for v in closure)
    assert any("remat_ir.runtime.interpret -> remat_ir.runtime.helper" in v.chain
               and "remat_ir.optimize" in v.where for v in closure), "\n".join(map(str, closure))
    # The lazy export `remat_ir.compile` pulls the pipeline (and so the optimizer) in.
    mods = _with({"remat_ir.runtime.interpret": (path, text + "\n\ndef _c(m):\n    import remat_ir\n"
                                                             "    return remat_ir.compile(m)\n")})
    closure = check_closures(mods)
    assert closure and any("remat_ir.pipeline -> remat_ir.optimize" in v.chain for v in closure), \
        "\n".join(map(str, closure))


def test_checker_reports_the_cli_reaching_past_the_api():
    path, text, _ = module_sources()["remat_ir.cli.commands"]
    extra = ("\n\ndef _x():\n    import torch\n    from remat_ir.pipeline import _check_optimizer_args\n"
             "    import remat_ir.optimize._internal\n    import remat_ir\n    return remat_ir._hidden\n")
    n = len(text.splitlines())
    bad = [v for v in check_rules(_with({"remat_ir.cli.commands": (path, text + extra)}))
           if v.where.startswith(path) and int(v.where.split(":")[1]) > n]
    assert {v.rule for v in bad} == {"e"}
    text_bad = "\n".join(map(str, bad))
    for what in ("import torch", "_check_optimizer_args", "remat_ir.optimize._internal", "remat_ir._hidden"):
        assert what in text_bad, text_bad


def test_checker_reports_an_import_cycle():
    # Two modules that import each other, one of them inside a function; and a longer cycle
    # through a package's lazy __getattr__.
    mods = _with({
        "remat_ir.ir.x": ("remat_ir/ir/x.py", "from remat_ir.ir import y\n"),
        "remat_ir.ir.y": ("remat_ir/ir/y.py", "def f():\n    from remat_ir.ir.x import thing\n"),
    })
    bad = check_cycles(mods)
    assert [v.where for v in bad] == ["remat_ir.ir.x -> remat_ir.ir.y -> remat_ir.ir.x"], "\n".join(map(str, bad))
    assert bad[0].rule == "cycle"
    assert "remat_ir/ir/y.py:2 remat_ir.ir.y -> remat_ir.ir.x" in bad[0].chain
    path, text, _ = module_sources()["remat_ir.runtime.fsdp"]
    mods = _with({"remat_ir.runtime.fsdp": (path, text + "\n\ndef _p():\n    import remat_ir\n"
                                                         "    return remat_ir.wrap\n")})
    bad = check_cycles(mods)
    assert len(bad) == 1 and "remat_ir.runtime.fsdp" in bad[0].where and "remat_ir.adopt" in bad[0].where, \
        "\n".join(map(str, bad))
    # Between packages: the tracer loading a model with the runtime, which imports the tracer.
    path, text, _ = module_sources()["remat_ir.trace.tracer"]
    mods = _with({"remat_ir.trace.tracer": (path, text + "\n\ndef _b(name):\n    from remat_ir.runtime.load "
                                                         "import load_model\n    return load_model(name)\n")})
    assert not check_cycles(mods)
    bad = check_cycles(mods, packages=True)
    assert [v.where for v in bad] == ["remat_ir.runtime -> remat_ir.trace -> remat_ir.runtime"], \
        "\n".join(map(str, bad))
    assert "remat_ir.trace.tracer: from remat_ir.runtime.load import load_model" not in bad[0].chain
    assert f"{path}:{len(text.splitlines()) + 4} remat_ir.trace.tracer -> remat_ir.runtime.load" in bad[0].chain


def test_checker_reports_the_runtime_closure_from_any_runtime_module():
    # The fsdp runner importing the planning wrapper back (and through it the pipeline).
    path, text, _ = module_sources()["remat_ir.runtime.fsdp"]
    mods = _with({"remat_ir.runtime.fsdp": (path, text + "\n\ndef _p():\n    from remat_ir.adopt import "
                                                         "AutoRemat\n    return AutoRemat\n")})
    closure = check_closures(mods)
    assert closure and all("reached from remat_ir.runtime.fsdp" in v.where for v in closure), \
        "\n".join(map(str, closure))
    assert any("remat_ir.runtime.fsdp -> remat_ir.adopt" in v.chain for v in closure)


def test_checker_reports_a_private_name_from_another_package():
    mods = _with({
        "remat_ir.runtime.x": ("remat_ir/runtime/x.py",
                               "def f():\n    from remat_ir.check.simulate import _dense, simulate\n"
                               "    from remat_ir.runtime.interpret import _same_package\n"
                               "    from remat_ir.check import simulate as s\n    return s._hidden, s.__name__\n"),
    })
    bad = [v for v in check_private(mods) if v.where.startswith("remat_ir/runtime/x.py")]
    assert [v.where.split("  ")[1] for v in bad] == ["(private: _dense, of remat_ir.check)",
                                                     "(private: _hidden, of remat_ir.check)"], \
        "\n".join(map(str, bad))
    tools = scan({"tools.t": ("tools/t.py", "from remat_ir.runtime.bind import _first\n"
                                            "import remat_ir.optimize._inner\n", False)})
    bad = check_private(mods, tools)
    assert [v.where.split("  ")[1] for v in bad] == ["(private: _first, of remat_ir.runtime)",
                                                     "(private: _inner, of remat_ir.optimize)"], \
        "\n".join(map(str, bad))


def test_checker_reports_every_cli_module():
    # The rule is every CLI module's: show.py importing torch or a private name breaks it; bench.py may
    # import torch, not a private name of the project.
    for name, torch_ok in (("remat_ir.cli.show", False), ("remat_ir.cli.outputs", False),
                           ("remat_ir.cli.bench", True)):
        path, text, _ = module_sources()[name]
        n = len(text.splitlines())
        extra = "\n\ndef _x():\n    import torch\n    from remat_ir.runtime.interpret import _hidden\n"
        bad = [v for v in check_rules(_with({name: (path, text + extra)}))
               if v.where.startswith(path) and int(v.where.split(":")[1]) > n]
        assert {v.rule for v in bad} == {"e"}
        got = "\n".join(map(str, bad))
        assert "_hidden" in got and ("import torch" in got) != torch_ok, got


# ------------------------------------------------------------- the real thing


def test_runtime_path_imports_no_optimizer():
    """Load a golden plan, wrap the model, run a step: no cvxpy, scipy, lark
    or remat_ir.optimize in sys.modules afterwards."""
    code = (
        "import sys\n"
        "import remat_ir\n"
        "from remat_ir.models import build_builtin\n"
        "plan = remat_ir.load_plan('schedules/gpt2-tiny.rir')\n"
        "shape = next(v.shape for v in plan.values if v.kind == 'input')\n"
        "module, inputs = build_builtin(plan.header.model, batch=shape[0], seq=shape[1])\n"
        "w = remat_ir.wrap(module, plan)\n"
        "w(*inputs).backward()\n"
        "assert all(p.grad is not None for p in module.parameters() if p.requires_grad)\n"
        "bad = [m for m in ('cvxpy', 'scipy', 'lark', 'remat_ir.optimize') if m in sys.modules]\n"
        "assert not bad, f'imported on the runtime path: {bad}'\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_tools_run_on_the_installed_package():
    """A script in tools/ imports remat_ir as installed (`pip install -e .`):
    none edits sys.path to find it."""
    edits = [p.name for p in sorted((ROOT / "tools").glob("*.py"))
             if re.search(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=", p.read_text(encoding="utf-8"))]
    assert not edits, f"tools editing sys.path: {edits}"
