"""Which of our files and functions one training iteration runs through, traced with `sys.setprofile`.

    .venv/bin/python benchmarks/trace_iteration.py [--config configs/tiny/format_copy_grpo.yaml] [--iteration 2]
        [--list]

Runs the config in this process (W&B off, a temporary run directory, `--iteration` iterations, evaluation only at
the start and the end) and, for iteration `--iteration` alone, records every call into a function defined under
`llm_pg/` from the rollout hook (`RolloutCallback.on_train_batch_start`) to the end of the module's `training_step`.
Comprehensions, generator expressions and lambdas are left out (they are parts of the function that holds them).
It also lists the functions that receive the LightningModule itself as an argument, other than the module's own
methods, Lightning's callback hooks (`on_*` methods of a `Callback`) and the CLI: a lower layer that takes the
module as its context. Issue 40 measured 25 files, 132 functions and 10 such functions on the main job, and sets
targets of at most 15, 80 and 0. Prints the lists with `--list`; the LAST line is JSON:
`{"files": N, "functions": N, "module_takers": [...]}`. A figure to read, not a test: it counts what runs, so a
config that turns a path on or off moves it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "llm_pg") + os.sep
SKIPPED = {"<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>", "<lambda>"}


class Tracer:
    """Records the `(file, qualified name)` of each call into our package while on, and who took the module."""

    def __init__(self) -> None:
        self.on = False
        self.module = None
        self.functions: set[tuple[str, str]] = set()
        self.takers: set[str] = set()

    def __call__(self, frame, event: str, arg) -> None:
        if not self.on or event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE) or code.co_name in SKIPPED:
            return
        where = os.path.relpath(code.co_filename, ROOT)
        name = code.co_qualname
        self.functions.add((where, name))
        if self.module is None or where.startswith("llm_pg/cli/"):
            return
        arguments = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        values = [frame.f_locals.get(a) for a in arguments]
        if not any(v is self.module for v in values):
            return
        first = values[0] if values else None
        if first is self.module and arguments[0] == "self":  # one of the module's own methods
            return
        from lightning.pytorch.callbacks import Callback

        if isinstance(first, Callback) and code.co_name.startswith("on_"):  # a Lightning hook
            return
        self.takers.add(f"{where}:{name}")


def traced_fit(config: str, iteration: int) -> Tracer:
    import lightning.pytorch as L

    from llm_pg.callbacks.rollout import RolloutCallback
    from llm_pg.cli.fit import run_cli

    tracer = Tracer()
    hook = RolloutCallback.on_train_batch_start
    calls = {"rollout": 0}

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch, batch_idx: int) -> None:
        calls["rollout"] += 1
        if calls["rollout"] == iteration:
            tracer.module = module
            tracer.on = True
            step = type(module).training_step

            def training_step(*args, **kwargs):
                try:
                    return step(*args, **kwargs)
                finally:
                    tracer.on = False

            module.training_step = training_step.__get__(module)  # this instance only: the class stays as it is
        hook(self, trainer, module, batch, batch_idx)

    RolloutCallback.on_train_batch_start = on_train_batch_start
    sys.setprofile(tracer)
    threading.setprofile(tracer)
    try:
        with tempfile.TemporaryDirectory() as runs:
            run_cli(
                [
                    "fit",
                    f"--config={ROOT / config}",
                    f"--runs_root={runs}",
                    "--run_name=trace",
                    f"--model.init_args.iterations={iteration}",
                    "--model.init_args.evaluation.every=100000",
                    "--wandb_project=null",
                    "--trainer.enable_progress_bar=false",
                ]
            )
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        RolloutCallback.on_train_batch_start = hook
    if calls["rollout"] < iteration:
        raise SystemExit(f"the run made {calls['rollout']} iterations, fewer than --iteration={iteration}")
    return tracer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny/format_copy_grpo.yaml", help="relative to the repository")
    parser.add_argument("--iteration", type=int, default=2, help="the iteration traced (1 = the first)")
    parser.add_argument("--list", action="store_true", help="print every file and function")
    args = parser.parse_args()
    if args.iteration < 1:
        parser.error(f"--iteration={args.iteration}: give 1 or more")
    os.environ.setdefault("WANDB_MODE", "disabled")
    tracer = traced_fit(args.config, args.iteration)
    files = sorted({where for where, _ in tracer.functions})
    if args.list:
        for where in files:
            names = sorted(name for w, name in tracer.functions if w == where)
            print(f"{where} ({len(names)}): {', '.join(names)}")
    takers = sorted(tracer.takers)
    print(f"iteration {args.iteration} of {args.config}: {len(files)} files, {len(tracer.functions)} functions")
    print(f"functions that take the LightningModule ({len(takers)}): {', '.join(takers) or 'none'}")
    print(json.dumps({"files": len(files), "functions": len(tracer.functions), "module_takers": takers}))


if __name__ == "__main__":
    main()
