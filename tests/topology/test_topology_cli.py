"""`lightning-shard topo`, run in-process through cli.main."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from lightning_shard.cli import SUBCOMMANDS, build_parser, main

ASSETS = Path(__file__).parents[1] / "assets" / "topology"


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_preset_json_with_best_subset(capsys):
    out = _json(capsys, ["topo", "--preset", "h100_nvl_8", "--gpus", "4", "--json"])
    assert out["name"] == "h100_nvl_8" and len(out["devices"]) == 8
    assert [i["devices"] for i in out["islands"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert {i["link"] for i in out["islands"]} == {"nvlink"} and out["islands"][0]["ring_gbps"] == 300.0
    assert out["matrix"][0][1] == "nvlink" and out["matrix"][0][4] == "cross_socket" and out["gbps"][0][1] == 300.0
    assert out["best_subset"] == {"k": 4, "devices": [0, 1, 2, 3], "ring_gbps": 63.0, "cuda_visible_devices": "0,1,2,3"}


def test_file_json(capsys):
    out = _json(capsys, ["topo", "--file", str(ASSETS / "f03_h100_sxm_nvswitch_tabs.txt"), "--json"])
    assert out["islands"] == [{"devices": list(range(8)), "node": 0, "link": "nvswitch", "ring_gbps": 450.0,
                               "ring_order": list(range(8))}]
    assert len(out["nics"]) == 10 and out["devices"][4]["numa"] == 1
    partial = _json(capsys, ["topo", "--file", str(ASSETS / "f22_pcie_2017_partial.txt"), "--partial", "--json",
                             "--pcie-gen", "3"])
    assert (partial["fabric"]["pcie_gen"] == 3 and partial["gbps"][0][1] == 15.75
            and partial["matrix"][6][7] == "unknown")
    assert any("no link information" in w for w in partial["warnings"])
    rocm = _json(capsys, ["topo", "--file", str(ASSETS / "f27_mi300_rocm_smi.txt"), "--json"])
    assert rocm["islands"][0]["link"] == "xgmi"
    rocm5 = _json(capsys, ["topo", "--file", str(ASSETS / "f27_mi300_rocm_smi.txt"), "--pcie-gen", "5", "--json"])
    assert rocm["fabric"]["pcie_gen"] == 4 and rocm5["fabric"]["pcie_gen"] == 5  # --pcie-gen applies to rocm-smi too


def test_live_machine_without_gpu_is_cpu(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("PATH", "")  # no nvidia-smi
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    out = _json(capsys, ["topo", "--json"])
    assert [d["kind"] for d in out["devices"]] == ["cpu", "cpu"] and "no GPU found" in out["warnings"][-1]


def test_rich_output(capsys):
    assert main(["topo", "--preset", "dgx1_v100", "--gpus", "2"]) == 0
    text = capsys.readouterr().out
    for words in ("dgx1_v100", "islands", "NV2", "cross_socket", "CUDA_VISIBLE_DEVICES=0,3", "50"):
        assert words in text, words
    assert main(["topo", "--preset", "hgx_h100_2nodes_ib"]) == 0
    assert "network" in capsys.readouterr().out


def test_errors_are_one_line(capsys):
    assert main(["topo", "--file", str(ASSETS / "f13_dgx2_v100_partial.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-shard topo: error: f13_dgx2_v100_partial.txt: line 7:") and "--partial" in err
    assert main(["topo", "--file", str(ASSETS / "f24_nvlink_s_a100.txt")]) == 2
    assert "nvlink -s" in capsys.readouterr().err
    assert main(["topo", "--preset", "nope"]) == 2
    assert "available:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["topo", "--preset", "cpu", "--file", "x"])  # mutually exclusive: argparse usage error


def test_subcommands_are_pluggable(monkeypatch):
    mod = types.ModuleType("fake_plan")
    mod.register = lambda sub: sub.add_parser("plan").set_defaults(func=lambda args: 7)
    monkeypatch.setitem(sys.modules, "fake_plan", mod)
    monkeypatch.setitem(SUBCOMMANDS, "plan", "fake_plan")
    assert build_parser().parse_args(["plan"]).func(None) == 7 and main(["plan"]) == 7


def _no_gpu(monkeypatch, n="1"):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("PATH", "")  # no nvidia-smi
    monkeypatch.setenv("LOCAL_WORLD_SIZE", n)


def test_no_gpu_says_so_without_link_generations(capsys, monkeypatch):
    """A machine without GPUs: the report says there is none and what it falls back to; no NVLink / PCIe gen."""
    _no_gpu(monkeypatch)
    assert main(["topo"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # rich wraps at the console width
    assert "cpu source: conf/topology/cpu.yaml nodes: 1 devices: 1 CPU process (no GPU)" in text
    assert "NVLink gen" not in text and "PCIe gen" not in text and "link classes" not in text  # no pair: no table
    assert "falling back to the cpu topology, 1 CPU process (gloo; LOCAL_WORLD_SIZE sets how many)" in text
    _no_gpu(monkeypatch, "2")
    out = _json(capsys, ["topo", "--json"])
    assert out["fabric"] == {"nvlink_gen": None, "pcie_gen": None, "network": "ib_ndr"}
    assert "2 CPU processes" in out["warnings"][-1]


def test_rich_output_keeps_brackets(capsys, monkeypatch):
    """Text that looks like rich markup is printed as is: the install hint keeps its [nvml] extra."""
    _no_gpu(monkeypatch)
    assert main(["topo"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "no GPU found (pynvml is not installed (pip install 'lightning-shard[nvml]');" in text
    assert "nvidia-smi is not installed (not on PATH)" in text
    assert main(["topo", "--file", str(ASSETS / "f08_h100_nvl_pairs.txt"), "--model", "[bold]X[/bold] [nvml]"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "devices: 8 x [bold]X[/bold] [nvml] NVLink gen 4, PCIe gen 4" in text
    assert "--model '[bold]X[/bold] [nvml]' is not a GPU whose PCIe generation we know" in text


def test_pcie_generation_follows_the_gpu(capsys):
    """H100 NVL cards are PCIe Gen5: the preset says so, and a capture with --model H100 NVL does too;
    a capture alone (which names no GPU) is Gen4 with a warning that says it is assumed."""
    nvl = _json(capsys, ["topo", "--preset", "h100_nvl_8", "--json"])
    assert nvl["fabric"]["pcie_gen"] == 5 and nvl["gbps"][0][2] == 63.0 and nvl["gbps"][0][4] == 51.66  # NODE, SYS
    f08 = str(ASSETS / "f08_h100_nvl_pairs.txt")
    named = _json(capsys, ["topo", "--file", f08, "--model", "NVIDIA H100 NVL", "--json"])
    assert named["fabric"]["pcie_gen"] == 5 and named["fabric"]["nvlink_gen"] == 4 and named["gbps"][0][2] == 63.0
    assert named["devices"][0]["model"] == "NVIDIA H100 NVL" and named["warnings"] == []
    assert named["gbps"] == nvl["gbps"]  # the capture and the preset of the same machine agree
    bare = _json(capsys, ["topo", "--file", f08, "--json"])
    assert bare["fabric"]["pcie_gen"] == 4 and bare["gbps"][0][2] == 31.5
    assert bare["warnings"] == ["PCIe gen 4 assumed (31.5 GB/s per direction): a capture does not name its GPUs; "
                                "pass --pcie-gen, or --model (e.g. --model 'H100 NVL')"]
    given = _json(capsys, ["topo", "--file", f08, "--pcie-gen", "5", "--json"])
    assert given["fabric"]["pcie_gen"] == 5 and given["warnings"] == []
    v100 = _json(capsys, ["topo", "--file", f08, "--model", "Tesla V100-PCIE-32GB", "--pcie-gen", "4", "--json"])
    assert v100["fabric"] == {"nvlink_gen": 2, "pcie_gen": 4, "network": "ib_ndr"}  # an explicit gen wins
    assert main(["topo", "--preset", "h100_nvl_8"]) == 0
    assert "NVLink gen 4, PCIe gen 5" in " ".join(capsys.readouterr().out.split())


def test_file_missing_or_a_directory_is_one_line(capsys, tmp_path):
    assert main(["topo", "--file", str(tmp_path / "nope.txt")]) == 2
    captured = capsys.readouterr()
    assert (captured.out == ""
            and captured.err == f"lightning-shard topo: error: --file {tmp_path / 'nope.txt'}: no such file\n")
    assert main(["topo", "--file", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lightning-shard topo: error: --file {tmp_path}: not a file") and err.count("\n") == 1
    assert main(["topo", "--file", str(ASSETS / "f08_h100_nvl_pairs.txt"), "--pcie-gen", "7"]) == 2
    assert "pcie_gen=7 is not one of [3, 4, 5]" in capsys.readouterr().err
    assert main(["topo", "--file", str(ASSETS / "f08_h100_nvl_pairs.txt"), "--pcie-gen", "0"]) == 2  # not "unset"
    assert "pcie_gen=0 is not one of [3, 4, 5]" in capsys.readouterr().err


def test_os_errors_of_any_subcommand_are_one_line(capsys, monkeypatch):
    mod = types.ModuleType("fake_cmd")

    def run(args):
        raise PermissionError(13, "Permission denied", "/root/x.png")

    mod.register = lambda sub: sub.add_parser("plan").set_defaults(func=run)
    monkeypatch.setitem(sys.modules, "fake_cmd", mod)
    monkeypatch.setitem(SUBCOMMANDS, "plan", "fake_cmd")
    assert main(["plan"]) == 2
    assert capsys.readouterr().err == "lightning-shard plan: error: /root/x.png: Permission denied\n"
