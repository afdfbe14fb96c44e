"""The memoised decomposition (passes.decompose) gives the graph run_decompositions() gives."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

from autopar.passes.decompose import decompose, decomposition_table
from models import GPT, MLP, Block, ConvNet


class InPlace(nn.Module):
    """In-place op and a mutated buffer: these need functionalization (full retrace)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        y = self.lin(x)
        y.relu_()
        return y


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(y.mean(dim=(2, 3))).softmax(-1)


class Written(nn.Module):
    """A tensor built by slice assignment into ``new_empty`` (DeepSeek-V3's attention builds its
    keys so): functionalized, a ``copy`` and ``slice_scatter``s, which passes.decompose rewrites."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 6), nn.Linear(8, 2)

    def forward(self, x):
        out = x.new_empty(*x.shape[:-1], 8)
        out[..., :6] = self.a(x)
        out[..., 6:] = self.b(x[:, :1])  # broadcast over the rows
        return out * 2


CASES = {
    "mlp": lambda: (MLP(), (torch.randn(4, 16),)),
    "block": lambda: (Block(), (torch.randn(2, 8, 32),)),
    "gpt": lambda: (GPT(vocab=64, d=32, layers=3, heads=4, max_len=16), (torch.randint(0, 64, (2, 16)),)),
    "convnet": lambda: (ConvNet(), (torch.randn(2, 3, 16, 16),)),
    "normed": lambda: (Normed(), (torch.randn(2, 3, 10, 10),)),
    "inplace": lambda: (InPlace(), (torch.randn(4, 8),)),
    "written": lambda: (Written(), (torch.randn(4, 3, 8),)),
}


def _ops(program: torch.export.ExportedProgram) -> list[tuple]:
    def shape(v):
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None
    return [(str(n.target), shape(n.meta.get("val")))
            for n in program.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_ops_as_run_decompositions(name):
    model, inputs = CASES[name]()
    expected = torch.export.export(model, inputs, strict=False).run_decompositions(decomposition_table())
    got = decompose(torch.export.export(model, inputs, strict=False))
    assert _ops(got) == _ops(expected)
    torch.manual_seed(0)
    want = expected.module()(*inputs)
    torch.manual_seed(0)
    assert torch.equal(got.module()(*inputs), want)


def test_repeated_layers_trace_once(monkeypatch):
    """Three identical blocks: later layers reuse the cached decompositions."""
    import autopar.passes.decompose as module

    traced = []
    original = module._trace
    monkeypatch.setattr(module, "_trace", lambda node, *a: traced.append(node.target) or original(node, *a))
    model, inputs = CASES["gpt"]()
    decompose(torch.export.export(model, inputs, strict=False))
    linear = [t for t in traced if t == torch.ops.aten.linear.default]
    assert 0 < len(linear) <= 5  # qkv, proj, fc, out (one per shape) and the head, not 3 × 4 + 1
    assert operator.getitem not in traced


def test_slice_assignments_become_cat_and_clone_with_the_same_values_and_grads():
    """No ``copy`` nor ``slice_scatter`` left (autograd has no derivative for ``aten::copy``, and
    ``slice_scatter``'s backward mixes a plain zeros tensor into DTensor gradients); values and
    gradients as the model's own."""
    model, (x,) = CASES["written"]()
    got = decompose(torch.export.export(model, (x,), strict=False))
    targets = {n.target for n in got.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.cat.default in targets
    assert not targets & {torch.ops.aten.copy.default, torch.ops.aten.slice_scatter.default}, targets
    module = got.module()
    inputs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = module(inputs[0]), model(inputs[1])
    torch.testing.assert_close(out, want)
    (out * want.detach()).sum().backward()
    (want * want.detach()).sum().backward()
    torch.testing.assert_close(inputs[0].grad, inputs[1].grad)
