"""Capture: torch.export (non-strict) to a core-ATen graph on fake tensors.

Planning never runs the model: torch.export traces with fake tensors, so a model built on
the ``meta`` device or under ``FakeTensorMode`` plans as well as a real one. We decompose to
core ATen (passes.decompose: once per distinct op signature) because that is where DTensor's
strategy registry and torch's FLOP formulas live (composite ops such as ``linear`` or SDPA
have neither; see shared/notes/torch-2.13-findings).

Writes nothing into ``node.meta`` beyond what export gives (``val``, ``nn_module_stack``,
``stack_trace``); returns a :class:`Captured` with the user-facing names of inputs and
parameters and a structural fingerprint of the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import io
import logging
import os
import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.fx import config as fx_config

from autopar.errors import AutoparError, ErrorKind, first_line, quiet_logs, raised_at
from autopar.plan import TensorSpec
from autopar.passes.decompose import decompose
from autopar.passes.embedding_bag import lower_fixed_bags
from autopar.passes.grouped_experts import ungroup_experts
from autopar.passes.stack_experts import stack_expert_lists
from autopar.passes.training_forward import training_forward

log = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__)
# Frames in these directories are library code, not the user's: torch's and autopar's folders
# (passes/ and solvers/ lie beside autopar/ in a checkout), as real paths with a trailing
# separator, so that a user's own folder named `autopar` or `passes` is not taken for them.
_LIBRARY_DIRS = tuple(os.path.join(os.path.realpath(os.path.dirname(importlib.util.find_spec(name).origin)), "")
                      for name in ("torch", "autopar", "autopar.passes", "autopar.solvers"))


@dataclass
class Captured:
    """A decomposed ExportedProgram plus the facts later passes and the plan need."""

    program: torch.export.ExportedProgram
    inputs: list[TensorSpec]  # user inputs, in call order
    parameter_of: dict[str, str]  # placeholder name -> parameter FQN
    buffer_of: dict[str, str]  # placeholder name -> buffer or constant FQN
    fingerprint: str
    # tied weights (an LM head sharing the embedding): every name of a shared parameter -> all
    # its names, in the model's order; only parameters with more than one name
    aliases: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # a pipeline stage's piece of the graph (passes.stages) instead of the whole program's,
    # and its boundary inputs that carry gradients back to the previous stage
    stage_graph: torch.fx.Graph | None = None
    grad_inputs: frozenset[str] = frozenset()
    # mixed precision (captured computing in a lower dtype): parameter placeholder -> bytes per
    # element of the model's own parameter, the master copy the optimizer steps (the graph's
    # placeholders hold the compute dtype); empty when the model computes in its own dtypes
    master_itemsize: dict[str, int] = dataclasses.field(default_factory=dict)
    compute_dtype: torch.dtype | None = None  # the policy's, when captured under one
    # parameter placeholders of frozen parameters (``requires_grad=False``: fine-tuning part of
    # a model): no gradient, no optimizer state, nothing to reduce
    frozen: frozenset[str] = frozenset()

    @property
    def tied(self) -> dict[str, str]:
        """Placeholders of one shared tensor exported as several inputs -> the first of them
        (they must be planned as one parameter)."""
        first: dict[tuple[str, ...], str] = {}
        tied = {}
        for placeholder, fqn in self.parameter_of.items():
            group = self.aliases.get(fqn)
            if group is None:
                continue
            if group in first:
                tied[placeholder] = first[group]
            else:
                first[group] = placeholder
        return tied

    @property
    def graph(self) -> torch.fx.Graph:
        return self.program.graph if self.stage_graph is None else self.stage_graph


def normalize_inputs(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"example_inputs must be a tensor or a tuple of tensors, got {type(example_inputs).__name__}")
    for i, value in enumerate(example_inputs):
        if not isinstance(value, torch.Tensor):
            raise AutoparError(ErrorKind.BAD_INPUT,
                               f"example input #{i} is a {type(value).__name__}; autopar plans tensor inputs only "
                               "(pass other arguments through a wrapper module)")
        if value.numel() == 0:
            raise AutoparError(ErrorKind.BAD_INPUT,
                               f"example input #{i} has shape {tuple(value.shape)}: no elements, so no step to plan; "
                               "give it the rows (and sizes) of one real training step")
    return tuple(example_inputs)


def leading_batch(inputs: tuple, splitter: str) -> int:
    """The batch size shared by every input's first dim, which ``splitter`` (pipeline
    micro-batches, replicas) cuts into rows; a clear error when the inputs disagree."""
    batch = inputs[0].shape[0] if inputs and inputs[0].dim() else 0
    if any(x.dim() == 0 or x.shape[0] != batch for x in inputs):
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"{splitter} split every input on dim 0, but the inputs' leading sizes are "
                           f"{[tuple(x.shape[:1]) for x in inputs]}; give every input the batch as its first dim")
    return batch


def compute_dtype_of(plan) -> torch.dtype | None:
    """The dtype a plan's mixed-precision policy computes in (``plan.options``), or None."""
    policy = plan.options.get("mixed_precision")
    return None if not policy else getattr(torch, policy["param_dtype"])


