"""The plan: a versioned JSON document people inspect, diff, re-cost and apply later.

Placements are stored as the strings autopar.placements writes, one per mesh dimension joined
by commas (``"S(0),R"``), so a plan file reads and diffs as text; ``ParameterPlan.spec`` and
``NodePlan.output_spec``/``input_spec`` give them back as values. Strategy *indices* are never stored because they are not stable across processes.
Wall-clock timings live in ``Plan.timings`` and are not written to disk, so the same model,
inputs and cluster always give a byte-identical file.

>>> spec = TensorSpec("x", (8, 16), "float32")
>>> TensorSpec.from_json(spec.to_json()) == spec
True
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from autopar import placements as pl
from autopar.errors import AutoparError, ErrorKind
from autopar.files import atomic_write_text
from autopar.plan_io import check_placements, read_plan_document
from autopar.plan_types import check_plan_objects, check_plan_types, chunk_group

SCHEMA_VERSION = 2  # 2: family and families (the planner's own apart from baselines); replicas as ReplicaPlan
_INDEXED = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def layer_of_path(path: str) -> str | None:
    """Outermost indexed module of a dotted path (``blocks.3`` of ``blocks.3.qkv``): the unit
    repeated-layer clustering folds and reports group by.

    >>> layer_of_path("blocks.3.attn.qkv"), layer_of_path("head.weight")
    ('blocks.3', None)
    """
    match = _INDEXED.match(path)
    return match.group(1) if match else None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix

    @classmethod
    def of(cls, name: str, tensor) -> "TensorSpec":
        return cls(name, tuple(int(s) for s in tensor.shape), str(tensor.dtype).removeprefix("torch."))

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        return cls(d["name"], tuple(d["shape"]), d["dtype"])


@dataclass(frozen=True)
class NodePlan:
    """Chosen strategy of one graph node: placements of its outputs and tensor inputs."""

    op: str
    outputs: tuple[str | None, ...]
    inputs: tuple[str, ...]
    compute_s: float
    fallback: bool = False  # no sharding rule: run replicated on local tensors
    reshard_s: float = 0.0  # resharding on this node's edges, with its neighbours as planned
    # the best other candidates with their costs, neighbours fixed (for `autopar explain`):
    # {"outputs", "inputs", "compute_s", "reshard_s", "memory_delta_bytes"}
    alternatives: tuple[dict, ...] = ()
    memory_bytes: int = 0  # per device: this node's outputs kept for backward, as placed
    stage: int = 0  # pipeline stage the node runs in (its placements refer to that stage's mesh)
    exchange: str = ""  # "sparse_allgather": a lookup that exchanges its table's gradient as touched rows
    layer: str = ""  # the indexed module it runs in (``blocks.3``), "" outside every layer
    position: int = 0  # its place in the order the graph runs (plan files list nodes by name)

    def output_spec(self, index: int = 0) -> pl.Spec | None:
        """Placement of tensor output ``index`` as a value (None for a non-tensor output)."""
        text = self.outputs[index]
        return None if text is None else pl.parse_spec(text)

    def input_spec(self, index: int) -> pl.Spec:
        """Placement tensor input ``index`` is consumed in, as a value."""
        return pl.parse_spec(self.inputs[index])


@dataclass(frozen=True)
class ParameterPlan:
    # one entry per mesh dim (autopar.placements): "R", "S(k)" (tensor dim k split), or "O" for a
    # ModuleList expert's weight or a table-wise table that lives whole on one device of that dim,
    # its owner (passes.stack_experts, passes.sparse)
    placement: str
    bytes: int
    # how its gradient is synchronised: "allreduce", "reduce_scatter"; for sparse tables also
    # "sparse_allgather" (touched rows), "row_sharded" (lookups routed to row owners), "column_sharded",
    # "table_wise" (the table on one device, pooled bags sent in one all-to-all; no gradient collective);
    # for MoE expert weights "expert_parallel" (experts split over devices, tokens moved by
    # all-to-all; no gradient collective for "O" weights) or "expert_tensor_parallel" (each
    # expert's hidden dim split)
    exchange: str
    # where its master weight, gradient and optimizer states live: the placement itself, or for
    # ZeRO-2 split further (the parameter is used as ``placement``, gathered once per step);
    # None in plans from before ZeRO (read as ``placement``)
    optimizer_state: str | None = None

    @property
    def spec(self) -> pl.Spec:
        """The placement as a value (one per mesh dim)."""
        return pl.parse_spec(self.placement)

    @property
    def state_spec(self) -> pl.Spec:
        """Where the master weight, gradient and optimizer states live, as a value."""
        return pl.parse_spec(self.optimizer_state or self.placement)

    @property
    def zero(self) -> bool:
        """Whether it is a ZeRO-2 parameter (states placed apart from its use)."""
        return self.optimizer_state is not None and self.optimizer_state != self.placement


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device at the step's peak. ``gathered_bytes``: sharded weights gathered for
    use (FSDP's unsharded parameters) held at once — the running layer's and the prefetched
    ones (plans made before it was counted read 0)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    gathered_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.gathered_bytes)

    @classmethod
    def together(cls, parts: "list[MemoryBreakdown]") -> "MemoryBreakdown":
        """What one device holds for several programs at once (a pipeline group's chunks): each
        one's state and activations, and the gathered weights of the one that gathers the most
        (the chunks run one at a time)."""
        return cls(*(max(getattr(part, f.name) for part in parts) if f.name == "gathered_bytes"
                     else sum(getattr(part, f.name) for part in parts) for f in fields(cls)))


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a contiguous range of layers on one device group with its own mesh.

    Times are per micro-batch (forward + backward, with the stage's own collectives);
    ``send_s`` moves its boundary outputs to the next stage and their gradients back
    (bandwidth and latency; it overlaps the next micro-batch's compute).
    """

    group: str
    device: str
    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    layers: tuple[str, ...]
    compute_s: float
    send_s: float
    in_flight: int  # micro-batches whose activations the stage holds at once (1F1B: stages after it + 1)
    memory: MemoryBreakdown
    # of the compute, the weight gradients (passes.weight_gradients), which zero-bubble schedules
    # run in the bubbles; None in plans made before they were costed (read as a third)
    weight_grad_s: float | None = None

    @property
    def busy_s(self) -> float:
        """Time its devices compute per micro-batch (what imbalance compares)."""
        return self.compute_s

    @property
    def weight_gradients_s(self) -> float:
        """:attr:`weight_grad_s`, or a third of the compute in plans made before it."""
        return self.compute_s / 3 if self.weight_grad_s is None else self.weight_grad_s

    @classmethod
    def from_json(cls, d: dict) -> "StagePlan":
        return cls(d["group"], d["device"], tuple(d["ranks"]), tuple(d["mesh_shape"]), tuple(d["mesh_dim_names"]),
                   tuple(d["layers"]), d["compute_s"], d["send_s"], d["in_flight"], MemoryBreakdown(**d["memory"]),
                   d.get("weight_grad_s"))


@dataclass(frozen=True)
class ReplicaPlan:
    """One data-parallel replica: a device group running the whole model, with its own mesh,
    on its ``batch`` rows of the global batch. ``step_s``: its forward and backward on those
    rows; ``sync_s``: the gradient all-reduce between groups that ends every step."""

    group: str
    device: str
    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    batch: int
    step_s: float
    sync_s: float
    memory: MemoryBreakdown
    fingerprint: str  # its graph at that batch (what apply() checks)

    @property
    def busy_s(self) -> float:
        return self.step_s

    @classmethod
    def from_json(cls, d: dict) -> "ReplicaPlan":
        return cls(d["group"], d["device"], tuple(d["ranks"]), tuple(d["mesh_shape"]), tuple(d["mesh_dim_names"]),
                   d["batch"], d["step_s"], d["sync_s"], MemoryBreakdown(**d["memory"]), d["fingerprint"])


@dataclass(frozen=True)
class Plan:
    fingerprint: str
    cluster: dict[str, Any]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    nodes: dict[str, NodePlan]
    parameters: dict[str, ParameterPlan]
    buffers: dict[str, str]
    predicted_step_s: float
    predicted_compute_s: float
    predicted_comm_s: float
    memory: MemoryBreakdown
    solver: dict[str, Any]
    mesh_candidates: tuple[dict[str, Any], ...]
    options: dict[str, Any]
    # hand-written configurations (ddp, fsdp, megatron_tp, context_parallel, tp_dp, …) costed here:
    # name -> {predicted_step_s, feasible, memory_bytes, reason when infeasible}
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    # which planning family made the plan ("one_mesh", "pipeline", "replicas"), and what each
    # family tried predicted: name -> {predicted_step_s, feasible, skipped (why it did not apply)}
    family: str = "one_mesh"
    families: dict[str, dict[str, Any]] = field(default_factory=dict)
    # pipeline: stages in order (empty = one stage over the whole mesh), micro-batches per
    # step, schedule (plan_types.PIPELINE_SCHEDULES) and the predicted idle fraction
    # (p−1)/(m+p−1), interleaved (p−1)/(m·v+p−1), zero bubble (ZB1P and ZBV) (p−1)/(3·m·v+p−1);
    # ``inputs`` then describe one micro-batch
    stages: tuple[StagePlan, ...] = ()
    # heterogeneous data parallelism: every group runs the whole model (``nodes`` placed on its
    # own mesh) on its ``batch`` rows of the global batch; ``send_s``: the gradient all-reduce
    # between groups; ``inputs`` then describe the global batch
    replicas: tuple[ReplicaPlan, ...] = ()
    micro_batches: int = 1
    schedule: str | None = None
    bubble: float = 0.0
    # interleaved 1F1B: chunks of layers per device group; ``stages`` then lists every chunk in
    # model order, chunk g on group plan_types.chunk_group(g, len(stages) / virtual_stages, schedule)
    virtual_stages: int = 1
    # sparse tables (passes.sparse): {fqn: {rows, row_bytes, lookups, touched_rows, density,
    # density_source, exchange, bytes_per_step: {method: bytes one device receives}, and for
    # table-wise tables owner (coordinate on the mesh dim placed "O") and pooled_bytes}}
    sparse: dict[str, dict[str, Any]] = field(default_factory=dict)
    # MoE layers (passes.experts): {module: {experts, top_k, parameters, placement, exchange,
    # expert_devices, load, load_source, order, order_applied (the experts live in that order;
    # then also relabel: {node, kind, stacks, permuted} — passes.expert_order.Relabel), device_load,
    # imbalance, device_load_in_order, imbalance_in_order, and for experts gathered per token whose
    # rows go to their owners dispatch: {dim, ids, gathers, segment, inputs, row_inputs, outputs,
    # rows, experts} — passes.expert_dispatch.Dispatch}}
    experts: dict[str, dict[str, Any]] = field(default_factory=dict)
    # symbolic costs (passes.symbolic): {symbol, traced_batch, batch_inputs, step_s (sympy
    # text of the step time in the batch size), nodes: {name: {flops, bytes}}}; empty when the
    # plan was made without them
    symbolic: dict[str, Any] = field(default_factory=dict)
    comm_bytes: float = 0.0  # bytes one device sends per step (one-mesh plans; 0 when not computed)
    # one training step's work (autopar.planning.throughput): flops_per_step, flops_dtype,
    # samples_per_step, tokens_per_step (None unless the first input is token ids),
    # peak_flops_per_s (every device's datasheet peak in that dtype), devices
    work: dict[str, Any] = field(default_factory=dict)
    # activation checkpointing: layer -> "full" (recomputed whole in backward; passes.recompute);
    # empty when every activation is kept
    recompute: dict[str, str] = field(default_factory=dict)
    # what recomputing costs and saves: rerun_s (forward time run again in backward, per step),
    # activations_kept_bytes (per device, had every activation been kept) and rerun_buffer_bytes
    # (the share of memory.activations_bytes that is one layer's activations, live in backward
    # while it reruns: forward hands backward the rest; absent in older plans); empty without it
    recompute_cost: dict[str, float] = field(default_factory=dict)
    # how the graph's outputs are left for the training step's loss (one-mesh plans): a placement
    # per output, split along their batch dim where the work was (autopar.parallel computes the
    # loss on them in place); empty: gathered whole on every device
    outputs: tuple[str, ...] = ()
    # the communication overlap could not hide behind compute (issue 20): predicted_step_s ≈
    # predicted_compute_s + this on one mesh; None in plans made before overlap was modelled
    # (their communication was all exposed: predicted_comm_s)
    predicted_exposed_comm_s: float | None = None
    # the overlap model's view of the step (one-mesh plans): {efficiency: η, layers: [{layer
    # ("" outside every layer), copies (repeated layers folded into it), forward: [compute_s,
    # overlappable comm_s], backward: [...]}]} — totals over the copies, in the order the graph
    # runs them; empty in plans made before overlap was modelled
    overlap: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    timings: dict[str, float] = field(default=None, compare=False, hash=False)  # not serialised
    # the captured graphs the plan was made from (autopar.planning.ModelGraphs), in the process
    # that made it: what autopar.replan re-plans from without the model or a new trace. Neither
    # serialised nor pickled (a plan read from a file or sent to another rank has none)
    graphs: Any = field(default=None, compare=False, hash=False, repr=False)

    def stage_groups(self) -> list[tuple[StagePlan, ...]]:
        """A pipeline plan's stages by the device group that runs them: one stage each, or
        under an interleaved schedule every group's ``virtual_stages`` chunks, in model order
        (plan_types.chunk_group); empty without stages."""
        groups = len(self.stages) // self.virtual_stages
        return [tuple(st for g, st in enumerate(self.stages) if chunk_group(g, groups, self.schedule) == r)
                for r in range(groups)] if self.stages else []

    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.mesh_shape:
            n *= s
        return n

    def predict(self, batch_size: int | None = None) -> float:
        """Predicted step time in seconds at ``batch_size`` (the traced batch when None),
        from the plan's symbolic costs: no model, no tracing. Raises BAD_INPUT when the plan
        has no symbolic costs or its placements cannot split that batch."""
        if batch_size is None:
            return self.predicted_step_s
        if not self.symbolic:
            raise AutoparError(ErrorKind.BAD_INPUT,
                               "this plan was made without symbolic costs; plan with autopar.plan(..., "
                               "symbolic=True) or `autopar plan --batch-size ...` to predict other batch sizes")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise AutoparError(ErrorKind.BAD_INPUT, f"batch_size must be a positive integer, got {batch_size!r}")
        for name in self.symbolic["batch_inputs"]:
            shards = pl.split_over(self.nodes[name].output_spec(), self.mesh_shape, 0) if name in self.nodes else 1
            if batch_size % shards:
                raise AutoparError(ErrorKind.BAD_INPUT,
                                   f"batch {batch_size} does not split over the {shards} devices that share input "
                                   f"{name}'s batch dim in this plan; use a multiple of {shards}")
        import sympy

        symbol = sympy.Symbol(self.symbolic["symbol"], positive=True, integer=True)
        step = sympy.sympify(self.symbolic["step_s"], locals={self.symbolic["symbol"]: symbol})
        return float(step.subs(symbol, batch_size))

    def predict_memory(self, batch_size: int) -> int:
        """Bytes per device at ``batch_size`` under this plan: weights, gradients and optimizer
        states as planned, activations scaled from the traced batch (``plan.symbolic``). Saved
        tensors without a batch dim scale too, so above the traced batch this bounds the need
        from above, below it from below."""
        traced = self.symbolic.get("traced_batch") if self.symbolic else None
        if not traced:
            raise AutoparError(ErrorKind.BAD_INPUT, "this plan was made without symbolic costs; plan with "
                               "symbolic=True (`autopar plan --batch-size ...`) to predict other batch sizes")
        m = self.memory
        return (m.params_bytes + m.grads_bytes + m.optimizer_bytes + m.gathered_bytes
                + math.ceil(m.activations_bytes * batch_size / traced))

    def __getstate__(self) -> dict:
        """Pickled (e.g. broadcast to other ranks) without :attr:`graphs`: a model and its graph."""
        return {**self.__dict__, "graphs": None}

    def to_json(self) -> str:
        d = asdict(replace(self, graphs=None))  # asdict deep-copies every field
        d.pop("timings")
        d.pop("graphs")
        d["inputs"] = [i.to_json() for i in self.inputs]
        return json.dumps(d, sort_keys=True, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> "Plan":
        d = read_plan_document(text, source, SCHEMA_VERSION)
        version = d["schema_version"]
        check_plan_objects(d, source)
        try:
            plan = cls(
                fingerprint=d["fingerprint"], cluster=d["cluster"],
                mesh_shape=tuple(d["mesh_shape"]), mesh_dim_names=tuple(d["mesh_dim_names"]),
                inputs=tuple(TensorSpec.from_json(i) for i in d["inputs"]),
                nodes={k: NodePlan(v["op"], tuple(v["outputs"]), tuple(v["inputs"]), v["compute_s"], v["fallback"],
                                   v["reshard_s"], tuple(v["alternatives"]), v.get("memory_bytes", 0),
                                   v.get("stage", 0), v.get("exchange", ""), v.get("layer", ""),
                                   v.get("position", 0))
                       for k, v in d["nodes"].items()},
                parameters={k: ParameterPlan(**v) for k, v in d["parameters"].items()},
                buffers=d["buffers"], predicted_step_s=d["predicted_step_s"],
                predicted_compute_s=d["predicted_compute_s"], predicted_comm_s=d["predicted_comm_s"],
                memory=MemoryBreakdown(**d["memory"]), solver=d["solver"],
                mesh_candidates=tuple(d["mesh_candidates"]), options=d["options"], baselines=d["baselines"],
                stages=tuple(StagePlan.from_json(st) for st in d.get("stages", ())),
                replicas=tuple(ReplicaPlan.from_json(r) for r in d.get("replicas", ())),
                micro_batches=d.get("micro_batches", 1), schedule=d.get("schedule"), bubble=d.get("bubble", 0.0),
                virtual_stages=d.get("virtual_stages", 1),
                sparse=d.get("sparse", {}), experts=d.get("experts", {}),
                symbolic=d.get("symbolic", {}), comm_bytes=d.get("comm_bytes", 0.0), work=d.get("work", {}), recompute=d.get("recompute", {}),
                outputs=tuple(d.get("outputs", ())), recompute_cost=d.get("recompute_cost", {}),
                predicted_exposed_comm_s=d.get("predicted_exposed_comm_s"), overlap=d.get("overlap", {}),
                family=d["family"],
                families=d["families"], schema_version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise AutoparError(ErrorKind.BAD_PLAN,
                               f"{source} is not a complete autopar plan: field {exc} is missing or malformed") from exc
        check_plan_types(plan, source)
        check_placements(plan, source)
        return plan

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, self.to_json())


def load_plan(path: str | os.PathLike) -> Plan:
    """The plan saved at ``path`` (``Plan.save``), checked field by field (BAD_PLAN naming the
    first wrong one)."""
    if not isinstance(path, (str, os.PathLike)):
        raise AutoparError(ErrorKind.BAD_INPUT, f"load_plan() takes the path of a plan file, got "
                           f"{type(path).__name__}")
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise AutoparError(ErrorKind.BAD_PLAN, f"cannot read plan file {os.fspath(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise AutoparError(ErrorKind.BAD_PLAN,
                           f"{os.fspath(path)} is not a text plan file (undecodable byte at {exc.start})") from exc
    return Plan.from_json(text, source=os.fspath(path))

