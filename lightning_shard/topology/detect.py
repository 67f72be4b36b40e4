"""Topology of the live machine: NVML first (`pynvml` from nvidia-ml-py, optional), then
`nvidia-smi topo -m`, then a `cpu` topology when there is no GPU.

Devices are matched by PCI bus id, so the result follows the job's view: `CUDA_VISIBLE_DEVICES` order,
its `GPU-<uuid>` entries (unique prefixes, as CUDA accepts), and containers whose GPUs NVML renumbers from
0. Index entries are NVML indices, which are CUDA ordinals when CUDA_DEVICE_ORDER=PCI_BUS_ID (set it:
CUDA's default "fastest first" order may differ on mixed boxes).
"""

from __future__ import annotations

import importlib
import os
import subprocess
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from lightning_shard.topology.links import Fabric, fabric_for_models
from lightning_shard.topology.model import Device, Topology
from lightning_shard.topology.parse import parse_topo
from lightning_shard.topology.presets import load_preset

# nvmlDeviceGetTopologyCommonAncestor levels (nvml.h: NVML_TOPOLOGY_INTERNAL ... NVML_TOPOLOGY_SYSTEM)
_ANCESTOR_TOKEN = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_REMOTE_GPU, _REMOTE_SWITCH = 0, 2  # nvmlNvLinkDeviceType_t: GPU, IBMNPU (1), SWITCH, UNKNOWN (0xFF)
_MAJOR_TO_NVLINK_GEN = {6: 1, 7: 2, 8: 3, 9: 4, 10: 5}  # compute capability -> NVLink generation
_QUERY = "--query-gpu=index,uuid,pci.bus_id,name,pcie.link.gen.max"
Runner = Callable[[Sequence[str]], str]


class Unavailable(RuntimeError):
    """This detection path does not apply here (no library, no driver, no GPU)."""


def normalize_bus_id(bus: Any) -> str:
    """'00000000:07:00.0' / b'0000:07:00.0' / '07:00.0' -> '0000:07:00.0' (lower case, 4-digit domain)."""
    text = bus.decode() if isinstance(bus, bytes) else str(bus)
    parts = text.strip().lower().split(":")
    if len(parts) == 2:
        parts = ["0"] + parts
    domain, bus_no, devfn = parts
    return f"{int(domain, 16):04x}:{int(bus_no, 16):02x}:{devfn}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible_order(env: Mapping[str, str], uuids: Sequence[str]) -> list[int]:
    """Indices (into `uuids`, the enumeration order) that CUDA_VISIBLE_DEVICES exposes, in CUDA order."""
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(len(uuids)))
    out: list[int] = []
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        if entry.startswith("MIG-"):
            raise ValueError(f"CUDA_VISIBLE_DEVICES entry {entry!r} is a MIG instance: MIG slices have no NVLink "
                             f"topology; pass the full GPU (GPU-<uuid> or its index) or use --preset")
        if entry.startswith("GPU-"):
            hits = [k for k, u in enumerate(uuids) if u.startswith(entry)]
            if len(hits) != 1:
                raise ValueError(f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {len(hits)} GPUs (uuids here: "
                                 f"{', '.join(uuids)}): give a unique prefix")
            k = hits[0]
        elif entry.lstrip("-").isdigit():
            k = int(entry)
            if k < 0:
                break  # CUDA stops at a negative entry
            if k >= len(uuids):
                raise ValueError(f"CUDA_VISIBLE_DEVICES entry {entry!r} names no GPU: "
                                 "this machine (or container) shows "
                                 f"{len(uuids)} GPUs, indices 0..{len(uuids) - 1}")
        else:
            raise ValueError(f"CUDA_VISIBLE_DEVICES entry {entry!r}: expected an index or GPU-<uuid>")
        if k in out:
            raise ValueError(f"CUDA_VISIBLE_DEVICES={spec!r} lists GPU {k} twice")
        out.append(k)
    return out


def detect_nvml(env: Mapping[str, str] | None = None, nvml: Any = None) -> Topology:
    env = os.environ if env is None else env
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as err:
            raise Unavailable("pynvml is not installed (pip install 'lightning-shard[nvml]')") from err
    try:
        nvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound / DriverNotLoaded
        raise Unavailable(f"NVML did not start: {err}") from err
    try:
        return _read_nvml(nvml, env)
    finally:
        nvml.nvmlShutdown()


def _read_nvml(nvml: Any, env: Mapping[str, str]) -> Topology:
    count = nvml.nvmlDeviceGetCount()
    if count == 0:
        raise Unavailable("NVML sees no GPU")
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
    buses = [normalize_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
    order = visible_order(env, uuids)
    if not order:
        raise Unavailable("CUDA_VISIBLE_DEVICES hides every GPU")
    slot = {buses[k]: pos for pos, k in enumerate(order)}  # bus id -> position in the job's view
    n = len(order)
    direct = [[0] * n for _ in range(n)]
    switch = [0] * n
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    for pos, k in enumerate(order):
        for link in range(max_links):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handles[k], link) != getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                    continue
                remote = normalize_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handles[k], link).busId)
            except Exception:  # NVMLError_NotSupported / InvalidArgument past the last link
                continue
            try:
                kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handles[k], link)
            except Exception:
                kind = None  # old drivers: decide by the bus id
            if kind == _REMOTE_GPU or (kind is None and remote in buses):
                if remote in slot:
                    direct[pos][slot[remote]] += 1  # a peer hidden from the job is ignored
            else:
                switch[pos] += 1  # NVSwitch, or an end we cannot identify: treated as a switch port
    tokens = [["X"] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            sw = min(switch[a], switch[b])
            if sw:
                tokens[a][b] = f"NVS{sw + min(direct[a][b], direct[b][a])}"
            elif direct[a][b] or direct[b][a]:
                tokens[a][b] = f"NV{max(direct[a][b], direct[b][a])}"
            else:
                tokens[a][b] = _pcie_token(nvml, handles[order[a]], handles[order[b]])
    devices = [Device(index=p, name=f"GPU{k}", local_index=p, model=_text(nvml.nvmlDeviceGetName(handles[k])),
                      pci_bus_id=buses[k], uuid=uuids[k], numa=_numa(nvml, handles[k])) for p, k in enumerate(order)]
    fabric = _fabric(nvml, [handles[k] for k in order], [d.model for d in devices])
    return Topology.from_tokens("nvml", tokens, devices, fabric, source="nvml")


def _pcie_token(nvml: Any, a: Any, b: Any) -> str:
    try:
        return _ANCESTOR_TOKEN.get(int(nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)), "N/A")
    except Exception:
        return "N/A"


