"""A learner killed after its checkpoint but before (or while) writing its metrics line: on restart the line
is rewritten from the checkpoint, and a torn line never glues onto the next one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tlt_stream.basics.config import Config
from tlt_stream.rl.checkpoint import latest_checkpoint, restore_checkpoint, save_checkpoint
from tlt_stream.rl.records import load_metrics
from tlt_stream.roles.learner_parts.records import UpdateRecords


def bare_service(run_dir: Path) -> UpdateRecords:
    return UpdateRecords(Config(), run_dir, None, lambda: None)  # type: ignore[arg-type]  # files only


def test_a_missing_metrics_line_is_recovered_from_the_checkpoint(tmp_path: Path, init_policy: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(init_policy)
    optimizer = torch.optim.AdamW(model.parameters())
    extra = {"metrics": {"reward_mean": 0.5, "groups": 2.0}, "trained_groups": ["s000001-0000", "s000001-0001"]}
    save_checkpoint(tmp_path / "checkpoints", step=2, model=model, optimizer=optimizer, ledger=["x"], extra=extra)
    service = bare_service(tmp_path)
    service._append_metrics({"version": 1, "reward_mean": 0.25, "trained_groups": ["s000000-0000"]})
    with (tmp_path / "metrics.jsonl").open("a") as out:
        out.write('{"version": 2, "reward_m')  # the kill tore the line for version 2
    found = latest_checkpoint(tmp_path / "checkpoints")
    assert found is not None
    _, meta = restore_checkpoint(found, restore_rng=False)
    service.recover_row(found, meta)
    rows = load_metrics(tmp_path)
    assert [r["version"] for r in rows] == [1, 2]
    assert rows[1]["trained_groups"] == extra["trained_groups"] and rows[1]["recovered"] is True
    assert rows[1]["groups"] == 2.0 and rows[1]["reward_mean"] == 0.5
    service.recover_row(found, meta)  # a second restart writes nothing more
    service._append_metrics({"version": 3, "trained_groups": []})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["version"] == 3 and len(load_metrics(tmp_path)) == 3
