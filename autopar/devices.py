"""Device catalog: peak dense FLOP/s per dtype, memory and memory bandwidth, with sources.

Figures are vendor datasheet numbers for *dense* math (no 2:4 sparsity). ``cpu`` is a
conservative default for a small x86 host; ``autopar profile`` (cost-model issue) replaces
it with measured figures. A ``Link`` between two devices defaults to its device's figures.

>>> get_device("H100").name
'H100-SXM'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.errors import AutoparError, ErrorKind

GB = 10**9
GiB = 2**30
TFLOPS = 10**12
# op classes whose kernels reach different fractions of the roofline (passes.cost.op_class;
# "attention": the fused kernel, FLOPs as passes.cost.attention_flops counts them)
OP_CLASSES = ("matmul", "attention", "conv", "pool", "reduction", "elementwise")
# collective kinds whose library implementation may fall short of autopar.comm's formulas
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# collective kinds the overlap model runs beside compute: prefetched weight gathers, gradient reductions
OVERLAP_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or host CPU) kind.

    ``compute_efficiency`` / ``memory_efficiency`` scale datasheet peaks to what real
    kernels reach (roofline with an efficiency factor).
    """

    name: str
    peak_flops: dict[str, float]  # dtype name -> dense FLOP/s
    memory_bytes: int
    memory_bandwidth_Bps: float
    intra_node_bandwidth_Bps: float  # default link between devices of one node
    intra_node_latency_s: float
    inter_node_bandwidth_Bps: float  # default network per device between nodes
    inter_node_latency_s: float
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    op_overhead_s: float = 0.0  # fixed time per executed op (dispatch; large for DTensor on CPU)
    # fraction of the roofline reached per op class (passes.cost.OP_CLASSES); 1 when not listed
    class_efficiency: tuple[tuple[str, float], ...] = ()
    # fraction of autopar.comm's ideal speed per collective kind (cluster.Link.efficiency)
    collective_efficiency: tuple[tuple[str, float], ...] = ()
    # fraction of overlappable communication (prefetched weight gathers, gradient reductions
    # during backward) this device's runtime hides behind compute (issue 20). Accelerators run
    # collectives on a stream beside the compute stream, but NCCL/RCCL kernels take SMs and
    # memory bandwidth from the compute they overlap: 0.9 is an assumption, not a measurement
    # (benchmarks/gpu_check.py measures it where a GPU is at hand); ``autopar profile``
    # measures what gloo reaches on a host
    overlap_efficiency: float = 0.9
    # the same per collective kind where measured (all_gather, reduce_scatter, all_reduce; the
    # rest take overlap_efficiency), from −1 to 1: below 0 overlapping costs more than it hides
    # (gloo's all-reduce thread taking a core from the compute on a small host)
    collective_overlap: tuple[tuple[str, float], ...] = ()
    source: str = ""
    aliases: tuple[str, ...] = field(default=())

    def efficiency(self, op_class: str) -> float:
        """Fraction of the roofline this device's kernels of ``op_class`` reach (measured by
        ``autopar profile``; 1 for catalog devices, whose efficiency is in the two factors above)."""
        return dict(self.class_efficiency).get(op_class, 1.0)

    def overlap(self, kind: str) -> float:
        """The overlap efficiency of collectives of ``kind``."""
        return dict(self.collective_overlap).get(kind, self.overlap_efficiency)

    def flops_per_s(self, dtype: str) -> float:
        """Peak for ``dtype`` (e.g. 'float32'), falling back to fp32 for unknown dtypes."""
        key = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(dtype, "fp32")
        return self.peak_flops.get(key, self.peak_flops["fp32"])


