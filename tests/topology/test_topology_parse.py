"""nvidia-smi topo -m parser on real captures (tests/assets/topology, sources in its README) and bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_shard.topology import LinkClass as L
from lightning_shard.topology import NotATopologyMatrix, TopologyParseError, from_capture, parse_topo
from lightning_shard.topology.model import parse_cpu_list
from lightning_shard.topology.parse import split_cells

ASSETS = Path(__file__).parents[1] / "assets" / "topology"
ALL8 = ((0, 1, 2, 3, 4, 5, 6, 7),)
SINGLE8 = tuple((i,) for i in range(8))

# file: (devices, islands, pair classes, slowest island ring GB/s (None: singletons), partial)
CAPTURES = {
    "f02_a100_sxm_nvswitch_nics.txt": (8, ALL8, {L.NVSWITCH}, 300.0, False),
    "f03_h100_sxm_nvswitch_tabs.txt": (8, ALL8, {L.NVSWITCH}, 450.0, False),
    "f05_h100_nvswitch_old_columns.txt": (8, ALL8, {L.NVSWITCH}, 450.0, False),
    "f06_h100_4gpu_direct_nv6.txt": (4, ((0, 1, 2, 3),), {L.NVLINK}, 150.0, False),
    "f08_h100_nvl_pairs.txt": (8, ((0, 1), (2, 3), (4, 5), (6, 7)), {L.NVLINK, L.NUMA_NODE, L.CROSS_SOCKET},
                               300.0, False),
    "f09_a100_pcie_pairs.txt": (4, ((0, 1), (2, 3)), {L.NVLINK, L.CROSS_SOCKET}, 300.0, False),
    "f13_dgx2_v100_partial.txt": (16, (tuple(range(16)),), {L.NVSWITCH}, 150.0, True),
    "f17_rtx4090_pcie_tabs.txt": (8, SINGLE8, {L.CROSS_SOCKET}, None, False),
    "f18_consumer_mixed_numa.txt": (5, tuple((i,) for i in range(5)), {L.CROSS_SOCKET, L.PCIE_HOSTBRIDGE, L.NUMA_NODE},
                                    None, False),
    "f20_rtx3090_numa_na_tabs.txt": (2, ((0,), (1,)), {L.CROSS_SOCKET}, None, False),
    "f22_pcie_2017_partial.txt": (8, SINGLE8, {L.PCIE_SWITCH, L.PCIE_HOSTBRIDGE, L.CROSS_SOCKET, L.UNKNOWN},
                                  None, True),
}


def _read(name: str) -> str:
    return (ASSETS / name).read_text()


@pytest.mark.parametrize("name", sorted(CAPTURES))
def test_real_captures(name):
    n, islands, classes, ring, partial = CAPTURES[name]
    topo = from_capture(ASSETS / name, allow_partial=partial)
    assert len(topo.devices) == n
    assert tuple(i.devices for i in topo.islands) == islands
    assert topo.link_classes() == classes
    rings = [i.ring_gbps for i in topo.islands if len(i.devices) > 1]
    assert (min(rings) if rings else None) == ring
    assert not [w for w in topo.warnings if "degraded" in w]


def test_capture_details():
    f02 = from_capture(ASSETS / "f02_a100_sxm_nvswitch_nics.txt")
    assert f02.nics[0] == "NIC0 (mlx5_0)" and len(f02.nics) == 8  # NIC legend
    assert f02.devices[4].numa == 1 and f02.devices[4].cpus[:2] == (32, 33) and len(f02.devices[4].cpus) == 64
    f03 = from_capture(ASSETS / "f03_h100_sxm_nvswitch_tabs.txt")
    assert f03.link(0, 7).nvlinks == 18 and f03.gbps(0, 7) == 450.0
    assert any("NIC3..NIC9" in w for w in f03.warnings)  # NIC rows cut from the capture
    f13 = from_capture(ASSETS / "f13_dgx2_v100_partial.txt", allow_partial=True)
    assert f13.nics[0] == "mlx5_0" and any("NVSwitch fabric" in w for w in f13.warnings)
    f20 = from_capture(ASSETS / "f20_rtx3090_numa_na_tabs.txt")
    assert [d.numa for d in f20.devices] == [None, 1]  # NUMA Affinity N/A
    f22 = from_capture(ASSETS / "f22_pcie_2017_partial.txt", allow_partial=True)
    assert f22.link(0, 1).token == "PIX" and f22.link(6, 7).cls is L.UNKNOWN and f22.link(4, 7).token == "PHB"
    f06 = from_capture(ASSETS / "f06_h100_4gpu_direct_nv6.txt")
    assert [d.numa for d in f06.devices] == [3, 1, 7, 5] and f06.devices[0].cpu_affinity == "6,14,22,30"


def test_tab_space_merged_and_junk_variants_parse_identically():
    text = _read("f08_h100_nvl_pairs.txt")
    want = parse_topo(text).to_dict()["matrix"]
    tabs = "\n".join(re.sub(r" {2,}", "\t", line) for line in text.splitlines())
    merged = text.replace("NODE    NODE", "NODENODE").replace("NV12     X", "NV12X")
    junk = "\x1b[1mNVIDIA Topology:\x1b[0m\r\n" + text.replace("\n", "\r\n").replace("GPU3 ", "\x1b[32mGPU3\x1b[0m ")
    for variant in (tabs, merged, junk):
        assert parse_topo(variant).to_dict()["matrix"] == want
    f03_no_tabs = _read("f03_h100_sxm_nvswitch_tabs.txt").replace("NV18\tNV18", "NV18NV18")
    assert parse_topo(f03_no_tabs).link_classes() == {L.NVSWITCH}


def test_split_cells():
    assert split_cells("NODENODE") == ["NODE", "NODE"]
    assert split_cells("NV12NV12") == ["NV12", "NV12"]
    assert split_cells("NV60-23,48-71") == ["NV6", "0-23,48-71"]
    assert split_cells("SYS0-7") == ["SYS", "0-7"]
    assert split_cells("FOO") is None
    assert parse_cpu_list("0-2,8,10-11") == (0, 1, 2, 8, 10, 11) and parse_cpu_list("N/A") == ()


def test_old_driver_tokens():
    old = ("\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tPSB\tSOC\t0-7\n"
           "GPU1\tPSB\t X \tSOC\t0-7\nGPU2\tSOC\tSOC\t X \t8-15\n")
    topo = parse_topo(old)
    assert topo.link(0, 1).cls is L.PCIE_SWITCH and topo.link(0, 2).cls is L.CROSS_SOCKET


GOOD = """\
        GPU0    GPU1    GPU2    CPU Affinity    NUMA Affinity
