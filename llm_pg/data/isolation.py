"""Scoring in worker processes, each call under a time limit: a user's reward code cannot hang or end a run.

A task whose scoring runs code that is not llm_pg's own (`runs_user_code`: a `Task` subclass defined outside
`llm_pg`, or a `DatasetTask` with a `module:function` reward) is scored by `RewardWorkers`: `workers` spawned
processes, each holding its own copy of the task, fed one completion at a time. A call that does not return within
`timeout` seconds is ended by the worker's `faulthandler` watchdog, which first writes where the code was stuck (so
the report names the function and line); the parent kills any worker still alive a few seconds later. A call that
raises, calls `sys.exit`, raises KeyboardInterrupt, or takes its worker down (`os._exit`, a crash) comes back as a
`Failure`, and `llm_pg.runs.guards.checked_scores` stops the run with one line naming the row. The built-in tasks
(format_copy, arith, math_hard, and DatasetTask's built-in rewards) score in-process: their checkers are linear-time
on any text (`llm_pg.data.tasks.answers`).

Spawned, not forked: the trainer's process holds threads (torch's, W&B's, vLLM's) whose locks a forked child could
inherit held. A spawned worker imports the task's module and the user's reward modules by name, from the parent's
`sys.path` (which holds the config's folder: `llm_pg.data.user_code`).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from multiprocessing.connection import Connection, wait
from pathlib import Path

from llm_pg.data.tasks.base import Example, RewardError, Score, Task
from llm_pg.data.tasks.tools import ToolEnvironment, ToolInput, ToolOutcome, ToolTask, call_tool

GRACE_SECONDS = 5.0  # after the watchdog's time: the parent kills a worker that is still alive
START_SECONDS = 120.0  # a worker's spawn and imports (torch, sympy, the user's modules), before any time limit
THIS_FILE = str(Path(__file__).resolve())
OUR_CODE = str(Path(__file__).resolve().parents[1])  # llm_pg/


class FailureKind(StrEnum):
    """How a call of the task's code failed (`Failure.kind`)."""

    RAISED = "raised"  # an exception; the detail holds its traceback from the first frame outside llm_pg
    REWARD_ERROR = "reward_error"  # a `RewardError`: the detail is its message
    EXIT = "exit"  # sys.exit or KeyboardInterrupt
    TIMEOUT = "timeout"  # past the time limit; the detail says where it was stuck
    DIED = "died"  # the worker process ended, or could not load the task
    SKIPPED = "skipped"  # not scored, because an earlier row failed


class Request(StrEnum):
    """What a worker is asked to do with a payload (`serve_one`)."""

    SCORE = "score"  # payload: (completion, example)
    TOOL = "tool"  # payload: (environment, tool name, input text or keyword arguments)


@dataclass(frozen=True)
class Failure:
    """Why one completion has no score (or one tool call no outcome): its `kind` and the `detail` the stop's one
    line shows."""

    kind: FailureKind
    detail: str


def runs_user_code(task: Task) -> bool:
    """Whether scoring `task` or running its tools runs code that is not llm_pg's own: its class, a reward function
    it calls, or a tool function."""
    if not type(task).__module__.startswith("llm_pg."):
        return True
    functions = [reward.fn for reward in getattr(task, "rewards", ())]
    if isinstance(task, ToolTask):
        functions += list(task.tools.values())
    return any(not getattr(fn, "__module__", "").startswith("llm_pg.") for fn in functions)


def task_frames(error: BaseException) -> str:
    """The traceback of `error` from the task's `score` on (the task's or a user's own code)."""
    frames = traceback.extract_tb(error.__traceback__)
    theirs = [f for f in frames if f.filename != THIS_FILE] or frames[-1:]
    start = frames.index(theirs[0]) if theirs else 0
    lines = traceback.format_list(frames[start:]) + traceback.format_exception_only(type(error), error)
    return "".join(lines).rstrip()


def score_one(task: Task, completion: str, example: Example) -> Score | Failure:
    """`task.score`, every way it can fail turned into a `Failure` (in a worker, or in-process)."""
    try:
        return task.score(completion, example)
    except RewardError as error:
        return Failure(FailureKind.REWARD_ERROR, str(error))
    except (SystemExit, KeyboardInterrupt, Exception) as error:
        return failure_of(error)


