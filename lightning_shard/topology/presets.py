"""Topology presets (`conf/topology/*.yaml`) and topologies built from captured text files.

A preset is plain YAML (readable by pyyaml, composable by Hydra as the `topology` group):

    name: hgx_h100_8            # must equal the file stem
    devices: 8
    model: NVIDIA H100 80GB HBM3
    nvlink_gen: 4               # links.NVLINK_GBPS_PER_LINK (default: from `model`, links.GPU_GENERATIONS, else 4)
    pcie_gen: 5                 # links.PCIE_X16_GBPS (default: from `model`, else 4)
    expect_nvlink: true         # warn when a GPU shows PCIe only
    numa: [0, 0, 0, 0, 1, 1, 1, 1]
    uniform: NV18               # every off-diagonal cell ... or
    matrix: ["X NV18 ...", ...] # rows of topo -m tokens (SHM and XGMI also allowed)
    nodes: 2                    # optional: identical nodes joined by `network`
    network: ib_ndr
    nics_per_node: 8
    base: hgx_h100_8            # optional: start from another preset's keys
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lightning_shard.shipped import CONF_DIR
from lightning_shard.topology.formats import ROCM, parse_rocm_smi, sniff
from lightning_shard.topology.links import (
    NETWORK_GBPS_PER_NIC,
    NVLINK_GBPS_PER_LINK,
    PCIE_X16_GBPS,
    Fabric,
    LinkClass,
    fabric_for_models,
)
from lightning_shard.topology.model import Device, Topology
from lightning_shard.topology.parse import clean, parse_topo

PRESET_DIR = CONF_DIR / "topology"
_KEYS = {"name", "description", "devices", "kind", "model", "nvlink_gen", "pcie_gen", "expect_nvlink", "numa",
         "uniform", "matrix", "nodes", "network", "nics_per_node", "base"}
_EXTRA_TOKENS = {"SHM": LinkClass.SHM, "XGMI": LinkClass.XGMI}


def list_presets(directory: Path | None = None) -> list[str]:
    return sorted(p.stem for p in (directory or PRESET_DIR).glob("*.yaml"))


def read_preset(name: str, directory: Path | None = None) -> dict[str, Any]:
    """The preset's keys after `base:` inheritance (no topology built)."""
    directory = directory or PRESET_DIR
    path = directory / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown topology preset {name!r}; available: {', '.join(list_presets(directory))} "
                         f"(or build one from a capture: lightning-shard topo --file CAPTURE)")
    data = yaml.safe_load(path.read_text()) or {}
    unknown = set(data) - _KEYS
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; a preset knows {sorted(_KEYS)}")
    if data.get("name", name) != name:
        raise ValueError(f"{path}: name {data['name']!r} must equal the file name {name!r}")
    if "base" in data:
        merged = read_preset(data["base"], directory)
        merged.update({k: v for k, v in data.items() if k != "base"})
        return merged
    return data


def load_preset(name: str, directory: Path | None = None, **overrides: Any) -> Topology:
    """A :class:`Topology` from `conf/topology/<name>.yaml`; `overrides` replace keys (e.g. devices=2)."""
    cfg = {**read_preset(name, directory), **overrides}
    return build_preset(cfg, source=f"conf/topology/{name}.yaml")


