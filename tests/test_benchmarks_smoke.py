"""Each benchmark script runs end to end at a minimal size and writes the JSON fields the docs quote.

Not timed tests: figures are only checked to be present and sane.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)  # tests here launch several processes

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def run(cmd: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
    # os.environ already points SFTTOOL_CACHE and the HF caches at this session's temp folder.
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_pipeline_benchmark(tmp_path):
    out = tmp_path / "pipeline.json"
    run([sys.executable, str(BENCH / "pipeline.py"), "--rows", "60", "--strategies", "bfd",
         "--max-length", "512", "--xtuner-max-rows", "60", "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert report["meta"]["max_length"] == 512
    by_strategy = {r["strategy"]: r for r in report["pipeline"]}
    bfd = by_strategy["bfd"]
    assert bfd["rows"] == 60 and bfd["tokens_per_s"] > 0 and bfd["peak_rss_mb"] > 0
    assert bfd["tokens_lost"] == 0 and bfd["split_samples"] == 0
    assert 0 < bfd["packing_efficiency"] <= 1
    assert {e["encoder"] for e in report["encode"]} == {"sfttool", "xtuner"}


@pytest.mark.slow
def test_train_step_benchmark(tmp_path):
    out = tmp_path / "train_step.json"
    proc = run([sys.executable, str(BENCH / "train_step.py"), "--models", "tiny", "--methods", "qlora",
                "--layouts", "packed,unpacked", "--max-length", "128", "--steps", "1", "--warmup", "1",
                "--overhead-steps", "1", "--out", str(out)], tmp_path)
    assert "overhead" in proc.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "train_step" and report["machine"]["cpu_cores"] >= 1
    results = {(r["method"], r["layout"]): r for r in report["results"]}
    assert set(results) == {("qlora", "packed"), ("qlora", "unpacked")}  # each case is a child process
    for r in results.values():
        assert r["tokens_per_s"] > 0 and r["peak_mem_mib"] > 0 and r["tokens_per_step"] > 0
        assert r["memory_kind"] == "peak_rss"
    packed, unpacked = results[("qlora", "packed")], results[("qlora", "unpacked")]
    assert 0 < packed["trainable_params"] < packed["params"]  # adapters only
    # Packed rows carry more real tokens per step than one padded sample per row.
    assert packed["tokens_per_step"] > unpacked["tokens_per_step"]
    assert {"bare_step_s", "sfttool_step_s", "overhead_pct"} <= set(packed)
    assert packed["loss_gap"] < 1e-4  # the bare loop computes the same loss as sfttool


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    # PYTHON: this interpreter, also when the suite runs without its virtual environment activated
    proc = run(["bash", str(BENCH / "gpu_check.sh"), "--dry-run"], tmp_path, OUT=str(tmp_path), PYTHON=sys.executable)
    assert "tokens/s" in proc.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["arch"] == "tiny"
    ran = [r for r in report["results"] if "tokens_per_s" in r]
    assert {r["method"] for r in ran} == {"qlora", "lora"}
    for r in ran:
        assert r["tokens_per_s"] > 0 and r["flops_per_token"] > 0 and r["attn"] == "sdpa"
        assert r["max_length"] == 128 and r["mfu"] is None  # no GPU peak to divide by on a CPU
    assert not [r for r in report["results"] if "error" in r]
    losses = {r["loss_implementation"]: r for r in report["loss_results"] if "loss" in r}
    assert {"unchunked", "chunked"} <= set(losses) and losses["chunked"]["positions"] == 64
    assert abs(losses["chunked"]["loss"] - losses["unchunked"]["loss"]) < 1e-3  # bf16 on both sides


@pytest.mark.slow
def test_loss_memory_benchmark(tmp_path):
    out = tmp_path / "loss_memory.json"
    proc = run([sys.executable, str(BENCH / "loss_memory.py"), "--vocab", "4096", "--hidden", "32", "--length", "256",
                "--trained", "0.6", "--repeats", "1", "--jobs", "4", "--out", str(out)], tmp_path)
    assert "x unchunked" in proc.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "loss_memory" and report["setup"]["vocab"] == 4096
    results = {r["case"]: r for r in report["results"]}
    assert set(results) == {"transformers", "sfttool_unchunked", "sfttool_chunked", "reference_chunked"}
    for r in results.values():
        assert r["trained"] == 0.6 and r["step_mib"] > 0 and r["median_s"] > 0
        assert r["loss_gap"] < 1e-4  # every case computes the same loss as plain transformers
    assert results["reference_chunked"]["memory_vs_reference"] == 1.0
    assert results["sfttool_unchunked"]["time_vs_unchunked"] == 1.0


# One case per reader and layout between the two modes (each case is a fresh process: seconds of imports).
CASES = {"qwen_chat": {"map_packed", "stream_unpacked"}, "hf_chat_template": {"map_unpacked", "stream_packed"}}


@pytest.mark.slow
@pytest.mark.parametrize("template", ["qwen_chat", "hf_chat_template"])
def test_tokenizer_limit_benchmark(tmp_path, template):
    out = tmp_path / "tokenizer_limit.json"
    run([sys.executable, str(BENCH / "tokenizer_limit.py"), "--rows", "40", "--cores", "1", "--out", str(out),
         "--template", template, "--cases", ",".join(sorted(CASES[template]))], tmp_path)
    report = json.loads(out.read_text())
    assert report["template"] == template
    results = {r["case"]: r for r in report["results"]}
    assert set(results) == {"limit"} | CASES[template]
    assert results["limit"]["fraction_of_limit"] == 1.0
    pipeline_tokens = {r["tokens"] for case, r in results.items() if case != "limit"}
    assert len(pipeline_tokens) == 1  # map-style and stream, packed or not, keep every token
    for r in results.values():
        assert r["cores"] == 1 and r["tokens_per_s"] > 0 and 0 < r["fraction_of_limit"] <= 1.5
    for case, r in results.items():  # the limit measured again in the case's own process
        assert case == "limit" or (r["limit_tokens_per_cpu_s_here"] > 0 and r["cpu_fraction_after_load_here"] > 0)


@pytest.mark.slow
def test_tokenizer_limit_alternating_in_one_process(tmp_path):
    out = tmp_path / "alternate.json"
    run([sys.executable, str(BENCH / "tokenizer_limit.py"), "--rows", "30", "--alternate", "2", "--out", str(out)],
        tmp_path)
    report = json.loads(out.read_text())
    assert len(report["pairs"]) == 2
    for pair in report["pairs"]:
        assert pair["fraction_after_load"] > 0 and 0 < pair["tokenizer_share_after_load"] <= 1


def test_gpu_check_refuses_to_run_without_a_gpu_unless_dry(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--out", str(tmp_path / "x.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr


@pytest.mark.slow
def test_rollout_benchmark(tmp_path):
    out = tmp_path / "rollout.json"
    proc = run([sys.executable, str(BENCH / "rollout.py"), "--model", "tiny", "--prompts", "2",
                "--num-generations", "2", "--max-completion-length", "8", "--micro-batch-size", "2", "--repeats", "1",
                "--out", str(out)], tmp_path)
    assert "vs direct" in proc.stdout and "generation's share of a step" in proc.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "rollout" and report["engine"] == "hf" and report["completions_per_round"] == 4
    assert report["sfttool_tokens_per_s"] > 0 and report["direct_tokens_per_s"] > 0 and report["ratio"] > 0
    assert 0 < report["generation_share"] < 1
    (repeat,) = report["repeats"]
    assert 4 <= repeat["sfttool_tokens"] <= repeat["sfttool_steps"] <= 4 * 8


@pytest.mark.slow
def test_mix_sources_benchmark(tmp_path):
    out = tmp_path / "mix_sources.json"
    run([sys.executable, str(BENCH / "mix_sources.py"), "--samples", "200", "--max-length", "512",
         "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert report["baseline"]["samples"] == 400 and report["baseline"]["pack_s"] > 0
    assert [m["strategy"] for m in report["mixes"]] == ["concat", "interleave", "interleave"]
    assert report["mixes"][0]["samples"] == 500  # 200 x 1 + 200 x 1.5
    assert all(0 < m["packing_efficiency"] <= 1 and m["rows"] > 0 for m in report["mixes"])


@pytest.mark.slow
def test_lazy_packing_benchmark(tmp_path):
    out = tmp_path / "lazy_packing.json"
    run([sys.executable, str(BENCH / "lazy_packing.py"), "--rows", "60", "--max-length", "512", "--buffers", "8",
         "60", "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    (start,) = report["startup"]
    assert start["rows"] == 60 and start["lazy_seconds"] > 0 and start["eager_seconds"] > 0
    assert start["convert_seconds"] >= 0 and start["check_seconds"] >= 0  # 60 rows: may round to 0.0
    eager = report["eager"]
    assert [r["buffer_size"] for r in report["lazy"]] == [8, 60]
    for r in report["lazy"]:  # every token packed
        assert r["tokens"] == eager["tokens"] and 0 < r["packing_efficiency"] <= 1
    assert report["lazy"][1]["rows_out"] == report["lazy"][1]["estimated_rows"]  # 60 rows: the estimate is exact


@pytest.mark.slow
def test_image_rows_benchmark(tmp_path):
    out = tmp_path / "image_rows.json"
    run([sys.executable, str(BENCH / "image_rows.py"), "--rows", "20", "--reference-rows", "5", "--read-rows", "2",
         "--size", "56", "56", "--images", "3", "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert report["build"]["rows"] == 20 and report["build"]["rows_per_s"] > 0
    assert report["processor_reference"]["rows"] == 5 and report["read"]["images"] > 0
    assert report["read"]["image_tokens"] == 4 * report["read"]["images"]  # 56 x 56: 2 x 2 merged patches


def test_trained_spans_benchmark(tmp_path):
    out = tmp_path / "trained_spans.json"
    run([sys.executable, str(BENCH / "trained_spans.py"), "--rows", "20", "--repeats", "1", "--out", str(out)], tmp_path)
    report = json.loads(out.read_text())
    assert report["samples"] >= 20 and report["tokens"] > 0  # the script checked both paths' labels equal
    assert set(report["cpu_seconds"]) == {"offsets", "ids", "encode_only"}
    assert all(value > 0 for value in report["cpu_seconds"].values())
