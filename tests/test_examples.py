"""Every example under examples/ trains the tiny model for 2 iterations through `llm-pg fit`, as its config is,
from a working directory that is not its own (modules and data files are found beside the config)."""

import csv
import os
import sys
from pathlib import Path

import pytest

from llm_pg.data import user_code

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIGS = sorted(EXAMPLES.glob("*/config.yaml"))
COMPONENTS = {  # what each example logs as train/reward_<component>
    "arith_reward": ["close_enough", "boxed_number"],
    "copy_numbers": ["answer_tag"],
    "json_tool": ["boxed_number"],
    "lookup_tool": ["correct", "boxed", "relaxed"],
    "reasoning_gym": ["score"],
    "reverse_task": ["tag", "placed"],
}


def test_every_example_is_listed():
    assert sorted(c.parent.name for c in CONFIGS) == sorted(COMPONENTS)
    for config in CONFIGS:
        assert config.read_text().startswith(f"# llm-pg fit --config examples/{config.parent.name}/config.yaml")


@pytest.mark.parametrize("config", CONFIGS, ids=[c.parent.name for c in CONFIGS])
def test_example_trains_two_iterations(config, tmp_path, monkeypatch):
    from llm_pg.cli.fit import main

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(user_code, "_lookup_dirs", [])
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            f"--config={os.path.relpath(config, tmp_path)}",
            "--model.init_args.iterations=2",
            f"--runs_root={tmp_path / 'runs'}",
            "--run_name=run",
            "--wandb_project=null",
            "--trainer.enable_progress_bar=false",
        ]
    )
    run = tmp_path / "runs" / "run"
    assert (run / "COMPLETE").exists()
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train = [row for row in rows if row.get("train/reward")]
    assert len(train) == 2
    for row in train:
        parts = [float(row[f"train/reward_{name}"]) for name in COMPONENTS[config.parent.name]]
        assert float(row["train/reward"]) == pytest.approx(sum(parts), abs=1e-5)  # components sum to the reward
    evals = [float(row["eval/exact_match"]) for row in rows if row.get("eval/exact_match")]
    assert len(evals) == 2 and all(0.0 <= value <= 1.0 for value in evals)  # at iteration 0 and at the end
