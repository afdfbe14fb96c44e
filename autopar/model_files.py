"""What ``autopar plan`` and ``autopar validate`` read a model from: a factory
``package.module:factory`` (returning a model, or (model, example inputs)), a torch.export
``.pt2`` archive, or a torch.save'd ``.pt`` (only when trusted: unpickling runs code), with
example inputs from ``--input NAME=SHAPE:DTYPE``. Every failure is a :class:`UsageError`
naming the file or factory and what to do, never a traceback from inside torch or the
user's module (the CLI shows that one with ``--debug``)."""

from __future__ import annotations

import importlib
import math
import os
import re
import sys

from autopar.errors import AutoparError, first_line, held_cause, quiet_logs, raised_at

_INPUT = re.compile(r"^(?:(\w+)=)?(\d+(?:x\d+)*):(\w+)$")


class UsageError(Exception):
    """Bad command-line usage: exit code 2."""


def parse_input_spec(spec: str, device="cpu"):
    """``tokens=4x1024:int64`` -> a zero tensor of that shape and dtype on ``device``."""
    import torch

    match = _INPUT.match(spec.strip())
    if match is None:
        raise UsageError(f"bad --input {spec!r}: write NAME=DIMxDIM:DTYPE, e.g. tokens=4x1024:int64")
    if not isinstance(getattr(torch, match.group(3), None), torch.dtype):
        raise UsageError(f"bad --input {spec!r}: {match.group(3)!r} is not a torch dtype; use e.g. float32, bfloat16, "
                         "float16, int64, int32, bool")
    shape = tuple(int(d) for d in match.group(2).split("x"))
    dtype = getattr(torch, match.group(3))
    if 0 in shape:
        raise UsageError(f"--input {spec!r} has a dim of size 0: no elements, so no step to plan; give the sizes of "
                         "one real training step")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > _input_bytes_cap():
        raise UsageError(f"--input {spec!r} is a {_size(nbytes)} tensor, more than half this machine's memory "
                         f"({_size(2 * _input_bytes_cap())}); the CLI builds example inputs as real tensors: give "
                         "one step's shapes at a smaller batch, or a factory returning inputs on the meta device")
    return torch.zeros(shape, dtype=dtype, device=device)


def _input_bytes_cap() -> int:
    """Half the machine's memory: the most an example input built by the CLI may take."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no way to ask
        return 2 ** 34


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes < 2 ** 70 else f"{float(nbytes):.3g}-byte"


def load_model(target: str, input_specs: list[str], trust_pickle: bool):
    """MODEL is ``package.module:factory``, a torch.export ``.pt2`` or a torch.save'd ``.pt``."""
    names = [spec.split("=", 1)[0].strip() for spec in input_specs if "=" in spec]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UsageError(f"--input {twice[0]} is given more than once; give each input of the model's forward once, "
                         "in order")
    model, inputs = _load_model(target, trust_pickle, input_specs)
    if input_specs:
        params = model.parameters() if hasattr(model, "parameters") else ()
        device = next((p.device for p in params), "cpu")
        inputs = tuple(parse_input_spec(s, device) for s in input_specs)
    if inputs is None:
        raise UsageError(f"{target} comes without example inputs: pass them with --input NAME=SHAPE:DTYPE")
    return model, inputs


def _check_archive_shapes(target: str, exported: tuple, input_specs: list[str]) -> None:
    """A .pt2 exported without dynamic dims runs only at its own input shapes: say so, rather
    than let its guard fail ("Guard failed: x.size()[0] == 8")."""
    import torch

    given = [tuple(parse_input_spec(spec, "meta").shape) for spec in input_specs]
    want = [tuple(x.shape) for x in exported if isinstance(x, torch.Tensor)]
    if given != want:
        raise UsageError(f"{target} was exported for inputs of shapes {want} and no dynamic dims; --input gives "
                         f"{given}. Give its shapes, or re-export with dynamic_shapes= (torch.export.Dim) for the "
                         "dims you want to vary")


