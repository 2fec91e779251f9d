"""Sweep files: expansion into seeded, named runs; the shipped sweeps parse with the real `llm-pg fit` parser."""

import os
import signal
import sys
import threading
import time

import pytest
import yaml
from conftest import ROOT

from llm_pg.cli.sweep import (
    Run,
    cli_value,
    expand,
    load_sweep,
    main,
    override_args,
    resume_flag,
    run_fit,
    select,
)

SWEEP = {
    "name": "abl",
    "base": "configs/tiny/format_copy_grpo.yaml",
    "seeds": [0, 3],
    "overrides": {"model.init_args.iterations": 5, "model.init_args.kl_coef": 0.05},
    "runs": {"reference": {}, "kl_coef0.2": {"model.init_args.kl_coef": 0.2}, "mb4_accum3": None},
}


def test_expand_names_every_run_after_its_overrides_and_seed():
    runs = expand(SWEEP)
    assert [r.name for r in runs] == [
        "abl/reference_seed0",
        "abl/reference_seed3",
        "abl/kl_coef0.2_seed0",
        "abl/kl_coef0.2_seed3",
        "abl/mb4_accum3_seed0",
        "abl/mb4_accum3_seed3",
    ]
    assert [r.seed for r in runs] == [0, 3] * 3
    assert {r.config for r in runs} == {"configs/tiny/format_copy_grpo.yaml"}
    assert runs[0].overrides == {"model.init_args.iterations": 5, "model.init_args.kl_coef": 0.05}
    assert runs[2].overrides == {"model.init_args.iterations": 5, "model.init_args.kl_coef": 0.2}  # the run's wins
    assert runs[2].label == "kl_coef0.2"


def test_fit_args_spell_overrides_as_cli_flags():
    run = Run("abl/x_seed1", "c.yaml", {"model.init_args.lora": None, "a.b": True, "c": [1, 2], "d": 1e-3}, seed=1)
    assert run.fit_args("/runs") == [
        "--config", "c.yaml",
        "--model.init_args.lora", "null", "--a.b", "true", "--c", "[1, 2]", "--d", "0.001",
        "--seed", "1", "--run_name", "abl/x_seed1", "--runs_root", "/runs",
    ]  # fmt: skip
    assert run.fit_args("/runs", resume=True)[-2:] == ["--ckpt_path", "last"]
    assert cli_value(0.05) == "0.05" and cli_value(False) == "false"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seeds": []}, "seeds"),
        ({"seeds": [1, 1]}, "repeat"),
        ({"runs": {"bad name": {}}}, "name"),
        ({"runs": {"a": {"seed": 3}}}, "seed"),
        ({"runs": {"a": {"-x": 1}}}, "flag"),
        ({"runs": {"a": 0.1}}, "mapping"),
        ({"sedes": [0]}, "unknown"),
        ({"base": None}, "base"),
        ({"runs": {"a" * 196: {}}}, r"makes a folder of 202 characters \(200 at most\): shorten it by 2"),
        ({"runs": {"a" * 195: {}}, "seeds": [0, 10]}, r"'a{195}' makes a folder of 202 .*: shorten it by 2"),  # seed10
    ],
)
def test_expand_rejects_mistakes_before_anything_runs(change, message):
    with pytest.raises(ValueError, match=message):
        expand({**SWEEP, **change})


def test_select_filters_by_seed_and_name():
    runs = expand(SWEEP)
    assert [r.name for r in select(runs, seeds=[3], only=["reference", "mb4_accum3"])] == [
        "abl/reference_seed3",
        "abl/mb4_accum3_seed3",
    ]
    assert select(runs) == runs
    with pytest.raises(ValueError, match="not in the sweep"):
        select(runs, only=["nope"])


def test_resume_flag_whenever_an_earlier_attempt_left_files(tmp_path):
    assert resume_flag(tmp_path) == [] and resume_flag(tmp_path / "absent") == []
    (tmp_path / ".lock").write_text("1 host\n")  # a lock alone is no attempt
    assert resume_flag(tmp_path) == []
    (tmp_path / "config.yaml").write_text("seed: 0\n")  # died before its first checkpoint: fit starts afresh
    assert resume_flag(tmp_path) == ["--ckpt_path", "last"]


