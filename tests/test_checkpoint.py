"""Sharded checkpoints the FSDP2 way: torch's ``get_state_dict(pmodel, optimizer)`` /
``set_state_dict`` with ``dcp.save`` / ``dcp.load``, across plans and world sizes (DCP
reshards on load). Trained 3 AdamW steps on 2 ranks under one plan, saved, loaded on 4 ranks
under another, trained 3 more: the parameters equal 6 steps of the single-process model —
the optimizer's moments and step count carried over. And ``autopar checkpoint convert``
turns the DCP folder into one ``torch.save`` file and back (torch's own format_utils)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import autopar
import autopar.cli
from distributed import run_world
from autopar.passes.runtime import full_value
import models
from models import MLP

STEPS, LR = 3, 1e-2


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP(16, 64, 8, layers=3)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 16, generator=generator), torch.randn(16, 8, generator=generator)


def _train(pmodel, optimizer, steps: range, batch=_batch) -> None:
    for step in steps:
        *inputs, target = batch(step)
        pmodel.step(*inputs, target=target)
        optimizer.step()
        optimizer.zero_grad()


def _save(pmodel, optimizer, folder: str) -> None:
    """The FSDP2 way: torch's get_state_dict, then dcp.save on every rank."""
    model_state, optimizer_state = get_state_dict(pmodel, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)


