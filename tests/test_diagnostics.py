"""Expected-error tests: `.rir` files under tests/diagnostics/ that say, in
comments, which errors the parser or the verifier must report and where.

In the manner of MLIR's `-verify-diagnostics` and xDSL's `tests/filecheck/`:
adding a case means adding a file.  The format is described in
tests/diagnostics/README.md; in short, a line carrying

    # expected-error {{substring of the message}}

expects an error on that line; `@+N` / `@-N` point N lines below / above,
`@unknown` expects a diagnostic that has no line (verifier errors about the
graph as a whole), and `:COL` (after the `@...` part, if any) pins the column
of a parse error.

* `parse/*.rir`: `parse_program` raises `RirSyntaxError` exactly there (one
  expectation per file);
* `verify/*.rir`: the file parses, and `verify()` reports exactly the expected
  diagnostics: each expectation is met by a diagnostic on its line whose message
  contains the substring, and each diagnostic meets some expectation.  A file
  with no expectations must verify ok.

The expectations are found in the raw lines by a regex, independently of the
parser, so they work inside lines the parser cannot read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from remat_ir.check.verify import verify
from remat_ir.ir.parser import parse_program
from remat_ir.ir.syntax import RirSyntaxError

ROOT = Path(__file__).parent / "diagnostics"
MODES = ("parse", "verify")

# `expected-error`, then `@+N`, `@-N` or `@unknown`, then `:COL`, then `{{text}}`.
EXPECT_RE = re.compile(
    r"expected-error(?:@(?P<at>[+-]\d+|unknown|\S*))?(?::(?P<col>\S*?))?\s*\{\{(?P<text>.*?)\}\}")
MENTION_RE = re.compile(r"expected-\w+")


@dataclass(frozen=True)
class Expectation:
    line: int  # the line the error is expected on; 0: a diagnostic without a line (`@unknown`)
    col: int | None  # the expected column (parse errors only), or None: any
    text: str  # a substring of the expected message
    source: int  # the line the comment is on

    def where(self) -> str:
        at = "no line (@unknown)" if self.line == 0 else f"line {self.line}"
        if self.col is not None:
            at += f", col {self.col}"
        return at


class BadExpectation(ValueError):
    """The file's expectation comments themselves are malformed."""


def parse_expectations(text: str) -> list[Expectation]:
    """Every `expected-error` in `text`, found textually, line by line."""
    lines = text.split("\n")  # line breaks as the parser counts them (not str.splitlines's)
    if lines[-1] == "":
        lines.pop()
    out: list[Expectation] = []
    for i, line in enumerate(lines, start=1):
        found = list(EXPECT_RE.finditer(line))
        # A mention that does not parse as an expectation is a typo, not a comment.
        if len(MENTION_RE.findall(line)) != len(found):
            raise BadExpectation(f"line {i}: cannot read the expectation in {line.strip()!r}; write "
                                 f"`# expected-error[@+N|@-N|@unknown][:COL] {{{{message}}}}`")
        if found and "#" not in line[:found[0].start()]:
            raise BadExpectation(f"line {i}: an expectation must be in a `#` comment")
        for m in found:
            at, col, msg = m.group("at"), m.group("col"), m.group("text")
            if at is None:
                target = i
            elif at == "unknown":
                target = 0
            elif re.fullmatch(r"[+-]\d+", at):
                target = i + int(at)
                if not 1 <= target <= len(lines) + 1:  # +1: the end of a file without a final newline
                    raise BadExpectation(f"line {i}: @{at} points at line {target}, outside the file")
            else:
                raise BadExpectation(f"line {i}: bad location `@{at}`; use @+N, @-N or @unknown")
            if col is not None and not re.fullmatch(r"[1-9]\d*", col):
                raise BadExpectation(f"line {i}: bad column `:{col}`; use a 1-based number")
            if not msg.strip():
                raise BadExpectation(f"line {i}: empty expected message")
            out.append(Expectation(target, int(col) if col else None, msg, i))
    return out


def _show(exps: list[Expectation]) -> list[str]:
    return [f"  {e.where()}: {{{{{e.text}}}}}   (comment on line {e.source})" for e in exps] or ["  (none)"]


