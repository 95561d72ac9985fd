"""The package list; everything else about the build is in pyproject.toml.

Every package under remat_ir/ is found (a new subpackage ships without
editing a list), and remat_ir.grammar is added: it lives in grammar/
(`package-dir` in pyproject.toml), where discovery does not look, and it
carries rir.lark, which `remat_ir.ir.parser.grammar_text` reads from the
installed package.  tests/test_packaging.py installs a wheel and checks both.
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["remat_ir", "remat_ir.*"]) + ["remat_ir.grammar"])
