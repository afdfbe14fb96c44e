"""Third-party models (Hugging Face transformers and timm, random init from small configs,
no downloads) for the model-zoo tests and benchmarks/model_zoo.py.

Every family is built as ``from_config`` gives it (its default attention, KV cache on, its
default MoE experts); capture switches the cache off itself (passes.training_forward). The
settings that remain, and why:
  * small sizes (layers, widths, heads, experts, vocabulary) so a test runs in seconds; where a
    default depends on them they are set too: Phi-3's ``pad_token_id`` (its default 32000 is
    past our small vocabulary), Qwen3's, Gemma-2's and GPT-OSS's ``head_dim`` (their defaults,
    128, 256 and 64, are larger than the small width's heads);
  * DeepSeek-V3: its dense first layers (``first_k_dense_replace``, 3), expert groups
    (``n_group``/``topk_group``, 8 and 4) and low-rank attention widths are set to fit two
    layers, four experts and the small width — it keeps its shared expert, sigmoid router and
    multi-head latent attention;
  * the MoE families (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE with its shared expert, GraniteMoE,
    GPT-OSS with its expert biases, DeepSeek-V3; all with their default grouped_mm experts)
    read sequences of :data:`MOE_SEQ` tokens: with fewer rows per expert, splitting each expert
    inside beats sending the rows to their experts' owners (the all-to-alls' latency), and the
    equivalence runs would not test the dispatch;
  * T5: decoder ids are a keyword argument, so a wrapper passes them;
  * every model runs in eval mode (no dropout), so a parallel run can match a single one;
  * outputs are reduced to one tensor (logits or the last hidden state) by a thin wrapper
    (tests/test_hf_defaults.py plans and trains one without it: its ModelOutput);
  * timm (``pretrained=False``) always imports torchvision: see
    :func:`declare_unloadable_torchvision_ops`, which importing this module runs.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import torch
from torch import nn

_TORCHVISION_OPS: torch.library.Library | None = None


def declare_unloadable_torchvision_ops() -> None:
    """Make torchvision importable where its compiled operators cannot load.

    PyPI's torchvision wheel is a CUDA build; beside a CPU-only torch its ``_C`` library does
    not load and ``import torchvision`` fails on registering fake kernels for
    ``torchvision::nms`` ("operator … does not exist"). timm always imports torchvision, and
    transformers does once it is installed. Declaring the two schemas first makes the import
    succeed; model definitions call no torchvision kernel. Where the library loads (a matching
    install), nothing is declared."""
    global _TORCHVISION_OPS
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None or _TORCHVISION_OPS is not None:
        return
    try:
        for library in glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so")):
            torch.ops.load_library(library)
        return
    except OSError:
        pass
    _TORCHVISION_OPS = torch.library.Library("torchvision", "FRAGMENT")  # kept: dropping it undefines them
    _TORCHVISION_OPS.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_OPS.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


declare_unloadable_torchvision_ops()

VOCAB, SEQ, BATCH = 256, 16, 4
MOE_MODELS, MOE_SEQ = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "granite_moe", "gpt_oss", "deepseek_v3"), 64


class Wrapped(nn.Module):
    """Calls a transformers model with keyword inputs and returns one tensor."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...], output: str) -> None:
        super().__init__()
        self.model = model
        self.keys = keys
        self.output = output

    def forward(self, *inputs):
        return getattr(self.model(**dict(zip(self.keys, inputs))), self.output)