def _resume(pmodel, optimizer, folder: str) -> None:
    """get_state_dict for the state's shapes and placements, dcp.load into it, set_state_dict."""
    model_state, optimizer_state = get_state_dict(pmodel, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(pmodel, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _save_after_three_steps(folder: str, cluster: str, options: dict) -> str:
    pmodel = autopar.parallelize(_model(), (_batch(0)[0],), cluster=cluster, loss_fn=F.mse_loss, **options)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    _train(pmodel, optimizer, range(STEPS))
    _save(pmodel, optimizer, folder)
    return _kind(pmodel.plan)


def _kind(plan) -> str:
    if plan.stages:
        return f"{len(plan.stages)} stages"
    if plan.replicas:
        return f"{len(plan.replicas)} replicas"
    return "+".join(sorted({p.optimizer_state or p.placement for p in plan.parameters.values()}))


def _load_and_train_three_more(folder: str, cluster: str, options: dict) -> dict:
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them all
    pmodel = autopar.parallelize(MLP(16, 64, 8, layers=3), (_batch(0)[0],), cluster=cluster, loss_fn=F.mse_loss,
                                 **options)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    _resume(pmodel, optimizer, folder)
    _train(pmodel, optimizer, range(STEPS, 2 * STEPS))
    return {"kind": _kind(pmodel.plan), "params": {name: full_value(p).tolist() for name, p in pmodel.named_parameters()}}


def _reference(model, batch, steps: int, loss_fn=F.mse_loss) -> tuple[dict[str, torch.Tensor], dict]:
    """The single-process run: ``model`` after ``steps`` AdamW steps on ``batch(step)`` (inputs...,
    target); its parameters and AdamW first moments by name."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        *inputs, target = batch(step)
        loss_fn(model(*inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad()
    names = {id(p): name for name, p in model.named_parameters()}
    moments = {names[id(p)]: state["exp_avg"] for p, state in optimizer.state.items()}
    return dict(model.named_parameters()), moments


CLUSTERS = os.path.join(os.path.dirname(__file__), "clusters")
ROUND_TRIPS = {  # (saved on 2 ranks under, loaded on 4 ranks under): cluster, options, what the plan is
    "ddp_to_fsdp": (("2xcpu", {"configuration": "ddp"}, "R"), ("4xcpu", {"configuration": "fsdp"}, "S(0)")),
    "pipeline_to_zero2": ((os.path.join(CLUSTERS, "two_cpu_regions.yaml"), {"pipeline": True, "micro_batches": 2},
                           "2 stages"), ("4xcpu", {"configuration": "zero2"}, "S(0)")),
    "replicas_to_fsdp": ((os.path.join(CLUSTERS, "two_cpu_regions.yaml"), {"replicas": True}, "2 replicas"),
                         ("4xcpu", {"configuration": "fsdp"}, "S(0)")),
}


@pytest.mark.distributed
@pytest.mark.parametrize("trip", list(ROUND_TRIPS))
def test_a_checkpoint_saved_under_one_plan_loads_under_another_on_more_ranks(tmp_path, trip):
    (cluster_a, options_a, kind_a), (cluster_b, options_b, kind_b) = ROUND_TRIPS[trip]
    folder = str(tmp_path / "step3")
    assert run_world(2, _save_after_three_steps, folder, cluster_a, options_a) == kind_a
    loaded = run_world(4, _load_and_train_three_more, folder, cluster_b, options_b)
    assert loaded["kind"] == kind_b, loaded["kind"]
    reference, _ = _reference(_model(), _batch, 2 * STEPS)
    for name, values in loaded["params"].items():
        error = (torch.tensor(values) - reference[name]).abs().max().item()
        assert error < 1e-5, (trip, name, error)


def _moe_model(seed: int = 0, module_list: bool = False):
    """float64: the key biases' gradients are 0 up to round-off, which AdamW (eps 1e-8) would
    turn into visible steps in float32 — a difference of the runs, not of the checkpoint."""
    torch.manual_seed(seed)
    return models.MoEGPT(d=32, hidden=256, experts=8, skew=1.0, module_list=module_list).double()


def _moe_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randint(0, 64, (32, 8), generator=generator), torch.randint(0, 64, (32, 8), generator=generator)


def _next_token_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _moe_parallel(cluster: str, model):
    pmodel = autopar.parallelize(model, (_moe_batch(0)[0],), cluster=cluster, loss_fn=_next_token_loss,
                                 pipeline=False, replicas=False)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    return pmodel, optimizer


def _orders(plan) -> dict[str, list[int]]:
    return {name: layer["order"] for name, layer in plan.experts.items() if layer.get("order_applied")}


def _expert_placements(plan) -> set[str]:
    return {p.placement for name, p in plan.parameters.items() if ".moe." in name and "gate" not in name}


def _save_moe_after_three_steps(folder: str, module_list: bool) -> dict:
    pmodel, optimizer = _moe_parallel("2xcpu", _moe_model(module_list=module_list))
    _train(pmodel, optimizer, range(STEPS), _moe_batch)
    _save(pmodel, optimizer, folder)
    return {"orders": _orders(pmodel.plan), "placements": _expert_placements(pmodel.plan)}


def _load_moe_and_train_three_more(folder: str, module_list: bool) -> dict:
    pmodel, optimizer = _moe_parallel("4xcpu", _moe_model(seed=1, module_list=module_list))
    _resume(pmodel, optimizer, folder)
    _train(pmodel, optimizer, range(STEPS, 2 * STEPS), _moe_batch)
    return {"orders": _orders(pmodel.plan),
            "params": {name: full_value(p).tolist() for name, p in pmodel.named_parameters()}}


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the single-process read of the folder
@pytest.mark.parametrize("module_list", [False, True], ids=["stacked", "module_list"])
def test_experts_in_a_balanced_order_are_saved_in_the_model_s_order(tmp_path, module_list):
    """Expert parallelism with the experts in a load-balancing order — stacked ``(E, ...)``
    weights with their rows stored in that order, or a ModuleList's experts each whole on its
    slot's owner (placement ``O``): the checkpoint holds the model's order — read in one process it
    equals the single-process model's weights and AdamW moments after 3 steps — and, loaded on
    4 ranks under another plan, 3 more steps equal 6 single-process steps."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = str(tmp_path / "step3")
    saved_plan = run_world(2, _save_moe_after_three_steps, folder, module_list)
    orders = saved_plan["orders"]
    assert orders and any(order != sorted(order) for order in orders.values()), orders
    assert ("O" in saved_plan["placements"]) == module_list, saved_plan
    dcp_to_torch_save(folder, str(tmp_path / "step3.pt"))
    saved = torch.load(tmp_path / "step3.pt", weights_only=True)
    weights, moments = _reference(_moe_model(module_list=module_list), _moe_batch, STEPS, _next_token_loss)
    for name, weight in weights.items():  # the reordered stacked weights among them
        assert (saved["model"][name] - weight).abs().max().item() < 1e-10, name
        assert (saved["optimizer"]["state"][name]["exp_avg"] - moments[name]).abs().max().item() < 1e-10, name
    loaded = run_world(4, _load_moe_and_train_three_more, folder, module_list)
    assert loaded["orders"] != orders, loaded["orders"]  # another plan: its own order, or none
    reference, _ = _reference(_moe_model(module_list=module_list), _moe_batch, 2 * STEPS, _next_token_loss)
    for name, values in loaded["params"].items():
        error = (torch.tensor(values, dtype=torch.float64) - reference[name]).abs().max().item()
        assert error < 1e-10, (name, error)


BIG_TABLES = {"tables": (50000, 4096, 64, 16), "dim": 16, "hidden": 256}  # tests/test_sparse.py's table-wise DLRM


def _dlrm(seed: int = 0):
    torch.manual_seed(seed)
    return models.DLRM(**BIG_TABLES).double()


def _dlrm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dense, ids = models.dlrm_inputs(_dlrm(), batch=512, seed=step + 1)
    target = torch.randn(512, 1, generator=torch.Generator().manual_seed(100 + step), dtype=torch.float64)
    return dense.double(), ids, target


def _tables(plan) -> dict[str, str]:
    return {name: p.exchange for name, p in plan.parameters.items() if name.startswith("embeddings.")}


def _dlrm_parallel(cluster: str, model, **options):
    pmodel = autopar.parallelize(model, _dlrm_batch(0)[:2], cluster=cluster, loss_fn=F.mse_loss, pipeline=False,
                                 replicas=False, **options)
    return pmodel, torch.optim.AdamW(pmodel.parameters(), lr=LR)


def _save_dlrm_after_three_steps(folder: str) -> dict[str, str]:
    pmodel, optimizer = _dlrm_parallel("2xcpu", _dlrm())
    _train(pmodel, optimizer, range(STEPS), _dlrm_batch)
    _save(pmodel, optimizer, folder)
    return _tables(pmodel.plan)


def _load_dlrm_and_train_three_more(folder: str) -> dict:
    pmodel, optimizer = _dlrm_parallel("4xcpu", _dlrm(seed=1), mesh_shape=(2, 2))
    _resume(pmodel, optimizer, folder)
    _train(pmodel, optimizer, range(STEPS, 2 * STEPS), _dlrm_batch)
    return {"tables": _tables(pmodel.plan),
            "params": {name: full_value(p).tolist() for name, p in pmodel.named_parameters()}}


@pytest.mark.distributed
def test_tables_each_on_one_device_load_as_tables_split_another_way_on_more_ranks(tmp_path):
    """DLRM's big tables table-wise on 2 ranks (each whole on its owner, placement ``O``),
    saved after 3 steps, loaded on 4 ranks where they are replicated with their touched rows
    exchanged: 3 more steps equal 6 single-process steps (float64)."""
    folder = str(tmp_path / "step3")
    saved = run_world(2, _save_dlrm_after_three_steps, folder)
    assert [saved[f"embeddings.{t}.weight"] for t in (0, 1)] == ["table_wise"] * 2, saved
    loaded = run_world(4, _load_dlrm_and_train_three_more, folder)
    assert [loaded["tables"][f"embeddings.{t}.weight"] for t in (0, 1)] == ["sparse_allgather"] * 2, loaded["tables"]
    reference, _ = _reference(_dlrm(), _dlrm_batch, 2 * STEPS)
    for name, values in loaded["params"].items():
        error = (torch.tensor(values, dtype=torch.float64) - reference[name]).abs().max().item()
        assert error < 1e-10, (name, error)


def _save_memory(folder: str) -> dict:
    """Save an FSDP plan's model and AdamW state on this rank (2 ranks, weights split by
    rows) while a dispatch mode watches every tensor an op creates; returns the largest such
    tensor, the largest local shard, the bytes this rank wrote, and the whole state's bytes."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):  # a DTensor by its local piece: what this rank holds
                local = t.to_local() if isinstance(t, DTensor) else t
                if isinstance(local, torch.Tensor) and not local.is_meta:
                    self.bytes = max(self.bytes, local.untyped_storage().nbytes())
            return out

    torch.manual_seed(0)
    model = MLP(64, 512, 64, layers=3)
    pmodel = autopar.parallelize(model, (torch.randn(16, 64),), cluster="2xcpu", loss_fn=F.mse_loss,
                                 configuration="fsdp")
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    x, target = torch.randn(16, 64), torch.randn(16, 64)
    pmodel.step(x, target=target)
    optimizer.step()
    shards = [p.to_local() for p in pmodel.parameters()]
    whole = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights + two AdamW moments
    watch = Largest()
    with watch:
        model_state, optimizer_state = get_state_dict(pmodel, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    rank = torch.distributed.get_rank()
    written = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.startswith(f"__{rank}_"))
    return {"largest_created": watch.bytes, "largest_shard": max(t.untyped_storage().nbytes() for t in shards),
            "written": written, "whole": whole, "local": 3 * sum(t.numel() * t.element_size() for t in shards)}


@pytest.mark.distributed
def test_saving_a_sharded_plan_holds_and_writes_only_this_rank_s_shards(tmp_path):
    """torch's get_state_dict + dcp.save on an FSDP plan (2 ranks): no op makes a tensor larger
    than this rank's largest shard while saving (nothing is gathered), and rank 0 writes its
    shards of the weights and AdamW moments — half the whole state, not all of it."""
    found = run_world(2, _save_memory, str(tmp_path / "ckpt"))
    assert found["largest_created"] <= found["largest_shard"], found
    assert found["local"] == found["whole"] // 2
    assert found["local"] <= found["written"] <= found["local"] + 64 * 1024, found  # + DCP's per-file headers


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # this test's own single-process dcp calls
def test_checkpoint_convert_goes_from_dcp_to_one_file_and_back(tmp_path):
    folder, single, back = tmp_path / "dcp", tmp_path / "model.pt", tmp_path / "dcp_again"
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    assert autopar.cli.main(["checkpoint", "convert", str(folder), str(single)]) == 0
    loaded = torch.load(single, weights_only=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"] == 3
    assert autopar.cli.main(["checkpoint", "convert", str(single), str(back)]) == 0
    again = {"model": {"w": torch.zeros(2, 3)}, "step": 0}
    dcp.load(again, checkpoint_id=str(back), no_dist=True)
    assert torch.equal(again["model"]["w"], state["model"]["w"]) and again["step"] == 3
    assert oct(os.stat(single).st_mode & 0o777) == oct(0o666 & ~_umask())
    assert oct(os.stat(back).st_mode & 0o777) == oct(0o777 & ~_umask())


@pytest.mark.parametrize("case", ["exists", "not_dcp", "missing", "not_torch_save", "no_folder"])
def test_checkpoint_convert_refuses_bad_paths_by_name_and_writes_nothing(tmp_path, case, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a zip file at all")
    source, destination, said = {
        "exists": (garbage, plain, "already exists"),
        "not_dcp": (plain, tmp_path / "out.pt", "not a DCP checkpoint"),
        "missing": (tmp_path / "nothing", tmp_path / "out.pt", "does not exist"),
        "not_torch_save": (garbage, tmp_path / "out", "not a readable torch.save file"),
        "no_folder": (garbage, tmp_path / "missing" / "out", "does not exist"),
    }[case]
    before = sorted(os.listdir(tmp_path))
    assert autopar.cli.main(["checkpoint", "convert", str(source), str(destination)]) == 2
    assert said in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == before  # no temporary left behind


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
