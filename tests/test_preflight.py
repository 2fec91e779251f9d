"""Every error before training is one line naming the key or file, exit 2, before the run dir is touched
(llm_pg/cli/fit.py `_preflight`, `instantiate_trainer`; llm_pg/callbacks/checkpoint.py `usable`)."""

import os
import sys

import pytest
import torch
from conftest import ROOT, fit

from llm_pg.callbacks.checkpoint import atomic_save, newest_verified
from llm_pg.cli.fit import main

TINY = f"--config={ROOT / 'configs/tiny/format_copy_grpo.yaml'}"
MATH = [f"--config={ROOT / 'configs/math_hard/grpo.yaml'}", "--model.init_args.model_name_or_path=tiny"]


def one_line_error(capsys, monkeypatch, *args) -> str:
    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    monkeypatch.setenv("LLM_PG_DEBUG", "0")
    with pytest.raises(SystemExit) as stop:
        main(list(args))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llm-pg")]
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("llm-pg: error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--trainer.devices=two", "trainer.`devices` selected with `CPUAccelerator` should be an int > 0"),
        ("--trainer.max_steps=-5", "trainer.`max_steps` must be a non-negative integer or -1"),
    ]
    + ([] if torch.cuda.is_available() else [("--trainer.accelerator=gpu", "trainer.accelerator=gpu: No supported")]),
)
def test_impossible_trainer_keys_are_one_line(tmp_path, capsys, monkeypatch, override, message):
    line = one_line_error(capsys, monkeypatch, "fit", TINY, f"--runs_root={tmp_path}", "--wandb_project=null", override)
    assert message in line, line
    assert not (tmp_path / "tiny_format_copy_grpo").exists()  # refused before the run dir was made


@pytest.mark.parametrize("text", ["", "# only a comment\n", "[1, 2]\n"])
def test_an_empty_or_non_mapping_config_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch, text):
    config = tmp_path / "exp.yaml"
    config.write_text(text)
    line = one_line_error(capsys, monkeypatch, "fit", f"--config={config}", f"--runs_root={tmp_path}")
    assert f"config file {config} is " in line and "give a YAML mapping of settings" in line, line


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (bytes(range(256)) * 2, "could not read"),
        ('{"problem": "caf\xe9 1+1", "solution": "\\\\boxed{2}", "level": "Level 5"}\n'.encode("latin-1"), "UTF-8"),
        (b'{"problem": "1+1", "solution": "no box", "level": "Level 5"}\n', "kept no rows"),
    ],
    ids=["empty", "binary", "latin-1", "no-rows-kept"],
)
def test_data_file_problems_are_one_line_naming_the_file_before_the_run_dir(
    tmp_path, capsys, monkeypatch, content, message
):
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    files = f"--data.task.init_args.data_files={{train: {data}, test: {data}}}"
    line = one_line_error(
        capsys, monkeypatch, "fit", *MATH, f"--runs_root={tmp_path / 'runs'}", "--wandb_project=null",
        "--data.task.init_args.dataset=json", files,
    )  # fmt: skip
    assert message in line and (str(data) in line or "split 'train'" in line), line
    assert not (tmp_path / "runs" / "math_hard_grpo").exists()


def test_settings_are_checked_before_the_run_dir(tmp_path, capsys, monkeypatch):
    (tmp_path / "tiny_format_copy_grpo").mkdir()
    (tmp_path / "tiny_format_copy_grpo" / "metrics.csv").write_text("step\n1\n")
    line = one_line_error(capsys, monkeypatch, "fit", TINY, f"--runs_root={tmp_path}", "--model.init_args.group_size=1")
    assert "model.group_size must be >= 2" in line, line  # not "run dir ... already holds a run"


def test_a_checkpoint_the_safe_loader_refuses_is_skipped_for_the_newest_good_one(tmp_path, random_model_dir, capsys):
    """A verified last.ckpt (its sha256 matches) whose pickle names a callable: the resume passes over it, in one
    line, to the iter_ copy beside it; the payload never runs."""
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=2", "--checkpoint.every_n_iterations=1")
    checkpoints = tmp_path / "run" / "checkpoints"
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    atomic_save({"llm_pg": Payload()}, checkpoints / "last.ckpt")  # hashed like a real one: it verifies
    path, skipped = newest_verified(checkpoints)
    assert path == checkpoints / "iter_00002.ckpt"
    assert len(skipped) == 1 and "last.ckpt (refused by the safe loader (weights_only=True)" in skipped[0]
    fit(tmp_path, random_model_dir, "--model.init_args.iterations=3", "--ckpt_path=last")
    out = capsys.readouterr().out
    assert "refused by the safe loader" in out and f"resuming from {checkpoints / 'iter_00002.ckpt'}" in out
    assert not marker.exists()
    assert (tmp_path / "run" / "COMPLETE").is_file()


@pytest.fixture
def model_copy(random_model_dir, tmp_path):
    """A copy of the random model directory to break."""
    import shutil

    out = tmp_path / "model"
    shutil.copytree(random_model_dir, out)
    return out


def _fit_line(capsys, monkeypatch, tmp_path, model, *extra) -> str:
    return one_line_error(
        capsys, monkeypatch, "fit", TINY, f"--model.init_args.model_name_or_path={model}",
        f"--runs_root={tmp_path / 'runs'}", "--wandb_project=null", *extra,
    )  # fmt: skip


def test_a_model_dir_without_tokenizer_files_is_one_line(tmp_path, capsys, monkeypatch, model_copy):
    for path in model_copy.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            path.unlink()
    line = _fit_line(capsys, monkeypatch, tmp_path, model_copy)
    assert f"model.init_args.model_name_or_path: no tokenizer loads from '{model_copy}'" in line, line
    assert "tokenizer.save_pretrained" in line and not (tmp_path / "runs" / "tiny_format_copy_grpo").exists()


def test_a_chat_template_the_tokenizer_lacks_is_one_line(tmp_path, capsys, monkeypatch, model_copy):
    import json

    (model_copy / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model_copy / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_copy / "tokenizer_config.json").write_text(json.dumps(config))
    line = _fit_line(capsys, monkeypatch, tmp_path, model_copy)
    assert "model.init_args.chat_template is true but the tokenizer of" in line and "chat_template: false" in line


def test_lora_targets_that_name_no_module_are_one_line(tmp_path, capsys, monkeypatch, random_model_dir):
    line = _fit_line(
        capsys, monkeypatch, tmp_path, random_model_dir,
        "--model.init_args.lora.r=4", "--model.init_args.lora.target_modules=[q_proj,qkv_proj]",
    )  # fmt: skip
    assert "model.init_args.lora.target_modules: ['qkv_proj'] name no module of llama models" in line, line
    assert "'gate_proj'" in line and "'q_proj'" in line  # the linear layers it has