def _tokens(batch: int = BATCH, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _images(batch: int = BATCH, side: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


def _small(**extra) -> dict:
    return dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                vocab_size=VOCAB, max_position_embeddings=64, **extra)


# causal LMs built by AutoModelForCausalLM.from_config from a small config: (config class, the
# settings besides the small sizes, each explained in the module docstring)
_CAUSAL = {
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 16}),
    "gemma2": ("Gemma2Config", {"num_key_value_heads": 2, "head_dim": 16}),
    "phi3": ("Phi3Config", {"num_key_value_heads": 2, "pad_token_id": 0}),
    "olmo2": ("Olmo2Config", {"num_key_value_heads": 2}),
    "granite": ("GraniteConfig", {"num_key_value_heads": 2}),
    "starcoder2": ("Starcoder2Config", {"num_key_value_heads": 2}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "olmoe": ("OlmoeConfig", {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "granite_moe": ("GraniteMoeConfig", {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt_oss": ("GptOssConfig", {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "head_dim": 16}),
    "deepseek_v3": ("DeepseekV3Config", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "n_shared_experts": 1, "first_k_dense_replace": 0, "n_group": 1,
                                         "topk_group": 1, "q_lora_rank": None, "kv_lora_rank": 16,
                                         "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                                         "head_dim": 8}),
}


def _build(name: str):
    if name.startswith("timm_"):
        return _build_timm(name)
    import transformers as T

    if name == "gpt2":
        cfg = T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                           bos_token_id=0, eos_token_id=0)
        return Wrapped(T.GPT2LMHeadModel(cfg), ("input_ids",), "logits"), (_tokens(),)
    if name == "llama":
        cfg = T.LlamaConfig(**_small(num_key_value_heads=2))
        return Wrapped(T.LlamaForCausalLM(cfg), ("input_ids",), "logits"), (_tokens(),)
    if name == "mistral":
        cfg = T.MistralConfig(**_small(num_key_value_heads=2))
        return Wrapped(T.MistralForCausalLM(cfg), ("input_ids",), "logits"), (_tokens(),)
    if name == "mixtral":
        cfg = T.MixtralConfig(**_small(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
        return Wrapped(T.MixtralForCausalLM(cfg), ("input_ids",), "logits"), (_tokens(seq=MOE_SEQ),)
    if name in _CAUSAL:
        config_class, options = _CAUSAL[name]
        cfg = getattr(T, config_class)(**_small(**options))
        seq = MOE_SEQ if name in MOE_MODELS else SEQ
        return Wrapped(T.AutoModelForCausalLM.from_config(cfg), ("input_ids",), "logits"), (_tokens(seq=seq),)
    if name == "bert":
        cfg = T.BertConfig(**_small())
        return Wrapped(T.BertModel(cfg), ("input_ids",), "last_hidden_state"), (_tokens(),)
    if name == "t5":
        cfg = T.T5Config(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, vocab_size=VOCAB)
        return (Wrapped(T.T5Model(cfg), ("input_ids", "decoder_input_ids"), "last_hidden_state"),
                (_tokens(), _tokens(seq=8)))
    if name == "vit":
        cfg = T.ViTConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          image_size=32, patch_size=8)
        return Wrapped(T.ViTModel(cfg, add_pooling_layer=False), ("pixel_values",), "last_hidden_state"), (_images(),)
    if name == "resnet":  # basic blocks with BatchNorm (eval: running statistics)
        cfg = T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
        return Wrapped(T.ResNetModel(cfg), ("pixel_values",), "pooler_output"), (_images(),)
    if name == "convnext":  # depthwise 7×7 convolutions, channels-last LayerNorm, layer scale
        cfg = T.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)
        return Wrapped(T.ConvNextModel(cfg), ("pixel_values",), "pooler_output"), (_images(),)
    raise KeyError(name)


def _build_timm(name: str):
    """timm's own definitions (``pretrained=False``): a ResNet with average-pool downsampling
    (resnet10t), ConvNeXt (LayerNorm2d, depthwise 7×7) with one block per stage, a 2-block ViT."""
    import timm

    shapes = {"timm_resnet": ("resnet10t", {}),
              "timm_convnext": ("convnext_atto", {"depths": (1, 1, 1, 1)}),
              "timm_vit": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 64,
                                                    "num_heads": 4})}
    arch, options = shapes[name]
    return timm.create_model(arch, pretrained=False, num_classes=10, **options), (_images(),)


LANGUAGE_MODELS = ("gpt2", "llama", "mistral", "mixtral") + tuple(_CAUSAL)
TRANSFORMERS_MODELS = LANGUAGE_MODELS + ("bert", "t5", "vit", "resnet", "convnext")
TIMM_MODELS = ("timm_resnet", "timm_convnext", "timm_vit")
MODELS = TRANSFORMERS_MODELS + TIMM_MODELS


# entries not built as their library's default config gives them (beyond small sizes), and why
NOT_DEFAULT: dict[str, str] = {}


def library(name: str) -> str:
    """The package a zoo entry comes from (tests skip on it when the extra is missing)."""
    return "timm" if name in TIMM_MODELS else "transformers"
# memory limit for the equivalence runs, as a fraction of the unconstrained plan's footprint:
# low enough to force sharding, high enough to stay feasible (Mixtral's experts, ResNet and ConvNeXt need more)
# the CNNs' largest convolutions, sharded, are gathered whole for their block (and the next,
# prefetched): below 0.75 of the unconstrained footprint no timm CNN plan fits on 2 ranks
MEMORY_FRACTION = {"resnet": 0.7, "convnext": 0.7, "timm_resnet": 0.75, "timm_convnext": 0.75}
# the MoE cases test the expert dispatch (rows sent to the experts' owners): with overlap, splitting
# each expert inside hides its collectives behind compute at these small sizes and wins over it
PLAN_OPTIONS = {name: {"overlap": False} for name in MOE_MODELS}
FRACTION_BY_WORLD = {2: 0.6, 4: 0.5}


def equivalence_case(name: str, world: int, dtype: str = "float32", fraction: float | None = None) -> tuple:
    """The case (tests/equivalence.py ``run_cases``) of one training step of zoo model ``name``
    on ``world`` ranks under a memory limit below its unconstrained footprint."""
    fraction = fraction or MEMORY_FRACTION.get(name, FRACTION_BY_WORLD[world])
    return (f"zoo:{name}", {}, "", 0, {"cluster": f"{world}xH100", "memory_fraction": fraction,
                                       **PLAN_OPTIONS.get(name, {})}, dtype, 1)


def build(name: str):
    """(model in eval mode, example inputs) for one zoo entry; seeded, so every rank agrees."""
    torch.manual_seed(0)
    model, inputs = _build(name)
    return model.eval(), inputs
