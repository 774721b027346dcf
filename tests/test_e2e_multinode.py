"""Multi-node as the example finetune scripts run it, emulated on one machine: two `torchrun --nnodes 2 --node-rank
0/1 --master-addr 127.0.0.1 --master-port P --nproc-per-node 2 apps/train CONFIG ...` train the tiny config with HSDP
across the two "nodes" (replicate 2 x fully_shard 2) and log the losses of one 4-process run (the trainer the app's
ranks run, in-process: `apprun.train_in_process`); a SIGKILL of
one node's launcher ends every rank of both nodes within `parallel.heartbeat_timeout_s` plus a margin; the job then
resumes on one node with 4 processes from the 2-node checkpoint and its first step follows the checkpoint.
About 2 minutes on 2 CPU cores: two starts of 4 ranks through the launchers, the torchrun ones exec'd (each
imports torch and transformers and checks the config), the app's forked from its launcher.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import apprun
from mmfsdp.ckpt import read_tracker
from tiny_resume import TINY, prepared_data

pytestmark = pytest.mark.slow

TORCHRUN = Path(sys.executable).with_name("torchrun")
STEPS = 6
HEARTBEAT_S = 15
MARGIN_S = 15


def _items(data: Path, out: Path) -> dict:
    return {
        "data.dataset_param.basic_parameters.dataset_dir": data / "data",
        "data.dataset_param.basic_parameters.cache_dir": data / "cache",
        "data.dataset_param.synthetic.num_train": 32,  # 8 samples per step (4 data-parallel ranks x 2)
        "data.dataset_param.synthetic.num_eval": 4,
        "parallel.data_parallel_replicate_size": 2,
        "parallel.fully_shard_parallel_size": 2,
        "parallel.heartbeat_timeout_s": HEARTBEAT_S,
        "training.micro_batch_size": 2,
        "training.train_iters": STEPS,
        "training.log_interval": 1,
        "training.save_interval": 2,
        "training.save": out / "ckpt",
        "training.load": out / "ckpt",
        "training.output_dir": out,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _node(node_rank: int, port: int, items: dict, log: Path) -> subprocess.Popen:
    cmd = [str(TORCHRUN), "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1",
           "--master-port", str(port), "--nproc-per-node", "2", str(apprun.APP), str(TINY), *apprun.overrides(items)]
    with log.open("w") as fh:
        return subprocess.Popen(cmd, cwd=apprun.ROOT, start_new_session=True, stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})


def _ranks(launcher: int) -> list[int]:
    """The live rank processes below a launcher (named `mmfsdp-rank<r>` by the app)."""
    found = []
    for pid in apprun.descendants(launcher)[1:]:
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("mmfsdp-rank") and \
                    Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(pid)
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_two_nodes_equal_one_and_a_dead_node_ends_the_job_which_resumes_on_one_node(tmp_path_factory, tmp_path):
    data = prepared_data(tmp_path_factory)
    reference_out = tmp_path / "one_node"
    reference = apprun.first_losses(
        apprun.train_in_process(TINY, {**_items(data, reference_out), "training.save_interval": 0}, nproc=4))
    assert sorted(reference) == list(range(1, STEPS + 1))

    out = tmp_path / "two_nodes"
    port = _free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [_node(rank, port, _items(data, out), logs[rank]) for rank in (0, 1)]
    try:
        deadline = time.time() + 240
        while not any(r["step"] >= 3 for r in apprun.records(out)):  # after the step-2 checkpoint
            assert all(n.poll() is None for n in nodes), "a node ended early:\n" + logs[0].read_text()[-3000:]
            assert time.time() < deadline, "no step 3 within 240 s:\n" + logs[0].read_text()[-3000:]
            time.sleep(0.1)
        ranks = [_ranks(n.pid) for n in nodes]
        assert [len(r) for r in ranks] == [2, 2], ranks
        for record in apprun.records(out):
            assert apprun.close(record["loss"], reference[record["step"]], what=f"step {record['step']} loss"), (record, reference)

        os.kill(nodes[1].pid, signal.SIGKILL)  # node 1's launcher, as a lost node would take it
        killed = time.time()
        everyone = ranks[0] + ranks[1]
        while any(_alive(pid) for pid in everyone) or nodes[0].poll() is None:
            if time.time() - killed > HEARTBEAT_S + MARGIN_S:
                pytest.fail(f"ranks {[p for p in everyone if _alive(p)]} / node 0's launcher alive "
                            f"{HEARTBEAT_S + MARGIN_S} s after node 1's launcher was killed:\n"
                            + logs[0].read_text()[-3000:])
            time.sleep(0.1)
        assert nodes[0].returncode != 0
        nodes[1].wait(timeout=10)
    finally:
        for node in nodes:
            apprun.kill_tree(node.pid)
            node.wait(timeout=30)
    tracker = read_tracker(out / "ckpt")
    assert tracker in (2, 4), tracker

    resumed = apprun.run(apprun.command(TINY, _items(data, out), nproc=4))  # one node, 4 processes
    assert f"at step {tracker}" in resumed.stdout, resumed.stdout[-2000:]
    first = next(line for line in resumed.stdout.splitlines() if f"/{STEPS} | loss " in line)
    assert f"step {tracker + 1}/{STEPS} | loss " in first, first
    records = apprun.records(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "each step once"
    for record in records:
        assert apprun.close(record["loss"], reference[record["step"]], what=f"step {record['step']} loss"), (record, reference[record["step"]])
