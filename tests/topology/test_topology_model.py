"""Topology model: presets (every shipped file), figures, NVSwitch heuristic, islands, warnings, nodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightning_shard.topology import LinkClass as L
from lightning_shard.topology import Topology, from_capture, list_presets, load_preset
from lightning_shard.topology.links import Fabric
from lightning_shard.topology.presets import PRESET_DIR, build_preset, read_preset

ASSETS = Path(__file__).parents[1] / "assets" / "topology"

# preset: (devices, nodes, islands, pair classes, slowest island ring GB/s)
PRESETS = {
    "hgx_h100_8": (8, 1, [tuple(range(8))], {L.NVSWITCH}, 450.0),
    "h100_nvl_8": (8, 1, [(0, 1), (2, 3), (4, 5), (6, 7)], {L.NVLINK, L.NUMA_NODE, L.CROSS_SOCKET}, 300.0),
    "a100_pcie_4_pairs": (4, 1, [(0, 1), (2, 3)], {L.NVLINK, L.CROSS_SOCKET}, 300.0),
    "dgx1_v100": (8, 1, [tuple(range(8))], {L.NVLINK, L.CROSS_SOCKET}, 50.0),
    "pcie_8": (8, 1, [(i,) for i in range(8)], {L.PCIE_SWITCH, L.PCIE_HOSTBRIDGE, L.CROSS_SOCKET}, None),
    "hgx_h100_2nodes_ib": (16, 2, [tuple(range(8)), tuple(range(8, 16))], {L.NVSWITCH, L.NETWORK}, 450.0),
    "cpu": (4, 1, [(0, 1, 2, 3)], {L.SHM}, 40.0),
    "cpu_2x2": (4, 1, [(0, 1), (2, 3)], {L.SHM, L.CROSS_SOCKET}, 40.0),
}


def test_every_shipped_preset_is_checked():
    assert set(list_presets()) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset(name):
    n, nodes, islands, classes, ring = PRESETS[name]
    text = (PRESET_DIR / f"{name}.yaml").read_text()
    assert text.startswith("#"), "a preset starts with a comment: what machine, where the figures come from"
    assert yaml.safe_load(text)["name"] == name
    topo = load_preset(name)
    assert (len(topo.devices), topo.num_nodes) == (n, nodes)
    assert [i.devices for i in topo.islands] == islands
    assert topo.link_classes() == classes
    rings = [i.ring_gbps for i in topo.islands if len(i.devices) > 1]
    assert (min(rings) if rings else None) == ring
    assert topo.warnings == []


def test_presets_compose_with_hydra():
    """The files are a Hydra group too ("Design rules" 11): `topology=<name>` gives the preset's keys."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from lightning_shard.train import register

    register()  # the structured-config schemas the shipped configs extend
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(PRESET_DIR.parent), version_base="1.3"):
        for name in sorted(PRESETS):
            cfg = compose(config_name="train", overrides=[f"topology={name}"])
            composed = OmegaConf.to_container(cfg.topology)
            for key, value in yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text()).items():
                if (name, key) == ("cpu", "devices"):
                    continue  # the Hydra app runs the cpu machine with 2 processes (conf/machine/cpu.yaml)
                assert composed[key] == value, (name, key)
            assert len(build_preset(OmegaConf.to_container(cfg.topology) if "base" not in cfg.topology
                                    else read_preset(name)).devices) == PRESETS[name][0]
    GlobalHydra.instance().clear()


def test_public_figures():
    hgx, nvl, a100 = load_preset("hgx_h100_8"), load_preset("h100_nvl_8"), load_preset("a100_pcie_4_pairs")
    assert hgx.gbps(0, 5) == 450.0  # NVLink4 through NVSwitch, per direction per GPU
    assert nvl.gbps(0, 1) == 300.0  # H100 NVL bridge: 600 GB/s bidirectional
    assert nvl.gbps(0, 2) == 63.0 and a100.gbps(1, 2) == pytest.approx(31.5 * 0.82)  # Gen5 NODE, Gen4 SYS
    assert a100.gbps(0, 1) == 300.0  # A100 NVLink3 bridge
    dgx1 = load_preset("dgx1_v100")
    assert dgx1.gbps(0, 1) == 25.0 and dgx1.gbps(0, 3) == 50.0  # NV1 / NV2 of NVLink2
    two = load_preset("hgx_h100_2nodes_ib")
    assert two.gbps(0, 8) == 50.0 and two.link(3, 12).cls is L.NETWORK  # NDR 400 Gb/s per GPU's NIC
    assert two.ring(range(16))[0] == 50.0
    assert load_preset("cpu", devices=2).devices[1].kind == "cpu"
    assert all(lk.latency_us >= 0 for row in hgx.links for lk in row)


