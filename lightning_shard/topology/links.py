"""Link classes between two devices and the public bandwidth / latency figures we attach to them.

Bandwidths are GB/s *per direction* (what one rank of a ring can send while it receives as much).
Every figure cites where it comes from; the latency figures are order-of-magnitude assumptions used only
to rank links, not measurements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Sequence


class LinkClass(str, Enum):
    """How two devices reach each other, fastest first (the order of the members is the ranking)."""

    SELF = "self"
    NVSWITCH = "nvswitch"  # NV# cells of a switched fabric (HGX / DGX-2): full per-GPU bandwidth to any peer
    NVLINK = "nvlink"  # NV# cells of direct GPU-GPU links (bridges, hybrid cube mesh, 4-GPU boards)
    XGMI = "xgmi"  # AMD Infinity Fabric (rocm-smi "XGMI")
    SHM = "shm"  # CPU "devices" of one host talking through shared memory (gloo test presets)
    PCIE_SWITCH = "pcie_switch"  # PIX / PXB: peers under PCIe switches, not through the CPU
    PCIE_HOSTBRIDGE = "pcie_hostbridge"  # PHB: through one PCIe host bridge (the CPU)
    NUMA_NODE = "numa_node"  # NODE: between host bridges of one NUMA node
    CROSS_SOCKET = "cross_socket"  # SYS: across the SMP interconnect (QPI/UPI/xGMI between sockets)
    NETWORK = "network"  # between nodes (InfiniBand / RoCE / Ethernet)
    UNKNOWN = "unknown"  # a cell a partial capture did not contain

    @property
    def is_fast(self) -> bool:
        """Links that make an island ("Design rules" 5)."""
        return self in (LinkClass.NVSWITCH, LinkClass.NVLINK, LinkClass.XGMI, LinkClass.SHM)

    @property
    def rank(self) -> int:
        return list(LinkClass).index(self)


# nvidia-smi topo -m legend: PIX/PXB/PHB/NODE/SYS; PSB (old drivers: "PCIe switch board") and SOC (old
# drivers' name for SYS, "socket-level link") appear in pre-2017 captures.
PCIE_TOKENS = {
    "PIX": LinkClass.PCIE_SWITCH,
    "PXB": LinkClass.PCIE_SWITCH,
    "PSB": LinkClass.PCIE_SWITCH,
    "PHB": LinkClass.PCIE_HOSTBRIDGE,
    "NODE": LinkClass.NUMA_NODE,
    "SYS": LinkClass.CROSS_SOCKET,
    "SOC": LinkClass.CROSS_SOCKET,
}
NV_TOKEN = re.compile(r"^NV(\d{1,2})$")  # NV# = "a bonded set of # NVLinks" (nvidia-smi legend)
NVS_TOKEN = re.compile(r"^NVS(\d{1,2})$")  # ours, not nvidia-smi's: # NVLinks known to go through NVSwitch

# --- NVLink: GB/s per direction per link, by generation -------------------------------------------
# NVIDIA NVLink page (nvidia.com/en-us/data-center/nvlink) and the GPU datasheets:
#   gen1 P100: 4 links, 160 GB/s total bidirectional   -> 20 GB/s per direction per link
#   gen2 V100: 6 links, 300 GB/s                        -> 25
#   gen3 A100: 12 links, 600 GB/s                       -> 25  (A100 PCIe bridge pair: 600 GB/s, NV12)
#   gen4 H100: 18 links, 900 GB/s (450 per direction)   -> 25  (H100 NVL bridge pair: 600 GB/s, NV12)
#   gen5 B200: 18 links, 1800 GB/s                      -> 50
NVLINK_GBPS_PER_LINK = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
DEFAULT_NVLINK_GEN = 4  # gens 2-4 share 25 GB/s per link, so NV# x 25 is right for every capture we hold

# --- PCIe x16, GB/s per direction (PCI-SIG: 8 / 16 / 32 GT/s x 16 lanes, 128b/130b encoding) --------
PCIE_X16_GBPS = {3: 15.75, 4: 31.5, 5: 63.0}
DEFAULT_PCIE_GEN = 4
# A ring that crosses the CPU sockets (SYS) runs below the PCIe link rate: the F09 capture's nccl-tests
# all_reduce across two A100 PCIe pairs on Gen4 measured busbw 25.9 GB/s = 0.82 x 31.5.
CROSS_SOCKET_FACTOR = 0.82

# --- Generations by GPU model, for sources that name the GPU but not its links (presets with `model:`,
# nvidia-smi names, NVML when a query fails, `topo --file --model`). First match on the upper-cased name
# wins; None: the part has no NVLink (its NVLink generation is then the default, and unused). Sources: the
# NVIDIA datasheets of each part (host interface; NVLink generation), e.g. H100 SXM / PCIe / NVL and H200:
# PCIe Gen5 x16, NVLink 4; A100 SXM4 / PCIe: PCIe Gen4, NVLink 3; V100: PCIe Gen3, NVLink 2; P100: Gen3, NVLink 1.
_B, _E = r"(?<![A-Z0-9])", r"(?!\d)"  # a model number is not part of a longer one ("A2" is not "A2000")
GPU_GENERATIONS: tuple[tuple[re.Pattern[str], int | None, int], ...] = tuple(
    (re.compile(pattern.replace("<", _B).replace(">", _E)), nvlink, pcie) for pattern, nvlink, pcie in (
        (r"<G?B(100|200)>", 5, 5),  # Blackwell data center
        (r"<G?H(100|200|800|20)>", 4, 5),  # Hopper: SXM, PCIe and NVL cards alike are PCIe Gen5
        (r"<RTX 50\d0>|<RTX PRO \d+ BLACKWELL", None, 5),  # Blackwell workstation / consumer
        (r"<A(100|800|30)>", 3, 4),  # Ampere data center
        (r"<A(2|10|16|40)>|<RTX A\d{4}>|<RTX 30\d0>", 3, 4),  # Ampere (A40, RTX A6000, RTX 3090: NVLink 3 bridges)
        (r"<L(4|20|40)>|<RTX 40\d0>|<RTX \d{4} ADA", None, 4),  # Ada: PCIe Gen4, no NVLink
        (r"<V100>|<TITAN V>", 2, 3),  # Volta
        (r"<T4>|<RTX 20\d0>|<QUADRO RTX|<TITAN RTX", 2, 3),  # Turing (NVLink 2 bridges on some)
        (r"<P100>", 1, 3),  # Pascal
        (r"<P(4|6|40)>|<GTX 10\d0>|<TITAN XP?>", None, 3),
    )
)


# --- AMD Infinity Fabric: MI300X datasheet, 7 links x 128 GB/s bidirectional -> 64 per direction ----
XGMI_GBPS_PER_LINK = 64.0

# --- Network, GB/s per direction per NIC: 400 Gb/s InfiniBand NDR = 50 GB/s; HDR 200 Gb/s = 25 GB/s ---
NETWORK_GBPS_PER_NIC = {"ib_ndr": 50.0, "ib_hdr": 25.0, "roce_400g": 50.0, "roce_200g": 25.0, "eth_100g": 12.5}

# Shared memory between processes of one host: gloo test presets only, a nominal figure (order of a
# host memcpy), chosen above the PCIe figures so that fake islands behave like real ones.
SHM_GBPS = 40.0

# Latency (us): assumed orders of magnitude for ranking small messages, not measured figures.
LATENCY_US = {
    LinkClass.SELF: 0.0,
    LinkClass.NVSWITCH: 1.0,
    LinkClass.NVLINK: 1.0,
    LinkClass.XGMI: 1.0,
    LinkClass.SHM: 2.0,
    LinkClass.PCIE_SWITCH: 2.0,
    LinkClass.PCIE_HOSTBRIDGE: 2.5,
    LinkClass.NUMA_NODE: 3.0,
    LinkClass.CROSS_SOCKET: 4.0,
    LinkClass.NETWORK: 5.0,
    LinkClass.UNKNOWN: 5.0,
}


@dataclass(frozen=True)
class Link:
    """One device pair: its class, the NVLink count if any, the cell it came from, and its figures."""

    cls: LinkClass
    gbps: float  # per direction
    latency_us: float
    nvlinks: int = 0
    token: str = ""

    def describe(self) -> str:
        what = f"{self.cls.value}" + (f" x{self.nvlinks}" if self.nvlinks else "")
        return f"{what} {self.gbps:g} GB/s"


@dataclass(frozen=True)
class Fabric:
    """The generation knobs that turn a cell token into figures."""

    nvlink_gen: int = DEFAULT_NVLINK_GEN
    pcie_gen: int = DEFAULT_PCIE_GEN
    network: str = "ib_ndr"
    nics_per_node: int = 8

    def __post_init__(self) -> None:
        if self.nvlink_gen not in NVLINK_GBPS_PER_LINK:
            raise ValueError(f"nvlink_gen={self.nvlink_gen} is not one of {sorted(NVLINK_GBPS_PER_LINK)}")
        if self.pcie_gen not in PCIE_X16_GBPS:
            raise ValueError(f"pcie_gen={self.pcie_gen} is not one of {sorted(PCIE_X16_GBPS)}")
        if self.network not in NETWORK_GBPS_PER_NIC:
            raise ValueError(f"network={self.network!r} is not one of {sorted(NETWORK_GBPS_PER_NIC)}")

    def link(self, cls: LinkClass, nvlinks: int = 0, token: str = "", gpus_per_node: int = 1) -> Link:
        pcie = PCIE_X16_GBPS[self.pcie_gen]
        if cls in (LinkClass.NVSWITCH, LinkClass.NVLINK):
            # NV# x per-link rate: NV18 on H100 = 450 GB/s per direction (the full per-GPU figure through
            # NVSwitch), NV12 H100 NVL / A100 PCIe bridge = 300 (= 600 GB/s bidirectional).
            gbps = nvlinks * NVLINK_GBPS_PER_LINK[self.nvlink_gen]
        elif cls is LinkClass.XGMI:
            gbps = max(nvlinks, 1) * XGMI_GBPS_PER_LINK
        elif cls is LinkClass.SHM:
            gbps = SHM_GBPS
        elif cls is LinkClass.CROSS_SOCKET:
            gbps = pcie * CROSS_SOCKET_FACTOR
        elif cls is LinkClass.NETWORK:
            # rail-optimized nodes: each GPU's ring traffic leaves through its share of the node's NICs
            gbps = NETWORK_GBPS_PER_NIC[self.network] * min(1.0, self.nics_per_node / max(gpus_per_node, 1))
        elif cls is LinkClass.SELF:
            gbps = float("inf")
        elif cls is LinkClass.UNKNOWN:
            gbps = 0.0
        else:  # PCIe classes: the x16 link rate of the generation
            gbps = pcie
        return Link(cls=cls, gbps=round(gbps, 3), latency_us=LATENCY_US[cls], nvlinks=nvlinks, token=token)


def classify_token(token: str) -> tuple[LinkClass, int] | None:
    """The class and NVLink count of one topo -m cell, or None for a token outside the vocabulary.

    NV# cells come back as NVLINK; whether the fabric is switched is decided on the whole matrix. NVS#
    (detection through NVML, presets) is a switched bundle of # links.
    """
    if token == "X":
        return LinkClass.SELF, 0
    if token in PCIE_TOKENS:
        return PCIE_TOKENS[token], 0
    match = NV_TOKEN.match(token)
    if match and int(match.group(1)) > 0:
        return LinkClass.NVLINK, int(match.group(1))
    match = NVS_TOKEN.match(token)
    if match and int(match.group(1)) > 0:
        return LinkClass.NVSWITCH, int(match.group(1))
    if token == "N/A":
        return LinkClass.UNKNOWN, 0
    return None


def generations_for(model: str | None) -> tuple[int | None, int | None]:
    """(NVLink generation, PCIe generation) of a GPU model name; None where the name is not in GPU_GENERATIONS."""
    name = (model or "").upper()
    for pattern, nvlink, pcie in GPU_GENERATIONS:
        if pattern.search(name):
            return nvlink, pcie
    return None, None


def fabric_for_models(models: Sequence[str | None], nvlink_gen: int | None = None, pcie_gen: int | None = None,
                      network: str = "ib_ndr", nics_per_node: int = 8) -> Fabric:
    """A Fabric whose generations not given follow the GPU models (the oldest where they differ), else the defaults."""
    gens = [generations_for(m) for m in models]
    known_nvlink = [nv for nv, _ in gens if nv is not None]
    known_pcie = [pcie for _, pcie in gens if pcie is not None]
    if nvlink_gen is None:
        nvlink_gen = min(known_nvlink) if known_nvlink else DEFAULT_NVLINK_GEN
    if pcie_gen is None:
        pcie_gen = min(known_pcie) if known_pcie else DEFAULT_PCIE_GEN
    return Fabric(nvlink_gen=nvlink_gen, pcie_gen=pcie_gen, network=network, nics_per_node=nics_per_node)
