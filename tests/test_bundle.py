"""`llm-pg bundle`: config, metrics, generations, eval completions and final weights per run; no wrapper folder."""

import zipfile

import pytest

from llm_pg.cli.bundle import bundle, main


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


def test_bundle_refuses_two_spellings_of_one_name_and_a_run_inside_another(tmp_path):
    """Found in review: `run_name: ./base` beside `base` passed the repeated-name check and mixed the two runs'
    files in the zip; a run `a/b` beside a run `a` would put one run's folder inside the other's."""
    base = make_run(tmp_path / "x", "base")
    dotted = make_run(tmp_path / "y", "base", run_name="./base")
    with pytest.raises(ValueError, match=r"run_name './base' cannot name a folder inside a zip"):
        bundle([base, dotted], tmp_path / "b.zip")
    (base / ".lock").write_text("1 host token\n")
    with pytest.raises(ValueError, match=r"lies in the run directory .*x/base, whose files are its own"):
        bundle([make_run(tmp_path / "w", "other")], base / "checkpoints" / "last.ckpt")  # found in review: it was
        # truncated, and its iteration copy (a hard link of it) with it
    assert (base / "checkpoints" / "last.ckpt").read_bytes() == b"big"
    inner = make_run(tmp_path / "z", "seed1", run_name="base/seed1")
    for pair in ([base, inner], [inner, base]):
        with pytest.raises(ValueError, match=r"one would lie inside the other"):
            bundle(pair, tmp_path / "b.zip")
    assert not (tmp_path / "b.zip").exists()


# ---- hostile run directories (issue 18, item 7) ------------------------------------------------------------


def test_links_out_of_the_run_directory_are_left_out_with_one_line_each(tmp_path, capsys):
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("private")
    (tmp_path / "outside" / "more.txt").write_text("private too")
    run = make_run(tmp_path / "runs", "r")
    (run / "final" / "stolen.txt").symlink_to(secret)  # a file link out
    (run / "final" / "dir").symlink_to(secret.parent)  # a folder link out
    (run / "eval" / "loop").symlink_to(run / "eval")  # a folder link back inside: walked once
    (run / "final" / "inside.txt").symlink_to(run / "metrics.csv")  # a link that stays inside: followed
    out = tmp_path / "b.zip"
    assert main([str(run), "--out", str(out)]) == 0
    archive = zipfile.ZipFile(out)
    assert all(b"private" not in archive.read(n) for n in archive.namelist())
    assert "r/final/inside.txt" in archive.namelist() and "r/final/adapter_model.safetensors" in archive.namelist()
    assert sorted(n for n in archive.namelist() if n.startswith("r/eval/")) == [
        "r/eval/iter_00000.jsonl",
        "r/eval/iter_00010.jsonl",
    ]
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"llm-pg bundle: skipped {run / 'final/dir'}: a link out of the run directory",
        f"llm-pg bundle: skipped {run / 'final/stolen.txt'}: a link out of the run directory",
    ]


def test_final_itself_a_link_out_is_left_out(tmp_path, capsys):
    elsewhere = make_run(tmp_path / "other", "x")
    run = make_run(tmp_path / "runs", "r", finished=False)
    (run / "final").symlink_to(elsewhere / "final")
    (run / "generations.jsonl").unlink()
    (run / "generations.jsonl").symlink_to(elsewhere / "metrics.csv")
    names = bundle([run], tmp_path / "b.zip")
    assert not any(n.startswith("r/final") for n in names) and "r/generations.jsonl" not in names
    assert capsys.readouterr().err.splitlines() == [
        f"llm-pg bundle: skipped {run / 'generations.jsonl'}: a link out of the run directory",
        f"llm-pg bundle: skipped {run / 'final'}: a link out of the run directory",
    ]


def test_a_config_with_a_python_tag_is_one_line_and_the_tag_never_runs(tmp_path, capsys):
    run = make_run(tmp_path / "runs", "r")
    marker = tmp_path / "ran"
    (run / "config.yaml").write_text(f"run_name: !!python/object/apply:os.system ['touch {marker}']\n")
    assert main([str(run), "--out", str(tmp_path / "b.zip")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"llm-pg bundle: error: {run / 'config.yaml'}: not a config llm-pg wrote (")
    assert "\n" not in err and "python/object/apply:os.system" in err
    assert not marker.exists() and not (tmp_path / "b.zip").exists()
    (run / "config.yaml").write_text("- a list\n")
    assert main([str(run), "--out", str(tmp_path / "b.zip")]) == 2
    assert "a YAML list, not a mapping" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["final/x.zip", "metrics.csv", "new/deeper/out.zip"])
def test_an_out_inside_the_run_is_refused_and_the_run_is_left_byte_identical(tmp_path, capsys, target):
    run = make_run(tmp_path, "r1")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert main([str(run), "--out", str(run / target)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"llm-pg bundle: error: --out {run / target} lies inside the run directory {run}, which the bundle reads "
        f"(the zip would grow into itself or replace the run's files); write it outside, e.g. --out r1.zip\n"
    )
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert not (run / "new").exists()
