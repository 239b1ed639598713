"""Documented device models for estimating stage times without the device (roofline).

A :class:`DeviceModel` holds the published peak arithmetic throughput and memory bandwidth
of a GPU. :meth:`DeviceModel.op_time` is the classic roofline (Williams, Waterman and
Patterson, CACM 2009): one kernel takes

``t = max(flops / (peak_flops * compute_efficiency), bytes / (bandwidth * memory_efficiency))
+ launch_overhead``

where ``flops`` come from the formulas of :mod:`torch.utils.flop_counter` (matrix products,
convolutions and attention; element-wise kernels count 0 FLOPs and are bandwidth bound) and
``bytes`` is the size of every tensor the kernel reads plus every tensor it writes (no cache
reuse). Views (no new storage, no mutation) cost nothing. A stage's forward (or backward)
time is the sum of its kernels' times, so the backward time is measured from the backward
kernels themselves (about twice the forward FLOPs for convolutions and matrix products,
as expected) rather than assumed.

The peaks are the vendors' dense (no sparsity) figures:

========  ============  ===========  ===========  =========  ======  =====================
device    FP32 TFLOP/s  TF32         FP16/BF16    bandwidth  memory  source
========  ============  ===========  ===========  =========  ======  =====================
V100      14.0          (none)       112 (FP16)   900 GB/s   16 GB   V100 PCIe datasheet
A100      19.5          156          312          2039 GB/s  80 GB   A100 SXM4 80GB datasheet
H100      67            494.5        989.5        3350 GB/s  80 GB   H100 SXM5 datasheet
========  ============  ===========  ===========  =========  ======  =====================

The V100 PCIe 16 GB is the card of the rotor and offloading papers (``rotor.md`` section 7,
``offload.md`` section 6). The efficiencies (0.75 of peak FLOP/s, 0.8 of peak bandwidth,
5 us per kernel) are round figures typical of large cuDNN/cuBLAS kernels, not fits. With
them the V100 model is about 10 % pessimistic against the rotor paper's measurements
(``benchmarks/results/zoo.md``): ResNet-101 at 1000x1000, batch 8, with 2 checkpointed
segments runs at 7.3 images/s (paper: 8.1); ResNet-1001 store-all at 1.0 images/s (paper's
estimate: 1.1).

Examples
--------
>>> v100 = get_device("v100")
>>> round(v100.op_time(flops=14e12 * 0.75, nbytes=0, dtype="float32"), 6)
1.000005
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from optmem.errors import OptmemInputError


@dataclass(frozen=True)
class DeviceModel:
    """Peak throughput and bandwidth of one accelerator, with a roofline time model.

    Parameters
    ----------
    name
        Short name (``"V100"``).
    peak_flops
        Peak FLOP/s by math mode: keys ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``.
    bandwidth
        Peak memory bandwidth in bytes/s.
    memory
        Device memory in bytes.
    compute_efficiency, memory_efficiency
        Fractions of the peaks that real kernels reach.
    launch_overhead
        Seconds added to every kernel that is not a view.
    tf32
        Run float32 matrix products in TF32 (the default of cuDNN convolutions on Ampere and
        later; PyTorch matmuls default to full FP32).
    source
        Where the figures come from.
    """

    name: str
    peak_flops: dict[str, float]
    bandwidth: float
    memory: int
    compute_efficiency: float = 0.75
    memory_efficiency: float = 0.8
    launch_overhead: float = 5e-6
    tf32: bool = False
    source: str = ""
    notes: dict[str, str] = field(default_factory=dict)

    def flops_per_second(self, dtype: str) -> float:
        """Peak FLOP/s used for kernels computing in ``dtype`` (``"float32"``, ...)."""
        key = {"float32": "tf32" if self.tf32 else "fp32", "float16": "fp16",
               "bfloat16": "bf16"}.get(dtype, "fp32")
        return self.peak_flops.get(key) or self.peak_flops["fp32"]

    def op_time(self, *, flops: float, nbytes: float, dtype: str = "float32") -> float:
        """Roofline time in seconds of one kernel (see the module docstring)."""
        compute = flops / (self.flops_per_second(dtype) * self.compute_efficiency)
        memory = nbytes / (self.bandwidth * self.memory_efficiency)
        return max(compute, memory) + self.launch_overhead

    def describe(self) -> dict[str, Any]:
        """JSON-ready description, recorded in every profile it times (``provenance``)."""
        out = asdict(self)
        out.pop("notes")
        return out


_GB = 1e9
_T = 1e12

DEVICES: dict[str, DeviceModel] = {
    "v100": DeviceModel(
        "V100", {"fp32": 14.0 * _T, "fp16": 112.0 * _T}, 900 * _GB, 16 * 2**30,
        source="NVIDIA Tesla V100 PCIe datasheet (dense peaks)"),
    "a100": DeviceModel(
        "A100", {"fp32": 19.5 * _T, "tf32": 156.0 * _T, "fp16": 312.0 * _T,
                 "bf16": 312.0 * _T}, 2039 * _GB, 80 * 2**30,
        source="NVIDIA A100 SXM4 80GB datasheet (dense peaks)"),
    "h100": DeviceModel(
        "H100", {"fp32": 67.0 * _T, "tf32": 494.5 * _T, "fp16": 989.5 * _T,
                 "bf16": 989.5 * _T}, 3350 * _GB, 80 * 2**30,
        source="NVIDIA H100 SXM5 datasheet (dense peaks)"),
}


def get_device(name: str, **overrides: Any) -> DeviceModel:
    """The device model called ``name`` (case-insensitive), with fields overridden.

    Raises
    ------
    OptmemInputError
        For an unknown name.
    """
    key = name.lower().replace("-", "").replace("_", "")
    if key not in DEVICES:
        raise OptmemInputError(
            f"unknown device model {name!r} (expected one of {', '.join(sorted(DEVICES))})",
            field="device")
    return replace(DEVICES[key], **overrides) if overrides else DEVICES[key]