def test_nvswitch_heuristic_vs_direct_links():
    """NV# uniform over >= 4 GPUs is a switch only if NV# x (peers) exceeds 18 links per GPU."""
    direct = from_capture(ASSETS / "f06_h100_4gpu_direct_nv6.txt")  # NV6 x 3 peers = 18: direct
    assert direct.link_classes() == {L.NVLINK}
    four = Topology.from_tokens("t", [["X" if i == j else "NV12" for j in range(4)] for i in range(4)])
    assert four.link_classes() == {L.NVSWITCH}  # NV12 x 3 = 36 > 18
    three = Topology.from_tokens("t", [["X" if i == j else "NV12" for j in range(3)] for i in range(3)])
    assert three.link_classes() == {L.NVLINK}  # fewer than 4 GPUs: never called a switch


def test_dgx1_hybrid_cube_mesh_ring():
    dgx1 = load_preset("dgx1_v100")
    gbps, order = dgx1.islands[0].ring_gbps, dgx1.islands[0].ring_order
    assert gbps == 50.0 and sorted(order) == list(range(8))  # a ring over NV2 links only exists
    assert all(dgx1.link(order[k], order[(k + 1) % 8]).nvlinks == 2 for k in range(8))


def _hgx_with_dead_gpu3() -> list[list[str]]:
    rows = [["X" if i == j else "NV18" for j in range(8)] for i in range(8)]
    for k in range(8):
        if k != 3:
            rows[3][k] = rows[k][3] = "NODE" if k < 4 else "SYS"
    return rows


def test_degraded_fabric_warning():
    topo = Topology.from_tokens("hgx", _hgx_with_dead_gpu3())
    assert topo.link(0, 1).cls is L.NVSWITCH  # the 7 healthy GPUs still form the switched island
    (warning,) = topo.warnings
    assert "GPU3" in warning and "PCIe only" in warning and "nvidia-smi nvlink -s -i 3" in warning
    assert [i.devices for i in topo.islands] == [(0, 1, 2, 4, 5, 6, 7), (3,)]
    pcie = build_preset({**read_preset("pcie_8"), "expect_nvlink": True})
    assert len(pcie.warnings) == 8 and "preset expects NVLink" in pcie.warnings[0]
    assert from_capture(ASSETS / "f17_rtx4090_pcie_tabs.txt").warnings == []  # no NVLink anywhere: fine


def test_subset_and_nodes():
    nvl = load_preset("h100_nvl_8")
    sub = nvl.subset([5, 4, 1, 0])
    assert [d.name for d in sub.devices] == ["GPU5", "GPU4", "GPU1", "GPU0"]
    assert [d.local_index for d in sub.devices] == [0, 1, 2, 3]
    assert [i.devices for i in sub.islands] == [(0, 1), (2, 3)] and sub.link(0, 2).cls is L.CROSS_SOCKET
    three = nvl.replicate_nodes(3)
    assert three.num_nodes == 3 and three.devices_per_node == 8 and len(three.islands) == 12
    assert three.devices[9].node == 1 and three.devices[9].local_index == 1
    with pytest.raises(ValueError, match="replicate a one-node topology"):
        three.replicate_nodes(2)
    d = three.to_dict()
    assert d["nodes"] == 3 and len(d["matrix"]) == 24 and d["gbps"][0][0] is None


@pytest.mark.parametrize(
    "cfg, words",
    [
        ({"name": "x", "devices": 2, "uniform": "NV4", "matrix": ["X NV4", "NV4 X"]}, "exactly one of"),
        ({"name": "x", "devices": 3, "matrix": ["X NV4", "NV4 X"]}, "3 rows of 3 cells"),
        ({"name": "x", "devices": 2, "uniform": "NV4", "numa": [0]}, "numa lists 1 entries"),
        ({"name": "x", "devices": 2, "uniform": "FOO"}, "not a link token"),
        ({"name": "x", "devices": 2, "uniform": "NV4", "pcie_gen": 7}, "pcie_gen=7"),
        ({"name": "x", "devices": 0, "uniform": "NV4"}, "devices=0: must be a whole number >= 1"),
    ],
)
def test_bad_presets(cfg, words):
    with pytest.raises(ValueError, match=words):
        build_preset(cfg)


def test_unknown_preset_and_keys(tmp_path):
    with pytest.raises(ValueError, match="unknown topology preset 'nope'; available: .*hgx_h100_8"):
        load_preset("nope")
    (tmp_path / "bad.yaml").write_text("# x\nname: bad\ndevices: 2\nuniform: NV4\ncolour: red\n")
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        load_preset("bad", directory=tmp_path)
    (tmp_path / "other.yaml").write_text("name: else\ndevices: 2\nuniform: NV4\n")
    with pytest.raises(ValueError, match="must equal the file name"):
        load_preset("other", directory=tmp_path)
    assert Fabric(nvlink_gen=5).link(L.NVSWITCH, 18).gbps == 900.0  # B200: 1.8 TB/s bidirectional
