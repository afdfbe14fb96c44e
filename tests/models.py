"""Small models shared by the tests (and examples): MLP, transformer block, GPT, conv net."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 8, layers: int = 2) -> None:
        super().__init__()
        dims = [d_in] + [hidden] * layers + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.feed_forward(self.ln2(x))

    def attention(self, x):
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def feed_forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class ExplicitAttentionBlock(Block):
    """The same block with attention written out as softmax(q·kᵀ/√d)·v (no fused kernel)."""

    def attention(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class GQAttention(nn.Module):
    """Grouped-query attention (``heads`` query heads sharing ``kv_heads`` key/value heads)
    through the fused kernel: causal, or with a padding mask of shape (B, 1, 1, T)
    (``mask=True``), or with the causal mask written out (``mask="causal"``, ``causal=False``)."""

    def __init__(self, d: int = 32, heads: int = 4, kv_heads: int = 2, causal: bool = True,
                 mask: bool | str = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.causal, self.mask = heads, kv_heads, causal, mask
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * (d // heads))
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        e = c // self.heads
        q = self.q(x).view(b, t, self.heads, e).transpose(1, 2)
        k, v = (z.view(b, t, self.kv_heads, e).transpose(1, 2) for z in self.kv(x).split(self.kv_heads * e, dim=2))
        mask = None
        if self.mask == "causal":  # written out as Hugging Face models pass it: (1, 1, T, T), no is_causal
            positions = torch.arange(t, device=x.device)
            mask = (positions.view(1, t) <= positions.view(t, 1)).view(1, 1, t, t)
        elif self.mask:  # the last position of every other sequence is padding
            keep = torch.ones(b, 1, 1, t, dtype=torch.bool, device=x.device)
            mask = keep.index_fill(3, torch.tensor([t - 1], device=x.device), False) | (
                torch.arange(b, device=x.device) % 2 == 0).view(b, 1, 1, 1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 4, heads: int = 4, max_len: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class MoE(nn.Module):
    """Top-k routed experts in GShard's grouped form, so every shape is fixed: the tokens are
    cut into ``groups``; in each group every expert takes at most ``capacity`` tokens (first
    choices queue before second choices, overflow is dropped); one-hot dispatch and combine
    tensors move tokens to expert slots and back; the experts are stacked weights (E, d, h)
    applied by batched matmuls. ``skew`` > 0 gives the router a bias falling over the experts,
    so the first experts take most tokens (a skewed load)."""

    def __init__(self, d: int = 32, hidden: int = 64, experts: int = 4, top_k: int = 2, groups: int = 4,
                 capacity_factor: float = 1.5, skew: float = 0.0) -> None:
        super().__init__()
        self.experts, self.top_k, self.groups, self.capacity_factor = experts, top_k, groups, capacity_factor
        self.router = nn.Linear(d, experts, bias=skew > 0)
        if skew > 0:
            with torch.no_grad():
                self.router.bias.copy_(skew * torch.linspace(1, -1, experts))
        self.w_in = nn.Parameter(torch.randn(experts, d, hidden) * d ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, d) * hidden ** -0.5)

    def forward(self, x):  # (B, T, d)
        b, t, d = x.shape
        tokens = x.reshape(self.groups, b * t // self.groups, d)  # (G, S, d)
        s, e, k = tokens.shape[1], self.experts, self.top_k
        capacity = max(1, int(self.capacity_factor * k * s / e))
        probs = self.router(tokens).softmax(-1)  # (G, S, E)
        weights, chosen = probs.topk(k, dim=-1)  # (G, S, k)
        choice = F.one_hot(chosen, e).to(x.dtype).transpose(1, 2).reshape(self.groups, k * s, e)  # first choices first
        slot = (choice.cumsum(1) - 1) * choice  # queue position of each (token, choice) at its expert
        slots = torch.arange(capacity, device=x.device)
        dispatch = choice.unsqueeze(-1) * (slot.unsqueeze(-1) == slots).to(x.dtype)  # (G, kS, E, C)
        dispatch = dispatch.reshape(self.groups, k, s, e, capacity).sum(1)  # (G, S, E, C)
        gates = (weights.unsqueeze(-1) * F.one_hot(chosen, e).to(x.dtype)).sum(2)  # (G, S, E)
        combine = gates.unsqueeze(-1) * dispatch
        expert_in = torch.einsum("gsec,gsd->egcd", dispatch, tokens)  # (E, G, C, d)
        expert_out = self.apply_experts(expert_in)
        return torch.einsum("gsec,egcd->gsd", combine, expert_out).reshape(b, t, d)

    def apply_experts(self, expert_in):  # (E, G, C, d)
        hidden = F.gelu(torch.einsum("egcd,edh->egch", expert_in, self.w_in))
        return torch.einsum("egch,ehd->egcd", hidden, self.w_out)


class Expert(nn.Module):
    """One feed-forward expert of :class:`ModuleListMoE`."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class ModuleListMoE(MoE):
    """:class:`MoE`'s routing with one module per expert (DeepSpeed-MoE / fairseq style): each
    expert takes its slice of the dispatched tokens, the outputs are stacked."""

    def __init__(self, d: int = 32, hidden: int = 64, experts: int = 4, top_k: int = 2, groups: int = 4,
                 capacity_factor: float = 1.5, skew: float = 0.0) -> None:
        super().__init__(d, hidden, experts, top_k, groups, capacity_factor, skew)
        del self.w_in, self.w_out
        self.expert = nn.ModuleList(Expert(d, hidden) for _ in range(experts))

    def apply_experts(self, expert_in):  # (E, G, C, d); each expert takes its (G·C, d) tokens
        tokens = expert_in.reshape(expert_in.shape[0], -1, expert_in.shape[-1])
        return torch.stack([expert(tokens[e]) for e, expert in enumerate(self.expert)]).reshape(expert_in.shape)


