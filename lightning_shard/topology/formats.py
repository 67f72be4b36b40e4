"""Recognise what a capture is, and read the one other matrix format we accept (rocm-smi --showtopo).

`nvidia-smi nvlink -s` / `-R`, NCCL's XML topology dump and nccl-tests output describe one GPU's links or
a benchmark, not the machine's pair matrix: we name them and ask for `nvidia-smi topo -m` instead.
"""

from __future__ import annotations

import re

from lightning_shard.topology.errors import NotATopologyMatrix, TopologyParseError
from lightning_shard.topology.links import Fabric, LinkClass
from lightning_shard.topology.model import Device, Topology

ROCM = "rocm-smi --showtopo output (AMD)"
_SIGNATURES = [  # (regex, what it looks like); first match wins, searched line by line
    (re.compile(r"ROCm System Management Interface|Link Type between two GPUs"), ROCM),
    (re.compile(r"^\s*Link \d+: Remote Device [0-9A-Fa-f]+:[0-9A-Fa-f]+:"),
     "`nvidia-smi nvlink -R` output (remote end of each NVLink of one GPU)"),
    (re.compile(r"^\s*Link \d+: (?:[\d.]+ GB/s|<inactive>)"),
     "`nvidia-smi nvlink -s` output (speed of each NVLink of one GPU)"),
    (re.compile(r"<(?:system|cpu|pci busid|gpu dev|nvlink target)\b"),
     "an NCCL topology dump (NCCL_TOPO_DUMP_FILE XML)"),
    (re.compile(r"\bbusbw\b|Avg bus bandwidth"), "nccl-tests benchmark output"),
]


def sniff(lines: list[str]) -> tuple[str, int] | None:
    """(what the text looks like, 1-based line) for a known non-topo-m format, else None."""
    for number, line in enumerate(lines, start=1):
        for pattern, what in _SIGNATURES:
            if pattern.search(line):
                return what, number
    return None


def not_a_matrix(what: str, line: int, source: str) -> NotATopologyMatrix:
    return NotATopologyMatrix(
        f"this is not an `nvidia-smi topo -m` matrix, it looks like {what}; run `nvidia-smi topo -m` on the "
        f"machine and pass that output (or use a preset: lightning-shard topo --preset NAME)",
        looks_like=what, line=line, source=source,
    )


_SECTION = re.compile(r"=+\s*(.*?)\s*=+\s*$")
_NUMA = re.compile(r"^GPU\[(\d+)\]\s*:\s*\(Topology\) Numa Node:\s*(\d+)")


def parse_rocm_smi(text: str, source: str = "<text>", name: str | None = None,
                   fabric: Fabric | None = None) -> Topology:
    """A topology from `rocm-smi --showtopo`: its "Link Type between two GPUs" matrix and NUMA nodes.

    XGMI pairs become XGMI links (one link each, 64 GB/s per direction); PCIE pairs become NODE or SYS by
    the two GPUs' NUMA nodes.
    """
    lines = text.splitlines()
    section, start = None, None
    numa: dict[int, int] = {}
    for k, line in enumerate(lines, start=1):
        m = _SECTION.match(line.strip())
        if m:
            section = m.group(1)
            if section == "Link Type between two GPUs":
                start = k
        m = _NUMA.match(line.strip())
        if m:
            numa[int(m.group(1))] = int(m.group(2))
    if start is None:
        raise TopologyParseError("rocm-smi output without a 'Link Type between two GPUs' section: run "
                                 "`rocm-smi --showtopo`", source=source)
    header = lines[start].split() if start < len(lines) else []
    n = len(header)
    if n == 0 or header != [f"GPU{i}" for i in range(n)]:
        raise TopologyParseError(f"expected the GPU0 GPU1 ... header of the link-type matrix, found {header[:4]}",
                                 line=start + 1, source=source)
    rows: list[list[str]] = []
    for i in range(n):
        k = start + 2 + i  # 1-based line number of row i
        text_k = lines[k - 1].strip() if k - 1 < len(lines) else "end of input"
        cells = text_k.split()
        if len(cells) != n + 1 or cells[0] != f"GPU{i}":
            raise TopologyParseError(f"expected row GPU{i} with {n} cells, found {text_k[:60]!r}",
                                     line=k, source=source)
        row = []
        for j, cell in enumerate(cells[1:]):
            if i == j:
                if cell != "0":
                    raise TopologyParseError(f"diagonal cell of GPU{i} is {cell!r}, expected 0", line=k, source=source)
                row.append("X")
            elif cell in ("XGMI", "PCIE"):
                row.append("XGMI" if cell == "XGMI" else "NODE" if numa.get(i) == numa.get(j) else "SYS")
            else:
                raise TopologyParseError(f"GPU{i}, column GPU{j}: unknown link type {cell!r}; expected XGMI or PCIE",
                                         line=k, source=source)
        rows.append(row)
    devices = [Device(index=i, name=f"GPU{i}", local_index=i, numa=numa.get(i)) for i in range(n)]
    return Topology.from_tokens(name or "rocm_smi", rows, devices, fabric or Fabric(), source=source,
                                extra_tokens={"XGMI": LinkClass.XGMI})