GPU0     X      NV4     SYS     0-7     0
GPU1    NV4      X      SYS     0-7     0
GPU2    SYS     SYS      X      8-15    1
"""


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("", 1, "empty input"),
        ("hello\nworld\n", 1, "no header line starting with GPU0"),
        (GOOD.replace("SYS      X      8-15    1", "SYS      X"), 4, "expected 2 value(s)"),
        (GOOD.replace("NV4     SYS     0-7     0\nGPU1", "NV4\nGPU1"), 2, "expected 3 link cells"),
        (GOOD.replace("NV4      X      SYS", "NVX      X      SYS"), 3, "unknown cell 'NVX'"),
        (GOOD.replace("SYS      X      8-15", "SYS      X      SYS  8-15"), 4, "expected 2 value(s)"),
        (GOOD.replace("GPU1    NV4      X ", "GPU1    NV4     SYS "), 3, "X must be exactly in its own column"),
        (GOOD.replace("GPU2    SYS     SYS ", "GPU2    SYS     PIX "), 4, "symmetric"),
        (GOOD.rsplit("GPU2", 1)[0], 4, "GPU2..GPU2 missing"),
        (GOOD.replace("GPU1    NV4", "GPU7    NV4"), 3, "expected row GPU1"),
        (GOOD.replace("NUMA Affinity", "Foo Bar"), 1, "unknown column 'Foo'"),
        (GOOD.replace("GPU1    GPU2", "GPU2    GPU1", 1), 1, "in order"),
        (GOOD.replace("\nGPU2", "\n\nGPU2"), 5, "after the end of the matrix"),
    ],
)
def test_bad_input_names_the_line(text, line, words):
    with pytest.raises(TopologyParseError) as err:
        parse_topo(text, source="cap.txt")
    assert err.value.line == line, str(err.value)
    assert f"cap.txt: line {line}:" in str(err.value) and words in str(err.value)
    assert isinstance(err.value, ValueError)


def test_truncated_capture_needs_allow_partial():
    with pytest.raises(TopologyParseError, match=r"line 7: .*GPU4..GPU15 missing.*allow_partial"):
        from_capture(ASSETS / "f13_dgx2_v100_partial.txt")


@pytest.mark.parametrize(
    "name, looks_like",
    [
        ("f23_nvlink_R_h100.txt", "nvlink -R"),
        ("f24_nvlink_s_a100.txt", "nvlink -s"),
        ("f26_nccl_topo_dump_nvswitch.txt", "NCCL topology dump"),
        ("f26_nccl_topo_dump_direct.txt", "NCCL topology dump"),
        ("f09_nccl_tests_output.txt", "nccl-tests"),
    ],
)
def test_other_tools_output_is_named(name, looks_like):
    with pytest.raises(NotATopologyMatrix) as err:
        from_capture(ASSETS / name)
    assert looks_like in err.value.looks_like
    assert "this is not an `nvidia-smi topo -m` matrix" in str(err.value) and "line " in str(err.value)


def test_rocm_smi_xgmi_matrix():
    topo = from_capture(ASSETS / "f27_mi300_rocm_smi.txt")
    assert len(topo.devices) == 8 and [d.numa for d in topo.devices] == [0] * 4 + [1] * 4
    assert topo.link_classes() == {L.XGMI}
    assert [i.devices for i in topo.islands] == [tuple(range(8))] and topo.islands[0].ring_gbps == 64.0
    with pytest.raises(NotATopologyMatrix, match="rocm-smi"):
        parse_topo(_read("f27_mi300_rocm_smi.txt"))
    with pytest.raises(TopologyParseError, match="unknown link type"):
        from lightning_shard.topology.formats import parse_rocm_smi

        parse_rocm_smi(_read("f27_mi300_rocm_smi.txt").replace("0            XGMI", "0            FOO", 1))
