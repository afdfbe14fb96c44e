"""Cost annotation: FLOPs and bytes moved per node, and roofline time on a device.

Writes ``node.meta["autopar.cost"] = OpCost(...)`` for every call_function node. FLOPs
come from torch's own formulas (``torch.utils.flop_counter.flop_registry``), which exist
for the core-ATen ops we capture. View ops move no bytes and cost nothing.

Time on a device (roofline with efficiency factors):
    t = max(flops / (peak(dtype)·eff_compute), bytes / (bandwidth·eff_memory)) / eff(class)
        + per-op overhead
where ``eff(class)`` is the fraction of that roofline the device reaches on the op's class
(matmul, conv, pool, reduction, elementwise; ``autopar profile`` measures it, 1 when unknown).
Fused attention (``F.scaled_dot_product_attention``) stays one op (passes.decompose), its
FLOPs from :func:`attention_flops`; attention written as matmuls and a softmax is costed as those.
"""

from __future__ import annotations

import math
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
    "scaled_dot_product_attention": "attention",
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


def view_chain(node: torch.fx.Node, through_getitem: bool = True) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    """The tensor a chain of views reads (a weight's placeholder behind its transposes), and
    the views from ``node`` back to it (``node`` first; empty when ``node`` is no view).
    ``through_getitem`` False stops at a ``getitem`` (one output of a multi-output op)."""
    views = []
    while node.op == "call_function" and is_view_op(node) and (through_getitem or node.target is not operator.getitem):
        views.append(node)
        node = node.args[0]
    return node, views


FUSED_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default
_ATTENTION_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_ATTENTION_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def attention_args(node: torch.fx.Node) -> tuple:
    """(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) of a fused
    attention node, positional or keyword, defaults filled in (tensors as fx nodes)."""
    given = dict(zip(_ATTENTION_ARGS, node.args))
    given.update(node.kwargs)
    return tuple(given.get(name, default) for name, default in zip(_ATTENTION_ARGS, _ATTENTION_DEFAULTS))


def attention_flops(query, key, value, is_causal: bool = False) -> float:
    """FLOPs of fused attention's forward: the scores (2·B·H·L·S·E) and their product with the
    values (2·B·H·L·S·Ev), half of both under a causal mask (the kernel skips the masked
    blocks). Arguments are fx nodes or tensors (query (B, H, L, E), key (B, Hk, S, E))."""
    q, k, v = (a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in (query, key, value))
    *batch, heads, length, dim = q.shape
    pairs = math.prod(batch) * heads * length * k.shape[-2]
    return 2.0 * pairs * (dim + v.shape[-1]) * (0.5 if is_causal else 1.0)


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
        if node.target is FUSED_ATTENTION:
            flops = attention_flops(*attention_args(node)[:3], is_causal=attention_args(node)[5])
        elif packet in flop_registry:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            flops = float(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))
        read = sum(tensor_bytes(v) for v in in_vals if isinstance(v, torch.Tensor))
        if node.target is torch.ops.aten.embedding.default:  # a lookup reads its rows, not the table
            read = sum(tensor_bytes(v) for v in outs) + tensor_bytes(node.args[1].meta["val"])
        written = sum(tensor_bytes(v) for v in outs)
        dtype = str(outs[0].dtype).removeprefix("torch.") if outs else "float32"
        node.meta[COST_KEY] = OpCost(flops, 0 if view else read, 0 if view else written, view, dtype,
                                     op_class(node.target))
