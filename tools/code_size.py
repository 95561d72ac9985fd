"""Lines of code per package of remat_ir, and its largest functions and classes.

    python tools/code_size.py [--top 12]

Lines are physical lines of the files (docstrings and comments included);
a function's or class's size is the span of its definition.
"""
from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _definitions(tree: ast.AST, prefix: str) -> list[tuple[int, str]]:
    """(lines, qualified name) of every function and class, nested ones included."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}.{node.name}"
            out.append((node.end_lineno - node.lineno + 1, f"{name} (line {node.lineno})"))
            out += _definitions(node, name)
    return out


def sizes(top: int) -> str:
    pkg_lines: dict[str, int] = defaultdict(int)
    pkg_files: dict[str, int] = defaultdict(int)
    defs: list[tuple[int, str]] = []
    for path in sorted((ROOT / "remat_ir").rglob("*.py")):
        rel = path.relative_to(ROOT)
        pkg = str(rel.parent).replace("/", ".")
        text = path.read_text(encoding="utf-8")
        pkg_lines[pkg] += len(text.splitlines())
        pkg_files[pkg] += 1
        mod = str(rel.with_suffix("")).replace("/", ".")
        defs += _definitions(ast.parse(text), mod)
    out = [f"{'package':<22}{'files':>6}{'lines':>8}"]
    for pkg in sorted(pkg_lines):
        out.append(f"{pkg:<22}{pkg_files[pkg]:>6}{pkg_lines[pkg]:>8}")
    out.append(f"{'total':<22}{sum(pkg_files.values()):>6}{sum(pkg_lines.values()):>8}")
    out.append("")
    out.append("largest functions and classes (lines):")
    for n, name in sorted(defs, reverse=True)[:top]:
        out.append(f"{n:>6}  {name}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    print(sizes(args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
