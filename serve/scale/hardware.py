"""GPU hardware presets for the roofline: peak dense bf16 FLOP/s, HBM bandwidth and capacity, NVLink.

All figures are per GPU, SXM form factor, from the vendor datasheets; "dense" means without the 2:4
structured sparsity that the datasheets' headline Tensor Core figures include (NVIDIA marks those
with an asterisk; dense = sparse / 2).

- A100 SXM4 80GB: NVIDIA A100 Tensor Core GPU datasheet
  (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf):
  BF16 Tensor Core 312 TFLOPS (624 sparse), HBM2e 80 GB at 2,039 GB/s, NVLink 600 GB/s.
- H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h100/):
  BF16 Tensor Core 1,979 TFLOPS sparse -> 989 dense, HBM3 80 GB at 3.35 TB/s, NVLink 900 GB/s.
- H200 SXM: NVIDIA H200 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h200/):
  BF16 1,979 TFLOPS sparse -> 989 dense (same GH100 compute as H100), HBM3e 141 GB at 4.8 TB/s,
  NVLink 900 GB/s.
- B200 (HGX B200, 1,000 W): NVIDIA HGX B200 specifications (https://www.nvidia.com/en-us/data-center/hgx/):
  FP16/BF16 Tensor Core 36 PFLOPS sparse for 8 GPUs -> 4.5 sparse, 2.25 PFLOPS dense per GPU;
  HBM3e 1,440 GB / 8 = 180 GB per GPU; 64 TB/s / 8 = 8 TB/s per GPU; NVLink 5 1.8 TB/s per GPU.

NVLink figures are the datasheets' total bidirectional bandwidth per GPU; a ring all-reduce moves
data one way per link, so the roofline uses half of it (``nvlink_unidirectional_bytes_per_s``).
"""
from __future__ import annotations

from dataclasses import dataclass

from serve.errors import check_choice


@dataclass(frozen=True)
class Hardware:
    """One GPU. Units: FLOP/s, bytes/s, bytes. Frozen; validated once.

    Attributes:
        name: preset key. peak_bf16_flops: dense bf16 Tensor Core FLOP/s.
        hbm_bytes_per_s: HBM bandwidth. hbm_bytes: HBM capacity.
        nvlink_bytes_per_s: NVLink bandwidth per GPU, both directions summed (datasheet figure).
        source: datasheet the numbers come from.
    """

    name: str
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    nvlink_bytes_per_s: float
    source: str = ""

    def __post_init__(self):
        for field_name in ("peak_bf16_flops", "hbm_bytes_per_s", "hbm_bytes", "nvlink_bytes_per_s"):
            val = getattr(self, field_name)
            if not isinstance(val, (int, float)) or not val > 0:
                raise ValueError(f"{field_name} must be a positive number, got {val!r}")

    @property
    def nvlink_unidirectional_bytes_per_s(self) -> float:
        """Bytes/s one way per GPU (half the datasheet's bidirectional figure)."""
        return self.nvlink_bytes_per_s / 2


TFLOPS, TBPS, GB = 1e12, 1e12, 1e9

PRESETS: dict[str, Hardware] = {
    "A100": Hardware("A100", 312 * TFLOPS, 2.039 * TBPS, 80 * GB, 600 * GB,
                     source="NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS bf16 dense, 2,039 GB/s, 80 GB, NVLink 600 GB/s"),
    "H100": Hardware("H100", 989 * TFLOPS, 3.35 * TBPS, 80 * GB, 900 * GB,
                     source="NVIDIA H100 datasheet (SXM5): 989 TFLOPS bf16 dense, 3.35 TB/s, 80 GB, NVLink 900 GB/s"),
    "H200": Hardware("H200", 989 * TFLOPS, 4.8 * TBPS, 141 * GB, 900 * GB,
                     source="NVIDIA H200 datasheet (SXM): 989 TFLOPS bf16 dense, 4.8 TB/s, 141 GB, NVLink 900 GB/s"),
    "B200": Hardware("B200", 2250 * TFLOPS, 8.0 * TBPS, 180 * GB, 1800 * GB,
                     source="NVIDIA HGX B200 specifications / 8 GPUs: 2.25 PFLOPS bf16 dense, 8 TB/s, 180 GB, "
                            "NVLink 1.8 TB/s"),
}


def hardware(name: str) -> Hardware:
    """The preset ``name`` (a key of ``PRESETS``). Raises ValueError naming the known presets."""
    check_choice("hardware", name, sorted(PRESETS))
    return PRESETS[name]
