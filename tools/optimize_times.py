"""The optimizer's own time on the models and budgets it is held to, against
the targets, as a markdown table.

    .venv/bin/python tools/optimize_times.py [--only gpt2-tiny,mlp] [--repeat 2]
    .venv/bin/python tools/optimize_times.py --cases gpt2 --solves              # floors and budgets, solves by kind
    .venv/bin/python tools/optimize_times.py --cases flat --solves              # the flat search's twelve budgets
    .venv/bin/python tools/optimize_times.py --cases flat --solves --set budget_rows_per_round=1000000 --set rows_apart=-1
    .venv/bin/python tools/optimize_times.py --cases flat --budgets floor --solves --set floor_rows_per_round=16
    .venv/bin/python tools/optimize_times.py --cases corpus --only mistral,t5-nomask   # families as wrap plans them

Each model is traced once (fake tensors where it is large); each row then
times `remat_ir.optimize.search.optimize` cold (a fresh problem and memo:
the graph's analysis counts, as a CLI run does it too), and prints the
plan's extra compute, the search mode, and a short hash of the plan text.
A budget `floor` times `search.floor` instead (its column shows the floor
as a share of the unoptimized peak).  With `--repeat N` every row is solved
N times and the hashes must agree: a plan depends on the program, the budget
and the settings only (every MILP stops at a node limit or its gap, never
at a time).  Budgets are fractions of the unoptimized peak in `--scope`.

Case sets (`--cases`): `targets` (the default: the models and budgets the
optimizer is held to, and the gpt2-tiny `--pareto` sweep), `gpt2`
(gpt2-small and gpt2-medium 4 x 512, fake: the floor and 0.7/0.5/0.3),
`flat` (twelve budgets of graphs the flat search plans whole: gpt2-tiny,
the 2-layer transformers GPT-2, the 3-layer transformers Llama) and
`corpus` (every family of `remat_ir.models.families`, traced with real
tensors as users call them, at 0.5, 0.3 and the floor, each planned as
`remat_ir.wrap` plans it: the rewrite ladder, `ladder.optimize` and
`ladder.floor`; a family whose package is missing is a skipped row).
`--budgets` replaces every case's budgets.

The `refused` column says where a budget is below the floor (the floor, in
bytes and as a share of the unoptimized peak), `time limit` where the
optimizer's safety time limit (`--set time_limit=...`) cut a search short:
the row's plan, or the floor a refusal names, is then only the best found.

Settings: `--effort` and `--set FIELD=VALUE` (repeatable) make the
`remat_ir.optimize.problem.Settings` of every solve (`Settings.of(effort,
FIELD=VALUE, ...)`: `rows_apart=-1`, `option_nodes=none`, `solver=SCIP`,
`time_limit=60`); the line above the table names the ones that differ from
the effort's.  `--solves` adds two columns from each result's solve
records: the solves by kind and method (how many, how many proven optimal,
their seconds), and the flat search's lazy rounds with the memory rows of
its last one.  A total of the rows' times ends the table.

The script runs under `PYTHONHASHSEED=0` (it starts itself again with it):
a model that iterates a set of strings in its forward traces a graph whose
op order is the hash seed's (transformers' ModernBERT computes its global
and local rotary embeddings in `set(config.layer_types)` order), and a
plan's hash names its graph too.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable, NamedTuple

from remat_ir.ir.printer import format_program, human_bytes
from remat_ir.ir.types import SCOPES
from remat_ir.models.families import FAMILIES
from remat_ir.optimize import ladder, search
from remat_ir.optimize.milp import FLAT
from remat_ir.optimize.pareto import sweep
from remat_ir.optimize.problem import Problem, Settings
from remat_ir.pipeline import trace
from remat_ir.runtime.load import load_model

ROOT = Path(__file__).resolve().parents[1]
SCOPE = "activations"
FLOOR = "floor"  # a budget that asks for the floor


def builtin(name, **kw):
    def make():
        m = load_model(name, fake=kw.get("fake", False), batch=kw.get("batch"), seq=kw.get("seq"))
        return trace(m.module, m.inputs, loss=m.loss, name=m.name, fake=kw.get("fake", False))
    return make


def model_file(path):
    def make():
        m = load_model(str(ROOT / path))
        return trace(m.module, m.inputs, loss=m.loss, name=m.name)
    return make


def llama3():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=1000, max_position_embeddings=64,
                      attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.train()
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0))
    return trace(model, (), {"input_ids": ids, "labels": ids}, name="transformers Llama, 3 layers")


def encoder_decoder(kind: str, layers: int):
    """A transformers T5 or BART with `layers` encoder and decoder layers
    (d=128), traced under fake tensors for a batch of 4 x 64 (labels 32)."""
    def make():
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            if kind == "t5":
                from transformers import T5Config, T5ForConditionalGeneration

                model = T5ForConditionalGeneration(T5Config(
                    vocab_size=1000, d_model=128, d_ff=256, d_kv=32, num_layers=layers,
                    num_decoder_layers=layers, num_heads=4, decoder_start_token_id=0, pad_token_id=0))
            else:
                from transformers import BartConfig, BartForConditionalGeneration

                model = BartForConditionalGeneration(BartConfig(
                    vocab_size=1000, d_model=128, encoder_layers=layers, decoder_layers=layers,
                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=256,
                    decoder_ffn_dim=256, max_position_embeddings=128, pad_token_id=1, bos_token_id=0,
                    eos_token_id=2, decoder_start_token_id=2))
            model.train()
            call = {"input_ids": torch.randint(0, 1000, (4, 64)), "attention_mask": torch.ones(4, 64, dtype=torch.long),
                    "labels": torch.randint(0, 1000, (4, 32))}
        return trace(model, (), call, name=f"transformers {kind} {layers}+{layers}", fake=True)
    return make


def family(name: str):
    """A family of `remat_ir.models.families` (small config, random weights)
    traced with real tensors as its usual training call makes them."""
    def make():
        from remat_ir.models.families import FAMILIES

        model, kwargs = FAMILIES[name]()
        model.train()
        return trace(model, (), kwargs, name=name)
    return make


def llama_70b_shapes(layers: int):
    """Llama-2-70B's shapes (d=8192, GQA 64/8 heads, FFN 28672) with `layers`
    layers, fake, one sequence of 4096."""
    def make():
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from transformers import LlamaConfig, LlamaForCausalLM

        with FakeTensorMode():
            model = LlamaForCausalLM(LlamaConfig(
                hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096))
            model.train()
            ids = torch.randint(0, 32000, (1, 4096))
        return trace(model, (), {"input_ids": ids, "labels": ids}, name=f"Llama-2-70B shapes, {layers} layers",
                     fake=True)
    return make


class Case(NamedTuple):
    """One model of a table and the budgets it is timed at."""

    label: str
    make: Callable  # () -> the traced Program
    budgets: tuple  # fractions of the unoptimized peak, or FLOOR
    target: float | None = None  # seconds per budget; None: no target
    # The module whose `optimize(program, budget, settings, scope=)` and
    # `floor(program, settings, scope=)` solve the rows: `search` (None), or
    # another strategy module of the same shape (`remat_ir.optimize.ladder`).
    strategies: object = None


# The models and budgets the optimizer is held to (a plain 4-tuple is a Case too).
CASES = [
    Case("gpt2-tiny", builtin("gpt2-tiny", fake=True), (0.7, 0.5), 2.0),
    Case("mlp", builtin("mlp"), (0.8,), 2.0),
    Case("transformers GPT-2, 2 layers", model_file("examples/hf_gpt2.py"), (0.7,), 2.0),
    Case("transformers Llama, 3 layers", llama3, (0.7,), 2.0),
    Case("gpt2-mid8", builtin("gpt2-mid8", fake=True), (0.5,), 5.0),
    Case("GPT-2 medium 4x512 (fake)", builtin("gpt2-medium", fake=True, batch=4, seq=512), (0.5, 0.3), 8.0),
    # Encoder-decoders and a deep model (the optimizer issue's targets).
    Case("T5 3+3 (fake)", encoder_decoder("t5", 3), (0.7, 0.5, 0.3), 10.0),
    Case("BART 3+3 (fake)", encoder_decoder("bart", 3), (0.7, 0.5, 0.3), 10.0),
    Case("T5 12+12 (fake)", encoder_decoder("t5", 12), (0.7, 0.5, 0.3), 10.0),
    Case("BART 12+12 (fake)", encoder_decoder("bart", 12), (0.7, 0.5, 0.3), 10.0),
    Case("Llama-2-70B shapes, 8 layers (fake)", llama_70b_shapes(8), (0.3,), 15.0),
    Case("Llama-2-70B shapes, 32 layers (fake)", llama_70b_shapes(32), (0.3,), 15.0),
    Case("Llama-2-70B shapes, 80 layers (fake)", llama_70b_shapes(80), (0.3,), 15.0),
    # Below the recompute floor: the rewrite ladder (its floor, and a budget under the graph's own floor).
    Case("gpt2-mid, rewrite ladder (fake)", builtin("gpt2-mid", fake=True), (FLOOR, 0.25), 20.0, ladder),
    Case("GPT-2 medium 4x512, rewrite ladder (fake)", builtin("gpt2-medium", fake=True, batch=4, seq=512),
         (FLOOR,), 20.0, ladder),
]

# GPT-2 small and medium at batch 4 x 512 under fake tensors: the floor and three budgets.
GPT2_CASES = [
    Case("gpt2-small 4x512 (fake)", builtin("gpt2-small", fake=True, batch=4, seq=512), (FLOOR, 0.7, 0.5, 0.3)),
    Case("gpt2-medium 4x512 (fake)", builtin("gpt2-medium", fake=True, batch=4, seq=512), (FLOOR, 0.7, 0.5, 0.3)),
]

# Graphs of at most `Settings.flat_max_decisions` decisions, planned whole by
# the flat search: twelve budgets for its lazy-row settings.
FLAT_CASES = [
    Case("gpt2-tiny", builtin("gpt2-tiny", fake=True), (0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75)),
    Case("transformers GPT-2, 2 layers", model_file("examples/hf_gpt2.py"), (0.5, 0.6, 0.7)),
    Case("transformers Llama, 3 layers", llama3, (0.6, 0.7)),
]

# Every family of the corpus at two budgets and the floor, as `wrap` plans them.
CORPUS_CASES = [Case(name, family(name), (0.5, 0.3, FLOOR), 20.0, ladder) for name in FAMILIES]

CASE_SETS = {"targets": CASES, "gpt2": GPT2_CASES, "flat": FLAT_CASES, "corpus": CORPUS_CASES}


# ---------------------------------------------------------------- settings


def _value(text: str):
    """A setting's value as typed: none, true/false, an int, a float, else the text."""
    low = text.lower()
    if low == "none":
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def overrides(pairs: list[str]) -> dict:
    """`FIELD=VALUE` strings (`--set`) as Settings overrides."""
    out = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq:
            raise SystemExit(f"--set {pair}: expected FIELD=VALUE (fields: "
                             f"{', '.join(f.name for f in fields(Settings))})")
        out[name.strip()] = _value(value.strip())
    return out