def check_keys(cfg: dict[str, Any], source: str, prefix: str = "") -> None:
    """Every key of a preset (or of a composed ``topology`` node: ``prefix="topology."``) holds a value it can take;
    an error names the key, the value and the choices."""
    def bad(key: str, problem: str) -> ValueError:
        return ValueError(f"{source}: {prefix}{key}={cfg[key]!r}: {problem}")

    unknown = sorted(set(cfg) - _KEYS)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(prefix + k for k in unknown)}; a topology knows "
                         f"{', '.join(sorted(_KEYS))}")
    choices = {"kind": ["gpu", "cpu"], "network": sorted(NETWORK_GBPS_PER_NIC),
               "nvlink_gen": sorted(NVLINK_GBPS_PER_LINK), "pcie_gen": sorted(PCIE_X16_GBPS)}
    for key, options in choices.items():
        if cfg.get(key) is not None and cfg[key] not in options:
            raise bad(key, f"not one of the choices: {', '.join(map(str, options))}")
    for key in ("devices", "nodes", "nics_per_node"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise bad(key, "must be a whole number >= 1")
    if cfg.get("expect_nvlink") is not None and not isinstance(cfg["expect_nvlink"], bool):
        raise bad("expect_nvlink", "must be true or false")
    if "devices" not in cfg:
        raise ValueError(f"{source}: {prefix}devices is missing (the number of devices per node)")


def build_preset(cfg: dict[str, Any], source: str = "<preset>", prefix: str = "") -> Topology:
    """``prefix``: how the keys are named where the user typed them (``"topology."`` on the train command)."""
    check_keys(cfg, source, prefix)
    name = cfg.get("name", "preset")
    n = int(cfg["devices"])
    if ("uniform" in cfg) == ("matrix" in cfg):
        raise ValueError(f"{source}: give exactly one of `uniform` (one cell for every pair) "
                         "or `matrix` (rows of cells)")
    if "uniform" in cfg:
        tokens = [["X" if i == j else str(cfg["uniform"]) for j in range(n)] for i in range(n)]
    else:
        tokens = [_row_tokens(str(row)) for row in cfg["matrix"]]
        if len(tokens) != n or any(len(r) != n for r in tokens):
            raise ValueError(f"{source}: matrix must be {n} rows of {n} cells (devices: {n}); got rows of "
                             f"{[len(r) for r in tokens]} cells")
    numa = cfg.get("numa") or [None] * n
    if len(numa) != n:
        raise ValueError(f"{source}: {prefix}numa lists {len(numa)} entries for {n} devices ({prefix}devices={n})")
    kind = cfg.get("kind", "gpu")
    label = "CPU" if kind == "cpu" else "GPU"
    devices = [Device(index=i, name=f"{label}{i}", local_index=i, kind=kind, model=cfg.get("model"), numa=numa[i])
               for i in range(n)]
    # generations not given follow the model (H100 / H200: PCIe Gen5, A100: Gen4, V100: Gen3), else the defaults
    fabric = fabric_for_models([cfg.get("model")], _int_or_none(cfg.get("nvlink_gen")),
                               _int_or_none(cfg.get("pcie_gen")),
                               network=cfg.get("network", "ib_ndr"), nics_per_node=int(cfg.get("nics_per_node", 8)))
    try:
        topo = Topology.from_tokens(name, tokens, devices, fabric, bool(cfg.get("expect_nvlink", False)), source,
                                    extra_tokens=_EXTRA_TOKENS)
    except ValueError as err:  # a cell the parser cannot read: name the key it came from
        key = "uniform" if "uniform" in cfg else "matrix"
        raise ValueError(f"{source}: {prefix}{key}={cfg[key]!r}: {err}; a cell is a `nvidia-smi topo -m` link token "
                         f"(NV<n>, PIX, PXB, PHB, NODE, SYS) or {', '.join(sorted(_EXTRA_TOKENS))}") from err
    nodes = int(cfg.get("nodes", 1))
    if nodes > 1:
        topo = topo.replicate_nodes(nodes)
        topo.name = name
    return topo


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _row_tokens(row: str) -> list[str]:
    return row.replace(",", " ").split()


def from_capture(path: str | Path, allow_partial: bool = False, fabric: Fabric | None = None,
                 expect_nvlink: bool = False, name: str | None = None) -> Topology:
    """A topology from a captured text file: `nvidia-smi topo -m`, or `rocm-smi --showtopo`."""
    path = Path(path)
    text = path.read_text(errors="replace")
    found = sniff(clean(text))
    if found and found[0] == ROCM:
        return parse_rocm_smi(text, source=path.name, name=name or path.stem, fabric=fabric)
    return parse_topo(text, source=path.name, allow_partial=allow_partial, fabric=fabric,
                      expect_nvlink=expect_nvlink, name=name or path.stem)
