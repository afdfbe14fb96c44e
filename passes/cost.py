"""Cost annotation: FLOPs and bytes moved per node, and roofline time on a device.

Writes ``node.meta["autopar.cost"] = OpCost(...)`` for every call_function node. FLOPs
come from torch's own formulas (``torch.utils.flop_counter.flop_registry``), which exist
for the core-ATen ops we capture. View ops move no bytes and cost nothing.

Time on a device (roofline with efficiency factors):
    t = max(flops / (peak(dtype)·eff_compute), bytes / (bandwidth·eff_memory))
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from autopar.comm import largest
from autopar.devices import DeviceSpec

COST_KEY = "autopar.cost"


@dataclass(frozen=True)
class OpCost:
    flops: float
    bytes_read: int
    bytes_written: int
    is_view: bool
    dtype: str

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    def time_s(self, device: DeviceSpec, work_split: int = 1) -> float:
        """Roofline time when the work is divided evenly over ``work_split`` devices."""
        if self.is_view:  # no data moves, but the op is still dispatched
            return device.op_overhead_s
        compute = self.flops / work_split / (device.flops_per_s(self.dtype) * device.compute_efficiency)
        memory = self.bytes_moved / work_split / (device.memory_bandwidth_Bps * device.memory_efficiency)
        return largest(compute, memory) + device.op_overhead_s


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_view_op(node: torch.fx.Node) -> bool:
    """getitem and ops whose first return aliases an input (view, permute, expand, split…)."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


def annotate_costs(graph: torch.fx.Graph) -> None:
    """Attach an OpCost to every call_function node."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        in_vals = [a.meta.get("val") for a in node.all_input_nodes]
        outs = [v for v in tree_flatten(node.meta.get("val"))[0] if isinstance(v, torch.Tensor)]
        view = is_view_op(node)
        flops = 0.0
        packet = getattr(node.target, "overloadpacket", None)
        if packet in flop_registry:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            flops = float(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))
        read = sum(tensor_bytes(v) for v in in_vals if isinstance(v, torch.Tensor))
        if node.target is torch.ops.aten.embedding.default:  # a lookup reads its rows, not the table
            read = sum(tensor_bytes(v) for v in outs) + tensor_bytes(node.args[1].meta["val"])
        written = sum(tensor_bytes(v) for v in outs)
        dtype = str(outs[0].dtype).removeprefix("torch.") if outs else "float32"
        node.meta[COST_KEY] = OpCost(flops, 0 if view else read, 0 if view else written, view, dtype)