class DenseRoutedMoE(nn.Module):
    """A ModuleList MoE where every expert sees every token and top-2 gates combine them; the
    router is skewed (the first experts take most tokens). ``expose``: "prob0" adds the
    router's probability of expert 0 to the output (a label-dependent use of the scores, like
    an auxiliary loss); "prob0+gates" besides takes the gates from the full probabilities (they
    must then be in the experts' labels for the output and in slots for the gates: no
    relabelling of the experts keeps that function)."""

    def __init__(self, expose: str = "", d: int = 256, experts: int = 4) -> None:
        super().__init__()
        self.expose, self.experts = expose, experts
        self.router = nn.Linear(d, experts)
        with torch.no_grad():
            self.router.bias.copy_(torch.linspace(2, -2, experts))
        self.expert = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):  # (T, d)
        probs = self.router(x).softmax(-1)
        weights, chosen = probs.topk(2, dim=-1)
        chosen = F.one_hot(chosen, self.experts).to(x.dtype)  # (T, k, E)
        gates = probs * chosen.sum(1) if self.expose == "prob0+gates" else (weights.unsqueeze(-1) * chosen).sum(1)
        routed = x.unsqueeze(0).expand(self.experts, *x.shape)
        out = torch.einsum("te,etd->td", gates, torch.stack([m(routed[e]) for e, m in enumerate(self.expert)]))
        return out + probs[:, :1] if self.expose else out