def reduce_dtype_of(plan) -> torch.dtype | None:
    """The dtype a plan's mixed-precision policy reduces gradients in, or None."""
    policy = plan.options.get("mixed_precision")
    return None if not policy else getattr(torch, policy["reduce_dtype"])


def compute_inputs(example_inputs, compute_dtype: torch.dtype | None) -> tuple:
    """The inputs as a model computing in ``compute_dtype`` receives them: floating inputs cast
    (FSDP2's ``cast_forward_inputs``), the others as they are."""
    args = normalize_inputs(example_inputs)
    if compute_dtype is None:
        return args
    return tuple(x.to(compute_dtype) if x.is_floating_point() else x for x in args)


@contextlib.contextmanager
def computing_in(model: nn.Module, compute_dtype: torch.dtype | None):
    """While inside, ``model``'s floating parameters hold ``compute_dtype`` copies (buffers keep
    theirs, as FSDP2's ``MixedPrecisionPolicy`` leaves them) — but batch norm's weight and bias
    keep their dtype like its running statistics (torch's AMP leaves them so too; its kernels
    refuse low-precision affine parameters beside fp32 statistics on CPU, and cuDNN's want them
    in fp32); restored on the way out, errors included. Yields {parameter FQN: bytes per
    element of the model's own parameter} for the parameters cast."""
    masters: dict[str, torch.Tensor] = {}
    own = {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
           if isinstance(module, nn.modules.batchnorm._BatchNorm) for name, _ in module.named_parameters(recurse=False)}
    try:
        if compute_dtype is not None:
            for fqn, param in model.named_parameters():
                if param.is_floating_point() and param.dtype != compute_dtype and fqn not in own:
                    masters[fqn] = param.data
                    param.data = param.data.to(compute_dtype)
        itemsize = {id(param): masters[fqn].element_size() for fqn, param in model.named_parameters() if fqn in masters}
        yield {fqn: itemsize[id(param)] for fqn, param in model.named_parameters(remove_duplicate=False)
               if id(param) in itemsize}  # every name of a tied weight
    finally:
        params = dict(model.named_parameters())
        for fqn, value in masters.items():
            params[fqn].data = value


