"""The plan's sections for sparse tables and MoE layers (``Plan.sparse``, ``Plan.experts``):
what each table's lookup and each expert group became under a solved placement, the
table-wise tables' owners, and the expert load per device. They also name those
parameters' ``exchange`` in the plan's parameter entries."""

from __future__ import annotations

import dataclasses
import math

from autopar import placements as pl
from autopar.mesh import MeshSpec
from autopar.plan import NodePlan, ParameterPlan
from autopar.solvers.balance import balanced_order, device_loads, imbalance
from autopar.passes.capture import Captured
from autopar.passes.experts import EXPERTS_KEY
from autopar.passes.expert_dispatch import DISPATCH_KEY
from autopar.passes.sparse import LOOKUP_KEY, TABLE_WISE, exchange_bytes
from autopar.passes.sparse import table_owners as sparse_owners


def sparse_tables(captured: Captured, nodes: dict[str, NodePlan], parameters: dict[str, ParameterPlan],
                   mesh: MeshSpec) -> dict[str, dict]:
    """Each sparse table's access figures and bytes per step by exchange method; sets the
    table's ``exchange`` to what its lookup chose (in ``parameters``, in place)."""
    tables = {}
    for node in captured.graph.nodes:
        lookup = node.meta.get(LOOKUP_KEY)
        if lookup is None or node.name not in nodes:
            continue
        chosen = nodes[node.name]
        table = parameters[lookup.parameter]
        placement = table.spec
        if chosen.exchange:
            exchange = chosen.exchange
        elif pl.is_replicated(placement) and pl.is_replicated(chosen.input_spec(1)):
            exchange = "none"  # every device looks up every index: the full gradient is already local
        elif pl.Shard(0) in placement:
            exchange = "row_sharded"
        elif pl.Shard(1) in placement:
            exchange = "column_sharded"
        else:
            exchange = table.exchange
        parameters[lookup.parameter] = dataclasses.replace(table, exchange=exchange)
        devices = math.prod(mesh.shape)
        tables[lookup.parameter] = {
            "rows": lookup.rows, "row_bytes": lookup.row_bytes, "lookups": lookup.lookups,
            "touched_rows": lookup.touched_rows(devices), "density": lookup.touched_rows(devices) / lookup.rows,
            "density_source": lookup.source, "exchange": exchange,
            "bytes_per_step": exchange_bytes(lookup, devices)}
        if exchange == TABLE_WISE:
            tables[lookup.parameter]["pooled_bytes"] = lookup.result_bytes
    for fqn, owner in table_owners(tables, parameters, mesh).items():
        tables[fqn]["owner"] = owner
    return tables


def table_owners(tables: dict[str, dict], parameters: dict[str, ParameterPlan], mesh: MeshSpec) -> dict[str, int]:
    """The device (coordinate on the mesh dim placed ``O``) that holds each table-wise table
    (passes.sparse.table_owners, per mesh dim)."""
    owners: dict[str, int] = {}
    by_dim: dict[int, list[tuple[str, int, int]]] = {}
    for fqn, table in tables.items():
        if table["exchange"] == TABLE_WISE:
            by_dim.setdefault(pl.owned_dim(parameters[fqn].spec), []).append(
                (fqn, table["pooled_bytes"], parameters[fqn].bytes))
    for dim, members in sorted(by_dim.items()):
        owners.update(sparse_owners(members, mesh.shape[dim]))
    return owners


def expert_layers(captured: Captured, parameters: dict[str, ParameterPlan], nodes: dict[str, NodePlan],
                   mesh: MeshSpec) -> dict[str, dict]:
    """Each MoE layer's expert placement and load per device; names the expert weights'
    ``exchange`` (in ``parameters``, in place)."""
    layers = {}
    groups = {id(g): g for n in captured.graph.nodes if (g := n.meta.get(EXPERTS_KEY)) is not None}
    for group in groups.values():
        if group.form == "module_list":
            layers[group.module] = _module_list_layer(captured, group, parameters, nodes, mesh)
            continue
        for fqn in group.parameters:
            exchange = _expert_exchange(parameters[fqn].spec)
            if exchange is not None:
                parameters[fqn] = dataclasses.replace(parameters[fqn], exchange=exchange)
        layer = _layer_load(group, parameters[group.parameters[0]].spec,
                            parameters[group.parameters[0]].exchange, mesh)
        dispatch = _dispatch_of(captured, group, nodes)
        if dispatch is not None:  # experts gathered per token, their rows sent to the owners
            layer["dispatch"] = dispatch
        # split over the experts, with a router that can speak in slots: rows stored in the balanced order
        if layer["exchange"] == "expert_parallel" and layer["expert_devices"] > 1:
            _apply_order(layer, group)
        layers[group.module] = layer
    return layers