CATALOG: tuple[DeviceSpec, ...] = (
    DeviceSpec(
        name="A100-80GB",
        peak_flops={"fp64": 9.7 * TFLOPS, "fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS,
                    "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS},
        memory_bytes=80 * GB, memory_bandwidth_Bps=2039 * GB,
        intra_node_bandwidth_Bps=300 * GB, intra_node_latency_s=2e-6,  # NVLink 3, 600 GB/s bidirectional
        inter_node_bandwidth_Bps=25 * GB, inter_node_latency_s=5e-6,  # HDR InfiniBand 200 Gb/s per GPU
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB), 2021",
        aliases=("A100",),
    ),
    DeviceSpec(
        name="H100-SXM",
        peak_flops={"fp64": 34 * TFLOPS, "fp32": 67 * TFLOPS, "tf32": 494.7 * TFLOPS,
                    "bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS},
        memory_bytes=80 * GB, memory_bandwidth_Bps=3350 * GB,
        intra_node_bandwidth_Bps=450 * GB, intra_node_latency_s=2e-6,  # NVLink 4, 900 GB/s bidirectional
        inter_node_bandwidth_Bps=50 * GB, inter_node_latency_s=5e-6,  # NDR InfiniBand 400 Gb/s per GPU
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5), 2023",
        aliases=("H100",),
    ),
    DeviceSpec(
        name="A100-40GB",
        peak_flops={"fp64": 9.7 * TFLOPS, "fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS,
                    "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS},
        memory_bytes=40 * GB, memory_bandwidth_Bps=1555 * GB,
        intra_node_bandwidth_Bps=300 * GB, intra_node_latency_s=2e-6,
        inter_node_bandwidth_Bps=25 * GB, inter_node_latency_s=5e-6,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB), 2021",
    ),
    DeviceSpec(
        name="V100-32GB",
        peak_flops={"fp64": 7.8 * TFLOPS, "fp32": 15.7 * TFLOPS, "fp16": 125 * TFLOPS, "bf16": 15.7 * TFLOPS},
        memory_bytes=32 * GB, memory_bandwidth_Bps=900 * GB,
        intra_node_bandwidth_Bps=150 * GB, intra_node_latency_s=3e-6,  # NVLink 2, 300 GB/s bidirectional
        inter_node_bandwidth_Bps=12.5 * GB, inter_node_latency_s=5e-6,  # EDR InfiniBand 100 Gb/s
        source="NVIDIA Tesla V100 datasheet (SXM2 32GB), 2020; no bf16 tensor cores (fp32 rate)",
        aliases=("V100",),
    ),
    DeviceSpec(
        name="H100-PCIe",
        peak_flops={"fp64": 26 * TFLOPS, "fp32": 51 * TFLOPS, "tf32": 378 * TFLOPS,
                    "bf16": 756 * TFLOPS, "fp16": 756 * TFLOPS, "fp8": 1513 * TFLOPS},
        memory_bytes=80 * GB, memory_bandwidth_Bps=2000 * GB,
        intra_node_bandwidth_Bps=64 * GB, intra_node_latency_s=5e-6,  # PCIe Gen5 x16
        inter_node_bandwidth_Bps=50 * GB, inter_node_latency_s=5e-6,
        source="NVIDIA H100 Tensor Core GPU datasheet (PCIe), 2023",
    ),
    DeviceSpec(
        name="H200",
        peak_flops={"fp64": 34 * TFLOPS, "fp32": 67 * TFLOPS, "tf32": 494.7 * TFLOPS,
                    "bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS},
        memory_bytes=141 * GB, memory_bandwidth_Bps=4800 * GB,
        intra_node_bandwidth_Bps=450 * GB, intra_node_latency_s=2e-6,
        inter_node_bandwidth_Bps=50 * GB, inter_node_latency_s=5e-6,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM), 2024",
        aliases=("H200-SXM",),
    ),
    DeviceSpec(
        name="B200",
        peak_flops={"fp64": 40 * TFLOPS, "fp32": 80 * TFLOPS, "tf32": 1100 * TFLOPS,
                    "bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS, "fp8": 4500 * TFLOPS},
        memory_bytes=180 * GB, memory_bandwidth_Bps=7700 * GB,
        intra_node_bandwidth_Bps=900 * GB, intra_node_latency_s=2e-6,  # NVLink 5, 1.8 TB/s bidirectional
        inter_node_bandwidth_Bps=50 * GB, inter_node_latency_s=5e-6,
        source="NVIDIA HGX B200 datasheet (per GPU, dense), 2024",
    ),
    DeviceSpec(
        name="L4",
        peak_flops={"fp32": 30.3 * TFLOPS, "tf32": 60 * TFLOPS, "bf16": 121 * TFLOPS,
                    "fp16": 121 * TFLOPS, "fp8": 242.5 * TFLOPS},
        memory_bytes=24 * GB, memory_bandwidth_Bps=300 * GB,
        intra_node_bandwidth_Bps=32 * GB, intra_node_latency_s=5e-6,  # PCIe Gen4 x16
        inter_node_bandwidth_Bps=3.125 * GB, inter_node_latency_s=20e-6,  # 100 GbE shared by 4 GPUs
        source="NVIDIA L4 Tensor Core GPU datasheet, 2023 (dense)",
    ),
    DeviceSpec(
        name="T4",
        peak_flops={"fp32": 8.1 * TFLOPS, "fp16": 65 * TFLOPS, "bf16": 8.1 * TFLOPS},
        memory_bytes=16 * GB, memory_bandwidth_Bps=320 * GB,
        intra_node_bandwidth_Bps=16 * GB, intra_node_latency_s=5e-6,  # PCIe Gen3 x16
        inter_node_bandwidth_Bps=3.125 * GB, inter_node_latency_s=20e-6,
        source="NVIDIA T4 Tensor Core GPU datasheet, 2019; no bf16 tensor cores (fp32 rate)",
    ),
    DeviceSpec(
        name="A10G",
        peak_flops={"fp32": 31.2 * TFLOPS, "tf32": 62.5 * TFLOPS, "bf16": 125 * TFLOPS, "fp16": 125 * TFLOPS},
        memory_bytes=24 * GB, memory_bandwidth_Bps=600 * GB,
        intra_node_bandwidth_Bps=32 * GB, intra_node_latency_s=5e-6,
        inter_node_bandwidth_Bps=3.125 * GB, inter_node_latency_s=20e-6,
        source="NVIDIA A10 Tensor Core GPU datasheet, 2021 (dense); AWS G5 A10G memory bandwidth",
    ),
    DeviceSpec(
        name="MI250X",
        peak_flops={"fp64": 95.7 * TFLOPS, "fp32": 95.7 * TFLOPS, "bf16": 383 * TFLOPS, "fp16": 383 * TFLOPS},
        memory_bytes=128 * GB, memory_bandwidth_Bps=3276.8 * GB,
        intra_node_bandwidth_Bps=100 * GB, intra_node_latency_s=3e-6,  # Infinity Fabric links
        inter_node_bandwidth_Bps=25 * GB, inter_node_latency_s=5e-6,  # Slingshot 200 Gb/s
        source="AMD Instinct MI250X datasheet, 2021 (matrix rates)",
    ),
    DeviceSpec(
        name="MI300X",
        peak_flops={"fp64": 163.4 * TFLOPS, "fp32": 163.4 * TFLOPS, "tf32": 653.7 * TFLOPS,
                    "bf16": 1307.4 * TFLOPS, "fp16": 1307.4 * TFLOPS, "fp8": 2614.9 * TFLOPS},
        memory_bytes=192 * GB, memory_bandwidth_Bps=5300 * GB,
        intra_node_bandwidth_Bps=300 * GB, intra_node_latency_s=3e-6,  # 7 Infinity Fabric links (assumed ring bus bw)
        inter_node_bandwidth_Bps=50 * GB, inter_node_latency_s=5e-6,
        source="AMD Instinct MI300X datasheet, 2023 (dense matrix rates)",
    ),
    DeviceSpec(
        name="cpu",
        peak_flops={"fp64": 50e9, "fp32": 100e9, "bf16": 50e9, "fp16": 25e9},
        memory_bytes=16 * GiB, memory_bandwidth_Bps=20 * GB,
        intra_node_bandwidth_Bps=2 * GB, intra_node_latency_s=50e-6,  # gloo over loopback TCP
        inter_node_bandwidth_Bps=1.25 * GB, inter_node_latency_s=100e-6,  # 10 GbE
        compute_efficiency=0.5, memory_efficiency=0.5,
        overlap_efficiency=0.0,  # gloo's collectives share the cores the compute runs on: unmeasured, none
        source="uncalibrated default for a 2-core x86 host; replace with `autopar profile`",
    ),
)

_BY_NAME: dict[str, DeviceSpec] = {}
for _spec in CATALOG:
    for _key in (_spec.name, *_spec.aliases):
        _BY_NAME[_key.lower()] = _spec


# links faster than a petabyte per second or slower than a week per message are typos (a unit
# slipped): cluster files and `replan --link` refuse them
MAX_LINK_BANDWIDTH_Bps = 1e15
MAX_LINK_LATENCY_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Link:
    """A point-to-point link: bandwidth per direction (bytes/s) and per-message latency (s).

    ``collective_efficiency`` (measured by ``autopar profile``): the fraction of the ideal
    formula's speed the collective library reaches per collective kind (gloo, for one, runs a
    reduce-scatter as an all-reduce); 1 for kinds not listed."""

    bandwidth_Bps: float
    latency_s: float
    collective_efficiency: tuple[tuple[str, float], ...] = ()

    def efficiency(self, kind: str) -> float:
        return dict(self.collective_efficiency).get(kind, 1.0)

    def record(self) -> dict:
        """The link as a plan records it (``plan.cluster["links"]``)."""
        return {"bandwidth_Bps": self.bandwidth_Bps, "latency_s": self.latency_s,
                "collective_efficiency": dict(self.collective_efficiency)}

    @classmethod
    def of_device(cls, device: DeviceSpec, inter_node: bool) -> "Link":
        """The default link between two of ``device``'s kind, in one node or across nodes."""
        if inter_node:
            return cls(device.inter_node_bandwidth_Bps, device.inter_node_latency_s, device.collective_efficiency)
        return cls(device.intra_node_bandwidth_Bps, device.intra_node_latency_s, device.collective_efficiency)


def get_device(name: str) -> DeviceSpec:
    """Look a device up by name or alias, case-insensitively."""
    spec = _BY_NAME.get(name.strip().lower())
    if spec is None:
        known = ", ".join(sorted({s.name for s in CATALOG}))
        raise AutoparError(ErrorKind.BAD_CLUSTER, f"unknown device {name!r}; known devices: {known}")
    return spec


# the largest cluster autopar plans: far above any built (10^6 devices is still one someone may
# plan), low enough that counts are refused before anything is allocated per device
MAX_DEVICES = 2 ** 24


def check_device_count(devices: int, source: str) -> None:
    """Refuse a cluster with more than :data:`MAX_DEVICES` devices, naming where it came from."""
    if devices > MAX_DEVICES:
        raise AutoparError(ErrorKind.BAD_CLUSTER,
                           f"{source} has {devices:,} devices; autopar plans clusters of at most {MAX_DEVICES:,} "
                           "devices: check the host and device counts")


# what torch.cuda.get_device_name reports -> catalog name, first match wins (case-insensitive
# substrings, each tuple all present): "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe"
# the PCIe one; the A100s by memory ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB")
_GPU_NAMES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("h100", "pcie"), "H100-PCIe"),
    (("h100", "nvl"), "H100-PCIe"),  # a PCIe card (with an NVLink bridge between pairs)
    (("h100",), "H100-SXM"),
    (("h200",), "H200"),
    (("b200",), "B200"),
    (("a100", "80g"), "A100-80GB"),
    (("a100",), "A100-40GB"),
    (("v100",), "V100-32GB"),
    (("a10g",), "A10G"),
    (("l4",), "L4"),
    (("t4",), "T4"),
    (("mi300x",), "MI300X"),
    (("mi250x",), "MI250X"),
)


def device_for_gpu_name(gpu_name: str) -> DeviceSpec | None:
    """The catalog entry of a GPU as ``torch.cuda.get_device_name`` names it (``"NVIDIA H100
    80GB HBM3"`` → H100-SXM), or None for a GPU the catalog does not hold.

    >>> device_for_gpu_name("NVIDIA A100-SXM4-40GB").name
    'A100-40GB'
    """
    words = gpu_name.lower()
    for parts, name in _GPU_NAMES:
        if all(part in words for part in parts) and not (parts == ("l4",) and "l40" in words):
            return _BY_NAME[name.lower()]
    return None
