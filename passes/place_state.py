"""Placing a plan's state on the devices: every parameter and buffer of the lowered module
becomes a DTensor with its planned placement (distributed from rank 0's values, or
initialised shard by shard from a model on the meta device), tied names share one
parameter, expert weights placed ``O`` go to their owner's sub-mesh (in a balanced order
where the plan reorders experts), and each parameter reports its gradient to the pass's
:class:`passes.grad_sync.GradientSync`. Also the device meshes and lane groups of plans
over device groups (pipeline stages, replicas). passes.lower calls it once per module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar import placements as pl
from autopar.comm import DDP_BUCKET_BYTES
from autopar.errors import AutoparError, ErrorKind
from autopar.plan import Plan
from autopar.passes import runtime
from autopar.passes.capture import Captured
from autopar.passes.dtensor_ops import dtensor_placements, inverse_order
from autopar.passes.expert_order import Relabel
from autopar.passes.grad_sync import GradientSync
from autopar.passes.materialize import check_initialisable, materialized, on_meta
from autopar.passes.stack_experts import expert_members, owner


def distribute_state(gm: torch.fx.GraphModule, plan: Plan, mesh: DeviceMesh, model: nn.Module,
                      captured: Captured, sync_on_accumulate: bool,
                      owner_meshes: dict[int, list[DeviceMesh]] | None = None) -> None:
    source = dict(model.named_parameters())
    placer = _Placer(mesh, captured, plan, owner_meshes)
    if on_meta(model):  # materialise one module at a time, keeping only this rank's shards
        source = _shards_from_meta(gm, plan, mesh, model, captured.aliases, placer)
    # tied weights (an LM head sharing the embedding): export keeps one of the names, the
    # unlifted module holds a separate copy under the other; every name gets the one DTensor
    alias_of = captured.aliases
    placed: dict[str, tuple[str, tuple[str, str]]] = {}  # alias -> (planned fqn, (placement, optimizer state))
    bucket_mb = plan.options.get("bucket_cap_mb")  # recorded only when not DDP's default
    gradient_sync = GradientSync(mesh, DDP_BUCKET_BYTES if bucket_mb is None else int(bucket_mb * 2**20),
                                 plan.options.get("overlap", True))
    owned = {name for name, _ in gm.named_parameters(remove_duplicate=False)}  # a stage holds only its own
    for fqn, pplan in plan.parameters.items():
        if fqn not in owned:
            continue
        if fqn in placed:
            first, placement = placed[fqn]
            if placement != (pplan.placement, pplan.optimizer_state or pplan.placement):
                raise AutoparError(
                    ErrorKind.UNSUPPORTED_OP,
                    f"tied parameters {first} and {fqn} (one tensor) were captured as two inputs and planned "
                    f"with different placements ({placement[0]} vs {pplan.placement}, optimizer states "
                    f"{placement[1]} vs {pplan.optimizer_state}); planning tied weights "
                    "as one is not supported yet: untie them, or plan with mesh_shape=(1,) for now")
            continue
        placed.update({name: (fqn, (pplan.placement, pplan.optimizer_state or pplan.placement))
                       for name in alias_of.get(fqn, [fqn])})
        owner, attr = _owner(gm, fqn)
        original = getattr(owner, attr)
        if isinstance(source.get(fqn), nn.Parameter) and isinstance(source[fqn], DTensor):
            # already lowered (passes.relower: the plan at other input shapes): the very
            # parameter an optimizer holds, its attributes and gradient hook already set
            for name in alias_of.get(fqn, [fqn]):
                setattr(*_owner(gm, name), source[fqn])
            continue
        full = source[fqn].detach() if fqn in source else original.detach()
        placed_value = full if isinstance(full, DTensor) else placer(fqn, full, pplan.state_spec)
        param = nn.Parameter(placed_value, requires_grad=original.requires_grad)
        if pl.owned_dim(pplan.spec) is not None:
            setattr(param, runtime.OWNED_ATTR, placer.owned(fqn, pplan.spec))
        if fqn in placer.row_orders:
            setattr(param, runtime.ROW_ORDER_ATTR, placer.row_orders[fqn])
        for name in alias_of.get(fqn, [fqn]):
            setattr(*_owner(gm, name), param)
        if sync_on_accumulate and param.requires_grad:  # a frozen parameter has no gradient to sync
            param.register_post_accumulate_grad_hook(gradient_sync)
    lowered_buffers = {name: b for name, b in model.named_buffers() if isinstance(b, DTensor)}
    for name, value in list(gm.named_buffers()):
        owner, attr = _owner(gm, name)
        value = source.get(name, lowered_buffers.get(name, value))
        owner._buffers[attr] = value if isinstance(value, DTensor) else distribute_tensor(
            value, mesh, dtensor_placements(pl.replicated(mesh.ndim)))
    for name in list(vars(gm)):
        value = getattr(gm, name)
        if isinstance(value, torch.Tensor) and not isinstance(value, (nn.Parameter, DTensor)):
            setattr(gm, name, runtime.replicate_constant(value, mesh))


class _Placer:
    """Distributes a full parameter as planned. An expert weight placed ``O`` on a mesh dim
    (passes.stack_experts) goes to its owner's sub-mesh — the mesh without that dim, at the
    owner's coordinate — and every rank builds every such sub-mesh, in the same order, the
    first time one is needed (process-group creation is collective)."""

    def __init__(self, mesh: DeviceMesh, captured: Captured, plan: Plan,
                 owner_meshes: dict[int, list[DeviceMesh]] | None = None) -> None:
        self.mesh = mesh
        members = expert_members(captured.graph)
        # experts placed in a balanced order: expert e in slot order.index(e) — a ModuleList's
        # expert on that slot's owner, a stacked weight's row e stored at that row
        self.row_orders: dict[str, list[int]] = {}
        for layer in plan.experts.values():
            if layer.get("order_applied"):
                relabel = Relabel.from_plan(layer["relabel"])
                self.row_orders.update({fqn: layer["order"] for fqn in relabel.permuted})
                slot = inverse_order(layer["order"])
                for name in {w.name for n in captured.graph.nodes if n.name in relabel.stacks
                             for w in n.args[0]} & members.keys():
                    expert, experts = members[name]
                    members[name] = (slot[expert], experts)
        self.members = {captured.parameter_of[name]: where for name, where in members.items()}
        self.table_owners = {fqn: table["owner"] for fqn, table in plan.sparse.items() if "owner" in table}
        self.submeshes = dict(owner_meshes or {})

    def __call__(self, fqn: str, full: torch.Tensor, spec: pl.Spec) -> DTensor:
        if fqn in self.row_orders:
            full = full[self.row_orders[fqn]]
        dim = pl.owned_dim(spec)
        if dim is None:
            return distribute_tensor(full, self.mesh, dtensor_placements(spec))
        rest = tuple(p for d, p in enumerate(spec) if d != dim) or (pl.R,)
        if dim not in self.submeshes:
            self.submeshes[dim] = _submeshes(self.mesh, dim)
        return distribute_tensor(full, self.submeshes[dim][self._owner(fqn, dim)], dtensor_placements(rest))

    def owned(self, fqn: str, spec: pl.Spec) -> tuple[DeviceMesh, int, int]:
        """(mesh, mesh dim placed ``O``, owner's coordinate on it) of expert weight ``fqn``."""
        dim = pl.owned_dim(spec)
        return self.mesh, dim, self._owner(fqn, dim)

    def _owner(self, fqn: str, dim: int) -> int:
        """The owner's coordinate on mesh dim ``dim``."""
        if fqn in self.table_owners:  # a table placed table-wise
            return self.table_owners[fqn]
        if fqn not in self.members:
            raise AutoparError(ErrorKind.BAD_PLAN, f"parameter {fqn} is placed \"O\" (on its owner only), but it is "
                               "not the weight of a batched expert in this model; re-plan this model")
        expert, experts = self.members[fqn]
        return owner(expert, experts, self.mesh.size(dim))


def _submeshes(mesh: DeviceMesh, dim: int) -> list[DeviceMesh]:
    """``mesh`` without mesh dim ``dim``, at each coordinate of that dim (a 1-D mesh gives
    one-device meshes). Collective: every rank of the world builds them, in the same order."""
    names = mesh.mesh_dim_names
    rest = tuple(n for d, n in enumerate(names) if d != dim) if names else None
    return [DeviceMesh(mesh.device_type, mesh.mesh.select(dim, k).reshape(-1) if mesh.ndim == 1
                       else mesh.mesh.select(dim, k), mesh_dim_names=rest or None)
            for k in range(mesh.size(dim))]


def owner_submeshes(plan: Plan, meshes: list[DeviceMesh]) -> list[dict[int, list[DeviceMesh]]]:
    """For each group's mesh (pipeline stages), the sub-meshes of every mesh dim, when some
    parameter of ``plan`` is placed ``O``; empty otherwise. Every rank calls it, in the same
    order, before lowering its own group (process-group creation is collective)."""
    if all(pl.owned_dim(p.spec) is None for p in plan.parameters.values()):
        return [{} for _ in meshes]
    return [{d: _submeshes(mesh, d) for d in range(mesh.ndim) if mesh.size(d) > 1} for mesh in meshes]


def _shards_from_meta(gm: torch.fx.GraphModule, plan: Plan, mesh: DeviceMesh, model: nn.Module,
                      aliases: dict[str, tuple[str, ...]], placer: _Placer) -> dict[str, DTensor]:
    """This rank's DTensor of every parameter and buffer ``gm`` holds, initialised by the
    model's own modules one at a time (passes.materialize)."""
    check_initialisable(model)
    wanted = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    wanted |= {name for name, _ in gm.named_buffers()}
    replicated = pl.replicated(mesh.ndim)
    placed = {}
    for tensors in materialized(model, torch.device(mesh.device_type)):
        for fqn, full in tensors.items():
            if fqn not in wanted:
                continue
            pplan = plan.parameters.get(fqn)
            value = placer(fqn, full.detach(), pplan.state_spec if pplan else replicated)
            for name in aliases.get(fqn, (fqn,)):
                placed[name] = value
    return placed


def stage_mesh(group, device_type: str) -> DeviceMesh:
    """The DeviceMesh of one device group of a plan (a ``StagePlan`` or ``ReplicaPlan``):
    its ranks in its mesh shape (collective: every rank builds it)."""
    return DeviceMesh(device_type, torch.tensor(group.ranks, device="cpu").reshape(group.mesh_shape),
                      mesh_dim_names=group.mesh_dim_names)


def group_meshes(groups: tuple, device_type: str) -> tuple[list[DeviceMesh], list[dist.ProcessGroup], int, int]:
    """Every group's DeviceMesh (pipeline stages: ``StagePlan``s, replicas: ``ReplicaPlan``s) and every lane's
    process group (the k-th rank of every group). Every rank builds all of them, in the same
    order, as process-group creation requires; returns them with this rank's group and lane."""
    meshes = [stage_mesh(g, device_type) for g in groups]
    lanes = [dist.new_group([g.ranks[k] for g in groups]) for k in range(len(groups[0].ranks))]
    rank = dist.get_rank()
    mine = next(i for i, g in enumerate(groups) if rank in g.ranks)
    return meshes, lanes, mine, groups[mine].ranks.index(rank)


def _owner(gm: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, attr = fqn.rpartition(".")
    return (gm.get_submodule(path) if path else gm), attr
