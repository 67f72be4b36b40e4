"""`lightning-shard topo`, run in-process through cli.main."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from lightning_shard.cli import SUBCOMMANDS, build_parser, main

ASSETS = Path(__file__).parent / "assets" / "topology"


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
    assert partial["fabric"]["pcie_gen"] == 3 and partial["gbps"][0][1] == 15.75 and partial["matrix"][6][7] == "unknown"
    assert any("no link information" in w for w in partial["warnings"])
    rocm = _json(capsys, ["topo", "--file", str(ASSETS / "f27_mi300_rocm_smi.txt"), "--json"])
    assert rocm["islands"][0]["link"] == "xgmi"


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
