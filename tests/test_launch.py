"""launch.py without Modal credentials or network: the app builds, and the command a launch runs is one
`llm-pg fit` accepts, resuming from `last` exactly when the run has a checkpoint."""

import importlib.util
import os
import re
import signal
import sys
import threading
from subprocess import Popen
from types import SimpleNamespace
from typing import ClassVar

import modal
import pytest
import yaml
from conftest import ROOT

from llm_pg.cli import modal_support
from llm_pg.cli.sweep import expand


@pytest.fixture(scope="module")
def launch():
    spec = importlib.util.spec_from_file_location("launch", ROOT / "launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def print_config(argv: list[str], capsys, monkeypatch) -> dict:
    """What `llm-pg fit` makes of a command line, parsed by the real CLI (nothing is instantiated)."""
    from llm_pg.cli.fit import run_cli

    monkeypatch.setattr(sys, "argv", ["llm-pg"])
    assert argv[1:4] == ["-m", "llm_pg.cli.fit", "fit"]
    args = [str(ROOT / a) if a.startswith("configs/") else a for a in argv[4:]]
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", *args, "--print_config"])
    assert exit_info.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_app_builds_with_its_functions_volumes_and_gpu(launch):
    assert isinstance(launch.app, modal.App)
    assert isinstance(launch.main, modal.app.LocalEntrypoint)  # the only entrypoint: `modal run launch.py` picks it
    for function in (launch.train, launch.sweep, launch.bundle):
        assert isinstance(function, modal.Function)
    spec = launch.train._spec_  # private, but the one place Modal keeps what the decorator asked for
    assert spec.gpus == "H100"
    assert set(spec.volumes) == {"/runs", "/hf-cache", "/compile-cache"}
    assert launch.TIMEOUT_S == 24 * 3600 and launch.RETRIES >= 1


def test_image_pins_torch_like_the_makefile(launch):
    assert launch.TORCH in (ROOT / "Makefile").read_text()


def _image_layers(image, version: str) -> list[str]:
    """The Dockerfile commands of a Modal image definition, base first, for builder `version`, built offline.

    Modal's `Image` is lazy: each method returns a new image whose loader closes over its base images and the
    function that writes its Dockerfile for a builder version. That function is what Modal runs at build time,
    so calling it here shows what would be built, with no network or credentials (private API: modal 1.6)."""
    from modal._utils.async_utils import synchronizer

    def walk(inner) -> list[str]:
        closure = (cell.cell_contents for cell in inner._load.__closure__)
        cells = dict(zip(inner._load.__code__.co_freevars, closure, strict=True))
        bases = [*cells.get("base_images", {}).values(), *([cells["base_image"]] if "base_image" in cells else [])]
        commands = [line for base in bases for line in walk(base)]  # `base_image`: a local-files layer's base
        if cells.get("dockerfile_function") is not None:
            commands += [line for line in cells["dockerfile_function"](version).commands if line != "FROM base"]
        return commands

    return walk(synchronizer._translate_in(image))


@pytest.mark.parametrize("version", ["2025.06", "2026.10"])  # builders that serve Python 3.11 images today
def test_image_has_a_c_compiler_for_vllm_and_its_compile_cache_on_a_volume(launch, version):
    layers = _image_layers(launch.image, version)
    assert layers[0].startswith("FROM python:3.11") and "slim" in layers[0]  # python image: its headers included
    installs = " ".join(line for line in layers if "apt-get install" in line)
    assert "gcc" in installs.split() and "build-essential" in installs.split()  # Triton's `cc` at vLLM's start
    apt = next(i for i, line in enumerate(layers) if "apt-get install" in line and "build-essential" in line)
    assert apt < next(i for i, line in enumerate(layers) if "vllm==" in line)  # before anything that may compile
    assert "ENV VLLM_CACHE_ROOT=/compile-cache/vllm" in layers
    for function in (launch.train, launch.train_cluster):
        assert "llm-pg-compile-cache" in repr(function._spec_.volumes["/compile-cache"])
    commits = []
    for volume in (launch.runs_volume, launch.hf_volume, launch.compile_volume):
        volume.commit = lambda volume=volume: commits.append(volume)  # the instance attribute, on these objects only
    try:
        launch._commit_volumes()
    finally:
        for volume in (launch.runs_volume, launch.hf_volume, launch.compile_volume):
            del volume.commit
    assert launch.compile_volume in commits  # the compile cache is persisted with the run, not lost on a retry


def test_fit_command_is_what_llm_pg_fit_expects(launch, capsys, monkeypatch):
    overrides = dict(map(launch.parse_override, ["model.init_args.kl_coef=0.1", "--data.prompts_per_step=4"]))
    command = launch.fit_command("configs/format_copy/grpo.yaml", overrides, "fc_kl", resume=False, seed=2)
    config = print_config(command, capsys, monkeypatch)
    assert config["model"]["class_path"] == "llm_pg.modules.GRPOModule"
    assert config["model"]["init_args"]["kl_coef"] == 0.1
    assert config["data"]["prompts_per_step"] == 4
    assert (config["seed"], config["run_name"], config["runs_root"]) == (2, "fc_kl", "/runs")
    assert config["ckpt_path"] is None
    assert config["trainer"]["devices"] == 1 and config["trainer"]["strategy"] == "auto"


def test_resumed_multi_gpu_command_adds_last_checkpoint_and_ddp(launch, capsys, monkeypatch):
    command = launch.fit_command("configs/math_hard/grpo.yaml", {}, "mh", resume=True, gpus=4)
    config = print_config(command, capsys, monkeypatch)
    assert config["ckpt_path"] == "last"
    assert str(config["trainer"]["devices"]) == "4" and config["trainer"]["strategy"] == "ddp"  # Lightning parses "4"


def test_default_run_name_matches_the_cli(launch):
    from llm_pg.runs.names import default_run_name

    assert launch.default_run_name is default_run_name  # one function: what `llm-pg fit` names a run without one
    assert launch.default_run_name("configs/tiny/format_copy_grpo.yaml", 3) == "tiny_format_copy_grpo_seed3"
    assert launch.default_run_name("configs/math_hard/grpo.yaml", 1) == "math_hard_grpo_seed1"


def test_parse_launch_args(launch):
    args = launch.parse_launch_args(["--config", "configs/math_hard/grpo.yaml", "--override", "a.b=x=y", "--gpus", "2"])
    assert (args.overrides, args.run_name, args.gpus, args.local) == ({"a.b": "x=y"}, "math_hard_grpo", 2, False)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        launch.parse_override("model.init_args.kl_coef")
    with pytest.raises(SystemExit):
        launch.parse_launch_args(["--config", "c.yaml", "--override", "seed=3"])


class FakeChild:
    """Stands in for the `llm-pg fit` process: records its command, exits with `returncode`."""

    commands: ClassVar[list[list[str]]] = []
    returncode = 0

    def __init__(self, command, **kwargs):
        FakeChild.commands.append(command)

    def wait(self, timeout=None):
        return FakeChild.returncode

    def poll(self):
        return FakeChild.returncode


def test_retry_resumes_from_last_checkpoint_and_a_finished_run_is_left_alone(launch, tmp_path, monkeypatch):
    monkeypatch.setattr(modal_support.subprocess, "Popen", FakeChild)
    FakeChild.commands, commits = [], []
    run = dict(config="configs/format_copy/grpo.yaml", overrides={}, run_name="fc", runs_root=str(tmp_path))
    assert launch.run_fit(**run, commit=lambda: commits.append(1)) == "finished"
    assert "--ckpt_path" not in FakeChild.commands[-1]  # first attempt: nothing to resume
    (tmp_path / "fc" / "checkpoints").mkdir(parents=True)
    (tmp_path / "fc" / "checkpoints" / "last.ckpt").write_bytes(b"")
    FakeChild.returncode = 3  # a crashed attempt raises, so Modal retries the input
    with pytest.raises(RuntimeError, match="exited with 3"):
        launch.run_fit(**run, commit=lambda: commits.append(1))
    assert FakeChild.commands[-1][-2:] == ["--ckpt_path", "last"]
    assert len(commits) == 2  # the run directory is persisted after every attempt, failed ones included
    FakeChild.returncode = 143  # stopped by SIGTERM: saved, but not finished; Modal's retry resumes it
    with pytest.raises(RuntimeError, match=r"stopped by a signal \(exit 143\); saved, a retry resumes it"):
        launch.run_fit(**run)
    FakeChild.returncode = 0
    (tmp_path / "fc" / "final").mkdir()  # final/ alone does not make a run finished: COMPLETE, written last, does
    assert launch.run_fit(**run) == "finished"
    (tmp_path / "fc" / "COMPLETE").write_text("{}")
    assert launch.run_fit(**run) == "already finished"
    assert len(FakeChild.commands) == 4


def test_fetch_command_lands_the_run_under_runs(launch):
    assert (
        launch.fetch_command("format_copy_grpo")
        == "mkdir -p runs && modal volume get llm-pg-runs format_copy_grpo runs"
    )
    nested = launch.fetch_command("abl/kl_coef0.2_seed0")
    assert re.fullmatch(r"mkdir -p runs/abl && modal volume get llm-pg-runs abl/kl_coef0.2_seed0 runs/abl", nested)


def test_configs_are_paths_under_configs_from_the_repo_root(launch, tmp_path):
    assert launch.repo_config(str(ROOT / "configs/format_copy/grpo.yaml")) == "configs/format_copy/grpo.yaml"
    assert launch.repo_config("configs/../configs/math_hard/grpo.yaml") == "configs/math_hard/grpo.yaml"
    with pytest.raises(SystemExit, match="under configs/"):
        launch.repo_config(str(tmp_path / "x.yaml"))
    with pytest.raises(SystemExit):
        launch.repo_config("pyproject.toml")


def test_no_secret_lookup_without_credentials(launch, monkeypatch):
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.setattr(launch.modal, "config", SimpleNamespace(config={}))
    assert launch._wandb_secrets() == []


def test_an_interrupted_launch_stops_training_and_still_commits(launch, tmp_path, monkeypatch):
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    monkeypatch.setattr("llm_pg.cli.modal_support.fit_command", lambda *args: sleeper)
    monkeypatch.setattr("llm_pg.cli.modal_support.COMMIT_EVERY_S", 0.2)
    commits = []

    def commit():  # the first periodic commit is where the interrupt (a preemption's SIGINT) lands
        commits.append(1)
        if len(commits) == 1:
            raise KeyboardInterrupt

    started = []
    spawn = lambda *a, **k: started.append(Popen(*a, **k)) or started[-1]  # noqa: E731
    monkeypatch.setattr(modal_support.subprocess, "Popen", spawn)
    with pytest.raises(KeyboardInterrupt):
        launch.run_fit("configs/format_copy/grpo.yaml", {}, "fc", runs_root=str(tmp_path), cwd=tmp_path, commit=commit)
    assert started[0].poll() is not None  # the training process is gone
    assert len(commits) == 2  # and the run directory was committed after it stopped


def test_sigterm_to_the_launcher_stops_training_and_commits(launch, tmp_path, monkeypatch):
    """A preemption's SIGTERM reaches the launcher: it must stop the training group and still commit."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    monkeypatch.setattr("llm_pg.cli.modal_support.fit_command", lambda *args: sleeper)
    monkeypatch.setattr("llm_pg.cli.modal_support.POLL_S", 0.1)
    started, commits = [], []
    spawn = lambda *a, **k: started.append(Popen(*a, **k)) or started[-1]  # noqa: E731
    monkeypatch.setattr(modal_support.subprocess, "Popen", spawn)
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        launch.run_fit("configs/format_copy/grpo.yaml", {}, "fc", runs_root=str(tmp_path), cwd=tmp_path,
                       commit=lambda: commits.append(1))  # fmt: skip
    timer.join()
    assert started[0].poll() is not None and commits == [1]
    assert signal.getsignal(signal.SIGTERM) is not modal_support._on_sigterm  # the handler is restored


def test_the_volume_is_committed_soon_after_each_new_checkpoint(launch, tmp_path, monkeypatch):
    marker = tmp_path / "fc" / "checkpoints" / "last.ckpt.sha256"
    marker.parent.mkdir(parents=True)
    writer = [sys.executable, "-c", f"import time, pathlib\nfor i in range(3):\n    time.sleep(0.4)\n"
              f"    pathlib.Path({str(marker)!r}).write_text(str(i))\ntime.sleep(0.4)"]  # fmt: skip
    monkeypatch.setattr("llm_pg.cli.modal_support.fit_command", lambda *args: writer)
    monkeypatch.setattr("llm_pg.cli.modal_support.POLL_S", 0.05)
    monkeypatch.setattr("llm_pg.cli.modal_support.COMMIT_MIN_S", 0.0)
    commits = []
    status = launch.run_fit("c.yaml", {}, "fc", runs_root=str(tmp_path), cwd=tmp_path, commit=lambda: commits.append(1))
    assert status == "finished"
    assert len(commits) == 4  # one per new last.ckpt (3), one at the end; COMMIT_EVERY_S (300 s) never came


def test_a_sweep_prefetches_each_model_and_dataset_once(tmp_path):
    runs = modal_support.prefetch_plan(expand(SWEEP))
    assert [r.name for r in runs] == ["abl/reference_seed0", "abl/qwen_seed0"]
    config = str(ROOT / "configs/tiny/format_copy_grpo.yaml")
    fetched = modal_support.prefetch_assets(config, {"data.prompts_per_step": 4})
    assert fetched == f"{config}: model tiny (local), task FormatCopyTask"


SWEEP = {
    "name": "abl",
    "base": "configs/tiny/format_copy_grpo.yaml",
    "seeds": [0, 1],
    "runs": {
        "reference": {},
        "kl0.2": {"model.init_args.kl_coef": 0.2},
        "qwen": {"model.init_args.model_name_or_path": "Qwen/Qwen2.5-0.5B"},
    },
}


# ---- multi-node (a Modal cluster): Lightning's variables, the command, only node 0 commits ----------------------


def test_cluster_env_makes_node_zero_the_rendezvous():
    ips = ["fdaa:0:1::a", "fdaa:0:1::b", "fdaa:0:1::c"]  # container_ips(): IPv6, ordered by container rank
    assert modal_support.cluster_env(2, ips) == {"MASTER_ADDR": ips[0], "MASTER_PORT": "29500", "NODE_RANK": "2"}
    assert modal_support.cluster_env(0, ips, port=1234)["MASTER_PORT"] == "1234"
    with pytest.raises(ValueError, match="container rank 3 outside a cluster of 3"):
        modal_support.cluster_env(3, ips)


def test_multi_node_command_sets_nodes_devices_and_keeps_a_config_strategy(launch, capsys, monkeypatch):
    command = launch.fit_command("configs/math_hard/grpo.yaml", {}, "mh", resume=False, gpus=8, nodes=2)
    config = print_config(command, capsys, monkeypatch)
    assert (str(config["trainer"]["devices"]), config["trainer"]["num_nodes"]) == ("8", 2)
    assert config["trainer"]["strategy"] == "ddp"
    fsdp = "configs/math_hard/grpo_7b_fsdp.yaml"
    assert modal_support.config_strategy(ROOT / fsdp) == "fsdp2"
    assert modal_support.config_strategy(ROOT / "configs/math_hard/grpo.yaml") is None
    assert modal_support.config_strategy(ROOT / "no/such.yaml") is None
    command = launch.fit_command(fsdp, {}, "mh7", resume=False, gpus=8, nodes=2, strategy=None)
    assert "--trainer.strategy" not in command
    config = print_config(command, capsys, monkeypatch)
    assert (config["trainer"]["strategy"], config["trainer"]["num_nodes"]) == ("fsdp2", 2)


def test_run_fit_on_a_node_passes_the_cluster_env_and_the_config_strategy(launch, tmp_path, monkeypatch):
    started = []

    class Child(FakeChild):
        def __init__(self, command, **kwargs):
            started.append((command, kwargs))

    monkeypatch.setattr(modal_support.subprocess, "Popen", Child)
    monkeypatch.setattr(FakeChild, "returncode", 0)
    env = modal_support.cluster_env(1, ["fdaa::a", "fdaa::b"])
    fsdp = "configs/math_hard/grpo_7b_fsdp.yaml"
    assert launch.run_fit(fsdp, {}, "mh7", 0, 8, str(tmp_path), ROOT, None, 2, env) == "finished"
    command, kwargs = started[-1]
    assert command[command.index("--trainer.num_nodes") + 1] == "2" and "--trainer.strategy" not in command
    assert {k: kwargs["env"][k] for k in env} == env and kwargs["env"]["PATH"] == os.environ["PATH"]
    launch.run_fit("configs/math_hard/grpo.yaml", {}, "mh", 0, 4, str(tmp_path), ROOT)  # one node: env inherited
    command, kwargs = started[-1]
    assert kwargs["env"] is None and command[-2:] == ["--trainer.strategy", "ddp"]


def test_cluster_function_reads_its_rank_and_only_node_zero_commits(launch, monkeypatch):
    assert isinstance(launch.train_cluster, modal.Function)
    assert launch.train_cluster._spec_.gpus == "H100:8"
    calls = []
    monkeypatch.setattr(launch, "run_fit", lambda *args: calls.append(args) or "finished")
    for rank in (0, 1):
        cluster = SimpleNamespace(container_rank=lambda rank=rank: rank, container_ips=lambda: ["fdaa::a", "fdaa::b"])
        monkeypatch.setattr(launch.modal.Cluster, "from_context", staticmethod(lambda cluster=cluster: cluster))
        train = launch.train_cluster._raw_f_  # private, as `_spec_` above: the function the decorators wrap
        assert train("configs/math_hard/grpo_7b_fsdp.yaml", {}, "mh7") == "finished"
    (node0, node1) = calls
    assert node0[7] is launch._commit_volumes and node1[7] is None  # commit: node 0 only
    assert node0[8] == node1[8] == launch.CLUSTER_NODES
    assert [args[9]["NODE_RANK"] for args in calls] == ["0", "1"]
    assert {args[9]["MASTER_ADDR"] for args in calls} == {"fdaa::a"}


def test_multi_node_launch_needs_the_cluster_size_it_was_defined_with(launch):
    argv = ["--config", "configs/math_hard/grpo_7b_fsdp.yaml", "--nodes", "3", "--gpus", "8"]
    assert launch.parse_launch_args(argv).nodes == 3
    with pytest.raises(SystemExit, match=r"LLM_PG_NODES=3 modal run launch\.py"):
        launch.main.info.raw_f(*argv)  # fails before anything reaches Modal
    with pytest.raises(SystemExit, match="--local runs on this machine only"):
        launch.local(launch.parse_launch_args(["--config", "configs/tiny/format_copy_grpo.yaml", "--nodes", "2"]))


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_step_and_ends_with_its_json(tmp_path):
    """benchmarks/gpu_check.sh --smoke: the GPU check's steps on the CPU (vLLM's only where it is installed)."""
    import json
    import subprocess

    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "BUDGET_S": "900", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu_check.sh"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    has_vllm = importlib.util.find_spec("vllm") is not None
    expected = ["environment", "imports", "tiny_hf", "iteration_hf"]
    expected += ["tiny_vllm", "iteration_vllm"] if has_vllm else []
    assert sorted(s["step"] for s in result["steps"]) == sorted(expected)
    assert all(s["status"] == "ok" for s in result["steps"]), result["steps"]
    assert result["environment"]["torch"] == __import__("torch").__version__
    assert len(result["tiny_hf_exact_match"]) == 2
    for engine in ["hf", "vllm"] if has_vllm else ["hf"]:
        figures = result[f"iteration_{engine}"]
        assert figures["engine"] == engine and figures["smoke"] is True
        assert figures["decode_ms_per_token"] > 0 and figures["tokens_per_s"] > 0 and figures["update_s"] > 0
        assert set(figures["projected_hours"]) == {
            "math_hard_grpo",
            "math_hard_reinforce",
            "format_copy_grpo",
            "format_copy_reinforce",
        }
