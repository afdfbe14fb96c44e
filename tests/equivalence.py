"""Equivalence cases run inside each gloo rank: parallel model vs the single-process model."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autopar
import models
from autopar.passes.runtime import OWNED_ATTR, ROW_ORDER_ATTR, full_value


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _inputs(kind: str, batch: int):
    g = torch.Generator().manual_seed(1)
    if kind == "tokens":
        return (torch.randint(0, 64, (batch, 8), generator=g),)
    if kind == "image":
        return (torch.randn(batch, 3, 16, 16, generator=g),)
    if kind == "seq":
        return (torch.randn(batch, 8, 32, generator=g),)
    if kind.startswith("long:"):  # long:T:D — sequences of T positions of width D
        length, width = (int(v) for v in kind[5:].split(":"))
        return (torch.randn(batch, length, width, generator=g),)
    if kind.startswith("seq:"):  # seq:D — sequences of 8 positions of width D
        return (torch.randn(batch, 8, int(kind[4:]), generator=g),)
    if kind.startswith("vec:"):  # vec:D — rows of width D
        return (torch.randn(batch, int(kind[4:]), generator=g),)
    return (torch.randn(batch, 16, generator=g),)


def check_case(model_name: str, kwargs: dict, input_kind: str, batch: int, options: dict,
               dtype: str = "float32", steps: int = 3) -> dict:
    """Returns max abs errors of outputs, loss, grads and params after ``steps`` AdamW steps."""
    torch.manual_seed(0)
    if model_name.startswith("zoo:"):  # a third-party model with its own example inputs
        import zoo
        model, raw_inputs = zoo.build(model_name.removeprefix("zoo:"))
    elif input_kind == "dlrm":
        model = models.DLRM(**kwargs)
        raw_inputs = models.dlrm_inputs(model, batch)
    elif input_kind == "jagged":
        model = models.JaggedDLRM(**kwargs)
        raw_inputs = models.jagged_dlrm_inputs(model, batch)
    else:
        model, raw_inputs = getattr(models, model_name)(**kwargs), _inputs(input_kind, batch)
    model = model.to(getattr(torch, dtype))
    reference = copy.deepcopy(model)
    inputs = tuple(x.to(getattr(torch, dtype)) if x.is_floating_point() else x for x in raw_inputs)
    options = dict(options)
    fraction = options.pop("memory_fraction", None)
    made = None  # rank 0's plan for these options, when the squeeze below already made it
    if fraction is not None:  # squeeze memory below the unconstrained plan's footprint to force sharding
        limit = [None, options.get("recompute"), None]
        if dist.get_rank() == 0:
            same = {"cluster": options["cluster"], "mesh_shape": options.get("mesh_shape"),
                    "mixed_precision": options.get("mixed_precision")}
            ample = autopar.plan(model, inputs, **same)
            limit[0] = int(fraction * ample.memory.total_bytes)
            if limit[1] is None:  # met by sharding rather than by recomputing, where sharding alone fits
                try:
                    squeezed = autopar.plan(model, inputs, **same, memory_limit=limit[0], recompute="none")
                    limit[1] = "none"
                    if set(options) <= set(same):  # the plan parallelize would make: not made twice
                        limit[2] = squeezed.to_json()
                except autopar.AutoparError:
                    limit[1] = "auto"
        dist.broadcast_object_list(limit, src=0)
        options["memory_limit"], options["recompute"], made = limit
    if made is not None:
        pmodel = autopar.apply(model, autopar.Plan.from_json(made))
    else:
        pmodel = autopar.parallelize(model, inputs, **options)
    params = dict(pmodel.named_parameters(remove_duplicate=False))  # tied weights under every name
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    assert set(params) == set(ref_params), set(params) ^ set(ref_params)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_forward = reference if "mixed_precision" not in options else under_policy(reference, options["mixed_precision"])
    errors = {"output": 0.0, "loss": 0.0, "grad": 0.0, "param": 0.0, "param_flat": 0.0}
    largest_grad = {name: torch.zeros_like(ref_params[name]) for name in params}  # per element, over steps
    for _ in range(steps):
        out, ref_out = pmodel(*inputs), ref_forward(*inputs)
        loss, ref_loss = out.float().square().mean(), ref_out.float().square().mean()
        loss.backward()
        ref_loss.backward()
        errors["output"] = max(errors["output"], (out - ref_out).abs().max().item())
        errors["output_scale"] = max(errors.get("output_scale", 0.0), ref_out.abs().max().item())
        errors["loss"] = max(errors["loss"], abs(loss.item() - ref_loss.item()))
        for name, p in params.items():
            ref_grad = ref_params[name].grad
            grad = full_value(p, grad=True)  # an expert weight's gradient lives on its owner only
            if (grad is None) != (ref_grad is None):
                errors.setdefault("missing_grad", []).append(name)
                continue
            if ref_grad is not None:
                errors["grad"] = max(errors["grad"], (grad - ref_grad).abs().max().item())
                errors["grad_scale"] = max(errors.get("grad_scale", 0.0), ref_grad.abs().max().item())
                largest_grad[name] = torch.maximum(largest_grad[name], ref_grad.abs())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    state = pmodel.full_state_dict()
    for name in params:
        diff = (state[name] - ref_params[name].detach()).abs()
        # elements whose gradient is round-off only (an attention key bias: analytically zero)
        # move by AdamW's normalised noise, up to lr per step; they are reported apart
        flat = largest_grad[name] < 1e-6
        for key, part in (("param_flat", diff[flat]), ("param", diff[~flat])):
            if part.numel() and part.max().item() > errors[key]:
                errors[key], errors[key + "_worst"] = part.max().item(), name
    errors["placements"] = sorted({str(tuple(p.placements)) for p in params.values()})
    errors["output_dtype"] = str(out.dtype).removeprefix("torch.")
    errors["master_dtypes"] = sorted({str(p.dtype).removeprefix("torch.") for p in params.values()})
    code = all_code(pmodel)
    # weights cast for compute: a compute copy, or a gather that casts before it moves (ZeRO-2, FSDP)
    errors["compute_copies"] = code.count("compute_copy(") + code.count(", torch.bfloat16, torch.float32)")
    errors["fused_attention"] = code.count("local_attention(")
    errors["attention_outputs"] = sorted({node.outputs[0] for node in pmodel.plan.nodes.values()
                                          if "scaled_dot_product_attention" in node.op})
    errors["attention_exchanges"] = sorted({node.exchange for node in pmodel.plan.nodes.values()
                                            if "scaled_dot_product_attention" in node.op})
    errors["norm_outputs"] = sorted({node.outputs[0] for node in pmodel.plan.nodes.values() if "layer_norm" in node.op})
    errors["outputs_placed"] = pmodel.plan.outputs
    errors["redistributes"] = code.count("redistribute(")
    errors["checkpointed"] = code.count("checkpointed(")  # layers recomputed in backward
    errors["exchanges"] = sorted({p.exchange for p in pmodel.plan.parameters.values()})
    errors["zero"] = sum(p.zero for p in pmodel.plan.parameters.values())  # ZeRO-2 parameters
    errors["weight_gathers"] = code.count(".gather(")  # gathered again for backward (FSDP)
    # experts placed in a balanced order (passes.expert_order): each weight's owner, and the orders
    errors["owners"] = {name: getattr(p, OWNED_ATTR)[2] for name, p in params.items() if hasattr(p, OWNED_ATTR)}
    errors["orders_applied"] = {module: layer["order"] for module, layer in pmodel.plan.experts.items()
                                if layer.get("order_applied")}
    errors["relabels"] = [line.strip() for line in code.splitlines() if "relabel_experts(" in line]
    errors["dispatches"] = code.count("dispatch_experts(")  # experts gathered per token, rows sent to owners
    # stacked experts stored in a balanced order: the rows as stored (slot j: expert order[j])
    # against the reference's rows in that order
    errors["row_orders"] = {}
    for name, p in params.items():
        order = getattr(p, ROW_ORDER_ATTR, None)
        if order is not None:
            stored = _full(p.detach())
            errors["row_orders"][name] = (order, (stored - ref_params[name].detach()[order]).abs().max().item())
    return errors


def all_code(pmodel) -> str:
    """The lowered module's code and that of the layers it checkpoints (passes.recompute)."""
    gm = pmodel.lowered[0]
    return "".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


