"""Checks that a plan read from a file holds values of the types its fields declare.

A hand-edited or corrupted plan file must fail where it is read, naming the field — not later
inside ``show``, ``explain`` or lowering with a Python error about a ``NoneType``. The check
follows the dataclasses' own annotations (``Plan``, ``NodePlan``, ``ParameterPlan``, ...); the
free-form dictionaries reports read are checked for the keys they read.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Union

from autopar import placements as pl
from autopar.devices import MAX_DEVICES
from autopar.errors import AutoparError, ErrorKind

_NUMBER = (int, float)
# plan.family: the planning families (autopar.planning.FAMILIES; a test keeps the two alike)
PLAN_FAMILIES = ("one_mesh", "pipeline", "replicas")
# output dims a one-mesh plan may leave split for the loss (the batch, the sequence): a loss
# that averages over them is taken device by device (passes.split_loss)
LOSS_SPLIT_DIMS = (0, 1)
# fused attention's (B, H, T, E) tensors: the dim context parallelism splits
ATTENTION_SEQUENCE_DIM = 2
# pipeline schedules a plan may record (torch.distributed.pipelining's Schedule<name>)
PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
# of those, the ones that split each backward into input and weight gradients and run the
# weight gradients later (zero bubble): costed, drawn and lowered differently
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
# of those, the ones that lay two chunks per group in a V (chunk g and 2p - 1 - g on group g)
V_SHAPED_SCHEDULES = ("ZBVZeroBubble",)


def chunk_group(chunk: int, groups: int, schedule: str | None) -> int:
    """The device group that runs chunk ``chunk`` of a pipeline over ``groups`` groups: torch's
    loop placement (``chunk mod groups``), or the V of ZBV (group g runs chunks g and
    2·groups − 1 − g, so the middle hand-over stays on one group).

    >>> [chunk_group(g, 2, "Interleaved1F1B") for g in range(4)], [chunk_group(g, 2, "ZBVZeroBubble") for g in range(4)]
    ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    if schedule in V_SHAPED_SCHEDULES:
        lap, position = divmod(chunk, groups)
        return groups - 1 - position if lap % 2 else position
    return chunk % groups
# how a parameter's gradient is synchronised (ParameterPlan.exchange documents each)
PARAMETER_EXCHANGES = ("allreduce", "reduce_scatter", "none", "sparse_allgather", "row_sharded", "column_sharded",
                       "table_wise", "expert_parallel", "expert_tensor_parallel")
# what a node exchanges besides its placements (NodePlan.exchange: passes.sparse's,
# passes.expert_dispatch's and passes.context_parallel's Strategy.exchange names; a test
# keeps them alike)
NODE_EXCHANGES = ("", "sparse_allgather", "table_wise", "expert_dispatch", "balanced_causal")
# the keys every node and parameter entry of a plan file has (the others have defaults)
_NODE_FIELDS = ("op", "outputs", "inputs", "compute_s", "fallback", "reshard_s", "alternatives")
_PARAMETER_FIELDS = ("placement", "bytes", "exchange")
# plan.cluster["spec"]: Cluster.describe()'s forms, one region or several
_CLUSTER_SPEC = re.compile(r"^(\d+x){1,2}\S+$")
_REGION_SPEC = re.compile(r"^.+:\d+x\d+x\S+$")
# the plan's fields a reader indexes as objects: checked before the dataclasses are built
_OBJECTS = ("nodes", "parameters", "buffers", "memory", "cluster", "solver", "options", "baselines", "families")


def check_plan_objects(d: dict, source: str) -> None:
    """Raise BAD_PLAN when a field read as an object (``nodes``, ``parameters`` …) is another
    JSON type: named here, not as "'list' object has no attribute 'items'"."""
    for key in _OBJECTS:
        if key in d and not isinstance(d[key], dict):
            _fail(source, key, "an object", d[key])
    for key, fields in (("nodes", _NODE_FIELDS), ("parameters", _PARAMETER_FIELDS)):
        for name, entry in d.get(key, {}).items():
            if not isinstance(entry, dict):
                _fail(source, f"{key}.{name}", "an object", entry)
            missing = [f for f in fields if f not in entry]
            if missing:
                _fail(source, f"{key}.{name}", f"an object with {', '.join(missing)} (missing)", entry)


