"""Device figures the Topology model does not carry: memory and peak dense 16-bit FLOP/s, by GPU model name.

Keyed by the ``model`` of a topology preset (``conf/topology/*.yaml``) or what NVML reports; matched by
substring, longest key first. Figures are the vendors' datasheet numbers (dense, no sparsity):
* H100 SXM5 80GB: 989 TFLOP/s BF16 dense, 80 GB HBM3 (NVIDIA H100 datasheet).
* H100 NVL: 835 TFLOP/s BF16 dense (1,671 with sparsity), 94 GB HBM3 (NVIDIA H100 NVL datasheet).
* A100 80GB (SXM or PCIe): 312 TFLOP/s BF16 dense, 80 GB (NVIDIA A100 datasheet).
* V100 SXM2 32GB: 125 TFLOP/s FP16 tensor core, 32 GB (NVIDIA V100 datasheet).
* "PCIe GPU" (the generic ``pcie_8`` preset): assumed A100 80GB PCIe-class figures, stated as such.
* CPU "devices" (gloo test presets): a nominal 0.1 TFLOP/s and the host's memory; nothing measured.
Memory bandwidth (used for the cost of quantizing communication, planner/time.py) from the same datasheets: H100 SXM5
3.35 TB/s, H100 NVL 3.9 TB/s, A100 80GB 2.0 TB/s (PCIe 1.935), A100 40GB 1.555 TB/s, V100 900 GB/s; CPU a nominal
20 GB/s per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: float
    peak_flops: float  # dense 16-bit (tensor core) FLOP/s
    assumed: bool = False  # figures assumed for a generic name, not a datasheet match
    memory_bw: float = 2e12  # bytes/s of device memory (element-wise kernels: quantization)


TABLE = {
    "H100 NVL": DeviceSpec("H100 NVL", 94 * GB, 835e12, memory_bw=3.9e12),
    "H100 80GB": DeviceSpec("H100 SXM5 80GB", 80 * GB, 989e12, memory_bw=3.35e12),
    "H100": DeviceSpec("H100 SXM5 80GB", 80 * GB, 989e12, memory_bw=3.35e12),
    "A100 80GB": DeviceSpec("A100 80GB", 80 * GB, 312e12, memory_bw=2.0e12),
    "A100": DeviceSpec("A100 40GB", 40 * GB, 312e12, memory_bw=1.555e12),
    "V100-SXM2-32GB": DeviceSpec("V100 SXM2 32GB", 32 * GB, 125e12, memory_bw=0.9e12),
    "V100": DeviceSpec("V100 16GB", 16 * GB, 125e12, memory_bw=0.9e12),
    "PCIe GPU": DeviceSpec("generic PCIe GPU (A100 80GB PCIe-class, assumed)", 80 * GB, 312e12, assumed=True,
                           memory_bw=1.935e12),
}
CPU = DeviceSpec("CPU process (nominal)", 16 * GB, 0.1e12, assumed=True, memory_bw=20e9)


def device_spec(model: Optional[str], kind: str = "gpu", memory_gb: Optional[float] = None,
                tflops: Optional[float] = None) -> DeviceSpec:
    """The spec for a device model name; ``memory_gb`` / ``tflops`` override (or supply an unknown model)."""
    if kind == "cpu":
        spec = CPU
    else:
        spec = next((TABLE[k] for k in sorted(TABLE, key=len, reverse=True) if model and k.lower() in model.lower()),
                    None)
        if spec is None:
            if memory_gb is None or tflops is None:
                raise ValueError(f"no memory/FLOP figures for device model {model!r}; known: {sorted(TABLE)}. Pass "
                                 "--device-memory-gb and --device-tflops (plan) or memory_gb=/tflops= to the planner")
            spec = DeviceSpec(model or "unknown", memory_gb * GB, tflops * 1e12, assumed=True)
    if memory_gb is not None or tflops is not None:
        spec = DeviceSpec(spec.name, (memory_gb * GB) if memory_gb else spec.memory_bytes,
                          (tflops * 1e12) if tflops else spec.peak_flops, True, spec.memory_bw)
    return spec