def settings_of(effort: str, pairs: list[str]) -> Settings:
    """The settings of `effort` with the `--set` overrides.  `Settings.of`
    leaves a None override at the effort's default, so a None (`option_nodes=none`:
    solve to the gap) is set on its result."""
    given = overrides(pairs)
    try:
        settings = Settings.of(effort, **{k: v for k, v in given.items() if v is not None})
        nones = {k: None for k, v in given.items() if v is None}
        return search.settings_of(replace(settings, **nones) if nones else settings)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--set: {e}") from None


def changed(settings: Settings, effort: str) -> list[str]:
    """The settings that differ from the effort's, as FIELD=VALUE."""
    base = Settings.of(effort)
    return [f"{f.name}={getattr(settings, f.name)!r}" for f in fields(Settings)
            if getattr(settings, f.name) != getattr(base, f.name)]


# ---------------------------------------------------------------- columns


def digest(program) -> str:
    return hashlib.sha256(format_program(program).encode()).hexdigest()[:10]


def by_kind(solves) -> str:
    """The solves by kind and method: how many, how many proven optimal, their seconds."""
    groups: dict[tuple, list] = {}
    for s in solves:
        g = groups.setdefault((s.kind, s.method), [0, 0, 0.0])
        g[0] += 1
        g[1] += s.status == "optimal"
        g[2] += s.seconds
    return ", ".join(f"{n} {kind}{'' if method == 'MILP' else ' ' + method} ({proven} proven, {sec:.1f} s)"
                     for (kind, method), (n, proven, sec) in groups.items()) or "-"