def under_policy(model: torch.nn.Module, precision: str):
    """``model``'s forward as FSDP2's MixedPrecisionPolicy runs it on one process: its fp32
    parameters (the masters the optimizer steps) cast to the compute dtype — batch norm's kept
    in theirs, as autopar keeps them (passes.capture.computing_in) —, floating inputs cast,
    gradients flowing back onto the fp32 parameters."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    own = {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
           if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) for name, _ in module.named_parameters(recurse=False)}

    def forward(*inputs):
        weights = {name: p.to(dtype) if p.is_floating_point() and name not in own else p
                   for name, p in model.named_parameters()}
        cast = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
        return torch.func.functional_call(model, weights, cast)
    return forward


def assert_equivalent(cases: list, results: list, bound=lambda case, key: 1e-5) -> set[str]:
    """Every case's errors within ``bound(case, key)`` and no gradient missing; returns the
    gradient exchanges the plans used (``ParameterPlan.exchange``)."""
    exchanges = set()
    for case, errors in zip(cases, results, strict=True):
        for key in ("output", "loss", "grad", "param", "param_flat"):
            assert errors[key] <= bound(case, key), (case[0], case[1], case[4], key, errors)
        assert "missing_grad" not in errors, (case, errors)
        exchanges |= set(errors["exchanges"])
    return exchanges


def run_cases(cases: list, contract: bool = False) -> list:
    results = []
    for case in cases:
        results.append(check_case(*case))
        dist.barrier()
    if contract:
        results.append(check_contract())
    return results


def check_contract() -> dict:
    """API contract inside a process group: world-size mismatch and the readable lowered code."""
    result = {}
    model, x = models.MLP(), torch.randn(8, 16)
    plan = autopar.plan(model, (x,), cluster="4xH100")
    try:
        autopar.apply(model, plan)
        result["mismatch"] = "no error"
    except autopar.AutoparError as exc:
        result["mismatch"] = f"{exc.kind.value}: {exc.message}"
    pmodel = autopar.parallelize(model, (torch.randn(64, 16),), cluster="2xH100")
    result["code"] = pmodel.code
    result["is_parallel_module"] = isinstance(pmodel, autopar.ParallelModule)
    # one training API: step() is loss_fn(pmodel(x), t).backward() for a plan without stages
    torch.manual_seed(0)
    model, x, target = models.MLP(), torch.randn(16, 16), torch.randn(16, 8)
    reference = copy.deepcopy(model)
    pmodel = autopar.parallelize(model, (x,), cluster="2xH100", loss_fn=torch.nn.functional.mse_loss)
    loss = pmodel.step(x, target=target)
    ref_loss = torch.nn.functional.mse_loss(reference(x), target)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    result["step_loss"] = abs(loss.item() - ref_loss.item())
    result["step_grad"] = max((_full(p.grad) - ref[n].grad).abs().max().item() for n, p in pmodel.named_parameters())
    # a language model's loss on logits left split along the batch (plan.outputs): as one process
    torch.manual_seed(0)
    gpt, tokens = models.GPT(layers=2), torch.randint(0, 64, (8, 16))
    gpt_reference = copy.deepcopy(gpt)

    def cross_entropy(logits, t):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), t.flatten(0, 1))
    lm = autopar.parallelize(gpt, (tokens,), cluster="2xH100", loss_fn=cross_entropy, configuration="ddp")
    loss = lm.step(tokens, target=tokens)
    ref_loss = cross_entropy(gpt_reference(tokens), tokens)
    ref_loss.backward()
    ref = dict(gpt_reference.named_parameters())
    result["lm_outputs"] = lm.plan.outputs
    result["lm_step_loss"] = abs(loss.item() - ref_loss.item())
    result["lm_step_grad"] = max((_full(p.grad) - ref[n].grad).abs().max().item() for n, p in lm.named_parameters())
    try:
        autopar.parallelize(model, (x,), cluster="2xH100").step(x, target=target)
        result["no_loss_fn"] = "no error"
    except autopar.AutoparError as exc:
        result["no_loss_fn"] = exc.message
    return result


# autograd nodes that only cast or view: a saved tensor reached from a parameter through these
# alone is a working copy of a weight (mixed precision), not an activation
_CAST_OR_VIEW = ("ToCopyBackward0", "PermuteBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0",
                 "UnsafeViewBackward0", "AliasBackward0", "ExpandBackward0")


def _weight_copy(t) -> bool:
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _CAST_OR_VIEW:
        nexts = [f for f, _ in fn.next_functions if f is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
        if type(fn).__name__ == "AccumulateGrad":
            return True
    return False


def forward_saving(pmodel, *inputs):
    """``pmodel(*inputs)`` and the bytes autograd keeps for backward during it on this rank
    (each storage once; the parameters' own storages and their cast working copies left out)."""
    weights = {p.to_local().untyped_storage().data_ptr() for p in pmodel.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        ptr = local.untyped_storage().data_ptr()
        if ptr not in weights and not _weight_copy(t):
            seen[ptr] = max(seen.get(ptr, 0), local.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pmodel(*inputs)
    return out, sum(seen.values())
