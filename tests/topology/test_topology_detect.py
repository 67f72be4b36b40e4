"""Live-machine detection through a fake NVML module (monkeypatched in as `pynvml`) and the fallbacks."""

from __future__ import annotations

import sys
import types

import pytest

from lightning_shard.topology import LinkClass as L
from lightning_shard.topology.detect import Unavailable, detect, detect_nvml, detect_smi, normalize_bus_id

ASSETS_F09 = "tests/assets/topology/f09_a100_pcie_pairs.txt"


class NVMLError(Exception):
    pass


def fake_nvml(gpus: list[dict], ancestor=lambda a, b: 50, major: int = 9) -> types.ModuleType:
    """gpus: {"bus": "0000:07:00.0", "uuid": "GPU-..", "links": [(remote bus, remote type), ...]}."""
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVML_FEATURE_ENABLED = 1
    m.NVML_NVLINK_MAX_LINKS = 18
    m.calls = []
    m.nvmlInit = lambda: m.calls.append("init")
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = lambda h: gpus[h]["uuid"].encode()  # old pynvml returns bytes
    m.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=("0000" + gpus[h]["bus"]).encode())
    m.nvmlDeviceGetNumaNodeId = lambda h: gpus[h].get("numa", 0)
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (major, 0)
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5

    def link(h, k):
        if k >= len(gpus[h]["links"]):
            raise NVMLError("Not Supported")
        return gpus[h]["links"][k]

    m.nvmlDeviceGetNvLinkState = lambda h, k: 0 if link(h, k)[0] is None else 1
    m.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, k: types.SimpleNamespace(busId=link(h, k)[0])

    def remote_type(h, k):
        kind = link(h, k)[1]
        if kind is None:
            raise NVMLError("Not Supported")
        return kind

    m.nvmlDeviceGetNvLinkRemoteDeviceType = remote_type
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: ancestor(a, b)
    return m


BUS = [f"0000:{b:02x}:00.0" for b in (0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb)]
UUID = [f"GPU-{k}{k}{k}{k}aaaa-0000-1111-2222-33334444555{k}" for k in range(8)]


def hgx(switch_type=2) -> list[dict]:
    switches = ["0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"]
    return [{"bus": BUS[i], "uuid": UUID[i], "numa": i // 4,
             "links": [(switches[k % 4], switch_type) for k in range(18)]} for i in range(8)]