def capture(model: nn.Module, example_inputs, compute_dtype: torch.dtype | None = None, *,
            stack_traces: bool = True) -> Captured:
    """Export ``model`` on ``example_inputs`` and decompose to core ATen. With
    ``compute_dtype`` (mixed precision), the graph is the model computing in that dtype: its
    floating parameters and inputs cast to it, as FSDP2 runs forward under a
    ``MixedPrecisionPolicy(param_dtype=...)``; the parameters' own dtype is their master copy's.
    ``stack_traces=False`` records no source line per node (a fifth of export's time on a
    32-layer Llama; planning reads none): a check that must name the user's line then
    captures once more with them, so its error still does."""
    if not isinstance(model, nn.Module):
        raise AutoparError(ErrorKind.BAD_INPUT, f"model must be a torch.nn.Module, got {type(model).__name__}")
    args = compute_inputs(example_inputs, compute_dtype)
    if not any(True for _ in model.parameters()):
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"{type(model).__name__} has no parameters: there is nothing to shard or replicate; "
                           "parallelize the model that owns the weights")
    try:
        # a fake kernel refusing the inputs logs its traceback, a guard on data its graph so far: the
        # error below names the cause and the user's line once
        with computing_in(model, compute_dtype) as master_itemsize, training_forward(model), \
                quiet_logs("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes"), \
                _no_partial_graph_printed(), _source_lines(stack_traces):
            program = torch.export.export(model, args, strict=False)
            # inside: a decomposition that retraces (a program that updates buffers: batch norm)
            # runs the parameters as exported, in the compute dtype
            lower_fixed_bags(program)
            program = decompose(program)
    except AutoparError:
        raise
    except Exception as exc:  # torch raises many types here; we translate them all
        raise _inputs_refused(model, args) or _untraceable(model, exc) from exc
    _drop_metadata_asserts(program)
    program.graph.eliminate_dead_code()
    if ungroup_experts(program.graph):
        program.graph_module.recompile()
    stack_expert_lists(program)
    try:
        _check_static_shapes(model, program)
        _check_matmul_dtypes(model, program, args)
    except AutoparError:
        if stack_traces:
            raise
        return capture(model, example_inputs, compute_dtype)  # again, so that the error names the line
    if not any(n.op == "call_function" for n in program.graph.nodes):
        raise AutoparError(ErrorKind.BAD_INPUT,
                           f"{type(model).__name__}.forward performs no tensor operations; nothing to plan")
    sig = program.graph_signature
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    inputs = [TensorSpec.of(name, placeholders[name].meta["val"]) for name in sig.user_inputs]
    buffer_of = dict(sig.inputs_to_buffers)
    buffer_of.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}))
    captured = Captured(program, inputs, dict(sig.inputs_to_parameters), buffer_of, fingerprint(program.graph),
                        _aliases(model))
    captured.master_itemsize = {name: master_itemsize[fqn] for name, fqn in captured.parameter_of.items()
                                if fqn in master_itemsize}
    captured.compute_dtype = compute_dtype
    requires = {fqn: p.requires_grad for fqn, p in model.named_parameters(remove_duplicate=False)}
    captured.frozen = frozenset(name for name, fqn in captured.parameter_of.items() if not requires.get(fqn, True))
    log.info("captured %s: %d nodes", type(model).__name__, len(program.graph.nodes))
    return captured


@contextlib.contextmanager
def _source_lines(record: bool):
    """Tracing records each node's source lines (``stack_trace``) or not (torch.fx's config)."""
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = not record
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _no_partial_graph_printed():
    """torch.export prints the graph traced so far to stderr when tracing fails (a dump of
    dozens of lines above autopar's message, which names the user's line): drop that dump,
    pass every other write to stderr through."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except Exception as exc:
        graph = getattr(exc, "partial_fx_graph", None)
        text = held.getvalue()
        sys.stderr.write(text.replace(f"{graph}\n", "") if graph is not None else text)
        raise
    sys.stderr.write(held.getvalue())


def _aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    names: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(fqn)
    return {fqn: tuple(group) for group in names.values() if len(group) > 1 for fqn in group}


def _drop_metadata_asserts(program: torch.export.ExportedProgram) -> None:
    """export keeps ``_assert_tensor_metadata`` checks (e.g. before a dtype cast in HF models):
    they produce nothing, but as graph nodes they would pin their input to one placement."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    program.graph_module.recompile()


def _check_static_shapes(model: nn.Module, program: torch.export.ExportedProgram) -> None:
    """Plans are made for fixed shapes: a shape that depends on tensor values (boolean-mask
    indexing, nonzero, unique) cannot be costed or sharded ahead of time."""
    for node in program.graph.nodes:
        vals = node.meta.get("val")
        for val in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(val, torch.Tensor) and not all(isinstance(d, int) for d in val.shape):
                raise AutoparError(
                    ErrorKind.UNTRACEABLE,
                    f"cannot plan {type(model).__name__}: node {node.name} ({node.target}) has shape "
                    f"{tuple(val.shape)}, which depends on the data\n  at {_user_frame(node)}\n"
                    "  fixes: 1) keep shapes fixed — replace boolean-mask indexing (x[mask]) or nonzero() "
                    "with torch.where / multiplying by the mask; 2) pad variable-length data to a fixed size")


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default}


