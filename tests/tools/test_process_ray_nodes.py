"""`process-dataset --ray HOST:PORT` on two Ray nodes simulated on this machine (`ray start --head` and
`ray start --address=...`, one CPU each): the job is submitted to the head and gives the shards the local
command gives for the same --shard-rows. `ray stop` tears the nodes down, also when the test fails."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sfttool import assets
from sfttool.config import load_config
from sfttool.tools.process_dataset import process_dataset

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'sfttool[ray]'")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # Ray starts worker processes

CONFIG = '''
from transformers import AutoTokenizer

from sfttool.dataset import process_hf_dataset
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.utils import PROMPT_TEMPLATE

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path={tok!r})
train_dataset = dict(
    type=process_hf_dataset, dataset=dict(type=load_data_path, path={data!r}),
    tokenizer=tokenizer, max_length=128,
    template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat))
train_dataloader = dict(batch_size=1, dataset=train_dataset)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes(tmp_path, tiny_tokenizer_dir):
    data = assets.write_jsonl(tmp_path / "d.jsonl", assets.tiny_conversations(400, seed=4))
    cfg = tmp_path / "cfg.py"
    cfg.write_text(CONFIG.format(tok=str(tiny_tokenizer_dir), data=str(data)))
    bin_dir = Path(sys.executable).parent
    ray, address = str(bin_dir / "ray"), f"127.0.0.1:{free_port()}"
    # Token authentication, which `ray start` may turn on, would need the token on every node: off here.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    node = ["--num-cpus=1", f"--object-store-memory={150 * 1024 ** 2}", "--node-ip-address=127.0.0.1"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)

    try:
        head = run(ray, "start", "--head", f"--port={address.split(':')[1]}", "--include-dashboard=false", *node)
        assert head.returncode == 0, head.stdout + head.stderr
        second = run(ray, "start", f"--address={address}", *node)
        assert second.returncode == 0, second.stdout + second.stderr
        job = run(str(bin_dir / "sfttool"), "process-dataset", str(cfg), "--out", str(tmp_path / "ray"),
                  "--shard-rows", "100", "--ray", address)
        assert job.returncode == 0, job.stdout + job.stderr
    finally:
        run(ray, "stop", "--force")
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert manifest["ray"]["nodes"] == 2 and manifest["ray"]["cpus"] == 2
    assert manifest["ray"]["nodes_used"] == 2  # each node ran blocks
    local = process_dataset(load_config(cfg), tmp_path / "local", shard_rows=100)
    assert [s["fingerprint"] for s in manifest["shards"]] == [s["fingerprint"] for s in local["shards"]]
    assert len(local["shards"]) == 4