def tool_one(task: Task, environment: ToolEnvironment, name: str, arguments: ToolInput) -> ToolOutcome | Failure:
    """`call_tool`, every way a tool can fail (other than a `ToolError`, an observation) turned into a `Failure`."""
    try:
        return call_tool(environment, name, arguments)
    except (SystemExit, KeyboardInterrupt, Exception) as error:
        return failure_of(error)


def failure_of(error: BaseException) -> Failure:
    """The `Failure` of user code that called `sys.exit`, raised KeyboardInterrupt, or raised."""
    if isinstance(error, SystemExit):
        return Failure(FailureKind.EXIT, f"called sys.exit({error.code!r}){_exited_in(error)}")
    if isinstance(error, KeyboardInterrupt):
        return Failure(FailureKind.EXIT, f"raised KeyboardInterrupt{_exited_in(error)}")
    return Failure(FailureKind.RAISED, task_frames(error))


def _exited_in(error: BaseException) -> str:
    """` in module:function (file line N)`: the outermost frame of `error`'s traceback outside llm_pg, which is the
    function llm_pg called (a `DatasetTask`'s reward `module:function`, a tool, a user task's `score`); the line is
    the innermost one of the user's own files. Empty when no frame is outside llm_pg."""
    frames = list(traceback.walk_tb(error.__traceback__))
    theirs = [(frame, line) for frame, line in frames if not frame.f_code.co_filename.startswith(OUR_CODE)]
    if not theirs:
        return ""
    called = theirs[0][0]
    module = called.f_globals.get("__name__", "?")
    library = (OUR_CODE, sys.prefix, sys.base_prefix)  # a wrapper around sys.exit (W&B installs one) is not the line
    user = [(frame, line) for frame, line in theirs if not frame.f_code.co_filename.startswith(library)]
    frame, line = (user or theirs)[-1]
    return f" in {module}:{called.f_code.co_qualname} ({frame.f_code.co_filename} line {line})"


def serve_one(task: Task, kind: Request, payload: tuple) -> Score | ToolOutcome | Failure:
    """One request of a worker or of in-process scoring: `(Request.SCORE, (completion, example))` or
    `(Request.TOOL, (environment, name, text))`."""
    return score_one(task, *payload) if kind == Request.SCORE else tool_one(task, *payload)


def _stuck_at(dump: str) -> str:
    """The innermost frame of a faulthandler dump that is the user's (not the standard library's or llm_pg's)."""
    frames = [line.strip() for line in dump.splitlines() if line.strip().startswith("File ")]
    library = (OUR_CODE, sys.prefix, sys.base_prefix)
    for line in frames:  # most recent call first
        path = line.split('"')[1] if '"' in line else ""
        if path and not path.startswith(library):
            return line
    return frames[0] if frames else "no Python frame (stuck in C code)"


def _serve(conn: Connection, task_bytes: bytes, timeout: float, dump_path: str) -> None:
    """A worker: serve `(row, kind, payload)` requests (`serve_one`) until None; the watchdog ends a call past
    `timeout`."""
    # Ctrl-C and SIGTERM (sent to the whole process group by a scheduler) are the trainer's to handle: it finishes
    # the iteration, saves and ends its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        task = pickle.loads(task_bytes)  # imports the task's module and the user's reward modules
    except BaseException as error:
        conn.send(("failed", f"{type(error).__name__}: {' '.join(str(error).split())}"))
        return
    conn.send(("ready", None))  # the time limit counts from here, not from the spawn
    with open(dump_path, "w") as dump:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):  # the trainer closed its end (it ended, or dropped the workers)
                return
            if request is None:
                return
            row, kind, payload = request
            faulthandler.dump_traceback_later(timeout, exit=True, file=dump)  # exit code 1 after the dump
            result = serve_one(task, kind, payload)
            faulthandler.cancel_dump_traceback_later()
            conn.send((row, result))


