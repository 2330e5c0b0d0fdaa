"""The tokenizer-limit benchmark counts the CPU time of the pipeline's tokenizer calls without changing
what they return."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from sfttool.dataset import encode

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "tokenizer_limit.py"


def test_tokenizer_calls_are_timed_and_return_the_same_ids(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(encode, "batch_token_ids", encode.batch_token_ids)  # put back after the test
    spec = importlib.util.spec_from_file_location("tokenizer_limit_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    texts = ["hello world " * 2000, "", "héllo 🙂"]
    expected = encode.batch_token_ids(tiny_tokenizer, texts)
    clock = iter([0.0, 10.0, 12.5, 20.0, 20.25, 30.0])  # the process's CPU seconds: start, each call, end
    monkeypatch.setattr(bench, "_cpu_seconds", lambda: next(clock))
    original = encode.batch_token_ids
    with bench.CpuMeter() as meter:
        assert encode.batch_token_ids(tiny_tokenizer, texts) == expected
        assert encode.batch_token_ids(tiny_tokenizer, texts[:1]) == expected[:1]
    assert encode.batch_token_ids is original  # put back when the block ends
    assert (meter.cpu_seconds, meter.tokenizer_cpu_seconds, meter.load_cpu_seconds) == (30.0, 2.75, 0.0)
    assert meter.fractions(600, limit_per_cpu_s=40.0) == {  # 600 tokens in 30 s = 20 per s: half the limit
        "cpu_fraction_of_limit": 0.5, "cpu_fraction_after_load": 0.5, "tokenizer_cpu_share": 0.092,
        "tokenizer_share_after_load": 0.092, "load_cpu_seconds": 0.0}
