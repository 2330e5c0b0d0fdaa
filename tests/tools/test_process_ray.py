"""`sfttool process-dataset --ray` on two Ray nodes simulated on this machine (`ray start --head`, then
`ray start --address=...`, one worker CPU each: 2 worker processes): the same samples, report counts and
(within 0.1 %) packing efficiency as the local command, both nodes running blocks; the same shards for the
same --shard-rows; a killed worker's block is run again without a duplicate or a missing row; the command
joins the cluster by the head's address; `train` loads the folder; `ray job submit` to the head's dashboard
runs the command on the cluster (with `ray[default]`, the dashboard's dependencies; else that test skips)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from sfttool import assets
from sfttool.cli.main import cli
from sfttool.config import load_config
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.pipeline import run_pipeline
from sfttool.dataset.resolve import dataset_config
from sfttool.registry import build
from sfttool.tools.process_dataset import load_processed_dataset, process_dataset

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'sfttool[ray]'")
try:  # the module Ray itself imports to tell `ray` from `ray[default]` (get_dashboard_dependency_error)
    import ray.dashboard.optional_deps  # noqa: F401
    DASHBOARD = True
except ImportError:
    DASHBOARD = False

from sfttool.tools.process_ray import pipeline_args, ray_process_dataset  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # Ray starts worker processes

CONFIG = '''
from datasets import load_dataset
from transformers import AutoTokenizer

from sfttool.dataset import process_hf_dataset
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.utils import PROMPT_TEMPLATE
{imports}
max_length = 128
tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path={tok!r})
train_dataset = dict(
    type=process_hf_dataset,
    dataset={dataset},
    tokenizer=tokenizer, max_length=max_length, dataset_map_fn={map_fn},
    template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat),
    pack_to_max_length=True, seed=0, max_dataset_length={subset})
train_dataloader = dict(batch_size=1, dataset=train_dataset)
'''

# Map fns in a module the workers import (PYTHONPATH): kill_once ends its own worker process the first time
# it meets row "kill" (a marker file says it did), as a node failure would; refuse_bad fails on row "bad".
KILLER = '''
import os


def kill_once(row):
    if row["id"] == "kill" and not os.path.exists(os.environ["SFTTOOL_TEST_MARKER"]):
        open(os.environ["SFTTOOL_TEST_MARKER"], "w").close()
        os._exit(1)
    return {"conversation": row["conversation"]}


def refuse_bad(row):
    if row["id"] == "bad":
        raise ValueError("a bad row")
    return {"conversation": row["conversation"]}
'''


def write_config(tmp_path, tok_dir, data, map_fn=None, subset=None, name="cfg.py"):
    dataset = (f"dict(type=load_dataset, path='json', data_files={[str(f) for f in data]!r})"
               if isinstance(data, list) else f"dict(type=load_data_path, path={str(data)!r})")
    path = tmp_path / name
    path.write_text(CONFIG.format(tok=str(tok_dir), dataset=dataset, map_fn=map_fn, subset=subset,
                                  imports=f"from ray_test_fns import {map_fn}" if map_fn else ""))
    return load_config(path)


def bad_rows() -> list[dict]:
    """One row of each kind the pipeline drops: an empty conversation, a masked answer, a prompt past
    max_length."""
    long_prompt = " ".join(["word"] * 200)
    return [{"conversation": []},
            {"conversation": [{"input": "hi?", "output": "masked.", "output_with_loss": False}]},
            {"conversation": [{"input": long_prompt, "output": "cut away."}]}]


def write_data(folder, n: int, bad_at: tuple[int, ...], split_at: int) -> list:
    """Two JSON Lines files (blank lines in the first) of ``n`` rows, the bad rows at ``bad_at``; row 250
    has the id ``kill``."""
    rows = assets.tiny_conversations(n, seed=3)
    for i, bad in zip(bad_at, bad_rows()):
        rows[i] = bad
    rows = [{"id": "kill" if i == 250 else str(i), **row} for i, row in enumerate(rows)]
    first = assets.write_jsonl(folder / "a.jsonl", rows[:split_at])
    first.write_text(first.read_text().replace("\n", "\n\n", 3))
    return [first, assets.write_jsonl(folder / "b.jsonl", rows[split_at:])]


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("ray_data"), 400, (5, 170, 333), 230)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes simulated on this machine, one worker CPU each (so 2 worker processes): `ray start
    --head`, then `ray start --address=HEAD`; this process joins as a driver. With `ray[default]` the head
    runs its dashboard on 127.0.0.1 (where `ray job submit` sends a job; ``dashboard`` is its URL, else None).
    Each node's dashboard agent gets a port of its own: its default, 52365, would be taken by the first node
    of the machine (the other's agent then runs without HTTP). At the end, also after a failure, the nodes'
    processes are stopped (``stop_nodes``). The workers import ``ray_test_fns``."""
    folder = tmp_path_factory.mktemp("ray_fns")
    (folder / "ray_test_fns.py").write_text(KILLER)
    # Token authentication, which the head may require, would need the token on every node: off here.
    env = {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]),
           "SFTTOOL_TEST_MARKER": str(folder / "killed"), "OMP_NUM_THREADS": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # for the nodes, and the driver's map fn reads the same marker
    sys.path.insert(0, str(folder))
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
    ray_cli, port = str(Path(sys.executable).with_name("ray")), free_port()
    node = ["--num-cpus=1", f"--object-store-memory={150 * 1024 ** 2}", "--node-ip-address=127.0.0.1"]

    dashboard = free_port() if DASHBOARD else None
    head_dashboard = (["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}"]
                      if DASHBOARD else ["--include-dashboard=false"])

    def run(*args: str) -> str:
        done = subprocess.run([ray_cli, *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    try:
        run("start", "--head", f"--port={port}", f"--ray-client-server-port={free_port()}", f"--temp-dir={temp_dir}",
            *head_dashboard, f"--dashboard-agent-listen-port={free_port()}", *node)
        run("start", f"--address=127.0.0.1:{port}", f"--dashboard-agent-listen-port={free_port()}", *node)
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False, logging_level="ERROR",
                 runtime_env={"env_vars": env})
        yield SimpleNamespace(folder=folder, address=f"127.0.0.1:{port}", run=run,
                              dashboard=f"http://127.0.0.1:{dashboard}" if DASHBOARD else None)
    finally:
        ray.shutdown()
        stop_nodes([temp_dir, f":{port} "])
        shutil.rmtree(temp_dir, ignore_errors=True)
        sys.path.remove(str(folder))
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def stop_nodes(marks: list[str]) -> None:
    """Kill this test's Ray processes: those whose command line names its temp dir or its head's port, and
    their children. (`ray stop` would stop every Ray node of the machine, a developer's own too.)"""
    import psutil
    mine = {}
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or []) + " "
        if any(mark in line for mark in marks):
            with contextlib.suppress(psutil.NoSuchProcess):
                mine.update({p.pid: p for p in [process, *process.children(recursive=True)]})
    for process in mine.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(list(mine.values()), timeout=30)


