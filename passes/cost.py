"""Cost annotation: FLOPs and bytes moved per node, and roofline time on a device.

Writes ``node.meta["autopar.cost"] = OpCost(...)`` for every call_function node. FLOPs
come from torch's own formulas (``torch.utils.flop_counter.flop_registry``), which exist
for the core-ATen ops we capture. View ops move no bytes and cost nothing.

Time on a device (roofline with efficiency factors):
    t = max(flops / (peak(dtype)·eff_compute), bytes / (bandwidth·eff_memory)) / eff(class)
        + per-op overhead
where ``eff(class)`` is the fraction of that roofline the device reaches on the op's class
(matmul, conv, pool, reduction, elementwise; ``autopar profile`` measures it, 1 when unknown).
Attention is decomposed at capture, so it is costed as its matmuls and its softmax.
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

# op classes whose kernels reach different fractions of the roofline (DeviceSpec.efficiency)
_CLASS_OF_OP = {
    **dict.fromkeys(("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "_int_mm"), "matmul"),
    **dict.fromkeys(("convolution", "convolution_backward", "_convolution", "conv1d", "conv2d", "conv3d"), "conv"),
    **dict.fromkeys(("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
                     "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
                     "adaptive_max_pool2d", "max_pool2d_with_indices_backward", "avg_pool2d_backward"), "pool"),
    **dict.fromkeys(("_softmax", "softmax", "_log_softmax", "log_softmax", "native_layer_norm", "layer_norm",
                     "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                     "sum", "mean", "amax", "amin", "var", "var_mean", "logsumexp", "cumsum", "norm",
                     "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm_backward"),
                    "reduction"),
}


def op_class(target) -> str:
    """The efficiency class of an ATen op (``elementwise`` for everything not listed)."""
    packet = getattr(target, "overloadpacket", None)
    return _CLASS_OF_OP.get(getattr(packet, "__name__", ""), "elementwise")


@dataclass(frozen=True)
class OpCost:
    flops: float
    bytes_read: int
    bytes_written: int
    is_view: bool
    dtype: str
    op_class: str = "elementwise"

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    def time_s(self, device: DeviceSpec, work_split: int = 1) -> float:
        """Roofline time when the work is divided evenly over ``work_split`` devices."""
        if self.is_view:  # no data moves, but the op is still dispatched
            return device.op_overhead_s
        compute = self.flops / work_split / (device.flops_per_s(self.dtype) * device.compute_efficiency)
        memory = self.bytes_moved / work_split / (device.memory_bandwidth_Bps * device.memory_efficiency)
        return largest(compute, memory) / device.efficiency(self.op_class) + device.op_overhead_s


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
        node.meta[COST_KEY] = OpCost(flops, 0 if view else read, 0 if view else written, view, dtype,
                                     op_class(node.target))
