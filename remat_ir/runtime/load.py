"""Loading the MODEL argument of the CLI: a built-in name or a `.py` file.

A model file defines `build()` returning `(module, example_inputs)` and,
optionally, `loss(output, *inputs)`; the loss is then part of the step.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


class ModelError(ValueError):
    """The MODEL argument cannot be loaded; the message says what to do."""


@dataclass
class LoadedModel:
    name: str
    module: torch.nn.Module
    inputs: tuple
    loss: Callable | None


def load_model(spec: str, *, batch: int | None = None, seq: int | None = None, device: str = "cpu",
               fake: bool = False, seed: int = 0) -> LoadedModel:
    """Build the model named by `spec`.  With `fake`, inside a FakeTensorMode:
    parameters and inputs have shapes but no memory.  Refuses (ModelError),
    before building anything, a batch or sequence length below 1, a sequence
    longer than a built-in model's block size, a flag the model cannot take,
    and a CUDA device on a machine without one."""
    check_device(device)
    for flag, n in (("batch", batch), ("seq", seq)):
        if n is not None and n < 1:
            raise ModelError(f"--{flag} {n}: the {'batch size' if flag == 'batch' else 'sequence length'} "
                             f"must be at least 1")
    ctx = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        ctx = FakeTensorMode(allow_non_fake_inputs=True)
    if spec.endswith(".py") or "/" in spec or Path(spec).is_file():
        return _load_file(spec, ctx, device, batch, seq)
    from remat_ir.models import BUILTINS, build_builtin

    if spec not in BUILTINS:
        raise ModelError(f"unknown model {spec!r}: give a built-in name ({', '.join(BUILTINS)}) "
                         "or a .py file that defines build()")
    builtin = BUILTINS[spec]
    if seq is not None and builtin.gpt is None:
        raise ModelError(f"--seq {seq}: {spec} takes no sequence length; drop --seq")
    if seq is not None and seq > builtin.gpt.block_size:
        raise ModelError(f"--seq {seq} is longer than {spec}'s block size, {builtin.gpt.block_size} "
                         f"positions: give --seq {builtin.gpt.block_size} or less")
    with ctx:
        module, inputs = build_builtin(spec, batch=batch, seq=seq, device=device, seed=seed)
    return LoadedModel(spec, module, tuple(inputs), None)


def _position_limit(module: torch.nn.Module) -> tuple[str, int] | None:
    """A hard limit on the sequence length the model's config states (its
    table of learned positions): `block_size` (nanoGPT style) or `n_positions`
    (transformers' GPT-2), on the first submodule with a `config`."""
    for m in module.modules():
        config = getattr(m, "config", None)
        if config is None:
            continue
        for attr in ("block_size", "n_positions"):
            n = getattr(config, attr, None)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                return f"config.{attr}", n
        return None
    return None


def check_device(device: str) -> None:
    """Refuse a CUDA device on a machine without one (ModelError)."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as e:
        raise ModelError(f"--device {device}: not a device ({e})") from e
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device {device}, but this machine has no CUDA device "
                         f"(torch.cuda.is_available() is False): use --device cpu")


def _exit_text(e: SystemExit) -> str:
    """`sys.exit(0)` for the SystemExit a model file raised."""
    return "sys.exit()" if e.code is None else f"sys.exit({e.code!r})"


def _load_file(path: str, ctx, device: str, batch, seq) -> LoadedModel:
    p = Path(path)
    if not p.is_file():
        raise ModelError(f"{path}: no such model file")
    name = f"_remat_model_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ModelError(f"{path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except SystemExit as e:  # sys.exit(0) would end the command with 0 and no plan
        raise ModelError(f"{path}: importing the model file exited ({_exit_text(e)}); a model file must "
                         f"define build() and not exit") from None
    except Exception as e:  # noqa: BLE001 - the user's file; say where it failed
        raise ModelError(f"{path}: importing the model file failed: {type(e).__name__}: {e}") from e
    build = getattr(mod, "build", None)
    if not callable(build):
        raise ModelError(f"{path}: defines no build() function; it must define build() returning "
                         "(module, example_inputs) and may define loss(output, *inputs)")
    kwargs = {}
    import inspect

    params = inspect.signature(build).parameters
    any_kw = any(q.kind == q.VAR_KEYWORD for q in params.values())
    for flag, n in (("batch", batch), ("seq", seq)):
        if n is None:
            continue
        if flag not in params and not any_kw:
            raise ModelError(f"{path}: --{flag} {n}, but build() takes no {flag} argument, so its inputs "
                             f"cannot change: give build() a `{flag}` parameter, or drop --{flag}")
        kwargs[flag] = n
    try:
        with ctx:
            built = build(**kwargs)
    except SystemExit as e:
        raise ModelError(f"{path}: build() exited ({_exit_text(e)}); it must return (module, "
                         f"example_inputs), not exit") from None
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{path}: build() failed: {type(e).__name__}: {e}") from e
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], torch.nn.Module)):
        raise ModelError(f"{path}: build() must return (module, example_inputs); got {type(built).__name__}")
    module, inputs = built
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    inputs = tuple(inputs)
    limit = _position_limit(module)
    if seq is not None and limit is not None and seq > limit[1]:
        # Under fake tensors an embedding does not check its indices: the
        # trace would succeed and the plan fail when run.
        raise ModelError(f"{path}: --seq {seq} is longer than the model's {limit[0]}, {limit[1]} positions: "
                         f"give --seq {limit[1]} or less")
    if device != "cpu":
        from remat_ir.models import move_to

        module = move_to(module, device)
        inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    loss = getattr(mod, "loss", None)
    if loss is not None and not callable(loss):
        raise ModelError(f"{path}: `loss` must be a function loss(output, *inputs)")
    return LoadedModel(p.stem, module, inputs, loss)
