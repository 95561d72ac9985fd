"""The README and docs/ as a test.

The README is the page a new user reads: it stays short (at most 250 lines)
and keeps the two commands verbatim, the second of which `.ci/run` runs.
docs/*.md holds the rest; every relative link in these pages points at a file
that exists (and, where a link names an anchor, at a heading of that file),
every `tools/...` script, repository path and `remat-*` command they name
exists, and the README's headline results table is the one in
docs/09-benchmarks.md, row for row.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README] + sorted(DOCS.glob("*.md"))

MAX_README_LINES = 250

# The two commands, verbatim: the README says them, .ci/run runs the second.
MAIN_JOB = ("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && "
            ".venv/bin/pip install -q -e . && .venv/bin/remat-compile gpt2-tiny -o gpt2-tiny.rir && "
            ".venv/bin/remat-verify gpt2-tiny.rir && .venv/bin/remat-run gpt2-tiny.rir gpt2-tiny --steps 5 --check")
TEST_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && "
                ".venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest -q -n 2")

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A path into the repository, as the pages name one (`tools/step_time.py`, `tests/test_adopt.py`).
REPO_PATH = re.compile(r"(?<![\w./-])((?:tools|tests|examples|remat_ir|grammar|schedules)/[\w./-]*\w)")
# A console script: remat-X not inside a longer word, a path or a comma-separated list
# (`--methods ckpt-all,remat-0.3,remat-floor` names benchmark methods, not commands).
COMMAND = re.compile(r"(?<![\w./,$-])remat-([a-z][a-z0-9]*(?:-[a-z][a-z0-9]*)*)")
NOT_COMMANDS = {"ir"}   # the project's own name: remat-ir, ~/.cache/remat-ir


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links live there)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    heads = re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", FENCE.sub("", _text(path)), re.M)
    return {_slug(h) for h in heads}


def _code_block_after(text: str, marker: str) -> str:
    """The first fenced code block after the line that contains `marker`."""
    at = text.index(marker)
    m = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M).search(text, at)
    assert m, f"no code block after {marker!r}"
    return m.group(1).strip()


def _scripts() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["scripts"])


def _table(text: str, header: str) -> list[str]:
    """The rows of the markdown table whose header line starts with `header`."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_readme_is_short():
    n = len(_text(README).splitlines())
    assert n <= MAX_README_LINES, (f"README.md has {n} lines (at most {MAX_README_LINES}): "
                                   "move the details to a page of docs/")


def test_docs_exist_and_are_indexed():
    index = _text(DOCS / "README.md")
    pages = [p.name for p in PAGES if p.parent == DOCS and p.name != "README.md"]
    assert pages, "docs/ has no pages"
    missing = [name for name in pages if f"]({name})" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(page):
    bad = []
    for target in LINK.findall(_prose(_text(page))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):     # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not bad, f"{page.relative_to(ROOT)}: broken links: {bad}"


def test_link_checker_sees_a_broken_link():
    text = "see [x](docs/nope.md), `[y](ignored.md)`, [web](https://example.com)\n```\n[z](also-ignored.md)\n```\n"
    assert LINK.findall(_prose(text)) == ["docs/nope.md", "https://example.com"]
    assert _slug("The traced step is eager's step") == "the-traced-step-is-eagers-step"


def test_readme_two_commands_verbatim():
    text = _text(README)
    assert _code_block_after(text, "Set up and run the main job") == MAIN_JOB
    assert _code_block_after(text, "Set up and run the tests") == TEST_COMMAND


def test_ci_runs_the_readme_test_command():
    ci = _text(ROOT / ".ci" / "run").splitlines()
    assert TEST_COMMAND in ci, ".ci/run does not run the README's test command verbatim"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_scripts_and_paths_exist(page):
    text = _text(page)
    missing = sorted({p for p in REPO_PATH.findall(text) if not (ROOT / p.rstrip(".")).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"
    scripts = _scripts()
    unknown = sorted({f"remat-{c}" for c in COMMAND.findall(text)
                      if c not in NOT_COMMANDS and f"remat-{c}" not in scripts})
    assert not unknown, (f"{page.relative_to(ROOT)} names commands that are not in pyproject's "
                         f"[project.scripts]: {unknown}")


def test_command_checker_sees_names():
    text = "`remat-compile x`, remat-frobnicate, remat-ir's cache ~/.cache/remat-ir, --methods a,remat-floor"
    assert COMMAND.findall(text) == ["compile", "frobnicate", "ir"]
    assert REPO_PATH.findall("run `tools/step_time.py` and `python tools/nope.py`.") == ["tools/step_time.py",
                                                                                         "tools/nope.py"]


def test_readme_results_table_is_the_benchmarks_page_table():
    header = "| method | peak total |"
    readme_rows = _table(_text(README), header)
    assert len(readme_rows) > 2, "README.md has no results table"
    assert readme_rows == _table(_text(DOCS / "09-benchmarks.md"), header), (
        "README.md's results table differs from docs/09-benchmarks.md's: change both")
