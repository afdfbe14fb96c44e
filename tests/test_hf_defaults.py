"""Hugging Face models as ``from_config`` gives them (passes.training_forward): the KV cache
their forward returns by default is switched off while capturing (said in the log, the user's
config left as it was), and their ``ModelOutput`` comes back from the parallel model as it
came from the model — here trained on 2 gloo ranks like one process, without a wrapper."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import autopar
import zoo
from distributed import run_world


def _llama():
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=zoo.VOCAB, max_position_embeddings=64)
    return T.AutoModelForCausalLM.from_config(config).eval()


def _logits_loss(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def test_the_kv_cache_is_switched_off_while_capturing_and_said(caplog):
    pytest.importorskip("transformers", reason="needs the [zoo] extra: pip install '.[zoo]'")
    model = _llama()
    assert model.config.use_cache is True  # the default: forward returns a DynamicCache
    with caplog.at_level(logging.INFO, logger="autopar.passes.training_forward"):
        plan = autopar.plan(model, (zoo._tokens(),), cluster="2xH100")
    assert plan.solver["status"] == "OPTIMAL"
    assert "captured without the KV cache" in caplog.text and "config.use_cache=False" in caplog.text
    assert model.config.use_cache is True  # restored


def _train_raw_model() -> dict:
    model = _llama()
    reference = copy.deepcopy(model)
    ids, target = zoo._tokens(), zoo._tokens(seed=2)
    pmodel = autopar.parallelize(model, (ids,), cluster="2xcpu", loss_fn=_logits_loss, configuration="ddp")
    loss = pmodel.step(ids, target=target)
    ref_loss = _logits_loss(reference(ids), target)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    with torch.no_grad():
        output, ref_output = pmodel(ids), reference(ids, use_cache=False)
    return {"type": type(output).__name__, "outputs": pmodel.plan.outputs, "averages": pmodel._averages, "keys": list(output.keys()),
            "loss": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
            "output": (output.logits - ref_output.logits).abs().max().item(),
            "grad": max(((p.grad.full_tensor() - ref[n].grad).abs().max() / ref[n].grad.abs().max()).item()
                        for n, p in pmodel.named_parameters() if ref[n].grad is not None)}


@pytest.mark.distributed
def test_a_model_output_comes_back_as_the_model_gives_it_and_trains_like_one_process():
    pytest.importorskip("transformers", reason="needs the [zoo] extra: pip install '.[zoo]'")
    found = run_world(2, _train_raw_model)
    assert found["type"] == "CausalLMOutputWithPast" and found["keys"] == ["logits"], found
    assert found["outputs"] == ("S(0)",) and found["averages"] is True, found  # each rank's loss on its rows
    assert found["loss"] < 1e-6 and found["output"] < 1e-5 and found["grad"] < 1e-5, found


def test_the_zoo_builds_its_language_models_as_their_configs_give_them():
    """≥ 12 causal-LM families, dense and MoE, none with the cache switched off by hand, every
    MoE one (the zoo's ``MOE_MODELS``) with transformers' default grouped_mm experts."""
    pytest.importorskip("transformers", reason="needs the [zoo] extra: pip install '.[zoo]'")
    assert len(zoo.LANGUAGE_MODELS) >= 12
    moe = set()
    for name in zoo.LANGUAGE_MODELS:
        config = zoo.build(name)[0].model.config
        assert config.use_cache is True, name
        if any(key in config.to_dict() for key in ("num_local_experts", "num_experts", "n_routed_experts")):
            moe.add(name)
            assert config._experts_implementation == "grouped_mm" or name in zoo.NOT_DEFAULT, name
    assert moe == set(zoo.MOE_MODELS) and set(zoo.NOT_DEFAULT) <= moe, moe