def _dispatch_of(captured: Captured, group, nodes: dict[str, NodePlan]) -> dict | None:
    """The plan's ``dispatch`` entry of a layer whose gathered experts' rows go to their owners
    (passes.expert_dispatch), or None."""
    for node in captured.graph.nodes:
        dispatch = node.meta.get(DISPATCH_KEY)
        if dispatch is not None and set(dispatch.weights) <= set(group.nodes) and node.name in nodes:
            dim = pl.index_of(nodes[node.name].output_spec(), pl.D)
            if dim is not None:
                return dispatch.to_plan(dim)
    return None


def _apply_order(layer: dict, group) -> None:
    """Mark ``layer``'s balanced order as placed (lowering applies it) when its router can be
    relabelled (passes.expert_order) and the order moves an expert."""
    if group.relabel is not None and layer["order"] != sorted(layer["order"]):
        layer["order_applied"] = True
        layer["relabel"] = group.relabel.to_plan()


def _module_list_layer(captured: Captured, group, parameters: dict[str, ParameterPlan], nodes: dict[str, NodePlan],
                       mesh: MeshSpec) -> dict:
    """A ModuleList's batched experts: placed as the stack of their weights is. Weights that
    live on their owners (``O``: expert parallel) get that ``exchange`` (in ``parameters``, in
    place); the others keep theirs. Experts on their owners go to the devices of the balanced
    order (:func:`_apply_order`)."""
    placement = nodes[group.nodes[0]].output_spec()
    stacks = [n for n in captured.graph.nodes if n.name in group.nodes]
    owned = True
    for stack in stacks:
        for weight in stack.args[0]:
            fqn = captured.parameter_of[weight.name]
            if pl.owned_dim(parameters[fqn].spec) is not None:
                parameters[fqn] = dataclasses.replace(parameters[fqn], exchange="expert_parallel")
            else:
                owned = False
    layer = _layer_load(group, placement, _expert_exchange(placement) or "replicated", mesh)
    if owned:
        _apply_order(layer, group)
    return layer


def _expert_exchange(placement: pl.Spec) -> str | None:
    """How stacked expert weights placed ``placement`` are split: over the experts (dim 0),
    inside each expert, or not at all (None)."""
    if pl.Shard(0) in placement:
        return "expert_parallel"
    if any(p.is_shard for p in placement):
        return "expert_tensor_parallel"
    return None


def _layer_load(group, placement: pl.Spec, exchange: str, mesh: MeshSpec) -> dict:
    """The layer's plan entry: placement and tokens per device, in the model's expert order
    and in the balanced one (advice: ``order_applied`` is False until the caller applies it)."""
    expert_devices = pl.split_over(placement, mesh.shape, 0)
    load = group.load or (1,) * group.experts
    divisible = group.experts % expert_devices == 0
    order = balanced_order(load, expert_devices) if divisible else list(range(group.experts))
    in_order = device_loads(load, list(range(group.experts)), expert_devices)
    balanced = device_loads(load, order, expert_devices)
    return {
        "experts": group.experts, "top_k": group.top_k, "parameters": list(group.parameters),
        "form": group.form, "placement": pl.format_spec(placement), "exchange": exchange,
        "expert_devices": expert_devices, "load": list(load), "load_source": group.load_source,
        "order": order, "order_applied": False, "device_load": balanced, "imbalance": imbalance(balanced),
        "device_load_in_order": in_order, "imbalance_in_order": imbalance(in_order)}