class _Worker:
    def __init__(self, context, task_bytes: bytes, timeout: float, folder: str, index: int) -> None:
        self.dump_path = os.path.join(folder, f"worker{index}.txt")
        Path(self.dump_path).unlink(missing_ok=True)  # no earlier worker's dump can be read as this one's
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, task_bytes, timeout, self.dump_path), daemon=True, name=f"llm-pg-reward-{index}"
        )
        self.process.start()
        child.close()
        self.row: int | None = None  # the row it is scoring
        self.deadline = 0.0
        self.loaded = False

    def ready(self, seconds: float) -> str | None:
        """Wait (at most `seconds`, once) until the worker has loaded the task: None, or why it could not."""
        if self.loaded:
            return None
        if not self.conn.poll(seconds):
            return f"the reward worker did not load the task within {seconds:g} s"
        try:
            status, detail = self.conn.recv()
        except (EOFError, OSError):
            status, detail = "failed", f"it ended while loading (exit code {self.process.exitcode})"
        if status != "ready":
            return f"the reward worker could not load the task: {detail}"
        self.loaded = True
        return None

    def stop(self, kill: bool = False) -> None:
        if kill and self.process.is_alive():
            self.process.kill()
        elif self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                self.process.kill()
        self.process.join(timeout=GRACE_SECONDS)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()

    def dump(self) -> str:
        try:
            return Path(self.dump_path).read_text(errors="replace")
        except OSError:
            return ""


class RewardWorkers:
    """`workers` spawned processes that score a task's completions, each call under `timeout` seconds.

    Started on first use; `close()` ends them (the data module does at the end of fit). After a failure the
    workers are replaced, so a caller that goes on (the `failures: zero` policies of other trainers) could; llm_pg
    stops the run instead (`llm_pg.runs.guards.checked_scores`)."""

    def __init__(self, task: Task, workers: int, timeout: float) -> None:
        if workers < 1:
            raise ValueError(f"reward_workers must be >= 1 to score in worker processes, got {workers}")
        self.task, self.size, self.timeout = task, workers, timeout
        self.workers: list[_Worker] = []
        self._folder: tempfile.TemporaryDirectory | None = None
        self._task_bytes: bytes | None = None

    def _start(self) -> None:
        if self._task_bytes is None:
            try:
                self._task_bytes = pickle.dumps(self.task)
            except Exception as error:
                raise ValueError(
                    f"task {type(self.task).__name__} cannot be sent to a reward worker ({type(error).__name__}: "
                    f"{error}); make it picklable, or set data.reward_workers: 0 to score in this process (without "
                    "a time limit)"
                ) from None
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="llm-pg-rewards-")
        context = multiprocessing.get_context("spawn")
        while len(self.workers) < self.size:
            self.workers.append(_Worker(context, self._task_bytes, self.timeout, self._folder.name, len(self.workers)))

    def score(self, completions: Sequence[str], examples: Sequence[Example]) -> list[Score | Failure]:
        """One result per completion, in order. After the first failure no further row is sent (the rows already
        being scored finish): the rows left get a `FailureKind.SKIPPED` failure, since the run stops at the first."""
        return self.serve([(Request.SCORE, pair) for pair in zip(completions, examples, strict=True)])

    def call_tools(self, calls: Sequence[tuple[ToolEnvironment, str, ToolInput]]) -> list[ToolOutcome | Failure]:
        """One outcome per `(environment, tool name, input)` call, in order, each under the time limit; as `score`
        after a failure."""
        return self.serve([(Request.TOOL, call) for call in calls])

    def serve(self, requests: Sequence[tuple[str, tuple]]) -> list:
        """One result per `(kind, payload)` request (`serve_one`), in order, spread over the workers."""
        self._start()
        results: list = [None] * len(requests)
        pending = deque(range(len(requests)))
        idle = list(self.workers)
        busy: dict[Connection, _Worker] = {}

        def fail(row: int, failure: Failure) -> None:
            results[row] = failure
            while pending:  # nothing more is sent: the run stops at this failure
                results[pending.popleft()] = Failure(FailureKind.SKIPPED, "not scored: an earlier row failed")

        while pending or busy:
            while pending and idle:
                worker, row = idle.pop(), pending.popleft()
                problem = worker.ready(START_SECONDS)  # the time limit counts from the task's load, not the spawn
                if problem is None:
                    try:
                        worker.conn.send((row, *requests[row]))
                    except OSError:  # it ended while idle (killed from outside)
                        problem = f"the reward worker ended while idle (exit code {worker.process.exitcode})"
                    except Exception as error:  # the request does not pickle (a tool environment holding a lock)
                        detail = f"cannot send it to a worker: {type(error).__name__}: {error}"
                        fail(row, Failure(FailureKind.RAISED, detail))
                        idle.append(worker)
                        continue
                if problem is not None:
                    fail(row, Failure(FailureKind.DIED, problem))
                    idle.append(self._replace(worker))
                    continue
                worker.row, worker.deadline = row, time.monotonic() + self.timeout + GRACE_SECONDS
                busy[worker.conn] = worker
            if not busy:
                continue
            wait_for = max(0.0, min(w.deadline for w in busy.values()) - time.monotonic())
            for conn in wait(list(busy), timeout=wait_for):
                worker = busy.pop(conn)
                try:
                    _, result = conn.recv()
                except (EOFError, OSError):  # the process ended: the watchdog's exit, os._exit, a crash
                    fail(worker.row, self._ended(worker))
                    idle.append(self._replace(worker))
                    continue
                if isinstance(result, Failure):
                    fail(worker.row, result)
                else:
                    results[worker.row] = result
                idle.append(worker)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if now >= worker.deadline:  # alive past the watchdog's time and the grace: killed
                    del busy[conn]
                    worker.stop(kill=True)
                    fail(worker.row, Failure(FailureKind.TIMEOUT, _stuck_at(worker.dump())))
                    idle.append(self._replace(worker))
        return results  # type: ignore[return-value]

    def _ended(self, worker: _Worker) -> Failure:
        worker.process.join(timeout=GRACE_SECONDS)
        dump = worker.dump()
        if "most recent call first" in dump:  # the watchdog fired: a timeout, with where it was stuck
            return Failure(FailureKind.TIMEOUT, _stuck_at(dump))
        code = worker.process.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return Failure(FailureKind.DIED, f"the worker process ended ({how}: os._exit or a crash in native code)")

    def _replace(self, worker: _Worker) -> _Worker:
        worker.stop(kill=True)
        index = self.workers.index(worker)
        fresh = _Worker(multiprocessing.get_context("spawn"), self._task_bytes, self.timeout, self._folder.name, index)
        self.workers[index] = fresh
        return fresh

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers.clear()
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None

    def __getstate__(self):  # a data module holding workers is deep-copied or pickled by Lightning at times
        return {"task": self.task, "size": self.size, "timeout": self.timeout}

    def __setstate__(self, state) -> None:
        self.__init__(state["task"], state["size"], state["timeout"])