def _check_matmul_dtypes(model: nn.Module, program: torch.export.ExportedProgram, args: tuple) -> None:
    """Fake kernels let a float64 input meet float32 weights in a matmul (eager refuses it):
    such a graph would be planned as if fine and fail at the first real step."""
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        dtypes = {a.meta["val"].dtype for a in node.args if isinstance(a, torch.fx.Node)
                  and isinstance(a.meta.get("val"), torch.Tensor)}
        if len(dtypes) > 1:
            names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            given = ", ".join(f"#{i} {str(x.dtype).removeprefix('torch.')}" for i, x in enumerate(args))
            raise AutoparError(
                ErrorKind.BAD_INPUT,
                f"{type(model).__name__}: node {node.name} ({node.target}) multiplies {names} tensors, which "
                f"the model cannot run (example inputs: {given})\n  at {_user_frame(node)}\n"
                "  fix: give example inputs in the dtype of the model's weights, or cast the model to theirs")


def _user_frame(node: torch.fx.Node) -> str:
    """The last frame of the node's stack trace outside torch (the user's line)."""
    lines = (node.meta.get("stack_trace") or "").strip().splitlines()
    for k in range(len(lines) - 1, -1, -1):
        line = lines[k].strip()
        if line.startswith("File ") and _TORCH_DIR not in line:
            code = lines[k + 1].strip() if k + 1 < len(lines) else ""
            return f"{line.removeprefix('File ')}: `{code}`"
    return "unknown location"


def fingerprint(graph: torch.fx.Graph) -> str:
    """sha256 over node names, targets and output shapes: equal graphs, equal fingerprints."""
    h = hashlib.sha256()
    for node in graph.nodes:
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
        h.update(f"{node.op}|{node.name}|{node.target}|{shape}\n".encode())
    return h.hexdigest()[:16]


def _inputs_refused(model: nn.Module, args: tuple) -> AutoparError | None:
    """When export fails, first run the model's own forward on fake copies of the inputs
    (nothing computed, no memory): if that fails as well, the inputs do not fit the model
    (a wrong width, dtype or count) — not a tracing problem — and the error says so, naming
    each input and the model's line that refused them. None when the forward runs."""
    from torch._subclasses import fake_tensor

    # what fake tensors cannot do (read a value, a shape from the data): export's trouble too
    cannot_fake = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
                   fake_tensor.UnsupportedOperatorException, fake_tensor.UnsupportedFakeTensorException)
    try:
        with quiet_logs(fake_tensor.__name__), fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
            model(*(fake_mode.from_tensor(x) for x in args))
    except cannot_fake:
        return None
    except Exception as exc:  # any other error of the forward itself
        given = ", ".join(f"#{i} {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" for i, x in enumerate(args))
        return AutoparError(
            ErrorKind.BAD_INPUT,
            f"{type(model).__name__}'s forward fails on the example inputs ({given}): {type(exc).__name__}: "
            f"{first_line(exc)}\n  at {raised_at(exc, _LIBRARY_DIRS)}\n"
            "  fix: give inputs of the shapes, dtypes and number the model's forward takes (as in one training step)")
    return None


def _untraceable(model: nn.Module, exc: Exception) -> AutoparError:
    """Name the user's source line that export failed on, and suggest fixes."""
    return AutoparError(
        ErrorKind.UNTRACEABLE,
        f"cannot trace {type(model).__name__} with torch.export: {type(exc).__name__}: {first_line(exc)}\n"
        f"  at {raised_at(exc, _LIBRARY_DIRS)}\n"
        "  fixes: 1) replace Python control flow on tensor values (`if x.sum() > 0`) with torch.where or torch.cond; "
        "2) avoid .item()/.tolist()/data-dependent output shapes inside forward; "
        "3) move unsupported Python side effects (printing, I/O, global state) out of forward",
    )
