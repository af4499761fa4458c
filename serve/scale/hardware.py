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
- B200 (HGX B200, 1,000 W): NVIDIA HGX B200 specifications table (https://www.nvidia.com/en-us/data-center/hgx/):
  FP16/BF16 Tensor Core 36 PFLOPS sparse for 8 GPUs -> 4.5 sparse, 2.25 PFLOPS dense per GPU;
  HBM3e 1,440 GB / 8 = 180 GB per GPU; HBM bandwidth 7.7 TB/s per GPU (the current table; earlier
  listings gave 64 TB/s / 8 = 8 TB/s); NVLink 5 1.8 TB/s per GPU.

NVLink figures are the datasheets' total bidirectional bandwidth per GPU; a ring all-reduce moves
data one way per link, so the roofline uses half of it (``nvlink_unidirectional_bytes_per_s``).

One NVLink domain is one 8-GPU HGX / DGX box (``gpus_per_node`` 8). A TP group larger than that spans
nodes, and its ring all-reduce crosses the nodes' network: each GPU has its own NIC, one way
``internode_bytes_per_s`` (the ring's slowest hop sets its pace; NCCL's hierarchical and SHARP
algorithms can do better, a roofline takes the plain ring):

- A100: DGX A100 datasheet, 8 x ConnectX-6 200 Gb/s HDR InfiniBand, one per GPU -> 25 GB/s per GPU.
- H100, H200, B200: DGX H100 / H200 / B200 datasheets, 8 x ConnectX-7 400 Gb/s NDR InfiniBand, one per
  GPU -> 50 GB/s per GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from serve.errors import check_choice, check_int


@dataclass(frozen=True)
class Hardware:
    """One GPU. Units: FLOP/s, bytes/s, bytes. Frozen; validated once.

    Attributes:
        name: preset key. peak_bf16_flops: dense bf16 Tensor Core FLOP/s.
        hbm_bytes_per_s: HBM bandwidth. hbm_bytes: HBM capacity.
        nvlink_bytes_per_s: NVLink bandwidth per GPU, both directions summed (datasheet figure).
        source: datasheet the numbers come from.
        internode_bytes_per_s: one GPU's NIC, one way (bytes/s), for TP groups beyond one node.
        gpus_per_node: GPUs in one NVLink domain (an HGX box: 8).
    """

    name: str
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    nvlink_bytes_per_s: float
    source: str = ""
    internode_bytes_per_s: float = 50e9
    gpus_per_node: int = 8

    def __post_init__(self):
        for field_name in ("peak_bf16_flops", "hbm_bytes_per_s", "hbm_bytes", "nvlink_bytes_per_s",
                           "internode_bytes_per_s"):
            val = getattr(self, field_name)
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0 < val < math.inf:
                raise ValueError(f"{field_name} must be a positive finite number, got {val!r}")
        check_int("gpus_per_node", self.gpus_per_node)

    @property
    def nvlink_unidirectional_bytes_per_s(self) -> float:
        """Bytes/s one way per GPU (half the datasheet's bidirectional figure)."""
        return self.nvlink_bytes_per_s / 2

    def allreduce_bytes_per_s(self, tp: int) -> float:
        """One-way bytes/s per GPU of a ring all-reduce over ``tp`` GPUs: NVLink within one node
        (``tp <= gpus_per_node``), the inter-node NIC beyond it."""
        check_int("tp", tp)
        return self.nvlink_unidirectional_bytes_per_s if tp <= self.gpus_per_node else self.internode_bytes_per_s


TFLOPS, TBPS, GB = 1e12, 1e12, 1e9

GPUS: dict[str, Hardware] = {
    "A100": Hardware("A100", 312 * TFLOPS, 2.039 * TBPS, 80 * GB, 600 * GB,
                     source="NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS bf16 dense, 2,039 GB/s, 80 GB, NVLink 600 GB/s; "
                            "DGX A100: 200 Gb/s HDR InfiniBand per GPU between nodes",
                     internode_bytes_per_s=25 * GB),
    "H100": Hardware("H100", 989 * TFLOPS, 3.35 * TBPS, 80 * GB, 900 * GB,
                     source="NVIDIA H100 datasheet (SXM5): 989 TFLOPS bf16 dense, 3.35 TB/s, 80 GB, NVLink 900 GB/s; "
                            "DGX H100: 400 Gb/s NDR InfiniBand per GPU between nodes"),
    "H200": Hardware("H200", 989 * TFLOPS, 4.8 * TBPS, 141 * GB, 900 * GB,
                     source="NVIDIA H200 datasheet (SXM): 989 TFLOPS bf16 dense, 4.8 TB/s, 141 GB, NVLink 900 GB/s; "
                            "DGX H200: 400 Gb/s NDR InfiniBand per GPU between nodes"),
    "B200": Hardware("B200", 2250 * TFLOPS, 7.7 * TBPS, 180 * GB, 1800 * GB,
                     source="NVIDIA HGX B200 specifications table / 8 GPUs: 2.25 PFLOPS bf16 dense, 7.7 TB/s, 180 GB, "
                            "NVLink 1.8 TB/s; DGX B200: 400 Gb/s NDR InfiniBand per GPU between nodes"),
}


def hardware(name: str) -> Hardware:
    """The preset ``name`` (a key of ``GPUS``). Raises ValueError naming the known presets."""
    check_choice("hardware", name, sorted(GPUS))
    return GPUS[name]