def nvl_pairs(n=4) -> list[dict]:
    """Bridged pairs (0,1), (2,3): 12 links each to the partner GPU."""
    return [{"bus": BUS[i], "uuid": UUID[i], "numa": i // 2, "links": [(BUS[i ^ 1], 0)] * 12} for i in range(n)]


def _pcie(a, b):
    return 40 if a // 2 == b // 2 else 50  # NODE inside a socket pair, SYS across


@pytest.fixture
def nvml(monkeypatch):
    def install(mod):
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod
    return install


def test_nvswitch(nvml):
    mod = nvml(fake_nvml(hgx()))
    topo = detect(env={})
    assert topo.source == "nvml" and len(topo.devices) == 8 and topo.link_classes() == {L.NVSWITCH}
    assert topo.gbps(0, 7) == 450.0 and topo.link(0, 7).token == "NVS18"
    assert topo.devices[2].pci_bus_id == "0000:3a:00.0" and topo.devices[5].numa == 1
    assert mod.calls == ["init", "shutdown"]


def test_unidentified_remote_ends_count_as_switch(nvml):
    nvml(fake_nvml(hgx(switch_type=None)))  # old driver: no remote device type, bus ids are no GPU's
    assert detect(env={}).link_classes() == {L.NVSWITCH}


def test_bridged_pairs_and_pcie_class(nvml):
    nvml(fake_nvml(nvl_pairs(), ancestor=lambda a, b: 40 if a // 2 == b // 2 else 50))
    topo = detect(env={})
    assert [i.devices for i in topo.islands] == [(0, 1), (2, 3)]
    assert topo.link(0, 1).token == "NV12" and topo.link(0, 2).cls is L.CROSS_SOCKET
    # remote type unsupported but the bus id is a GPU's: still a direct link
    pairs = [{**g, "links": [(BUS[i ^ 1], None)] * 12} for i, g in enumerate(nvl_pairs())]
    nvml(fake_nvml(pairs))
    assert detect(env={}).link(2, 3).cls is L.NVLINK


def test_pcie_only(nvml):
    gpus = [{"bus": BUS[i], "uuid": UUID[i], "links": []} for i in range(4)]
    nvml(fake_nvml(gpus, ancestor=lambda a, b: {0: 10, 1: 20}.get(min(a, b) + max(a, b) - 1, 30), major=8))
    topo = detect(env={})
    assert topo.link(0, 1).token == "PIX" and topo.link(0, 2).token == "PXB" and topo.link(1, 3).token == "PHB"
    assert all(len(i.devices) == 1 for i in topo.islands) and topo.fabric.nvlink_gen == 3 and topo.fabric.pcie_gen == 5


def test_cuda_visible_devices_reorders_by_bus_id(nvml):
    nvml(fake_nvml(nvl_pairs(), ancestor=_pcie))
    topo = detect(env={"CUDA_VISIBLE_DEVICES": "3,0,2"})
    assert [d.name for d in topo.devices] == ["GPU3", "GPU0", "GPU2"]
    assert [d.pci_bus_id for d in topo.devices] == [BUS[3], BUS[0], BUS[2]]
    assert topo.link(0, 2).cls is L.NVLINK  # GPU3-GPU2 bridge found through the bus id
    assert topo.link(0, 1).cls is L.CROSS_SOCKET and topo.link(1, 2).cls is L.CROSS_SOCKET  # GPU0's partner hidden
    assert [i.devices for i in topo.islands] == [(0, 2), (1,)]
    assert topo.warnings and "GPU0" in topo.warnings[0]  # its bridge partner is not visible: flagged


def test_cuda_visible_devices_uuids(nvml):
    nvml(fake_nvml(nvl_pairs(), ancestor=_pcie))
    topo = detect(env={"CUDA_VISIBLE_DEVICES": f"{UUID[1][:12]},{UUID[0]}"})
    assert [d.uuid for d in topo.devices] == [UUID[1], UUID[0]] and topo.link(0, 1).nvlinks == 12
    for bad, words in [("GPU-", "matches 4 GPUs"), ("7", "names no GPU"), ("MIG-abc", "MIG"), ("0,0", "twice"),
                       ("x", "expected an index")]:
        with pytest.raises(ValueError, match=words):
            detect(env={"CUDA_VISIBLE_DEVICES": bad})
    assert detect(env={"CUDA_VISIBLE_DEVICES": "1,-1,0"}).devices[0].name == "GPU1"  # CUDA stops at -1
    assert len(detect(env={"CUDA_VISIBLE_DEVICES": "1,-1,0"}).devices) == 1


def test_container_renumbering(nvml):
    """Inside a container NVML shows only the container's GPUs, numbered from 0; bridges to hidden GPUs drop."""
    host = nvl_pairs(4)
    container = [host[1], host[2], host[3]]  # host GPU0 not mapped in
    nvml(fake_nvml(container, ancestor=lambda a, b: 50))
    topo = detect(env={})
    assert [d.pci_bus_id for d in topo.devices] == [BUS[1], BUS[2], BUS[3]]
    assert [i.devices for i in topo.islands] == [(0,), (1, 2)]


def test_fallbacks(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with pytest.raises(Unavailable, match="pynvml is not installed"):
        detect_nvml(env={})
    topo_m = open(ASSETS_F09).read()
    query = "\n".join(f"{i}, {UUID[i]}, 00000000:{0x18 + i:02X}:00.0, NVIDIA A100 80GB PCIe" for i in range(4))

    def run(cmd):
        return topo_m if cmd[1] == "topo" else query

    topo = detect(env={"CUDA_VISIBLE_DEVICES": f"2,{UUID[3]}"}, run=run)
    assert topo.source == "nvidia-smi topo -m" and [d.name for d in topo.devices] == ["GPU2", "GPU3"]
    assert topo.devices[0].pci_bus_id == "0000:1a:00.0" and topo.link(0, 1).nvlinks == 12

    def no_smi(cmd):
        raise Unavailable("nvidia-smi: not found")

    cpu = detect(env={"LOCAL_WORLD_SIZE": "2"}, run=no_smi)
    assert [d.kind for d in cpu.devices] == ["cpu", "cpu"] and "no GPU found" in cpu.warnings[-1]
    with pytest.raises(Unavailable):
        detect_smi(env={"CUDA_VISIBLE_DEVICES": ""}, run=run)


def test_nvml_init_failure_falls_back(nvml):
    mod = fake_nvml([])
    mod.nvmlInit = lambda: (_ for _ in ()).throw(NVMLError("Driver Not Loaded"))
    nvml(mod)
    with pytest.raises(Unavailable, match="Driver Not Loaded"):
        detect_nvml(env={})
    nvml(fake_nvml([]))
    with pytest.raises(Unavailable, match="no GPU"):
        detect_nvml(env={})


def test_normalize_bus_id():
    assert normalize_bus_id(b"00000000:07:00.0") == "0000:07:00.0"
    assert normalize_bus_id("0000:C7:00.0") == "0000:c7:00.0" and normalize_bus_id("07:00.0") == "0000:07:00.0"


def test_generations_by_gpu_model():
    from lightning_shard.topology.links import generations_for

    cases = {"NVIDIA H100 NVL": (4, 5), "NVIDIA H100 80GB HBM3": (4, 5), "NVIDIA H100 PCIe": (4, 5),
             "NVIDIA H200": (4, 5), "NVIDIA GH200 480GB": (4, 5), "NVIDIA B200": (5, 5),
             "NVIDIA A100-SXM4-80GB": (3, 4), "NVIDIA A100 80GB PCIe": (3, 4), "NVIDIA A10G": (3, 4),
             "Tesla V100-SXM2-32GB": (2, 3), "Tesla P100-PCIE-16GB": (1, 3), "Tesla T4": (2, 3),
             "NVIDIA GeForce RTX 4090": (None, 4), "NVIDIA L40S": (None, 4), "NVIDIA GeForce RTX 5090": (None, 5),
             "NVIDIA RTX A2000": (3, 4), "PCIe GPU": (None, None), "AMD Instinct MI300X": (None, None),
             None: (None, None)}
    assert {m: generations_for(m) for m in cases} == cases


def test_preset_generations_follow_the_model():
    from lightning_shard.topology.links import generations_for
    from lightning_shard.topology.presets import build_preset, list_presets, read_preset

    def gens(model):
        t = build_preset({"name": "x", "devices": 2, "uniform": "SYS", **({"model": model} if model else {})})
        return t.fabric.nvlink_gen, t.fabric.pcie_gen, t.gbps(0, 1)

    assert gens("NVIDIA H100 NVL") == (4, 5, 51.66) and gens("NVIDIA A100 80GB PCIe") == (3, 4, 25.83)
    assert gens("Tesla V100-SXM2-32GB") == (2, 3, 12.915) and gens(None) == (4, 4, 25.83)
    assert build_preset({"name": "x", "devices": 2, "uniform": "SYS", "model": "NVIDIA H100 NVL",
                         "pcie_gen": 4}).fabric.pcie_gen == 4  # an explicit key wins
    checked = 0
    for name in list_presets():  # the shipped presets that name their GPU agree with the table
        cfg = read_preset(name)
        nvlink, pcie = generations_for(cfg.get("model"))
        if pcie is not None:
            checked += 1
            assert cfg.get("pcie_gen", pcie) == pcie and cfg.get("nvlink_gen", nvlink) == nvlink, name
    assert checked >= 4


def test_nvml_generation_falls_back_to_the_model(nvml):
    mod = fake_nvml(nvl_pairs())
    mod.nvmlDeviceGetName = lambda h: "NVIDIA H100 NVL"
    mod.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: (_ for _ in ()).throw(NVMLError("Not Supported"))
    mod.nvmlDeviceGetCudaComputeCapability = lambda h: (_ for _ in ()).throw(NVMLError("Not Supported"))
    nvml(mod)
    topo = detect(env={})
    assert (topo.fabric.nvlink_gen, topo.fabric.pcie_gen) == (4, 5) and topo.devices[0].model == "NVIDIA H100 NVL"
    mod.nvmlDeviceGetName = lambda h: "NVIDIA A100 80GB PCIe"
    assert detect(env={}).fabric.pcie_gen == 4
    mod.nvmlDeviceGetName = lambda h: "Some Future GPU"
    assert detect(env={}).fabric.pcie_gen == 4  # unknown model: the default


def test_smi_generation_from_the_query_else_the_model(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    topo_m = open(ASSETS_F09).read()

    def runner(name, gen=None):
        extra = "" if gen is None else f", {gen}"
        query = "\n".join(f"{i}, {UUID[i]}, 00000000:{0x18 + i:02X}:00.0, {name}{extra}" for i in range(4))
        return lambda cmd: topo_m if cmd[1] == "topo" else query

    calls = []
    smi = runner("NVIDIA H100 NVL")
    topo = detect(env={}, run=lambda cmd: calls.append(cmd) or smi(cmd))
    assert ["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id,name,pcie.link.gen.max", "--format=csv,noheader"] in calls
    assert topo.fabric.pcie_gen == 5 and topo.gbps(0, 2) == round(63.0 * 0.82, 3)  # SYS across the pairs
    assert topo.devices[3].model == "NVIDIA H100 NVL" and topo.devices[3].uuid == UUID[3]
    assert detect(env={}, run=runner("NVIDIA H100 NVL", 4)).fabric.pcie_gen == 4  # the slot's limit wins
    assert detect(env={}, run=runner("NVIDIA H100 NVL", "[N/A]")).fabric.pcie_gen == 5
    a100 = detect(env={"CUDA_VISIBLE_DEVICES": "1,0"}, run=runner("NVIDIA A100 80GB PCIe"))
    assert ((a100.fabric.nvlink_gen, a100.fabric.pcie_gen) == (3, 4)
            and [d.name for d in a100.devices] == ["GPU1", "GPU0"])
