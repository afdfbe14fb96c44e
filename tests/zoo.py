"""Third-party models (Hugging Face transformers, random init from small configs, no
downloads) for the model-zoo tests and benchmarks/model_zoo.py.

Settings each family needs (recorded here, as the torch-2.13 notes ask):
  * causal LMs: ``use_cache=False`` — otherwise forward returns a DynamicCache, which
    torch.export cannot put in a graph output;
  * GPT-2: ``attn_implementation="eager"`` — in eval mode its SDPA path fails decomposition
    ("Cannot view a tensor with shape … and strides …"), as run_decompositions() does;
  * T5: decoder ids are a keyword argument, so a wrapper passes them;
  * Mixtral: ``_experts_implementation="batched_mm"`` — the default grouped_mm is an opaque
    custom op that fails under fake tensors;
  * every model runs in eval mode (no dropout), so a parallel run can match a single one;
  * outputs are reduced to one tensor (logits or the last hidden state) by a thin wrapper.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, BATCH = 256, 16, 4


class Wrapped(nn.Module):
    """Calls a transformers model with keyword inputs and returns one tensor."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...], output: str) -> None:
        super().__init__()
        self.model = model
        self.keys = keys
        self.output = output

    def forward(self, *inputs):
        return getattr(self.model(**dict(zip(self.keys, inputs))), self.output)


def _tokens(batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _small(**extra) -> dict:
    return dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64, **extra)


def _build(name: str):
    import transformers as T

    if name == "gpt2":
        cfg = T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, use_cache=False,
                           bos_token_id=0, eos_token_id=0, attn_implementation="eager")
        return Wrapped(T.GPT2LMHeadModel(cfg), ("input_ids",), "logits"), (_tokens(),)
    if name == "llama":
        cfg = T.LlamaConfig(**_small(num_key_value_heads=2, use_cache=False))
        return Wrapped(T.LlamaForCausalLM(cfg), ("input_ids",), "logits"), (_tokens(),)
    if name == "mistral":
        cfg = T.MistralConfig(**_small(num_key_value_heads=2, use_cache=False))
        return Wrapped(T.MistralForCausalLM(cfg), ("input_ids",), "logits"), (_tokens(),)
    if name == "mixtral":
        cfg = T.MixtralConfig(**_small(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                       use_cache=False))
        cfg._experts_implementation = "batched_mm"
        return Wrapped(T.MixtralForCausalLM(cfg), ("input_ids",), "logits"), (_tokens(),)
    if name == "bert":
        cfg = T.BertConfig(**_small())
        return Wrapped(T.BertModel(cfg), ("input_ids",), "last_hidden_state"), (_tokens(),)
    if name == "t5":
        cfg = T.T5Config(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, vocab_size=VOCAB, use_cache=False)
        return (Wrapped(T.T5Model(cfg), ("input_ids", "decoder_input_ids"), "last_hidden_state"),
                (_tokens(), _tokens(seq=8)))
    if name == "vit":
        cfg = T.ViTConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          image_size=32, patch_size=8)
        images = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        return Wrapped(T.ViTModel(cfg, add_pooling_layer=False), ("pixel_values",), "last_hidden_state"), (images,)
    raise KeyError(name)


MODELS = ("gpt2", "llama", "mistral", "mixtral", "bert", "t5", "vit")
# memory limit for the equivalence runs, as a fraction of the unconstrained plan's footprint:
# low enough to force sharding, high enough to stay feasible (Mixtral's experts need more)
MEMORY_FRACTION = {"mixtral": 0.9}


def build(name: str):
    """(model in eval mode, example inputs) for one zoo entry; seeded, so every rank agrees."""
    torch.manual_seed(0)
    model, inputs = _build(name)
    return model.eval(), inputs
