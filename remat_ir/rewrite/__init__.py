"""Graph rewrites below the recompute floor.

Recomputation frees a value and runs its op again; it cannot split an op, nor
run one that updates state twice.  These rewrites change the traced graph so
that it can:

    batchnorm_split     a training BatchNorm as a running-stat update plus a pure
                        normalization that can be recomputed (eager's bits)
    lm_head_nll:R       the chunked loss: cross-entropy (and the LM head's matmul,
                        where nothing else reads the logits) R rows at a time by
                        remat.lm_head_nll, no logits-sized tensor kept for
                        backward (eager's bits)
    lm_head_nll:R:late  the same, and a head weight tied to the embedding gets
                        its head gradient just before the embedding's, from the
                        logits' gradient made again, so it is not held through
                        backward (eager's bits)
    chunked_attention:K every softmax attention in K chunks of its B*H matrices, so
                        no [B, H, T, T] tensor is ever whole (the dropout mask is
                        drawn whole, as eager's)

A rewrite is a pure function Program -> Program that returns the rewritten
graph with its unoptimized schedule and names itself in `Header.rewrites`.
`apply(program, names)` replays a list of them: the runtime replays a
plan's list on a fresh trace of the model to check that the plan is this
model's.  The optimizer picks them (`remat_ir.optimize.search`); the
verifier checks their results without this code (`remat_ir.check.rewritten`).
"""
from __future__ import annotations

from remat_ir.ir import Program
from remat_ir.ir.header import retired_rewrite
from remat_ir.rewrite.batchnorm import NAME as BATCHNORM_SPLIT
from remat_ir.rewrite.batchnorm import candidates as batchnorm_candidates
from remat_ir.rewrite.batchnorm import split_batchnorm
from remat_ir.rewrite.chunk_attention import NAME as CHUNKED_ATTENTION
from remat_ir.rewrite.chunk_attention import chunk_attention
from remat_ir.rewrite.chunk_attention import chunk_choices as attention_choices
from remat_ir.rewrite.chunk_loss import NAME as CHUNKED_LOSS
from remat_ir.rewrite.chunk_loss import NotApplicable, chunk_loss, region, rows_of, tied

__all__ = ["BATCHNORM_SPLIT", "BIT_EXACT", "CHUNKED_ATTENTION", "CHUNKED_LOSS", "NotApplicable", "apply",
           "attention_choices", "describe", "has_batchnorm", "keeps_bits", "late_applies", "loss_rows_of",
           "region"]

# Whether a rewrite keeps eager's bits (`--exact` allows only these).  Chunked
# attention gave eager's bits on CPU in every test, but a batched matmul over
# fewer matrices may pick another kernel (cuBLAS does), so it does not claim them.
BIT_EXACT = {BATCHNORM_SPLIT: True, CHUNKED_LOSS: True, CHUNKED_ATTENTION: False}


def apply(program: Program, names: list[str]) -> Program:
    """`program` with the rewrites `names` ("batchnorm_split", "lm_head_nll:32")
    applied in order.  Raises NotApplicable (a ValueError) for a name that is
    unknown or a rewrite the graph does not allow."""
    for spec in names:
        name, _, arg = spec.partition(":")
        if name == BATCHNORM_SPLIT and not arg:
            program = split_batchnorm(program)
        elif name == CHUNKED_LOSS and _rows(arg):
            program = chunk_loss(program, *_rows(arg))
        elif name == CHUNKED_ATTENTION and arg.isdigit():
            program = chunk_attention(program, int(arg))
        elif retired_rewrite(spec):
            raise NotApplicable(retired_rewrite(spec))
        else:
            raise NotApplicable(f"unknown rewrite {spec!r}: expected {BATCHNORM_SPLIT}, {CHUNKED_LOSS}:R "
                                f"(R rows a chunk), {CHUNKED_LOSS}:R:late or {CHUNKED_ATTENTION}:K")
    return program


def _rows(arg: str) -> tuple[int, bool] | None:
    """(R, late) from "R" or "R:late"; None for anything else."""
    k, _, late = arg.partition(":")
    return (int(k), bool(late)) if k.isdigit() and late in ("", "late") else None


def keeps_bits(names: list[str]) -> bool:
    """Whether every rewrite in `names` keeps eager's bits."""
    return all(BIT_EXACT.get(spec.partition(":")[0], False) for spec in names)


def has_batchnorm(program: Program) -> bool:
    return bool(batchnorm_candidates(program))


def loss_rows_of(program: Program) -> int | None:
    """The rows a chunk of the chunked loss takes on `program` (a scratch of
    about 1 MiB); None when the rewrite does not apply or its rows make one
    chunk.  One count: the chunks' rows change only the scratch, not what
    is computed."""
    return rows_of(program)


def late_applies(program: Program) -> bool:
    """Whether `lm_head_nll:R:late` applies: the head's weight is tied."""
    try:
        return tied(program)
    except NotApplicable:
        return False


def describe(names: list[str]) -> str:
    """The rewrites in words, for CLI output and plan comments."""
    words = []
    for spec in names:
        name, _, arg = spec.partition(":")
        k, _, late = arg.partition(":")
        words.append(f"cross-entropy in chunks of {k} rows (remat.lm_head_nll)" + (
                     ", the tied weight's head gradient made again at the end of backward" if late else "")
                     if name == CHUNKED_LOSS
                     else f"attention in {arg} chunks" if name == CHUNKED_ATTENTION
                     else "BatchNorm split (running-stat update + recomputable normalization)"
                     if name == BATCHNORM_SPLIT else spec)
    return "; ".join(words)