def samples_of(dataset) -> Counter:
    """Whole samples (input_ids, labels), cut out of packed rows by sample_lengths."""
    out = Counter()
    for row in dataset:
        start = 0
        for n in row["sample_lengths"]:
            out[(tuple(row["input_ids"][start:start + n]), tuple(row["labels"][start:start + n]))] += 1
            start += n
    return out


def local_report(cfg):
    """The report of the local pipeline on the whole data (what process_hf_dataset logs)."""
    node = cfg.train_dataloader.dataset
    args = pipeline_args(node)
    return run_pipeline(dataset=dataset_config(node["dataset"]), **{**args, "source": None, "map_num_proc": None})[1]


def test_ray_equals_the_local_command(tmp_path, tiny_tokenizer_dir, cluster):
    """2 blocks of 4000 rows, one per worker, against the local command's one shard of 8000. Each block
    leaves a few rows part-filled: at 4000 rows a block (~2,500 packed rows) that is 0.02 % here."""
    data = write_data(tmp_path, 8000, (3999, 5, 6001), 2500)  # a new field early: datasets infers from the start
    cfg = write_config(tmp_path, tiny_tokenizer_dir, data)
    manifest = ray_process_dataset(cfg, tmp_path / "ray", shard_rows=4000)
    local = process_dataset(cfg, tmp_path / "local")
    on_ray, here = load_processed_dataset(tmp_path / "ray"), load_processed_dataset(tmp_path / "local")
    assert samples_of(on_ray) == samples_of(here)
    assert len(samples_of(here)) > 7000  # not vacuous
    assert [s["name"] for s in manifest["shards"]] == [f"shard-{i:05d}.parquet" for i in range(2)]
    figures = manifest["ray"]
    assert figures["blocks"] == 2 and (figures["nodes"], figures["cpus"], figures["nodes_used"]) == (2, 2, 2)
    assert manifest["tokens"] == local["tokens"] and manifest["trained_tokens"] == local["trained_tokens"]
    assert len(local["shards"]) == 1
    assert abs(manifest["packing_efficiency"] - local["packing_efficiency"]) <= 0.001
    report, counted = local_report(cfg), manifest["report"]
    assert counted["rows_in"] == report.rows_in == 8000
    assert counted["dropped"] == report.dropped and len(report.dropped) == 3
    assert counted["drop_examples"] == report.drop_examples  # the same rows named, from their blocks
    assert counted["encoded"] == report.encoded and counted["truncated"] == report.truncated
    assert counted["packed_samples"] == report.pack.samples == sum(samples_of(here).values())