class TaskScorer:
    """How a task's completions are scored: in `RewardWorkers` when its scoring runs user code (`runs_user_code`)
    and `workers` allows (None: `min(4, CPUs)` workers; 0: in this process, without isolation or a time limit), else
    in this process. `score` gives a `Score` or a `Failure` per completion."""

    def __init__(self, task: Task, workers: int | None = None, timeout: float = 30.0) -> None:
        self.task, self.timeout = task, timeout
        count = min(4, os.cpu_count() or 1) if workers is None else workers
        self.pool = RewardWorkers(task, count, timeout) if count > 0 and runs_user_code(task) else None

    @property
    def isolated(self) -> bool:
        return self.pool is not None

    def score(self, completions: Sequence[str], examples: Sequence[Example]) -> list[Score | Failure]:
        if self.pool is not None:
            return self.pool.score(completions, examples)
        return [score_one(self.task, c, e) for c, e in zip(completions, examples, strict=True)]

    def call_tools(self, calls: Sequence[tuple[ToolEnvironment, str, ToolInput]]) -> list[ToolOutcome | Failure]:
        """One outcome per `(environment, tool name, input)` call: in the workers (the same time limit as a reward)
        when the task's tools are user code, else in this process."""
        if self.pool is not None:
            return self.pool.call_tools(calls)
        return [tool_one(self.task, *call) for call in calls]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
