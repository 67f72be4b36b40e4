"""Run summaries and the sweep report (Markdown table + PNG), from hand-made summaries (no training)."""

from __future__ import annotations

import json

from lightning_shard.app.report import markdown_table, read_summaries, write_report, write_summary


def _summary(strategy: str, mem: int, wire: float, tps: float) -> dict:
    return {"strategy": strategy, "topology": "cpu", "recipe": "gpt_test", "accumulation_policy": "defer",
            "world_size": 2, "tokens_per_s": tps, "memory": {"total": mem, "gathered_params": 0},
            "wire_bytes_per_step": wire, "collectives_per_step": 3.0, "final_val_loss": float("nan")}


def test_summary_roundtrip_is_plain_json(tmp_path):
    import torch

    path = write_summary(tmp_path, {"x": torch.tensor(1.5), "nan": float("nan"), "t": (1, 2)})
    assert json.loads(path.read_text()) == {"x": 1.5, "nan": None, "t": [1, 2]}


def test_report_has_one_row_per_run_and_a_png(tmp_path):
    for i, (name, mem) in enumerate((("zero0", 4 << 20), ("zero2", 2 << 20), ("zero3", 1 << 20))):
        run = tmp_path / f"{i}-{name}-cpu-gpt_test"
        run.mkdir()
        write_summary(run, _summary(name, mem, 3 << 20, 1000.0 * (i + 1)))
    (tmp_path / "3-fsdp_shard-cpu-gpt_test").mkdir()  # a failed job: no summary
    md, png = write_report(tmp_path)
    text = md.read_text()
    assert text.count("| cpu | gpt_test |") == 3
    assert "| 4.000 |" in text and "| 1.000 |" in text and "| 3.000 |" in text  # MiB columns
    assert "3-fsdp_shard-cpu-gpt_test" in text  # listed as without summary
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert [r["strategy"] for r in read_summaries(tmp_path)] == ["zero0", "zero2", "zero3"]


def test_empty_sweep_writes_nothing(tmp_path):
    assert write_report(tmp_path) is None
    assert markdown_table([]).count("\n") == 2