class GatheredMoE(nn.Module):
    """Experts gathered per token, as transformers' Mixtral does with its "batched_mm"
    experts: every (token, choice) row takes a copy of its expert's weights (``w[ids]``) and
    is multiplied on its own (``bmm``); SwiGLU experts, top-k gates renormalised, a residual.
    ``skew`` > 0 biases the router towards the first experts; ``mix_rows`` centres the hidden
    rows over all rows (each row then depends on the others)."""

    def __init__(self, d: int = 32, hidden: int = 64, experts: int = 8, top_k: int = 2, skew: float = 0.0,
                 mix_rows: bool = False) -> None:
        super().__init__()
        self.top_k, self.mix_rows = top_k, mix_rows
        self.router = nn.Linear(d, experts, bias=skew > 0)
        if skew > 0:
            with torch.no_grad():
                self.router.bias.copy_(skew * torch.linspace(1, -1, experts))
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * hidden, d) * d ** -0.5)
        self.down = nn.Parameter(torch.randn(experts, d, hidden) * hidden ** -0.5)

    def forward(self, x):  # (T, d)
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        rows = x.repeat_interleave(self.top_k, dim=0)  # one row per (token, choice)
        ids = chosen.reshape(-1)
        gate, up = torch.bmm(self.gate_up[ids], rows.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        if self.mix_rows:
            hidden = hidden - hidden.mean(0)
        out = torch.bmm(self.down[ids], hidden.unsqueeze(-1)).squeeze(-1)
        out = out * weights.reshape(-1, 1)
        return x + out.view(x.shape[0], self.top_k, -1).sum(1)


class GroupedMoE(nn.Module):
    """Grouped-GEMM experts, as transformers' default "grouped_mm" experts and torchtitan's
    MoE run them: the (token, choice) rows sorted by expert, each expert's block multiplied by
    ``torch._grouped_mm`` (block ends: cumulative counts), the rows put back in their
    order. ``mix_rows`` centres the hidden rows over all rows (each row then depends on the
    others, so the sort matters and the layer must stay as written)."""

    def __init__(self, d: int = 32, hidden: int = 16, experts: int = 4, top_k: int = 2, mix_rows: bool = False) -> None:
        super().__init__()
        self.top_k, self.experts, self.mix_rows = top_k, experts, mix_rows
        self.router = nn.Linear(d, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, d, 2 * hidden) * d ** -0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, d) * hidden ** -0.5)

    def forward(self, x):  # (T, d)
        weights, chosen = self.router(x).softmax(-1).topk(self.top_k, dim=-1)
        ids, order = torch.sort(chosen.reshape(-1))
        rows = x[order // self.top_k]
        counts = torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1)  # bincount's shape is data's
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(rows, self.gate_up, offs=offs).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        if self.mix_rows:
            hidden = hidden - hidden.mean(0)
        out = torch._grouped_mm(hidden, self.down, offs=offs) * weights.reshape(-1)[order].unsqueeze(-1)
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.shape[0])
        return x + out[restore].view(x.shape[0], self.top_k, -1).sum(1)


class MoEBlock(Block):
    """Pre-norm transformer block whose feed-forward is a mixture of experts."""

    def __init__(self, d: int = 32, heads: int = 4, experts: int = 4, hidden: int = 64, groups: int = 4,
                 capacity_factor: float = 1.5, module_list: bool = False, skew: float = 0.0) -> None:
        super().__init__(d, heads)
        del self.fc, self.out
        self.moe = (ModuleListMoE if module_list else MoE)(d, hidden, experts, groups=groups,
                                                           capacity_factor=capacity_factor, skew=skew)

    def feed_forward(self, x):
        return self.moe(x)


class MoEGPT(nn.Module):
    """A small MoE transformer: token embedding, MoE blocks, head."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, experts: int = 4, hidden: int = 64,
                 groups: int = 4, capacity_factor: float = 1.5, module_list: bool = False, skew: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MoEBlock(d, 4, experts, hidden, groups, capacity_factor, module_list, skew)
                                    for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class NormConvNet(nn.Module):
    """Convolutions with batch norm (running statistics, kept in fp32 under mixed precision)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x):  # (B, 3, 16, 16)
        x = F.max_pool2d(F.relu(self.bn1(self.c1(x))), 2)
        x = F.avg_pool2d(F.relu(self.bn2(self.c2(x))), 2)
        return self.fc(x.flatten(1))


class ConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x):  # (B, 3, 16, 16)
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.avg_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(x.flatten(1))