def test_same_shard_rows_give_the_same_shards(tmp_path, tiny_tokenizer_dir, data_files, cluster):
    """A block is a local shard (the same rows, numbered alike, after the same seeded subset)."""
    cfg = write_config(tmp_path, tiny_tokenizer_dir, data_files, subset=300)
    on_ray = ray_process_dataset(cfg, tmp_path / "ray", shard_rows=120)
    local = process_dataset(cfg, tmp_path / "local", shard_rows=120)
    assert [s["fingerprint"] for s in on_ray["shards"]] == [s["fingerprint"] for s in local["shards"]]
    assert on_ray["fingerprint"] == local["fingerprint"] and len(on_ray["shards"]) == 3
    assert on_ray["report"]["dropped"]["over max_dataset_length"] == 100


def test_a_killed_worker_is_retried_without_duplicates(tmp_path, tiny_tokenizer_dir, data_files, cluster):
    marker = cluster.folder / "killed"
    cfg = write_config(tmp_path, tiny_tokenizer_dir, data_files, map_fn="kill_once")
    manifest = ray_process_dataset(cfg, tmp_path / "ray", shard_rows=100)
    assert marker.exists()  # the worker holding row 250 did die
    local = process_dataset(cfg, tmp_path / "local")  # the marker is there: nothing dies now
    assert samples_of(load_processed_dataset(tmp_path / "ray")) == samples_of(load_processed_dataset(tmp_path / "local"))
    assert manifest["report"]["rows_in"] == 400 and manifest["tokens"] == local["tokens"]
    assert sorted(p.name for p in (tmp_path / "ray" / "data").iterdir()) == [s["name"] for s in manifest["shards"]]


def test_a_bad_line_is_named_as_the_local_command_names_it(tmp_path, tiny_tokenizer_dir, cluster):
    data = assets.write_jsonl(tmp_path / "d.jsonl", assets.tiny_conversations(30, seed=1))
    data.write_text(data.read_text() + '{"conversation": [{"input": "a", "output": \n')
    cfg = write_config(tmp_path, tiny_tokenizer_dir, data)
    with pytest.raises(DatasetError) as on_ray:
        ray_process_dataset(cfg, tmp_path / "ray", shard_rows=10)
    with pytest.raises(DatasetError) as local:
        process_dataset(cfg, tmp_path / "local")
    assert str(on_ray.value) == str(local.value) and "line 31" in str(on_ray.value)


def test_a_failing_map_fn_names_the_row_as_loaded(tmp_path, tiny_tokenizer_dir, cluster):
    rows = [{"id": str(i), **row} for i, row in enumerate(assets.tiny_conversations(40, seed=1))]
    rows[33]["id"] = "bad"  # in block 3 of 4
    cfg = write_config(tmp_path, tiny_tokenizer_dir, assets.write_jsonl(tmp_path / "d.jsonl", rows), map_fn="refuse_bad")
    with pytest.raises(DatasetError) as on_ray:
        ray_process_dataset(cfg, tmp_path / "ray", shard_rows=10)
    with pytest.raises(DatasetError) as local:
        process_dataset(cfg, tmp_path / "local")
    assert str(on_ray.value) == str(local.value) and ", row 33: dataset_map_fn refuse_bad failed" in str(local.value)


