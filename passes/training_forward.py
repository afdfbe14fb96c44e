"""The forward a model trains with, as libraries build it for generation too.

Hugging Face models come from ``from_config`` / ``from_pretrained`` ready to generate: with
``config.use_cache=True`` their forward returns a KV cache object (``DynamicCache``), which
torch.export cannot put in a graph's outputs and which training never reads. While capturing,
every config in the model (a submodule's ``config`` and the configs nested in it, such as a
multimodal model's ``text_config``) has ``use_cache`` switched off, as training scripts do by
hand; the log says so, and the user's model is left as it was, errors included.

    >>> with training_forward(model) as switched:   # doctest: +SKIP
    ...     program = torch.export.export(model, args)
    >>> switched
    ['config.use_cache']
"""

from __future__ import annotations

import contextlib
import logging

from torch import nn

log = logging.getLogger(__name__)


def _configs(model: nn.Module) -> dict[int, tuple[str, object]]:
    """Every config object reachable from ``model``'s modules -> (a name for it, the config);
    found by duck typing (``to_dict`` and ``use_cache``), so transformers is never imported."""
    found: dict[int, tuple[str, object]] = {}
    pending = [(f"{name}.config" if name else "config", getattr(module, "config", None))
               for name, module in model.named_modules()]
    while pending:
        name, config = pending.pop(0)  # in module order: the first name a shared config has
        if config is None or id(config) in found or not hasattr(config, "to_dict"):
            continue
        found[id(config)] = (name, config)
        for key, value in vars(config).items():
            if key.endswith("_config") and hasattr(value, "to_dict"):
                pending.append((f"{name}.{key}", value))
    return found


@contextlib.contextmanager
def training_forward(model: nn.Module):
    """While inside, no config in ``model`` asks for a KV cache. Yields the switched names."""
    switched = [(name, config) for name, config in _configs(model).values()
                if getattr(config, "use_cache", None) is True]
    try:
        for _, config in switched:
            config.use_cache = False
        if switched:
            log.info("captured without the KV cache (a generation feature training never reads): %s",
                     ", ".join(f"{name}.use_cache=False" for name, _ in switched))
        yield [f"{name}.use_cache" for name, _ in switched]
    finally:
        for _, config in switched:
            config.use_cache = True
