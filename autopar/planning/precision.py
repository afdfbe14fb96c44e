"""Mixed precision as FSDP2 defines it (``torch.distributed.fsdp.MixedPrecisionPolicy``):
parameters cast to ``param_dtype`` for compute and for the gathers of sharded weights,
floating inputs cast too, gradients reduced in ``reduce_dtype``, the optimizer stepping the
model's own (fp32) parameters — the master weights.

autopar takes torch's own policy type (or the CLI's ``bf16`` / ``fp16`` / ``fp32``) and
checks it once here. Gradients that are all-reduced (replicated weights) are reduced in fp32
on the master gradients; gradients of sharded weights are reduce-scattered in the compute
dtype on their way back to the master shard (the cost model counts exactly these bytes).

>>> Precision.of("bf16")
Precision(param_dtype='bfloat16', reduce_dtype='float32')
>>> Precision.of("fp32") is None
True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.errors import AutoparError, ErrorKind

NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_COMPUTE = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Precision:
    """A checked mixed-precision policy; dtype names as torch writes them without ``torch.``."""

    param_dtype: str
    reduce_dtype: str = "float32"

    @property
    def compute_dtype(self) -> torch.dtype:
        return getattr(torch, self.param_dtype)

    def to_plan(self) -> dict[str, str]:
        return {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype}

    @classmethod
    def from_plan(cls, entry: dict | None) -> "Precision | None":
        return None if not entry else cls(entry["param_dtype"], entry["reduce_dtype"])

    @classmethod
    def of(cls, policy) -> "Precision | None":
        """From ``None``, a ``MixedPrecisionPolicy``, a ``Precision`` or ``"bf16" | "fp16" | "fp32"``;
        None when the model computes in its own dtypes (no policy, or fp32)."""
        if policy is None or isinstance(policy, Precision):
            return policy
        if isinstance(policy, str):
            if policy not in NAMES:
                raise AutoparError(ErrorKind.BAD_INPUT, f"unknown precision {policy!r}; choose one of "
                                   f"{', '.join(NAMES)}")
            return None if policy == "fp32" else cls(str(NAMES[policy]).removeprefix("torch."))
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not isinstance(policy, MixedPrecisionPolicy):
            raise AutoparError(ErrorKind.BAD_INPUT,
                               "mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy (e.g. "
                               "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) or "
                               f"one of {', '.join(NAMES)}; got {type(policy).__name__}")
        if policy.param_dtype is not None and policy.param_dtype not in _COMPUTE:
            raise AutoparError(ErrorKind.BAD_INPUT, f"param_dtype {policy.param_dtype} is not a compute dtype autopar "
                               "plans for; use torch.bfloat16, torch.float16 or torch.float32")
        if policy.reduce_dtype not in (None, torch.float32):
            raise AutoparError(ErrorKind.BAD_INPUT,
                               f"reduce_dtype {policy.reduce_dtype} is not supported: autopar reduces gradients in "
                               "float32 (set reduce_dtype=torch.float32, or leave it None)")
        if policy.output_dtype is not None or not policy.cast_forward_inputs:
            raise AutoparError(ErrorKind.BAD_INPUT,
                               "output_dtype and cast_forward_inputs=False are not supported: leave them at their "
                               "defaults (outputs in param_dtype, floating inputs cast to it)")
        if policy.param_dtype in (None, torch.float32):
            return None
        return cls(str(policy.param_dtype).removeprefix("torch."))
