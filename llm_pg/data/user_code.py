"""Where the files a config names are looked up: beside the config file, then the working directory.

`class_path: mytask.MyTask` and a reward `"myrewards:score"` in `exp/config.yaml` find `exp/mytask.py` and
`exp/myrewards.py` without PYTHONPATH: the `llm-pg` entry point puts every `--config` file's directory, then the
working directory, on `sys.path` before the config is parsed (jsonargparse imports `class_path` while parsing).
They go at the end, so a file beside a config never shadows an installed package (a `yaml.py` there cannot replace
PyYAML); directories already on the path keep their place.

Data files a task names by a relative path (`DatasetTask`'s `data_files: {train: train.jsonl}`) are looked up in
the same directories, in the same order (`find_file`): the entry point records them (`lookup_dirs`) when it
extends the path. A process that never went through the entry point (a test calling `run_cli`) looks in the
working directory only, unless it calls `add_config_dirs` itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

_lookup_dirs: list[str] = []  # the config directories of this process's command line, then the working directory


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
    """Append the directories of the command line's config files, then the working directory, to `sys.path`
    and record them for `find_file`; returns the directories added to `sys.path` (absolute), in lookup order."""
    wanted = list(dict.fromkeys([str(path.resolve().parent) for path in config_files(words)] + [os.getcwd()]))
    _lookup_dirs[:] = wanted
    added = []
    for directory in wanted:
        if directory not in sys.path and os.path.realpath(directory) not in map(os.path.realpath, sys.path):
            added.append(directory)
    sys.path.extend(added)
    return added


def lookup_dirs() -> list[str]:
    """Where relative file names are looked up, in order: the config files' directories, then the working
    directory (only the working directory before `add_config_dirs` ran)."""
    return list(_lookup_dirs) or [os.getcwd()]


def find_file(name: str) -> str | None:
    """The absolute path of `name`, the first of `lookup_dirs()` that holds it (an absolute `name` as it is);
    None when none does."""
    if os.path.isabs(name):
        return name if os.path.isfile(name) else None
    for directory in lookup_dirs():
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None
