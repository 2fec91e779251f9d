"""What `llm-pg` prints: its help lists every command, the known third-party noise is silenced and nothing else."""

import logging
import sys
import warnings

import pytest
from lightning.fabric.utilities.warnings import PossibleUserWarning
from transformers.utils import logging as hf_logging

from llm_pg.cli.console import silence_known_noise
from llm_pg.cli.entry import COMMANDS, main
from llm_pg.cli.fit import LLMPGCLI

OURS = ["fit", "validate", "sweep", "report", "bundle", "real-model", "pretrain-tiny", "eval-tiny"]


def test_help_lists_every_command_with_one_line_and_not_test_or_predict(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == OURS
    for line in out.splitlines():
        if line.startswith("  "):
            assert len(line.split(maxsplit=1)[1]) > 20, line  # a description, not just the name
    assert "test" not in listed and "predict" not in listed
    assert list(COMMANDS) == OURS


def test_no_command_prints_the_help_and_exits_2(capsys):
    with pytest.raises(SystemExit) as stop:
        main([])
    assert stop.value.code == 2 and "pretrain-tiny" in capsys.readouterr().out


def test_lightning_test_and_predict_are_not_offered(capsys, monkeypatch):
    assert set(LLMPGCLI.subcommands()) == {"fit", "validate"}
    monkeypatch.setattr(sys, "argv", ["llm-pg"])  # `main` hands its words to LightningCLI through sys.argv
    with pytest.raises(SystemExit) as stop:
        main(["test", "--config", "configs/tiny/format_copy_grpo.yaml"])
    assert stop.value.code == 2
    assert "invalid choice: 'test' (choose from 'fit', 'validate')" in capsys.readouterr().err


def test_known_warnings_are_silenced_and_any_other_still_shows():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        silence_known_noise()
        for message, category in [
            ("Found 59 module(s) in eval mode at the start of training. This may ...", PossibleUserWarning),
            ("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning),
            ("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use ...", FutureWarning),
            ("the learning rate is 1e9: this will diverge", UserWarning),
            ("Found 59 module(s) in eval mode", RuntimeWarning),  # the same words in another category: shown
        ]:
            warnings.warn(message, category, stacklevel=1)
    assert [(str(w.message), w.category) for w in caught] == [
        ("the learning rate is 1e9: this will diverge", UserWarning),
        ("Found 59 module(s) in eval mode", RuntimeWarning),
    ]


def test_known_log_lines_are_silenced_and_others_still_show(caplog):
    silence_known_noise()
    silence_known_noise()  # idempotent: one filter per logger
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    connector = logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector")
    assert len(rank_zero.filters) == 1
    with caplog.at_level(logging.INFO):
        rank_zero.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        rank_zero.info("TPU available: False, using: 0 TPU cores")
        rank_zero.info("GPU available: True (cuda), used: True")
        connector.info("`weights_only` was not set, defaulting to `False`.")
        connector.warning("checkpoint could not be restored")
    assert [r.getMessage() for r in caplog.records] == [
        "GPU available: True (cuda), used: True",
        "checkpoint could not be restored",
    ]


def test_only_the_weight_loading_bars_of_transformers_are_silenced():
    previous = hf_logging.set_tqdm_hook(None)
    try:
        silence_known_noise()
        with hf_logging.tqdm(range(2), desc="Loading weights") as bar:
            assert bar.disable
        with hf_logging.tqdm(range(2), desc="Downloading model.safetensors") as bar:
            assert not bar.disable
    finally:
        hf_logging.set_tqdm_hook(previous)
