"""The world a process group runs in (issue 23): the device its tensors and collectives live
on, and — for ``autopar.parallelize`` without a cluster — the cluster it is.

Device: NCCL runs on CUDA; gloo on the CPU, or on CUDA tensors where the model's weights are
on a GPU (gloo handles CUDA tensors for the collectives DTensor issues, so two ranks sharing
one GPU exercise every device path of lowering and runtime). A rank's CUDA device is the
current one: ``torch.cuda.set_device(local_rank)``, as torchrun scripts call it.

Cluster: one ``cpu`` device per rank on CPUs. On GPUs, the catalog's entry for the name
``torch.cuda.get_device_name`` reports (``"NVIDIA H100 80GB HBM3"`` → H100-SXM), or for a GPU
the catalog lacks a generic profile (its memory as the device reports it, the rest an A100's
datasheet figures) and a warning that ``autopar profile`` measures it; ``LOCAL_WORLD_SIZE``
ranks per host (torchrun sets it; unset: every rank on one host); and where a host runs more
ranks than it has GPUs, each rank plans within its share of one GPU's memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os

import torch
import torch.distributed as dist
from torch import nn

from autopar.cluster import Cluster
from autopar.devices import DeviceSpec, device_for_gpu_name, get_device
from autopar.errors import AutoparError, ErrorKind

log = logging.getLogger(__name__)

# what a GPU the catalog lacks is planned as (besides its memory): a mid-range datacenter part
GENERIC_GPU = "A100-80GB"


def device_type(model: nn.Module | None = None) -> str:
    """``"cuda"`` where the process group's collectives (NCCL) or the model's weights (gloo
    over CUDA tensors) are on a GPU, else ``"cpu"``."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    tensors = itertools.chain(model.parameters(), model.buffers()) if model is not None else ()
    return "cuda" if any(t.device.type == "cuda" for t in tensors) else "cpu"


def runtime_device(kind: str) -> torch.device:
    """The device this rank's tensors of ``kind`` live on: its current CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def world_cluster(model: nn.Module | None = None) -> Cluster:
    """The cluster the current process group runs on (see the module docstring)."""
    world = dist.get_world_size()
    if device_type(model) != "cuda":
        return Cluster.from_spec(f"{world}xcpu")
    per_host = ranks_per_host(world, os.environ.get("LOCAL_WORLD_SIZE"))
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    total = torch.cuda.get_device_properties(index).total_memory
    device = gpu_device(name, total)
    sharing = math.ceil(per_host / max(1, torch.cuda.device_count()))
    limit = None if sharing == 1 else min(device.memory_bytes, total) // sharing
    if sharing > 1:
        log.warning("%d ranks per host share %d GPU(s): each plans within 1/%d of one GPU's memory", per_host,
                    torch.cuda.device_count(), sharing)
    return Cluster.homogeneous(device, world // per_host, per_host, limit)


def ranks_per_host(world: int, local_world_size: str | None) -> int:
    """Ranks on each host: ``LOCAL_WORLD_SIZE`` (torchrun's), or the whole world when unset."""
    if local_world_size is None:
        return world
    try:
        per_host = int(local_world_size)
    except ValueError:
        per_host = 0
    if per_host < 1 or world % per_host:
        raise AutoparError(ErrorKind.BAD_CLUSTER,
                           f"LOCAL_WORLD_SIZE={local_world_size!r} does not divide the world of {world} ranks into "
                           "hosts of equal size; pass cluster= to parallelize (e.g. '2x8xH100' or a cluster file)")
    return per_host


def gpu_device(name: str, memory_bytes: int) -> DeviceSpec:
    """The catalog entry for a GPU named ``name``, or a generic profile with its memory."""
    device = device_for_gpu_name(name)
    if device is not None:
        return device
    log.warning("GPU %r is not in autopar's catalog: planning with a generic profile (%.0f GB as the device "
                "reports, the rest %s datasheet figures); `autopar profile` measures this GPU, or pass cluster= "
                "with a cluster file", name, memory_bytes / 1e9, GENERIC_GPU)
    return dataclasses.replace(get_device(GENERIC_GPU), name=name, memory_bytes=memory_bytes, aliases=(),
                               source=f"generic profile: {GENERIC_GPU} figures, memory as {name!r} reports it")
