"""Pipeline stages: give every graph node a stage at layer boundaries, and cut a graph into
one graph per stage.

Layers are the indexed modules (``blocks.3``) in the order the graph first runs them; a
stage holds a contiguous range of them. Nodes outside any layer (embeddings, final norm,
head) go with the layer that ran last before them (the first stage before any layer), and no
node runs before a value it reads, so data only flows forward.

A stage's graph takes what earlier stages produced and later nodes still read (its
*boundary inputs*; the first stage takes the user inputs) and returns what later stages
read (its *boundary outputs*; the last stage returns the model's outputs). Values a later
stage needs from further back, such as position ids, are passed through every stage in
between, because a pipeline stage only talks to its neighbours. Parameters live in the one
stage that reads them; buffers and constants are copied into every stage that reads them.

A stage's boundary input is the placeholder ``stage{s}_{producer}``, so a plan can hold the
placements of every stage's nodes under distinct names.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_unflatten

from autopar.errors import AutoparError, ErrorKind
from autopar.plan import layer_of_path


def node_layer(node: torch.fx.Node) -> str | None:
    """Innermost indexed module the node runs in (``blocks.3``), from ``nn_module_stack``."""
    for path, _cls in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        layer = layer_of_path(path)
        if layer:
            return layer
    return None


FRONT, BACK = "<before the layers>", "<after the layers>"  # ops outside every layer, by position


def outside_layers(seen_layer: bool) -> str:
    """The label of an op outside every layer: :data:`FRONT` before the graph's first layer
    ran (``seen_layer`` False), :data:`BACK` after."""
    return BACK if seen_layer else FRONT


def layer_order(graph: torch.fx.Graph) -> list[str]:
    """Layers in the order the graph first runs them: the units stages are cut between."""
    seen: dict[str, None] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            layer = node_layer(node)
            if layer:
                seen.setdefault(layer)
    return list(seen)


def _is_state(node: torch.fx.Node, state: set[str]) -> bool:
    return node.op == "get_attr" or node.name in state


def assign_stages(graph: torch.fx.Graph, layers: list[str], cuts: list[int], state: set[str],
                  parameters: dict[str, str]) -> dict[str, int]:
    """Stage of every node. ``cuts`` are the indices into ``layers`` where stages 1, 2, …
    begin; ``state`` names the placeholders that are parameters, buffers or constants and
    ``parameters`` maps parameter nodes to their names (for the error below)."""
    stage_of_layer = {layer: bisect.bisect_right(cuts, k) for k, layer in enumerate(layers)}
    stage: dict[str, int] = {}
    current = 0
    for node in graph.nodes:
        if node.op == "placeholder" or node.op == "get_attr":
            stage[node.name] = 0
            continue
        if node.op == "output":
            stage[node.name] = len(cuts)
            continue
        layer = node_layer(node) if node.op == "call_function" else None
        if layer in stage_of_layer:
            current = max(current, stage_of_layer[layer])
        reads = [stage[a.name] for a in node.all_input_nodes if not _is_state(a, state)]
        stage[node.name] = max([current, *reads])
    for node in graph.nodes:  # state lives where it is read
        if _is_state(node, state):
            used = sorted({stage[u.name] for u in node.users})
            if len(used) > 1 and node.name in parameters:
                raise AutoparError(
                    ErrorKind.UNSUPPORTED_OP,
                    f"parameter {parameters[node.name]} is read by pipeline stages {used} (tied weights, e.g. an "
                    "LM head sharing the embedding); one parameter in several stages is not supported: untie "
                    "it, or plan without pipeline stages")
            stage[node.name] = used[0] if used else 0
    return stage


@dataclass
class StageGraph:
    """One stage: its graph, the names of its boundary inputs and outputs (producer node
    names in the full graph), in the order its forward takes and returns them."""

    graph: torch.fx.Graph
    inputs: list[str]
    outputs: list[str]


def split_graph(graph: torch.fx.Graph, stage: dict[str, int], num_stages: int, state: set[str],
                out_spec=None, only: int | None = None) -> list[StageGraph | None]:
    """Cut ``graph`` into ``num_stages`` graphs (see the module docstring). ``out_spec``
    (the pytree spec of a runnable module's outputs) makes the last stage return the model's
    own output structure. ``only`` builds just that stage's graph (the others are None)."""
    nodes = list(graph.nodes)
    order = {n.name: k for k, n in enumerate(nodes)}
    last_use: dict[str, int] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            last_use[arg.name] = max(last_use.get(arg.name, -1), stage[node.name])
    readers = {n.name: {stage[u.name] for u in n.users} for n in nodes}
    user_inputs = [n for n in nodes if n.op == "placeholder" and n.name not in state]
    stages = []
    carried: list[torch.fx.Node] = user_inputs  # values entering the current stage, in order
    for s in range(num_stages):
        if only is not None and s != only:
            live = [n for n in nodes if n.op != "output" and not _is_state(n, state)
                    and stage[n.name] <= s and last_use.get(n.name, -1) > s] if s < num_stages - 1 else []
            live.sort(key=lambda n: order[n.name])
            stages.append(None)
            carried = live
            continue
        new = torch.fx.Graph()
        env: dict[str, torch.fx.Node] = {}
        for value in carried:  # a boundary input is named after its producer and the stage
            env[value.name] = new.placeholder(value.name if s == 0 else f"stage{s}_{value.name}")
            env[value.name].meta = {"val": value.meta["val"]}
        for node in nodes:
            here = readers[node.name] if _is_state(node, state) else {stage[node.name]}
            if node.op == "output" or s not in here or node.name in env:
                continue
            env[node.name] = new.node_copy(node, lambda a: env[a.name])
        if s < num_stages - 1:
            live = [n for n in nodes if n.op != "output" and not _is_state(n, state)
                    and stage[n.name] <= s and last_use.get(n.name, -1) > s]
            live.sort(key=lambda n: order[n.name])
            new.output(tuple(env[n.name] for n in live))
        else:
            live = []
            out = graph.output_node()
            result = torch.fx.map_arg(out.args[0], lambda a: env[a.name])
            new.output(result if out_spec is None else tree_unflatten(list(result), out_spec))
        new.lint()
        stages.append(StageGraph(new, [v.name for v in carried], [n.name for n in live]))
        carried = live
    return stages


def lane_slice_dim(val: torch.Tensor, lanes: int) -> int | None:
    """The dim a boundary tensor is sliced on, one slice per lane (so each value crosses the
    link between groups once): its first dim that divides evenly; None = sent whole."""
    if lanes < 2:
        return None
    return next((d for d, size in enumerate(val.shape) if size % lanes == 0), None)