def test_dry_run_skips_finished_runs_and_resumes_interrupted_ones(tmp_path, capsys):
    sweep_file = tmp_path / "abl.yaml"
    sweep_file.write_text(yaml.safe_dump({k: v for k, v in SWEEP.items() if k != "name"}))
    (tmp_path / "runs/abl/reference_seed0/final").mkdir(parents=True)
    (tmp_path / "runs/abl/reference_seed0/COMPLETE").write_text("{}")
    (tmp_path / "runs/abl/reference_seed3/checkpoints").mkdir(parents=True)
    (tmp_path / "runs/abl/reference_seed3/checkpoints/last.ckpt").write_bytes(b"")
    (tmp_path / "runs/abl/reference_seed3/final").mkdir()  # final/ without COMPLETE: not finished
    assert main([str(sweep_file), "--runs_root", str(tmp_path / "runs"), "--dry-run", "--only", "reference"]) == 0
    out = capsys.readouterr().out
    assert "[1/2] abl/reference_seed0 (done, skipped)" in out
    assert "[2/2] abl/reference_seed3 (resuming)" in out
    assert out.count("--ckpt_path last") == 1


def test_a_run_stopped_by_sigterm_is_not_counted_finished(tmp_path, capsys, monkeypatch):
    sweep_file = tmp_path / "abl.yaml"
    sweep_file.write_text(yaml.safe_dump({k: v for k, v in SWEEP.items() if k != "name"}))
    codes = iter([0, 143, 0, 3])
    monkeypatch.setattr("llm_pg.cli.sweep.run_fit", lambda command: (next(codes), False))
    assert main([str(sweep_file), "--runs_root", str(tmp_path / "runs"), "--only", "reference,kl_coef0.2"]) == 1
    captured = capsys.readouterr()
    assert "sweep: 2/4 runs finished" in captured.out
    assert "abl/kl_coef0.2_seed3: interrupted (saved; the next sweep resumes it)" in captured.err  # runs in run order
    assert "abl/reference_seed3: failed (exit 3)" in captured.err


def test_a_sigterm_to_the_sweep_stops_its_run_and_the_sweep(tmp_path, capsys, monkeypatch):
    """`kill <sweep>` reaches the running `llm-pg fit` (which saves and stops) instead of orphaning it."""
    ready, got = tmp_path / "ready", tmp_path / "got"
    child = (
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(got)!r}).write_text('term'), sys.exit(143)))\n"
        f"pathlib.Path({str(ready)!r}).write_text('')\n"
        "time.sleep(60)\n"
    )

    def kill_when_ready():
        for _ in range(600):
            if ready.exists():
                return os.kill(os.getpid(), signal.SIGTERM)  # to this process: the sweep
            time.sleep(0.05)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=kill_when_ready, daemon=True).start()
    start = time.perf_counter()
    assert run_fit([sys.executable, "-c", child]) == (143, True)
    assert got.read_text() == "term" and time.perf_counter() - start < 30
    assert signal.getsignal(signal.SIGTERM) is before  # the sweep's own handling is back

    sweep_file = tmp_path / "abl.yaml"
    sweep_file.write_text(yaml.safe_dump({k: v for k, v in SWEEP.items() if k != "name"}))
    monkeypatch.setattr("llm_pg.cli.sweep.run_fit", lambda command: (143, True))
    assert main([str(sweep_file), "--runs_root", str(tmp_path / "runs"), "--only", "reference"]) == 1
    err = capsys.readouterr().err
    assert "abl/reference_seed0: interrupted (saved; the next sweep resumes it)" in err
    assert "abl/reference_seed3: not started" in err


