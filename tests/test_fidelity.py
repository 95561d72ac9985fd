"""The planned step is eager's step, on the transformers families users train.

For each family (small configs called with masks, labels, LoRA adapters,
or without a mask; a state-space LM, a speech model, a diffusion UNet:
`remat_ir.models.families`): the traced step runs eager's aten ops in eager's
order (`remat_ir.trace.fidelity.compare`), and three AdamW steps through
`remat_ir.wrap(model, budget=0.5)` leave the parameters bitwise equal to
eager's.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from remat_ir.models.families import FAMILIES  # noqa: E402
from remat_ir.side_by_side import train_side_by_side  # noqa: E402
from remat_ir.trace.fidelity import compare  # noqa: E402

FAMILY_NAMES = ["llama", "llama-padded", "llama-lora", "mixtral", "qwen3-moe", "mistral", "gemma2", "phi3", "mamba",
                "distilbert", "modernbert", "t5", "bart", "t5-nomask", "bart-nomask", "whisper", "vit", "clip",
                "convnext", "unet"]
# Families that need a package beside transformers (timm: the `test` extra does not install it).
NEEDS = {"llama-lora": "peft", "convnext": "timm", "unet": "diffusers"}


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_family_traces_and_trains_as_eager(name):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name], exc_type=ImportError)  # timm without torchvision fails to import
    model, kwargs = FAMILIES[name]()
    f = compare(model, (), kwargs)
    assert f.same, f.difference
    assert len(f.eager) > 300
    r = train_side_by_side(model, kwargs, budget=0.5, steps=3)
    assert r["bitwise"], r


@pytest.mark.slow
def test_a_loss_changed_in_place_plans_at_0_3_as_eager(capsys):
    """Qwen3-MoE adds the router's loss to the LM loss in place (`loss +=
    coef * aux`): the chunked-loss rewrite leaves such a loss alone (it
    used to leave the `add_` on a value it removed: a SimulationError, and
    the step ran eagerly), and the step plans at 0.3 and trains bitwise."""
    model, kwargs = FAMILIES["qwen3-moe"]()
    r = train_side_by_side(model, kwargs, budget=0.3, steps=1)
    assert r["bitwise"], r
    assert "eagerly" not in capsys.readouterr().err


def test_a_changed_step_is_found():
    # The check is not blind: a trace of another call differs from eager's step.
    model, kwargs = FAMILIES["llama"]()
    f = compare(model, (), kwargs)
    other = dict(kwargs, attention_mask=kwargs["attention_mask"].clone())
    other["attention_mask"][0, -3:] = 0  # the padded path builds a mask tensor
    from remat_ir.trace.fidelity import eager_ops
    assert eager_ops(model, (), other) != f.traced


def test_a_mask_decision_is_a_guard(tmp_path):
    """An all-ones mask and a padded one are two decisions of the model's code:
    a budget wrap plans each once, and a plan for one refuses the other."""
    import remat_ir
    from remat_ir.ir.parser import parse_program
    from remat_ir.ir.printer import format_program
    from remat_ir.runtime.bind import PlanMismatch

    model, kwargs = FAMILIES["llama"]()
    padded = dict(kwargs, attention_mask=kwargs["attention_mask"].clone())
    padded["attention_mask"][0, -5:] = 0
    plan = remat_ir.compile(model, (), kwargs)
    assert any("attention_mask" in g for g in plan.header.guards)
    text = format_program(plan)
    assert format_program(parse_program(text)) == text
    w = remat_ir.wrap(model, parse_program(text))  # the model check replays the plan's guards
    w(**kwargs).loss.backward()
    with pytest.raises(PlanMismatch, match="attention_mask"):
        w(**padded)
    a = remat_ir.wrap(model, cache=False)
    for call in (kwargs, padded, kwargs, padded):
        a(**call).loss.backward()
    assert len(remat_ir.planner(a).plans) == 2


def test_guards_never_run_plan_text():
    from remat_ir.ir.guards import Guard, GuardError

    for bad in ["__import__('os').system('true') == 0", "input('x').__class__ == 1",
                "aten.add_.Tensor(input('x'), 1) == 1", "(lambda: 1)() == 1", "open('f') == 1",
                "aten.sum.default(input('x')) == 'a'"]:
        with pytest.raises(GuardError):
            Guard(bad)
    g = Guard("aten._local_scalar_dense.default(aten.all.default(aten.eq.Scalar(input('m'), 1))) == True")
    assert g.expr(lambda kind, name: torch.ones(3)) is True
    assert g.expr(lambda kind, name: torch.zeros(3)) is False


def test_strides_that_sizes_of_one_leave_ambiguous_are_eager_s():
    """At 1 x 1 a channels-last tensor is contiguous too: eager's GELU returns
    it with contiguous strides, the next conv keeps them, and the pooling to
    1 x 1 does not restride its result; the trace must take the same path
    (timm's ConvNeXt head on 32 x 32 images; no timm needed here)."""

    class Head(torch.nn.Module):
        def __init__(self, c=8):
            super().__init__()
            self.down, self.fc = torch.nn.Conv2d(c, c, 2, stride=2), torch.nn.Conv2d(c, c, 1)

        def forward(self, x):
            x = self.down(x.permute(0, 3, 1, 2))  # channels-last strides, 2 x 2 -> 1 x 1
            x = self.fc(torch.nn.functional.gelu(x))
            return torch.nn.functional.adaptive_avg_pool2d(x, 1).sum()

    torch.manual_seed(0)
    f = compare(Head(), (torch.randn(2, 2, 2, 8),))
    assert f.same, f.difference
    assert "aten.as_strided_.default" not in f.traced
