"""A training step's work, so reports can speak in tokens/s per device and MFU.

The reports turn it into rates (autopar.report.throughput). MFU (model FLOPs utilisation) = the FLOPs one training step needs / (step time × the summed
datasheet peak of every device in the dtype those FLOPs run in) — PaLM's definition, as
torchtitan reports it. The FLOPs are the graph's own (passes.cost: matmuls and attention
included, as captured), forward once and twice more for backward where a gradient flows;
recomputation, when a plan recomputes, is work the hardware does but not model FLOPs.
"""

from __future__ import annotations

from collections import Counter

from autopar.cluster import Cluster
from autopar.passes.build_problem import gradient_path
from autopar.passes.capture import Captured
from autopar.passes.cost import COST_KEY, annotate_costs


def step_work(captured: Captured, cluster: Cluster) -> dict:
    """``Plan.work`` of the whole-batch graph ``captured`` on ``cluster``."""
    graph = captured.graph
    if any(n.op == "call_function" and COST_KEY not in n.meta for n in graph.nodes):
        annotate_costs(graph)
    on_path = gradient_path(graph, captured)
    flops: Counter = Counter()
    for node in graph.nodes:
        if node.op == "call_function":
            cost = node.meta[COST_KEY]
            flops[cost.dtype] += (3 if node.name in on_path else 1) * cost.flops
    dtype = max(flops, key=lambda d: (flops[d], d)) if flops else "float32"
    first = captured.inputs[0] if captured.inputs else None
    tokens = first.shape[0] * first.shape[1] if first is not None and len(first.shape) >= 2 and \
        first.dtype.startswith(("int", "uint")) else None
    peak = sum(len(group.ranks) * group.cluster.device.flops_per_s(dtype) for group in cluster.groups())
    return {"flops_per_step": float(sum(flops.values())), "flops_dtype": dtype,
            "samples_per_step": first.shape[0] if first is not None and first.shape else None,
            "tokens_per_step": tokens, "peak_flops_per_s": peak, "devices": cluster.num_devices}