SHIPPED = sorted((ROOT / "configs" / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_sweeps_parse_with_the_real_cli(path, capsys, monkeypatch):
    runs, sweep = _expanded(path, monkeypatch)
    assert len({r.label for r in runs}) >= 2 and len(sweep["seeds"]) >= 1  # an ablation, or two arms compared
    _parse_with_the_real_cli(runs, sweep, capsys)


# Two-arm comparisons on the real models (configs/real_cpu/sweeps/, configs/qwen_cpu/sweeps/): GRPO against
# GR-REINFORCE, 3 seeds, both arms on their folder's GRPO rehearsal.
REAL_SWEEPS = sorted((ROOT / "configs").glob("*_cpu/sweeps/*.yaml"))


@pytest.mark.parametrize("path", REAL_SWEEPS, ids=lambda p: p.stem)
def test_real_model_sweeps_parse_with_the_real_cli(path, tmp_path, capsys, monkeypatch):
    from llm_pg.models import real_model

    monkeypatch.setenv("LLM_PG_CACHE", str(tmp_path))  # a manifest stands in for each model (the name resolves)
    for name in real_model.MODELS:
        real_model.model_dir(name).mkdir(parents=True)
        (real_model.model_dir(name) / real_model.MANIFEST).write_text("{}")
    runs, sweep = _expanded(path, monkeypatch)
    assert {r.label for r in runs} == {"grpo", "reinforce"} and sweep["seeds"] == [0, 1, 2]
    assert len({r.config for r in runs}) == 1 and runs[0].config.startswith(f"configs/{path.parts[-3]}/")
    _parse_with_the_real_cli(runs, sweep, capsys)


def _expanded(path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["llm-pg"])  # LightningCLI warns when it sees pytest's arguments too
    assert path.read_text().startswith("#"), "a sweep file opens with the command that runs it"
    sweep = load_sweep(path)
    return expand(sweep), sweep


def _parse_with_the_real_cli(runs, sweep, capsys):
    from llm_pg.cli.fit import run_cli
    from llm_pg.runs.spelling import OBJECTIVE_PATHS

    for run in (r for r in runs if r.seed == sweep["seeds"][0]):
        with pytest.raises(SystemExit) as exit_info:
            run_cli(["fit", *[a if a != run.config else str(ROOT / a) for a in run.fit_args()], "--print_config"])
        assert exit_info.value.code == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["run_name"] == run.name
        for key, value in run.overrides.items():
            node = printed
            for part in key.split("."):
                node = node[part]
            if key.endswith(".objective") and value in OBJECTIVE_PATHS:  # a short name: its class, with the defaults
                node, value = node["class_path"], OBJECTIVE_PATHS[value]
            assert node == value, (run.name, key)


def test_override_args_refuses_keys_the_sweep_sets():
    with pytest.raises(ValueError, match="run_name"):
        override_args({"run_name": "x"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "base: configs/tiny/format_copy_grpo.yaml\nruns:\n  a: {}\n  b: {}\n  a: {model.init_args.lr: 0.1}\n",
            "line 5: 'a' is given twice in one mapping (first on line 3); each run name and key once",
        ),
        ("base: configs/tiny/format_copy_grpo.yaml\nruns:\n  ..: {}\n", "name '..': use letters, digits and"),
        ("base: configs/tiny/format_copy_grpo.yaml\nruns:\n  ../../escape: {}\n", "name '../../escape': use letters"),
        ("name: ..\nbase: configs/tiny/format_copy_grpo.yaml\nruns:\n  a: {}\n", "name '..': use letters, digits"),
        ("base: configs/tiny/format_copy_grpo.yaml\nruns: {a: {}\n", "not valid YAML"),
        ("base: x.yaml\nseeds: [0, 0]\nruns: {a: {}}\n", "seeds repeat: [0, 0]"),
    ],
)
def test_a_bad_sweep_file_is_one_line_and_exit_2_before_anything_runs(tmp_path, capsys, text, message):
    sweep_file = tmp_path / "bad.yaml"
    sweep_file.write_text(text)
    before = sorted(tmp_path.rglob("*"))
    status = main([str(sweep_file), "--runs_root", str(tmp_path / "runs")])
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()  # the file's mistake alone: no usage lines, no traceback
    assert status == 2 and line.startswith(f"llm-pg sweep: error: {sweep_file}: ") and message in line, line
    assert captured.out == "" and sorted(tmp_path.rglob("*")) == before  # nothing created


def test_a_wrong_command_line_still_gets_the_usage(tmp_path, capsys):
    sweep_file = tmp_path / "good.yaml"
    sweep_file.write_text("base: configs/tiny/format_copy_grpo.yaml\nruns:\n  a: {}\n")
    with pytest.raises(SystemExit) as stopped:
        main([str(sweep_file), "--only", "b"])
    err = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and err[0].startswith("usage: llm-pg sweep") and "--only names ['b']" in err[-1]


def test_yaml_merge_keys_still_work_and_an_override_is_not_a_repeat(tmp_path):
    sweep_file = tmp_path / "merged.yaml"
    sweep_file.write_text(
        "base: configs/tiny/format_copy_grpo.yaml\n"
        "common: &common {model.init_args.lr: 0.1, model.init_args.kl_coef: 0.0}\n"
        "runs:\n  a: {<<: *common}\n  b: {<<: *common, model.init_args.lr: 0.2}\n"
    )
    spec = load_sweep(sweep_file)
    assert spec["runs"]["b"] == {"model.init_args.lr": 0.2, "model.init_args.kl_coef": 0.0}
