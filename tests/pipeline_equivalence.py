"""Pipeline equivalence cases run inside each gloo rank: ``pmodel.step`` over stages and
micro-batches vs the single-process model trained on the whole batch."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
import models
from autopar.passes.recompute import SPAN_PREFIX
from autopar.passes.runtime import full_value
from equivalence import under_policy


def token_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _max_over_ranks(errors: dict) -> dict:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, errors)
    return {k: max(e[k] for e in gathered) for k in errors}


def check_pipeline(cluster_path: str, micro_batches: int | None = None, steps: int = 3, layers: int = 4,
                   batch: int = 8, schedule: str = "1F1B", options: dict | None = None, vocab: int = 64,
                   moe: dict | None = None) -> dict:
    """Max abs errors of loss, grads (every step), params after ``steps`` SGD steps, and
    the evaluation output; plus the plan's shape. ``options`` (to parallelize) replace the
    pipeline ones, e.g. ``{"replicas": True, "batch_split": (6, 2)}``; ``moe`` (MoEGPT's
    arguments) trains the MoE transformer instead of the GPT."""
    torch.manual_seed(0)
    model = models.MoEGPT(vocab=vocab, layers=layers, **moe) if moe is not None else models.GPT(vocab=vocab, layers=layers)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, vocab, (batch, 16), generator=g), torch.randint(0, vocab, (batch, 16), generator=g))
               for _ in range(steps)]
    options = options or {"pipeline": True, "micro_batches": micro_batches, "schedule": schedule}
    forward = reference if "mixed_precision" not in options else under_policy(reference, options["mixed_precision"])
    pmodel = autopar.parallelize(model, (batches[0][0],), cluster=cluster_path, loss_fn=token_loss, **options)
    ref_params = dict(reference.named_parameters())
    own = dict(pmodel.named_parameters())
    assert own and set(own) <= set(ref_params), set(own) - set(ref_params)
    # SGD, not Adam: Adam turns rounding noise in gradients that are zero in exact arithmetic
    # (the key bias under softmax) into full-size steps, which says nothing about the plan
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    errors = {"loss": 0.0, "grad": 0.0, "param": 0.0, "output": 0.0}
    for x, y in batches:
        loss = pmodel.step(x, target=y)
        ref_loss = token_loss(forward(x), y)
        ref_loss.backward()
        errors["loss"] = max(errors["loss"], (loss - ref_loss.detach()).abs().item())
        for name, p in own.items():
            grad = full_value(p, grad=True)  # an expert weight's gradient lives on its owner only
            gap = float("inf") if grad is None else (grad - ref_params[name].grad).abs().max().item()
            errors["grad"] = max(errors["grad"], gap)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for name, p in own.items():
        errors["param"] = max(errors["param"], (full_value(p).detach() - ref_params[name].detach()).abs().max().item())
    with torch.no_grad():
        errors["output"] = (pmodel(batches[0][0]) - forward(batches[0][0])).abs().max().item()
    errors["sliced"] = float("send_slice(" in pmodel.code or "receive_slice(" in pmodel.code)
    errors["checkpointed"] = float(SPAN_PREFIX in pmodel.code)  # a layer run under torch.utils.checkpoint
    errors = _max_over_ranks(errors)
    covered = [None] * dist.get_world_size()
    dist.all_gather_object(covered, sorted(own))
    plan = pmodel.plan
    errors["all_params_covered"] = sorted({n for names in covered for n in names}) == sorted(ref_params)
    errors["stages"] = [list(st.layers) for st in plan.stages]
    errors["stage_meshes"] = [list(st.mesh_shape) for st in plan.stages]
    errors["micro_batches"] = plan.micro_batches
    errors["recompute"] = dict(plan.recompute)
    errors["batch_split"] = [r.batch for r in plan.replicas]
    errors["between_groups"] = {fqn: t.get("between_groups") for fqn, t in plan.sparse.items()}
    errors["experts"] = {module: layer["exchange"] for module, layer in plan.experts.items()}
    errors["orders_applied"] = {module: layer["order"] for module, layer in plan.experts.items()
                                if layer.get("order_applied")}
    return errors


def check_pipelines(cases: list[tuple]) -> list[dict]:
    """:func:`check_pipeline` for each argument tuple in ``cases``, in one process group."""
    return [check_pipeline(*case) for case in cases]