def _load_model(target: str, trust_pickle: bool, input_specs: list[str]):
    """(model, example inputs or None); ``input_specs`` are checked against an archive of
    fixed shapes."""
    import torch

    sys.path.insert(0, os.getcwd())  # factories and pickled classes resolve like `python -c` would
    if target.endswith(".pt2"):
        if not os.path.exists(target):
            raise UsageError(f"model file {target!r} does not exist")
        try:
            with quiet_logs("torch.export") as held:  # it logs the archive's traceback; the message says why
                program = torch.export.load(target)
        except Exception as exc:  # torch raises zipfile's, its stream reader's and pickle's errors here
            cause = held_cause(held) or f"{type(exc).__name__}: {first_line(exc)}"
            raise UsageError(f"cannot load {target}: it is not a readable torch.export archive ({cause}); save one "
                             "with torch.export.save(...)") from exc
        exported = tuple(program.example_inputs[0]) if program.example_inputs else None
        if input_specs and exported is not None and not program.range_constraints:
            _check_archive_shapes(target, exported, input_specs)
        return program.module(), exported
    if target.endswith((".pt", ".pth")):
        if not os.path.exists(target):
            raise UsageError(f"model file {target!r} does not exist")
        if not trust_pickle:
            raise UsageError(f"{target} is a pickle: loading it runs arbitrary code. Pass --trust-pickle if you "
                             "trust its source, or save the model with torch.export.save(...) as .pt2")
        try:
            model = torch.load(target, weights_only=False)
        except (ImportError, AttributeError) as exc:
            raise UsageError(f"cannot unpickle {target}: {exc}; run autopar where the model's code is importable") from exc
        except Exception as exc:  # a truncated or foreign file: zipfile's, pickle's, torch's errors
            raise UsageError(f"cannot load {target}: it is not a readable torch.save file "
                             f"({type(exc).__name__}: {first_line(exc)})") from exc
        if isinstance(model, dict):
            raise UsageError(f"{target} holds {_a(type(model).__name__)} (a state_dict?), not a model: autopar needs "
                             "the model itself — save it with torch.save(model), or better as .pt2 with "
                             "torch.export.save(torch.export.export(model, inputs), path)")
        return _model_and_inputs(model, f"{target} holds")
    if ":" not in target:
        raise UsageError(f"cannot load model {target!r}: give a .pt2/.pt file or package.module:factory")
    module_name, factory_name = target.split(":", 1)
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"cannot import {target!r}: {exc}") from exc
    except SyntaxError as exc:
        raise UsageError(f"cannot import {target!r}: syntax error in {exc.filename}, line {exc.lineno}: "
                         f"{exc.msg}") from exc
    except Exception as exc:  # the module's own code failed while importing
        raise UsageError(f"cannot import {target!r}: importing {module_name} raised {type(exc).__name__}: "
                         f"{first_line(exc)}") from exc
    if not callable(factory):
        raise UsageError(f"{target!r}: {factory_name} is of type {type(factory).__name__}, not a function that "
                         "returns a model (or (model, example inputs))")
    try:
        made = factory()
    except AutoparError:
        raise
    except SystemExit as exc:  # the factory ended the program: say so instead of exiting silently
        raise UsageError(f"the factory {target!r} called sys.exit({exc.code!r}) (at {raised_at(exc)}); a factory "
                         "returns a model, or (model, example inputs)") from exc
    except Exception as exc:  # the user's factory failed: their error, with its line
        raise UsageError(f"the factory {target!r} raised {type(exc).__name__}: {first_line(exc)} "
                         f"(at {raised_at(exc)}); rerun with --debug for its traceback") from exc
    return _model_and_inputs(made, f"the factory {target!r} returned")


def _a(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _model_and_inputs(made, source: str):
    """What a factory returned or a file holds (``source`` says which), as (model, example
    inputs or None); a clear error for anything else (None, a string, a tuple of another
    length …)."""
    from torch import nn

    if isinstance(made, nn.Module):
        return made, None
    if isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], nn.Module):
        inputs = made[1]
        return made[0], tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    shown = f"a {len(made)}-item {type(made).__name__}" if isinstance(made, (tuple, list)) else \
        "None" if made is None else _a(type(made).__name__)
    raise UsageError(f"{source} {shown}; autopar needs a torch.nn.Module, or a pair (model, example inputs)")
