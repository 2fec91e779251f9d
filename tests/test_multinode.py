"""Multi-node wiring: two local "nodes" of one CPU process each, started with the variables a Modal cluster run sets
(`llm_pg.cli.modal_support.cluster_env`: MASTER_ADDR = the first container's IP, a fixed MASTER_PORT, NODE_RANK = the
container's rank) and `--trainer.num_nodes 2 --trainer.devices 1`, train under FSDP2 exactly as one process does
over the rows both sampled (tests/test_fsdp.py builds the comparison)."""

import json
import socket

import pytest
from test_fsdp import assert_matches_one_process, fit_command, replay_one_process, run_processes

from llm_pg.cli.modal_support import cluster_env


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_from_cluster_variables_equal_one_process(tmp_path, random_model_dir, monkeypatch):
    ips = ["::1", "::1"]  # Modal gives IPv6 addresses ordered by container rank; both "containers" are here
    port = free_port(ips[0])
    command = fit_command(
        tmp_path,
        random_model_dir,
        "nodes",
        "--trainer.num_nodes=2",
        "--trainer.devices=1",
        "--model.init_args.iterations=1",
    )
    run_processes([(command, cluster_env(rank, ips, port)) for rank in (0, 1)])
    run = tmp_path / "nodes"
    records = [json.loads((run / f"record_rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["node_rank"]) for r in records] == [(0, 0), (1, 1)]  # one rank per node, in node order
    single, norms = replay_one_process(
        tmp_path, random_model_dir, run / "rollouts", monkeypatch, "--model.init_args.iterations=1"
    )
    assert_matches_one_process(run, single, norms, random_model_dir, iterations=1)