def lazy_rows(solves) -> str:
    """The flat search's rounds (each adds memory rows) and the rows of its last."""
    flat = [s for s in solves if s.kind == FLAT]
    if not flat:
        return "-"
    last = flat[-1].rows
    return f"{len(flat)} rounds, {'every' if last is None else last} rows"


def solve(case: Case, program, budget: int | None, settings: Settings, scope: str):
    strategies = case.strategies or search
    if budget is None:
        return strategies.floor(program, settings, scope=scope)
    return strategies.optimize(program, budget, settings, scope=scope)


# ---------------------------------------------------------------- the table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="targets", choices=list(CASE_SETS), help="the set of models and budgets")
    ap.add_argument("--only", default="", help="comma-separated labels (prefixes) to run")
    ap.add_argument("--budgets", default="", help="comma-separated fractions (or floor) for every case")
    ap.add_argument("--scope", default=SCOPE, choices=SCOPES)
    ap.add_argument("--effort", default="fast", choices=("fast", "full"))
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="FIELD=VALUE",
                    help="an optimizer setting (remat_ir.optimize.problem.Settings), repeatable")
    ap.add_argument("--solves", action="store_true", help="add the solves by kind and the flat search's rounds")
    ap.add_argument("--repeat", type=int, default=1, help="solves per row (the plan hashes must agree)")
    ap.add_argument("--no-pareto", action="store_true", help="skip the gpt2-tiny --pareto row (targets)")
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    settings = settings_of(args.effort, args.settings)
    given = [b.strip() for b in args.budgets.split(",") if b.strip()]
    budgets = tuple(b if b == FLOOR else float(b) for b in given)

    print(f"{args.cases}, scope {args.scope}, effort {args.effort}"
          + "".join(f", {c}" for c in changed(settings, args.effort)))
    cols = ["model", "decisions", "budget", "optimize time", "target", "refused", "time limit", "extra compute",
            "search", "plan"]
    if args.solves:
        cols += ["solves", "flat rounds"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    ok, total, rows = True, 0.0, 0
    for case in CASE_SETS[args.cases]:
        case = Case(*case)
        if only and not any(case.label.startswith(o) for o in only):
            continue
        try:
            program = case.make()
        except ImportError as e:  # a family whose package is not installed (timm, diffusers)
            cells = [case.label, "-", "-", "-", "-", "-", "-", f"skipped: {e}", "-", "-"]
            print("| " + " | ".join(cells + (["-", "-"] if args.solves else [])) + " |", flush=True)
            continue
        decisions = len(Problem.of(program, args.scope).decisions)
        top = search.unoptimized_peak(program, args.scope)
        for frac in budgets or case.budgets:
            budget = None if frac == FLOOR else search.resolve_budget(program, frac, args.scope)
            times, hashes, r, refused, limited = [], set(), None, None, False
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                try:
                    r = solve(case, program, budget, settings, args.scope)
                    limited |= r.time_limited
                except search.Infeasible as e:
                    refused = e
                    limited |= e.time_limited
                times.append(time.perf_counter() - t0)
                if r is not None:
                    hashes.add(digest(r.program))
            t = min(times)
            total += t
            rows += 1
            same = len(hashes) <= 1 and (refused is None or r is None)
            ok = ok and same
            over = "" if case.target is None or t <= case.target else " (over)"
            target = "-" if case.target is None else f"{case.target:g} s"
            no = "-"
            if refused is not None:
                no = f"below the floor, {human_bytes(refused.floor_bytes)} ({refused.floor_bytes / top:.1%})"
            if r is None:
                extra, mode, plan = "-", "-", "-"
            else:
                extra = f"{r.overhead:.3%}"
                mode = r.mode + "".join(f", {w}" for w in r.program.header.rewrites)
                plan = next(iter(hashes)) + ("" if same else f" ({len(hashes)} different plans!)")
            shown = frac if budget is not None else (f"floor ({r.predicted_peak / top:.1%})" if r else "floor")
            cells = [case.label, str(decisions), str(shown), f"{t:.1f} s{over}", target, no,
                     "stopped" if limited else "-", extra, mode, plan]
            if args.solves:
                cells += [by_kind(r.solves), lazy_rows(r.solves)] if r else ["-", "-"]
            print("| " + " | ".join(cells) + " |", flush=True)
    pareto = args.cases == "targets" and not args.no_pareto and not budgets and \
        (not only or any("gpt2-tiny".startswith(o) or o == "pareto" for o in only))
    if pareto:
        # The sweep takes an effort, a solver and a time limit only.
        other = [c for c in changed(settings, args.effort) if c.split("=")[0] not in ("solver", "time_limit")]
        program = builtin("gpt2-tiny", fake=True)()
        t0 = time.perf_counter()
        points = sweep(program, args.scope, points=8, effort=args.effort, solver=settings.solver,
                       time_limit=settings.time_limit)
        t = time.perf_counter() - t0
        total += t
        rows += 1
        cells = [f"gpt2-tiny --pareto, {len(points)} points", "-", "whole sweep",
                 f"{t:.1f} s{'' if t <= 10 else ' (over)'}", "10 s", "-", "-", "-",
                 "-" if not other else "without " + ", ".join(other), "-"]
        if args.solves:
            cells += ["-", "-"]
        print("| " + " | ".join(cells) + " |")
    print(f"\ntotal {total:.1f} s ({rows} rows)")
    return 0 if ok else 1


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":  # (the module docstring says why)
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    sys.exit(main())