def check_parse(text: str, filename: str = "<case>") -> list[str]:
    """Problems with a parse case; [] when the parser fails exactly as expected."""
    exps = parse_expectations(text)
    if len(exps) != 1:
        return [f"a parse case needs exactly one expectation, found {len(exps)}:", *_show(exps)]
    (exp,) = exps
    if exp.line == 0:
        return ["a parse error always has a line; @unknown is for verifier diagnostics"]
    try:
        parse_program(text, filename)
    except RirSyntaxError as e:
        line_ok = e.line == exp.line
        col_ok = exp.col is None or e.column == exp.col
        if line_ok and col_ok and exp.text in e.message:
            return []
        why = [w for ok, w in ((line_ok, "line"), (col_ok, "column"), (exp.text in e.message, "message"))
               if not ok]
        return [f"the parse error differs from the expectation ({', '.join(why)}):",
                "expected:", *_show(exps),
                "actual:", f"  line {e.line}, col {e.column}: {e.message}"]
    return ["the text parsed, but a parse error was expected:", *_show(exps)]


def check_verify(text: str, filename: str = "<case>") -> list[str]:
    """Problems with a verify case; [] when verify() reports exactly the expected errors."""
    exps = parse_expectations(text)
    if any(e.col is not None for e in exps):
        return ["verifier diagnostics have no column; drop `:COL` from the expectations in a verify case"]
    try:
        program = parse_program(text, filename)
    except RirSyntaxError as e:
        return ["a verify case must parse, but:", f"  {e}"]
    verdict = verify(program)
    diags = list(verdict.errors)
    problems: list[str] = []
    if verdict.omitted:
        problems.append(f"{verdict.omitted} diagnostics were omitted (over the cap); keep cases small")
    unmet = [e for e in exps if not any(d.line == e.line and e.text in d.message for d in diags)]
    unexpected = [d for d in diags if not any(d.line == e.line and e.text in d.message for e in exps)]
    for e in unmet:
        problems.append(f"expected at {e.where()}: {{{{{e.text}}}}} (comment on line {e.source}): "
                        f"no such diagnostic")
    for d in unexpected:
        where = f"line {d.line}" if d.line else f"no line ({d.where or 'unknown'}; expect it with @unknown)"
        problems.append(f"unexpected diagnostic at {where}: {d.message}")
    if not exps and not verdict.ok:
        problems.insert(0, "no expectations, so the plan must verify ok, but it does not")
    if exps and verdict.ok:
        problems.insert(0, "the plan verifies ok, but errors were expected")
    if problems:
        problems += ["expected:", *_show(exps), "actual:"]
        problems += [f"  {'line ' + str(d.line) if d.line else d.where or 'no line'}: {d.message}"
                     for d in diags] or ["  (none: ok)"]
    return problems


CHECKERS = {"parse": check_parse, "verify": check_verify}


def _cases() -> list[Path]:
    return sorted(ROOT.rglob("*.rir"))


