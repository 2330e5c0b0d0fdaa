"""Sequence parallelism is exact: loss and gradients with the rows split over ranks equal one process on
the whole rows (fp32), for packed rows whose samples straddle the split, with eager, SDPA and the
flash-attention varlen path, 'token' and 'sample' reductions (each with the chunked loss), the unchunked loss."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(900)  # tests here launch several processes

HERE = Path(__file__).resolve().parent
RTOL = 1e-5


def relative(got, want) -> float:
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def run_workers(model_dir: Path, out: Path, world: int, sp: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                           str(HERE / "sp_worker.py"), str(model_dir), str(out), str(sp)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def assert_exact(ranks: list[dict]) -> None:
    """Every rank's averaged gradients equal the reference's; the loss each rank reports is its data-parallel
    group's share (as with plain data parallelism), so their mean is the reference loss."""
    cases = [k for k in ranks[0] if k != "varlen_calls"]
    assert len(cases) == 4
    for case in cases:
        mean_loss = sum(results[case]["loss"] for results in ranks) / len(ranks)
        assert relative(mean_loss, ranks[0][case]["ref_loss"]) <= RTOL, case
    for results in ranks:
        for case in cases:
            r = results[case]
            assert r["grads"].keys() == r["ref_grads"].keys() and len(r["grads"]) > 10
            for name, want in r["ref_grads"].items():
                assert want.abs().max() > 0 and relative(r["grads"][name], want) <= RTOL, (case, name)


@pytest.mark.slow
def test_two_ranks_split_each_row_exactly(tmp_path, tiny_qwen2_dir):
    ranks = run_workers(tiny_qwen2_dir, tmp_path, world=2, sp=2)
    assert_exact(ranks)
    for case in [k for k in ranks[0] if k != "varlen_calls"]:  # one group: each rank reports the whole rows' loss
        assert all(relative(r[case]["loss"], r[case]["ref_loss"]) <= RTOL for r in ranks), case
    # Both rows flattened into one of 26 tokens: the kernel gets every sample's boundary from the whole
    # row -- samples of [5, 4, 4] and [6, 5] tokens plus the collate's padding (2) -- and each rank its
    # 2 of the 4 query heads and 1 of the 2 key/value heads; 2 layers, each run again in backward.
    for results in ranks:
        calls = results["varlen_calls"]
        assert [c[:4] for c in calls] == [([0, 5, 9, 13, 19, 24, 26], [0, 5, 9, 13, 19, 24, 26], 6, 6)] * 4
        assert all(c[4] == (26, 2, 16) and c[5] == (26, 1, 16) for c in calls)


@pytest.mark.slow
def test_four_ranks_two_sequence_groups_by_two_data_parallel(tmp_path, tiny_qwen2_dir):
    ranks = run_workers(tiny_qwen2_dir, tmp_path, world=4, sp=2)
    assert_exact(ranks)
    for r in ranks[1:]:  # every rank ends with the same (averaged) gradients
        for case in [k for k in r if k != "varlen_calls"]:
            for name, grad in r[case]["grads"].items():
                assert torch.equal(grad, ranks[0][case]["grads"][name]), (case, name)
