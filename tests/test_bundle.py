"""`llm-pg bundle`: config, metrics, generations, eval completions and final weights per run; no wrapper folder."""

import zipfile

import pytest

from llm_pg.bundle import bundle, main


def make_run(root, name, run_name=None, finished=True):
    run = root / name
    (run / "eval").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / "wandb" / "offline-run-1").mkdir(parents=True)
    (run / "config.yaml").write_text(f"seed: 0\nrun_name: {run_name or name}\n")
    (run / "metrics.csv").write_text("step,train/reward\n1,0.5\n")
    (run / "generations.jsonl").write_text('{"iteration": 0}\n')
    (run / "hparams.yaml").write_text("lr: 1\n")
    (run / "eval" / "iter_00000.jsonl").write_text("{}\n")
    (run / "eval" / "iter_00010.jsonl").write_text("{}\n")
    (run / "checkpoints" / "last.ckpt").write_bytes(b"big")
    (run / "wandb" / "offline-run-1" / "run.wandb").write_bytes(b"w")
    if finished:
        (run / "final").mkdir()
        (run / "final" / "adapter_model.safetensors").write_bytes(b"weights")
        (run / "final" / "tokenizer.json").write_text("{}")
    return run


def test_bundle_layout_has_run_names_at_the_top_and_leaves_checkpoints_out(tmp_path):
    grpo = make_run(tmp_path / "runs", "format_copy_grpo")
    swept = make_run(tmp_path / "runs" / "abl", "kl_coef0.2_seed0", run_name="abl/kl_coef0.2_seed0", finished=False)
    out = tmp_path / "out" / "results.zip"
    assert main([str(grpo), str(swept), "--out", str(out)]) == 0
    names = sorted(zipfile.ZipFile(out).namelist())
    assert names == sorted(
        [
            *(
                f"format_copy_grpo/{f}"
                for f in (
                    "config.yaml",
                    "metrics.csv",
                    "generations.jsonl",
                    "eval/iter_00000.jsonl",
                    "eval/iter_00010.jsonl",
                    "final/adapter_model.safetensors",
                    "final/tokenizer.json",
                )
            ),
            *(
                f"abl/kl_coef0.2_seed0/{f}"
                for f in (
                    "config.yaml",
                    "metrics.csv",
                    "generations.jsonl",
                    "eval/iter_00000.jsonl",
                    "eval/iter_00010.jsonl",
                )
            ),
        ]
    )
    assert zipfile.ZipFile(out).read("format_copy_grpo/final/adapter_model.safetensors") == b"weights"


def test_bundle_refuses_non_runs_and_repeated_names(tmp_path):
    a = make_run(tmp_path / "x", "run")
    b = make_run(tmp_path / "y", "run")
    with pytest.raises(ValueError, match="both run 'run'"):
        bundle([a, b], tmp_path / "b.zip")
    with pytest.raises(FileNotFoundError, match=r"no config\.yaml"):
        bundle([tmp_path], tmp_path / "b.zip")
    assert not (tmp_path / "b.zip").exists()