def check_plan_types(plan, source: str) -> None:
    """Raise BAD_PLAN naming the first field of ``plan`` whose value has the wrong type."""
    _check_dataclass(plan, "", source)
    _need(plan.cluster, {"spec": str, "memory_limit_bytes": int}, "cluster", source)
    _need(plan.cluster, {"hosts": int, "devices_per_host": int}, "cluster", source, optional=True)
    if not _CLUSTER_SPEC.match(plan.cluster["spec"]) and not all(_REGION_SPEC.match(part)
                                                              for part in plan.cluster["spec"].split(" + ")):
        _fail(source, "cluster.spec", "the cluster as autopar describes it ('8xH100', '2x8xA100-80GB' or "
              "'a:1x8xH100 + b:1x8xV100-32GB')", plan.cluster["spec"])
    for key in ("memory_limit_bytes", "hosts", "devices_per_host"):
        if plan.cluster.get(key, 1) < 1:
            _fail(source, f"cluster.{key}", "a positive integer", plan.cluster[key])
    if plan.family not in PLAN_FAMILIES:
        _fail(source, "family", f"one of {', '.join(PLAN_FAMILIES)} (a newer autopar's plan? upgrade)", plan.family)
    if plan.micro_batches < 1 or plan.bubble > 1:
        _fail(source, "micro_batches/bubble", "1 or more micro-batches and a bubble fraction of at most 1",
              (plan.micro_batches, plan.bubble))
    if plan.schedule is not None and plan.schedule not in PIPELINE_SCHEDULES:
        _fail(source, "schedule", f"null or one of {', '.join(PIPELINE_SCHEDULES)}", plan.schedule)
    if plan.virtual_stages < 1 or len(plan.stages) % plan.virtual_stages:
        _fail(source, "virtual_stages", f"1 or more, dividing the {len(plan.stages)} stages", plan.virtual_stages)
    if plan.schedule in V_SHAPED_SCHEDULES and plan.virtual_stages != 2:
        _fail(source, "virtual_stages", f"2 under {plan.schedule} (two chunks per group, in a V)", plan.virtual_stages)
    for fqn, parameter in plan.parameters.items():
        if parameter.exchange not in PARAMETER_EXCHANGES:
            _fail(source, f"parameters.{fqn}.exchange", f"one of {', '.join(PARAMETER_EXCHANGES)}", parameter.exchange)
    for name, node in plan.nodes.items():
        if node.exchange not in NODE_EXCHANGES:
            _fail(source, f"nodes.{name}.exchange", "empty or one of " + ", ".join(filter(None, NODE_EXCHANGES)),
                  node.exchange)
    _need(plan.solver, {"status": str, "objective_s": _NUMBER, "bound_s": _NUMBER}, "solver", source)
    devices = 1
    for size in plan.mesh_shape:
        if size < 1:
            _fail(source, "mesh_shape", "positive sizes", list(plan.mesh_shape))
        devices *= size
    if devices > MAX_DEVICES:
        _fail(source, "mesh_shape", f"at most {MAX_DEVICES:,} devices in all", list(plan.mesh_shape))
    if plan.work:
        _need(plan.work, {"flops_per_step": _NUMBER, "flops_dtype": str, "peak_flops_per_s": _NUMBER,
                          "devices": int}, "work", source)
        _need(plan.work, {"tokens_per_step": (*_NUMBER, type(None))}, "work", source, optional=True)
        if plan.work["peak_flops_per_s"] <= 0 or plan.work["devices"] < 1:
            _fail(source, "work", "a positive peak and device count", plan.work)
    _need(plan.options, {"optimizer": str, "overlap": bool, "bucket_cap_mb": _NUMBER, "prefetch_layers": int},
          "options", source, optional=True)
    if plan.options.get("bucket_cap_mb", 1) <= 0 or plan.options.get("prefetch_layers", 0) < 0:
        _fail(source, "options", "a positive bucket_cap_mb and a prefetch_layers of 0 or more", plan.options)
    if plan.recompute_cost:
        _need(plan.recompute_cost, {"rerun_s": _NUMBER, "activations_kept_bytes": _NUMBER}, "recompute_cost", source)
        _need(plan.recompute_cost, {"rerun_buffer_bytes": _NUMBER}, "recompute_cost", source, optional=True)
    if plan.overlap:
        _need(plan.overlap, {"efficiency": _NUMBER, "layers": list}, "overlap", source)
        _need(plan.overlap, {"by_collective": dict}, "overlap", source, optional=True)
        for k, entry in enumerate(plan.overlap["layers"]):
            where = f"overlap.layers[{k}]"
            if not isinstance(entry, dict):
                _fail(source, where, "an object", entry)
            _need(entry, {"layer": str, "copies": int, "forward": list, "backward": list}, where, source)
            for phase in ("forward", "backward"):
                times = entry[phase]
                if len(times) not in (2, 3) or not all(isinstance(t, _NUMBER) and not isinstance(t, bool)
                                                       and math.isfinite(t) and (t >= 0 or k == 2)
                                                       for k, t in enumerate(times)):
                    _fail(source, f"{where}.{phase}", "[compute seconds, communication seconds, and that "
                          "communication weighted by its overlap efficiency]", times)
            if entry["copies"] < 1:
                _fail(source, f"{where}.copies", "a positive count", entry["copies"])
            exposed = entry.get("exposed_copies", 0)
            if not isinstance(exposed, int) or isinstance(exposed, bool) or not 0 <= exposed <= entry["copies"]:
                _fail(source, f"{where}.exposed_copies", "a count of copies from 0 to copies", exposed)
    for name, node in plan.nodes.items():
        for k, alternative in enumerate(node.alternatives):
            if not isinstance(alternative, dict):
                _fail(source, f"nodes.{name}.alternatives[{k}]", "an object", alternative)
            _need(alternative, {"outputs": list, "inputs": list, "compute_s": _NUMBER, "reshard_s": _NUMBER,
                                "memory_delta_bytes": int}, f"nodes.{name}.alternatives[{k}]", source)
    for name, row in {**plan.baselines, **plan.families}.items():
        if not isinstance(row, dict):
            _fail(source, f"baselines/families.{name}", "an object", row)
        _need(row, {"predicted_step_s": (*_NUMBER, type(None)), "memory_bytes": (int, type(None)),
                    "feasible": bool, "reason": str, "skipped": (str, type(None))},
              f"baselines/families.{name}", source, optional=True)


