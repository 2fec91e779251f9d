"""Where the Python modules a config names are looked up: beside the config file, then the working directory.

`class_path: mytask.MyTask` and a reward `"myrewards:score"` in `exp/config.yaml` find `exp/mytask.py` and
`exp/myrewards.py` without PYTHONPATH: the `llm-pg` entry point puts every `--config` file's directory, then the
working directory, on `sys.path` before the config is parsed (jsonargparse imports `class_path` while parsing).
They go at the end, so a file beside a config never shadows an installed package (a `yaml.py` there cannot replace
PyYAML); directories already on the path keep their place.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path


def config_files(words: Sequence[str]) -> list[Path]:
    """The files given as `--config FILE` or `--config=FILE` on a command line, in order."""
    files = []
    for i, word in enumerate(words):
        if word == "--config" and i + 1 < len(words):
            files.append(Path(words[i + 1]))
        elif word.startswith("--config="):
            files.append(Path(word.removeprefix("--config=")))
    return files


def add_config_dirs(words: Sequence[str]) -> list[str]:
    """Append the directories of the command line's config files, then the working directory, to `sys.path`;
    returns the directories added (absolute), in lookup order."""
    wanted = [str(path.resolve().parent) for path in config_files(words)] + [os.getcwd()]
    added = []
    for directory in dict.fromkeys(wanted):
        if directory not in sys.path and os.path.realpath(directory) not in map(os.path.realpath, sys.path):
            added.append(directory)
    sys.path.extend(added)
    return added