def _mode(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


@pytest.mark.parametrize("path", _cases(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_diagnostics(path: Path):
    mode = _mode(path)
    assert mode in CHECKERS, f"{path}: cases live under {', '.join(m + '/' for m in MODES)}"
    rel = path.relative_to(ROOT.parent.parent).as_posix()
    text = path.read_text(encoding="utf-8")
    try:
        problems = CHECKERS[mode](text, rel)
    except BadExpectation as e:
        pytest.fail(f"{rel}: {e}", pytrace=False)
    if problems:
        pytest.fail(f"{rel}:\n" + "\n".join(problems), pytrace=False)


def test_there_are_cases():
    by_mode = {m: [p for p in _cases() if _mode(p) == m] for m in MODES}
    assert len(by_mode["parse"]) >= 10 and len(by_mode["verify"]) >= 10, by_mode
    # At least one positive verify case: a plan the verifier must accept.
    assert any(not parse_expectations(p.read_text()) for p in by_mode["verify"])
    assert {p.parent for p in _cases()} <= {ROOT / m for m in MODES}, "cases live in parse/ or verify/"


# --------------------------------------------------- the matcher itself

PLAN = """\
rir 1
model "tiny"
fingerprint ""
device cpu
optimizer none 0 bytes
has_loss true

values
  x       input    f32[2,4] 32 bytes source x
  w       param    f32[4,3] 48 bytes source w requires_grad
  d.loss  tangent  f32[] 4 bytes source "0"

graph forward
  mm f32[2,3] 24 bytes = aten.mm.default(x, w)
  loss f32[] 4 bytes = aten.sum.default(mm)
graph backward
  d.mm f32[2,3] 24 bytes = aten.expand_copy.default(d.loss, [2, 3])
  x.t f32[4,2] stride [1,4] view of x = aten.t.default(x)
  d.w f32[4,3] 48 bytes = aten.mm.default(x.t, d.mm)

forward
  compute mm
  compute loss
  free mm
backward
  compute d.mm
  free d.loss
  compute x.t
  compute d.w
  free x.t
  free d.mm

outputs
  result 0 = loss
  grad w = d.w
"""


def _edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def test_matcher_reads_expectations():
    text = "a\nb  # expected-error {{one}}\n# expected-error@+1:7 {{two}}\nc\nd # expected-error@-3 {{x}} " \
           "expected-error@unknown {{y}}\n"
    assert parse_expectations(text) == [
        Expectation(2, None, "one", 2), Expectation(4, 7, "two", 3), Expectation(2, None, "x", 5),
        Expectation(0, None, "y", 5)]
    # Found textually: inside an unterminated string too.
    assert parse_expectations('model "oops # expected-error {{unterminated}}') == \
        [Expectation(1, None, "unterminated", 1)]
    for bad in ["x # expected-error {{}}", "x # expected-error@+9 {{m}}", "x # expected-eror {{m}}",
                "x # expected-error@3 {{m}}", "x # expected-error:0 {{m}}", "x # expected-error {m}",
                "x expected-error {{m}}"]:
        with pytest.raises(BadExpectation):
            parse_expectations(bad)


def test_matcher_accepts_the_right_answers():
    assert check_verify(PLAN) == []
    freed = _edit(PLAN, "  compute mm\n  compute loss\n  free mm\n", "  compute mm\n  free mm\n  compute loss\n")
    assert check_verify(_edit(freed, "  compute loss\n", "  compute loss  # expected-error {{freed at line 23}}\n")) == []
    assert check_verify(_edit(freed, "  free mm\n", "  free mm  # expected-error@+1 {{reads mm}}\n")) == []
    bad = _edit(PLAN, "  compute mm\n", "  compute mm\n  fre mm  # expected-error:3 {{did you mean `free`}}\n")
    assert check_parse(bad) == []


def test_matcher_rejects_mismatches():
    """A case must fail when the error is on another line, in another column,
    says something else, is missing, or comes with an unexpected one."""
    freed = _edit(PLAN, "  compute mm\n  compute loss\n  free mm\n", "  compute mm\n  free mm\n  compute loss\n")
    wrong_line = _edit(freed, "  free mm\n", "  free mm  # expected-error {{freed at line 23}}\n")
    assert any("no such diagnostic" in p for p in check_verify(wrong_line))
    assert any("unexpected diagnostic at line 24" in p for p in check_verify(wrong_line))
    wrong_text = _edit(freed, "  compute loss\n", "  compute loss  # expected-error {{double free}}\n")
    assert check_verify(wrong_text)
    assert any("unexpected diagnostic" in p for p in check_verify(freed))  # no expectation at all
    extra = _edit(PLAN, "  compute mm\n", "  compute mm  # expected-error {{boom}}\n")
    assert any("verifies ok, but errors were expected" in p for p in check_verify(extra))
    unknown = _edit(freed, "  compute loss\n", "  compute loss  # expected-error {{freed at line 23}} "
                    "expected-error@unknown {{never computed}}\n")
    assert any("no line (@unknown)" in p for p in check_verify(unknown))
    col = _edit(PLAN, "  compute mm\n", "  compute mm\n  fre mm  # expected-error:4 {{did you mean `free`}}\n")
    assert any("column" in p for p in check_parse(col))
    line = _edit(PLAN, "  compute mm\n", "  compute mm  # expected-error@+1 {{did you mean `free`}}\n  fre mm\n")
    assert check_parse(line) == []  # @+1 is right...
    assert any("line" in p for p in check_parse(line.replace("@+1", "@+2")))  # ...@+2 is not
    assert any("message" in p for p in check_parse(line.replace("`free`", "`frees`")))
    assert any("parsed" in p for p in check_parse(PLAN + "# expected-error {{x}}\n"))
    assert any("exactly one" in p for p in check_parse(PLAN))
    assert any("must parse" in p for p in check_verify(line))


@pytest.mark.parametrize("path", sorted((ROOT / "verify").glob("header-*.rir")), ids=lambda p: p.name)
def test_the_runtime_refuses_exactly_the_header_lines_the_verifier_does(path: Path):
    """A header's autocast and constants: what `remat-verify` calls sound is
    what the runtime runs (one statement of them, `remat_ir.ir.header`)."""
    from remat_ir.runtime.bind import PlanMismatch, check_header

    text = path.read_text()
    expected = parse_expectations(text)
    program = parse_program(text, str(path))
    if not expected:
        check_header(program)
        return
    with pytest.raises(PlanMismatch) as info:
        check_header(program)
    assert info.value.line == expected[0].line and expected[0].text in str(info.value)