def _fail(source: str, where: str, wanted: str, value) -> typing.NoReturn:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise AutoparError(ErrorKind.BAD_PLAN, f"{source}: field {where} should be {wanted}, not {shown}; re-create "
                       "the plan with `autopar.plan(...).save(path)`")


def _need(mapping: dict, keys: dict[str, type | tuple], where: str, source: str, optional: bool = False) -> None:
    for key, wanted in keys.items():
        if key not in mapping:
            if optional:
                continue
            _fail(source, f"{where}.{key}", "present", None)
        value = mapping[key]
        if isinstance(value, bool) and bool not in (wanted if isinstance(wanted, tuple) else (wanted,)) \
                or not isinstance(value, wanted) or isinstance(value, float) and not math.isfinite(value):
            _fail(source, f"{where}.{key}", _name(wanted), value)


def _name(wanted) -> str:
    kinds = wanted if isinstance(wanted, tuple) else (wanted,)
    return " or ".join("null" if k is type(None) else "a number" if k in _NUMBER else f"a {k.__name__}"
                       for k in dict.fromkeys(float if k is int and float in kinds else k for k in kinds))


def _check_dataclass(obj, where: str, source: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for field in dataclasses.fields(obj):
        if field.name == "timings":  # not serialised
            continue
        _check(getattr(obj, field.name), hints[field.name], f"{where}{field.name}", source)


def _check(value, hint, where: str, source: str) -> None:
    if hint is Any:
        return
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        for option in args:
            try:
                _check(value, option, where, source)
                return
            except AutoparError:
                continue
        _fail(source, where, " or ".join(_hint_name(a) for a in args), value)
    if hint is type(None):
        if value is not None:
            _fail(source, where, "null", value)
        return
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            _fail(source, where, f"a {hint.__name__}", value)
        _check_dataclass(value, f"{where}.", source)
        return
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            _fail(source, where, "a list", value)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(value)
        elif origin is list:
            args = (args[0],) * len(value) if args else ()
        if args and len(args) != len(value):
            _fail(source, where, f"a list of {len(args)}", value)
        for k, (item, item_hint) in enumerate(zip(value, args)):
            _check(item, item_hint, f"{where}[{k}]", source)
        return
    if origin is dict:
        if not isinstance(value, dict):
            _fail(source, where, "an object", value)
        for key, item in value.items():
            if args:
                _check(key, args[0], f"{where} key", source)
                _check(item, args[1], f"{where}.{key}", source)
        return
    # every count, size and time a plan holds is non-negative: a negative one is a hand edit
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, _NUMBER) or not math.isfinite(value) or value < 0:
            _fail(source, where, "a finite number of 0 or more", value)
        return
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            _fail(source, where, "an integer of 0 or more", value)
        return
    if isinstance(hint, type) and (not isinstance(value, hint) or hint is not bool and isinstance(value, bool)):
        _fail(source, where, f"a {hint.__name__}", value)