def tiny_mlp():
    """Factory for CLI tests: ``autopar plan models:tiny_mlp``."""
    torch.manual_seed(0)
    return MLP(), (torch.randn(8, 16),)


def tiny_gpt():
    """Factory for CLI tests of pipeline plans: ``autopar plan models:tiny_gpt``."""
    torch.manual_seed(0)
    return GPT(layers=4), (torch.randint(0, 64, (8, 16)),)


class DLRM(nn.Module):
    """DLRM-like: embedding-bag tables of different sizes (fixed bags), a bottom MLP for dense
    features, pairwise dot-product interaction and a top MLP."""

    def __init__(self, tables: tuple[int, ...] = (4096, 1024, 64, 16), dim: int = 8, dense: int = 4,
                 hidden: int = 16) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for rows in tables)
        pairs = (len(tables) + 1) * len(tables) // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.tables = tables

    def forward(self, dense, ids):  # dense (B, F); ids (T, B, L)
        x = self.bottom(dense)
        features = torch.stack([x] + [emb(i) for emb, i in zip(self.embeddings, ids)], dim=1)
        scores = torch.bmm(features, features.transpose(1, 2))
        i, j = torch.triu_indices(features.shape[1], features.shape[1], offset=1)
        return self.top(torch.cat([x, scores[:, i, j]], dim=1))


def dlrm_inputs(model: DLRM, batch: int = 8, bag: int = 4, seed: int = 1, hot: int = 6) -> tuple:
    """Dense features and ids drawn from ``hot`` rows spread over each table (skewed access)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(0, min(hot, rows), (batch, bag), generator=g) * (rows // min(hot, rows))
                       for rows in model.tables])
    return torch.randn(batch, model.bottom[0].in_features, generator=g), ids


class JaggedDLRM(nn.Module):
    """DLRM fed as DLRM and TorchRec feed it: each table's ids flat (1-D) with offsets marking
    bags of varying size (empty ones too) — sum with per-sample weights, mean, and sum with
    ``include_last_offset``."""

    def __init__(self, tables: tuple[int, ...] = (4096, 1024, 64), dim: int = 8, dense: int = 4,
                 hidden: int = 16) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.embeddings = nn.ModuleList([nn.EmbeddingBag(tables[0], dim, mode="sum"),
                                         nn.EmbeddingBag(tables[1], dim, mode="mean"),
                                         nn.EmbeddingBag(tables[2], dim, mode="sum", include_last_offset=True)])
        pairs = (len(tables) + 1) * len(tables) // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.tables = tables

    def forward(self, dense, ids0, offsets0, weights0, ids1, offsets1, ids2, offsets2):
        x = self.bottom(dense)
        pooled = [self.embeddings[0](ids0, offsets0, per_sample_weights=weights0),
                  self.embeddings[1](ids1, offsets1), self.embeddings[2](ids2, offsets2)]
        features = torch.stack([x] + pooled, dim=1)
        scores = torch.bmm(features, features.transpose(1, 2))
        i, j = torch.triu_indices(features.shape[1], features.shape[1], offset=1)
        return self.top(torch.cat([x, scores[:, i, j]], dim=1))


def jagged_dlrm_inputs(model: JaggedDLRM, batch: int = 8, seed: int = 1, hot: int = 6) -> tuple:
    """Dense features, and per table ids of bags of 0–5 ids (skewed over ``hot`` rows) with
    their offsets (the last table's offsets end with the id count)."""
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(batch, model.bottom[0].in_features, generator=g)]
    for t, rows in enumerate(model.tables):
        lengths = torch.randint(0, 6, (batch,), generator=g)
        lengths[1] = 0  # an empty bag in every table
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        ids = torch.randint(0, min(hot, rows), (int(lengths.sum()),), generator=g) * (rows // min(hot, rows))
        inputs += [ids, offsets if t == 2 else offsets[:-1]]
        if t == 0:
            inputs.append(torch.rand(ids.numel(), generator=g))
    return tuple(inputs)