def test_parquet_files_are_read_by_row_groups(tmp_path, tiny_tokenizer_dir, cluster):
    """Blocks of 70 rows over Parquet files of row groups of 25 rows: the local command's shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = assets.tiny_conversations(200, seed=5)
    for name, part in (("a", rows[:90]), ("b", rows[90:])):
        pq.write_table(pa.Table.from_pylist(part), tmp_path / f"{name}.parquet", row_group_size=25)
    cfg = write_config(tmp_path, tiny_tokenizer_dir, tmp_path / "*.parquet")
    on_ray = ray_process_dataset(cfg, tmp_path / "ray", shard_rows=70)
    local = process_dataset(cfg, tmp_path / "local", shard_rows=70)
    assert [s["fingerprint"] for s in on_ray["shards"]] == [s["fingerprint"] for s in local["shards"]]
    assert len(on_ray["shards"]) == 3 and on_ray["report"]["rows_in"] == 200


def test_what_ray_cannot_read_is_refused(tmp_path, tiny_tokenizer_dir, cluster):
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(assets.tiny_conversations(3)))
    with pytest.raises(DatasetError, match="rows.json: a JSON array; --ray reads JSON Lines"):
        ray_process_dataset(write_config(tmp_path, tiny_tokenizer_dir, array), tmp_path / "out")


def test_cli_joins_the_cluster_at_its_address(tmp_path, tiny_tokenizer_dir, data_files, cluster):
    """The command, as a new driver, sent to the head by its address (after the tests that use the module's
    driver: it leaves)."""
    from sfttool.dataset.collate_fns import default_collate_fn

    ray.shutdown()
    cfg = write_config(tmp_path, tiny_tokenizer_dir, data_files[1])
    out = tmp_path / "out"
    refused = CliRunner().invoke(cli, ["process-dataset", cfg.filename, "--out", str(out), "--ray", "--num-proc", "2"])
    assert refused.exit_code != 0 and "--num-proc" in refused.output
    result = CliRunner().invoke(cli, ["process-dataset", cfg.filename, "--out", str(out), "--shard-rows", "60",
                                      "--ray", cluster.address])
    assert result.exit_code == 0, result.output
    assert "Packing efficiency" in result.output and "Ray: 3 blocks on 2 of 2 node(s)" in result.output
    assert not ray.is_initialized()  # it left the cluster
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "parquet" and manifest["ray"]["address"] == cluster.address
    assert (manifest["ray"]["nodes"], manifest["ray"]["blocks"], manifest["ray"]["nodes_used"]) == (2, 3, 2)
    train_cfg = tmp_path / "train_from_disk.py"
    train_cfg.write_text("from sfttool.tools.process_dataset import load_processed_dataset\n"
                         f"train_dataset = dict(type=load_processed_dataset, path={str(out)!r}, max_length=128)\n"
                         "train_dataloader = dict(batch_size=2, dataset=train_dataset)\n")
    dataset = build(load_config(train_cfg).train_dataloader.dataset)
    assert len(dataset) == manifest["rows"]
    batch = default_collate_fn([dataset[0], dataset[1]])["data"]
    assert batch["input_ids"].shape == batch["labels"].shape and batch["input_ids"].shape[0] == 2


def test_ray_job_submit_runs_the_command_on_the_cluster(tmp_path, tiny_tokenizer_dir, data_files, cluster):
    """The documented form, `ray job submit` to the head's dashboard: the config in --working-dir (uploaded
    with the job), --out an absolute path every node sees, `--ray` alone (the job's RAY_ADDRESS). The job's
    driver runs on the head; 4 blocks of 120 rows on both nodes give the local command's 4 shards of 120.
    (After the module driver left: the job needs none here.)"""
    if cluster.dashboard is None:
        pytest.skip("`ray job submit` needs the head's dashboard: pip install 'ray[default]'")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    cfg = write_config(job_dir, tiny_tokenizer_dir, data_files)
    out = tmp_path / "out"
    sfttool = str(Path(sys.executable).with_name("sfttool"))  # the job's shell may not have this venv on PATH
    output = cluster.run("job", "submit", "--address", cluster.dashboard, "--working-dir", str(job_dir), "--",
                         sfttool, "process-dataset", "cfg.py", "--out", str(out), "--shard-rows", "120", "--ray")
    assert "succeeded" in output and "Ray: 4 blocks on 2 of 2 node(s), 2 worker processes" in output, output
    manifest = json.loads((out / "manifest.json").read_text())
    figures = manifest["ray"]
    assert figures["address"] is None  # no --ray address: the job's RAY_ADDRESS
    assert (figures["nodes"], figures["cpus"], figures["blocks"], figures["nodes_used"]) == (2, 2, 4, 2)
    local = process_dataset(cfg, tmp_path / "local", shard_rows=120)
    assert [s["fingerprint"] for s in manifest["shards"]] == [s["fingerprint"] for s in local["shards"]]
    assert manifest["fingerprint"] == local["fingerprint"] and manifest["tokens"] == local["tokens"]
    assert samples_of(load_processed_dataset(out)) == samples_of(load_processed_dataset(tmp_path / "local"))
    assert manifest["report"]["rows_in"] == 400 and sum(manifest["report"]["dropped"].values()) == 3


def test_an_address_with_nothing_there_is_said_at_once(tmp_path, tiny_tokenizer_dir, data_files):
    ray.shutdown()  # (after the module's other tests) this process starts as a new driver
    port = free_port()  # closed again: nothing listens there
    result = CliRunner().invoke(cli, ["process-dataset", write_config(tmp_path, tiny_tokenizer_dir, data_files[1]).filename,
                                      "--out", str(tmp_path / "out"), "--ray", f"127.0.0.1:{port}"])
    assert result.exit_code == 1 and f"Error: --ray 127.0.0.1:{port}: nothing answers at 127.0.0.1:{port}" in result.output