def _hint_name(hint) -> str:
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def placement_problems(plan, shapes: dict[str, tuple[int, ...]],
                       node_shapes: dict[str, tuple] | None = None) -> list[str]:
    """What is wrong with the plan's parameter placements for parameters of these ``shapes``
    (FQN -> shape, from the model): text that is no placement, a placement for another number
    of mesh dims, a split of a dim the tensor lacks or that does not divide over its devices;
    and with its node outputs' placements for ``node_shapes`` (node name -> each output's
    shape, None for a non-tensor): a split of a dim the output lacks.
    ``autopar validate`` reports them; lowering would fail on each with a raw error."""
    problems = _parameter_problems(plan, shapes)
    for name, outputs in sorted((node_shapes or {}).items()):
        node = plan.nodes.get(name)
        for k, (text, shape) in enumerate(zip(node.outputs if node else (), outputs)):
            if text is None or shape is None:
                continue
            dims = sorted({p.dim for p in pl.parse_spec(text) if p.is_shard})
            if dims and dims[-1] >= len(shape):
                problems.append(f"node {name}: output {k} placement {text!r} splits dim {dims[-1]}, the output has "
                                f"{len(shape)} dims (shape {list(shape)})")
    return problems


def _parameter_problems(plan, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    meshes = {tuple(group.mesh_shape) for group in (*plan.stages, *plan.replicas)} or {tuple(plan.mesh_shape)}
    problems = []
    for fqn, pplan in sorted(plan.parameters.items()):
        if fqn not in shapes:
            continue
        for field, text in (("placement", pplan.placement), ("optimizer_state", pplan.optimizer_state)):
            if text is None:
                continue
            try:
                spec = pl.parse_spec(text)
            except ValueError as exc:
                problems.append(f"{fqn}: {field} {text!r} is not a placement ({exc})")
                continue
            fitting = [mesh for mesh in meshes if len(mesh) == len(spec)]
            if not fitting:
                problems.append(f"{fqn}: {field} {text!r} has {len(spec)} entries, the mesh has "
                                f"{' or '.join(str(len(m)) for m in sorted(meshes))} dims")
                continue
            shape = shapes[fqn]
            for dim in sorted({p.dim for p in spec if p.is_shard}):
                if dim >= len(shape):
                    problems.append(f"{fqn}: {field} {text!r} splits dim {dim}, the parameter has {len(shape)} "
                                    f"dims (shape {list(shape)})")
                elif all(shape[dim] % pl.split_over(spec, mesh, dim) for mesh in fitting):
                    devices = pl.split_over(spec, fitting[0], dim)
                    problems.append(f"{fqn}: {field} {text!r} splits dim {dim} of size {shape[dim]} over "
                                    f"{devices} devices, which does not divide it")
    return problems