def _numa(nvml: Any, handle: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetNumaNodeId(handle))
    except Exception:
        return None


def _fabric(nvml: Any, handles: Sequence[Any], models: Sequence[str | None] = ()) -> Fabric:
    """Generations from NVML (compute capability, max PCIe link generation); where a query fails, from the
    model names (links.GPU_GENERATIONS: H100 / H200 Gen5, A100 Gen4, V100 Gen3), else the defaults."""
    nvlink_gen: int | None
    pcie_gen: int | None
    try:
        major = min(nvml.nvmlDeviceGetCudaComputeCapability(h)[0] for h in handles)
        nvlink_gen = _MAJOR_TO_NVLINK_GEN.get(major, 5 if major > 10 else None)
    except Exception:
        nvlink_gen = None
    try:
        pcie_gen = min(max(int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)), 3) for h in handles)
        pcie_gen = min(pcie_gen, 5)
    except Exception:
        pcie_gen = None
    return fabric_for_models(list(models), nvlink_gen, pcie_gen)


def _run(cmd: Sequence[str]) -> str:
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=True)
    except FileNotFoundError as err:
        raise Unavailable(f"{cmd[0]} is not installed (not on PATH)") from err
    except (OSError, subprocess.SubprocessError) as err:
        raise Unavailable(f"{' '.join(cmd)} failed: {err}") from err
    return done.stdout


def detect_smi(env: Mapping[str, str] | None = None, run: Runner = _run) -> Topology:
    """Fallback: parse `nvidia-smi topo -m`, map uuids / bus ids with --query-gpu, apply CUDA_VISIBLE_DEVICES.

    The PCIe generation is the GPUs' `pcie.link.gen.max` (the most the GPU and its slot allow), else the one
    of their model; the NVLink generation is the model's (links.GPU_GENERATIONS), else the default.
    """
    env = os.environ if env is None else env
    text = run(["nvidia-smi", "topo", "-m"])
    rows = [[c.strip() for c in r.split(",")] for r in run(["nvidia-smi", _QUERY, "--format=csv,noheader"]).splitlines()
            if r.strip()]
    info = {int(r[0]): (r[1], normalize_bus_id(r[2]), r[3]) for r in rows if len(r) >= 4}
    pcie_max = {int(r[0]): int(r[4]) for r in rows if len(r) >= 5 and r[4].isdigit()}  # "[N/A]" on some parts
    topo = parse_topo(text, source="nvidia-smi topo -m", name="nvidia-smi")
    devices = [replace(d, uuid=info[d.index][0], pci_bus_id=info[d.index][1], model=info[d.index][2])
               if d.index in info else d for d in topo.devices]
    order = visible_order(env, [d.uuid or "" for d in devices])
    if not order:
        raise Unavailable("CUDA_VISIBLE_DEVICES hides every GPU")
    gens = [pcie_max[devices[k].index] for k in order if devices[k].index in pcie_max]
    pcie_gen = min(max(min(gens), 3), 5) if gens and len(gens) == len(order) else None
    fabric = fabric_for_models([devices[k].model for k in order], pcie_gen=pcie_gen)
    if fabric != topo.fabric:
        topo = parse_topo(text, source="nvidia-smi topo -m", name="nvidia-smi", fabric=fabric)
    topo.devices = devices
    return topo if order == list(range(len(topo.devices))) else topo.subset(order, name="nvidia-smi")


def detect(env: Mapping[str, str] | None = None, nvml: Any = None, run: Runner = _run) -> Topology:
    """NVML, else nvidia-smi, else a `cpu` topology with LOCAL_WORLD_SIZE (default 1) devices."""
    env = os.environ if env is None else env
    notes: list[str] = []
    for path in (lambda: detect_nvml(env, nvml), lambda: detect_smi(env, run)):
        try:
            return path()
        except Unavailable as why:
            notes.append(str(why))
    n = int(env.get("LOCAL_WORLD_SIZE", 1))
    topo = load_preset("cpu", devices=n)
    topo.warnings.append(f"no GPU found ({'; '.join(notes)}): falling back to the cpu topology, {n} CPU "
                         f"process{'es' if n != 1 else ''} (gloo; LOCAL_WORLD_SIZE sets how many)")
    return topo
