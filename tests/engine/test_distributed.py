"""Two CPU processes (gloo) through `sfttool train --nproc-per-node 2`: DDP, ZeRO-2,
ZeRO-3. Each run finishes, both ranks end with identical weights, the loss falls."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_helpers import lockstep_config, logged, mean, write_config

pytestmark = pytest.mark.timeout(900)  # tests here launch several processes

HERE = Path(__file__).resolve().parent


SFTTOOL_TRAIN = [sys.executable, "-m", "sfttool.cli.main", "train"]


def launch_env(**extra: str) -> dict:
    """The environment ``sfttool train`` gives torchrun's workers (``worker_env``), with this folder's
    helpers importable, one OpenMP thread per process, and no inherited ``LOCAL_RANK``."""
    from sfttool.engine.launch import worker_env

    env = dict(worker_env(), PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", **extra)
    env.pop("LOCAL_RANK", None)
    return env


def run_sfttool(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """``sfttool train ARGS`` in a subprocess. With ``--nproc-per-node N`` the test starts torchrun itself,
    with the command and environment ``sfttool train`` gives it (``sfttool.engine.launch``), as a user's
    own launcher would: the launcher's part before torchrun (one config check, seconds of imports) is
    tested on its own (the global-batch test's simulated nodes below, tests/robustness/test_faults_e2e.py,
    tests/cli/test_train.py)."""
    from sfttool.engine.launch import LaunchPlan, torchrun_command

    command = [*SFTTOOL_TRAIN, *args]
    if "--nproc-per-node" in args:
        at = args.index("--nproc-per-node")
        command = torchrun_command(LaunchPlan(nproc_per_node=int(args[at + 1])), args[:at] + args[at + 2:])
    return subprocess.run(command, env=launch_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def two_rank_config(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    # 40 packed rows / 2 ranks = 20 iterations per rank
    return lockstep_config(tmp_path / "ddp.py", tiny_qwen2_dir, tiny_sft_jsonl)


@pytest.mark.slow
@pytest.mark.parametrize("deepspeed", [None, "zero2", "zero3"])
def test_two_processes_train_in_lockstep(two_rank_run, deepspeed):
    _, work, result = two_rank_run(deepspeed)  # lockstep_config's run, shared with the resume tests
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    rank0 = torch.load(work / "weights_rank0.pt")
    rank1 = torch.load(work / "weights_rank1.pt")
    assert rank0.keys() == rank1.keys() and any("lora_B" in k for k in rank0)
    for k in rank0:
        assert torch.equal(rank0[k], rank1[k]), k
    losses = logged(work)
    assert len(losses) == 10  # 20 iterations per rank: one loss per optimizer step of 2
    assert mean(losses[-3:]) < mean(losses[:3]) - 0.1
    assert (work / "hf_adapter" / "adapter_model.safetensors").is_file()
    assert (work / "iter_20.pth").exists()


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_the_global_batch(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    """The loss normaliser spans ranks: 2 ranks x micro-batch 1 train like 1 rank x
    micro-batch 2 (same rows per step; dropout off). Without it, each rank's
    own token mean would weight rows differently. The two ranks are two simulated nodes (NNODES=2, one
    process each, plain data parallelism); two processes on one node run the same code after torchrun's
    rendezvous and train in lockstep (test_two_processes_train_in_lockstep)."""
    from safetensors.torch import load_file

    from sfttool.engine.train import train

    common = dict(max_epochs=1, lr=5e-3, dropout=0.0, save_steps=100)
    two = write_config(tmp_path / "two.py", tiny_qwen2_dir, tiny_sft_jsonl, batch_size=1, **common)
    one = write_config(tmp_path / "one.py", tiny_qwen2_dir, tiny_sft_jsonl, batch_size=2, **common)
    results = launch_two_nodes([str(two), "--work-dir", str(tmp_path / "two")])
    assert all(r.returncode == 0 for r in results), "\n".join(r.stdout[-2000:] + r.stderr[-2000:] for r in results)
    single = train(str(one), work_dir=str(tmp_path / "one"))
    a = load_file(tmp_path / "two" / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(single / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    assert max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) > 0  # trained: B starts at 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def launch_two_nodes(args: list[str], timeout: int = 400, through_the_launcher: bool = True
                     ) -> list[subprocess.CompletedProcess]:
    """Two nodes of NNODES=2 (one process each) started in parallel on this machine: ``sfttool train`` with
    NNODES, NODE_RANK, ADDR and PORT set, which starts torchrun for its node; or, with
    ``through_the_launcher=False``, the torchrun command and environment it would start, directly."""
    from sfttool.engine.launch import LaunchPlan, free_port, torchrun_command

    port = free_port()
    base = launch_env(NNODES="2", ADDR="127.0.0.1", PORT=str(port), NPROC_PER_NODE="1")

    def command(rank: int) -> list[str]:
        if through_the_launcher:
            return [*SFTTOOL_TRAIN, *args]
        return torchrun_command(LaunchPlan(nproc_per_node=1, nnodes=2, node_rank=rank, port=port), args)

    nodes = [subprocess.Popen(command(r), env=dict(base, NODE_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [node.communicate(timeout=timeout) for node in nodes]
    return [subprocess.CompletedProcess(node.args, node.returncode, out, err) for node, (out, err) in zip(nodes, outputs)]


@pytest.mark.slow
@pytest.mark.parametrize("deepspeed", [None, "zero3"])
def test_two_simulated_nodes_with_sequence_parallelism_train_like_one_process(
        tmp_path, tiny_qwen2_dir, tiny_sft_jsonl, deepspeed):
    """NNODES=2 on one machine, one process per node, each row split across the two nodes
    (sequence_parallel_size = 2), plain and under ZeRO-3 (its shards on both nodes; this run is stopped
    after 2 optimizer steps and resumed): the run ends with the weights of one process training on the
    whole rows, uninterrupted (which 2 processes on one node with sequence_parallel_size = 2 match too:
    tests/parallel/test_sequence_parallel_train.py). The launcher's reading of NNODES and the rest is
    tested by the global-batch test above; here torchrun starts as it would start it."""
    from safetensors.torch import load_file

    from sfttool.engine.train import train

    common = dict(max_epochs=0.25, lr=5e-3, dropout=0.0, save_steps=4)  # 10 iterations = 5 optimizer steps of 2
    whole = write_config(tmp_path / "one.py", tiny_qwen2_dir, tiny_sft_jsonl, **common)
    split = tmp_path / "sp.py"
    split.write_text(whole.read_text().replace("seed = 7\n", "seed = 7\nsequence_parallel_size = 2\n"))
    nodes = tmp_path / "nodes"  # one folder both nodes see, as a shared filesystem
    launch = ["--deepspeed", deepspeed] if deepspeed else []
    for extra in ([["--max-steps", "2"], ["--resume"]] if deepspeed else [[]]):
        results = launch_two_nodes([str(split), "--work-dir", str(nodes), *launch, *extra], through_the_launcher=False)
        assert all(r.returncode == 0 for r in results), "\n".join(r.stdout[-2000:] + r.stderr[-2000:] for r in results)
        if extra[:1] == ["--max-steps"]:
            assert sorted(p.name for p in nodes.glob("iter_*")) == ["iter_4.pth"]
    assert sorted(p.name for p in nodes.glob("iter_*")) == ["iter_10.pth", "iter_8.pth"]  # the newest 2 kept
    single = train(str(whole), work_dir=str(tmp_path / "one"))
    resumed_at = 2 if deepspeed else 0  # optimizer steps (one logged loss each)
    assert logged(nodes) == pytest.approx(logged(single)[resumed_at:], rel=1e-5)
    a = load_file(nodes / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(single / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
