"""Parser for `nvidia-smi topo -m` text.

Accepts what real captures contain: tab- or space-separated cells, NIC columns (`NIC#` or device names
such as `mlx5_0`), the `CPU Affinity` / `NUMA Affinity` / `GPU NUMA ID` column sets of different drivers,
`N/A` cells, CPU lists with ranges, the legend and NIC legend blocks, cells merged where tabs were lost
(`NODENODE`, `NV12NV12`), a preamble (`NVIDIA Topology:`, a shell prompt) and ANSI escapes.
Anything else raises :class:`TopologyParseError` naming the line and what was expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lightning_shard.topology.errors import TopologyParseError
from lightning_shard.topology.formats import not_a_matrix, sniff
from lightning_shard.topology.links import Fabric
from lightning_shard.topology.model import Device, Topology

AFFINITY_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
VOCABULARY = "X, SYS, NODE, PHB, PXB, PIX, PSB, SOC, NV# or N/A"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-_]|[\x00-\x08\x0b-\x1f\x7f]")
_COLUMN = re.compile(r"^[A-Za-z][\w.-]*\d$")  # GPU0, NIC3, mlx5_0, ...
_MERGED_COLUMNS = re.compile(r"^(?:(?:GPU|NIC)\d+){2,}$")
_CELL = re.compile(r"X|SYS|NODE|PHB|PXB|PIX|PSB|SOC|N/A|NV(\d{1,2})")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")


@dataclass
class TopoMatrix:
    """The matrix as printed: device columns, cells per row, affinity values, NIC legend."""

    columns: list[str]
    affinity_columns: list[str]
    cells: dict[str, list[str]] = field(default_factory=dict)
    affinity: dict[str, dict[str, str]] = field(default_factory=dict)
    row_line: dict[str, int] = field(default_factory=dict)
    nic_legend: dict[str, str] = field(default_factory=dict)

    @property
    def gpus(self) -> list[str]:
        return [c for c in self.columns if c.startswith("GPU")]

    @property
    def nics(self) -> list[str]:
        return [c for c in self.columns if not c.startswith("GPU")]


def clean(text: str) -> list[str]:
    """Lines with ANSI escapes, carriage returns and other control characters (tabs kept) removed."""
    return [_ANSI.sub("", line).rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]


def split_cells(token: str) -> list[str] | None:
    """'NODENODE' -> ['NODE', 'NODE']; 'NV180-55,112-167' -> ['NV18', '0-55,112-167']; unknown -> None.

    A remainder that is not a cell is returned as the last element (the caller decides if it is an
    affinity value that lost its tab).
    """
    out, pos = [], 0
    while pos < len(token):
        m = _CELL.match(token, pos)
        if not m:
            return out + [token[pos:]] if out else None
        end = m.end()
        if m.group(1) and len(m.group(1)) == 2 and end < len(token) and token[end] in "-,":
            end -= 1  # 'NV60-23': NV6 followed by the CPU list '0-23'
        out.append(token[pos:end])
        pos = end
    return out


def _header(line: str, number: int, source: str) -> tuple[list[str], list[str]]:
    tokens = line.split()
    columns: list[str] = []
    k = 0
    while k < len(tokens) and _COLUMN.match(tokens[k]) and not tokens[k].startswith(("CPU", "NUMA")):
        tok = tokens[k]
        columns += re.findall(r"(?:GPU|NIC)\d+", tok) if _MERGED_COLUMNS.match(tok) else [tok]
        k += 1
    rest = " ".join(tokens[k:])
    affinity = []
    for m in re.finditer("|".join(map(re.escape, AFFINITY_COLUMNS)) + r"|\S+", rest):
        if m.group(0) not in AFFINITY_COLUMNS:
            raise TopologyParseError(f"unknown column {m.group(0)!r} in the header; expected device columns then "
                                     f"{' / '.join(AFFINITY_COLUMNS)}", line=number, source=source)
        affinity.append(m.group(0))
    gpus = [c for c in columns if c.startswith("GPU")]
    if gpus != [f"GPU{i}" for i in range(len(gpus))] or columns[: len(gpus)] != gpus:
        raise TopologyParseError(f"expected GPU columns GPU0, GPU1, ... in order before any NIC column, found "
                                 f"{', '.join(columns)}", line=number, source=source)
    return columns, affinity


def _row(line: str, number: int, label: str, m: TopoMatrix, source: str) -> None:
    n, tokens = len(m.columns), line.split()[1:]
    cells: list[str] = []
    extra: list[str] = []
    for tok in tokens:
        if len(cells) >= n:
            extra.append(tok)
            continue
        for piece in split_cells(tok) or [tok]:
            if len(cells) >= n:
                extra.append(piece)
            elif _CELL.fullmatch(piece):
                cells.append(piece)
            else:
                raise TopologyParseError(f"row {label}, column {m.columns[len(cells)]}: "
                                         f"unknown cell {piece!r}; expected "
                                         f"{VOCABULARY}", line=number, source=source)
    if len(cells) < n:
        raise TopologyParseError(f"row {label}: expected {n} link cells ({m.columns[0]}..{m.columns[-1]}), "
                                 f"found {len(cells)}: "
                                 f"the row is truncated or a column was lost", line=number, source=source)
    own = m.columns.index(label)
    bad_x = [m.columns[j] for j, c in enumerate(cells) if (c == "X") != (j == own)]
    if bad_x:
        raise TopologyParseError(f"row {label}: X must be exactly in its own column {label}, "
                                 f"but columns {', '.join(bad_x)} "
                                 f"disagree: the columns are misaligned", line=number, source=source)
    want = len(m.affinity_columns) if label.startswith("GPU") else 0
    if len(extra) != want:
        raise TopologyParseError(f"row {label}: expected {want} value(s) after the {n} link cells "
                                 f"({', '.join(m.affinity_columns) or 'none'}), "
                                 f"found {len(extra)} ({' '.join(extra) or 'none'})",
                                 line=number, source=source)
    m.cells[label] = cells
    m.affinity[label] = dict(zip(m.affinity_columns, extra))
    m.row_line[label] = number


def parse_matrix(text: str, source: str = "<text>", allow_partial: bool = False) -> TopoMatrix:
    """The printed matrix, checked: rows in column order, X on the diagonal, symmetric cells."""
    lines = clean(text)
    if not any(line.strip() for line in lines):
        raise TopologyParseError("empty input: expected the output of `nvidia-smi topo -m`", line=1, source=source)
    other = sniff(lines)
    if other:
        raise not_a_matrix(*other, source=source)
    head = next((k for k, line in enumerate(lines) if re.match(r"^\s*GPU0(?:\s|GPU|$)", line)), None)
    if head is None:
        raise TopologyParseError("no header line starting with GPU0: "
                                 "expected the column header of `nvidia-smi topo -m` "
                                 "(GPU0 GPU1 ... CPU Affinity)", line=1, source=source)
    columns, affinity = _header(lines[head], head + 1, source)
    m = TopoMatrix(columns, affinity)
    k = head + 1
    while k < len(lines) and lines[k].strip():
        label = lines[k].split()[0]
        expected = columns[len(m.cells)] if len(m.cells) < len(columns) else None
        if label != expected:
            if label in ("Legend:", "NIC"):
                break
            raise TopologyParseError(f"expected row {expected or '(none: all rows read)'}, found {label!r}",
                                     line=k + 1, source=source)
        _row(lines[k], k + 1, label, m, source)
        k += 1
    for number, line in enumerate(lines[k:], start=k + 1):
        legend = _NIC_LEGEND.match(line)
        if legend:
            m.nic_legend[legend.group(1)] = legend.group(2)
        elif re.match(r"^\s*GPU\d+\s", line):
            raise TopologyParseError(f"row {line.split()[0]} after the end of the matrix (a blank line cuts it)",
                                     line=number, source=source)
    missing = [g for g in m.gpus if g not in m.cells]
    if missing and not allow_partial:
        raise TopologyParseError(f"the matrix ends after row {list(m.cells)[-1] if m.cells else '(none)'} "
                                 "but the header names "
                                 f"{len(m.gpus)} GPUs ({missing[0]}..{missing[-1]} missing): "
                                 "the capture is truncated; pass "
                                 f"allow_partial=True (CLI: --partial) to accept unknown links for the missing pairs",
                                 line=k + 1, source=source)
    if not m.cells:
        raise TopologyParseError("header without any GPU row", line=k + 1, source=source)
    _check_symmetric(m, source)
    return m


def _check_symmetric(m: TopoMatrix, source: str) -> None:
    idx = {c: j for j, c in enumerate(m.columns)}
    for a, row in m.cells.items():
        for b, cell in zip(m.columns, row):
            other = m.cells.get(b)
            if other is not None and m.row_line[b] < m.row_line[a] and other[idx[a]] != cell:
                raise TopologyParseError(f"row {a} says {cell} for {b} but row {b} (line {m.row_line[b]}) says "
                                         f"{other[idx[a]]} for {a}: a topo matrix is symmetric, "
                                         "the capture is corrupted",
                                         line=m.row_line[a], source=source)


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


def parse_topo(text: str, source: str = "<text>", allow_partial: bool = False, fabric: Fabric | None = None,
               expect_nvlink: bool = False, name: str | None = None) -> Topology:
    """A one-node :class:`Topology` from `nvidia-smi topo -m` text (GPUs only; NICs listed by name)."""
    m = parse_matrix(text, source, allow_partial)
    gpus, idx = m.gpus, {c: j for j, c in enumerate(m.columns)}
    tokens = [["N/A"] * len(gpus) for _ in gpus]
    for a in gpus:
        for b in gpus:
            if a in m.cells:
                tokens[idx[a]][idx[b]] = tokens[idx[b]][idx[a]] = m.cells[a][idx[b]]
    for i in range(len(gpus)):
        tokens[i][i] = "X"
    devices = [Device(index=i, name=g, local_index=i, numa=_int_or_none(m.affinity.get(g, {}).get("NUMA Affinity")),
                      cpu_affinity=(m.affinity.get(g, {}).get("CPU Affinity") or None)) for i, g in enumerate(gpus)]
    nics = [f"{n} ({m.nic_legend[n]})" if n in m.nic_legend else n for n in m.nics]
    topo = Topology.from_tokens(name or "topo_m", tokens, devices, fabric, expect_nvlink, source, nics)
    absent = [n for n in m.nics if n not in m.cells]
    if absent and len(absent) < len(m.nics):
        topo.warnings.append(f"NIC rows {absent[0]}..{absent[-1]} are not in the capture "
                             "(GPU-NIC links come from the GPU rows)")
    return topo
