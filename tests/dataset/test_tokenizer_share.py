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
    clock = iter([10.0, 12.5, 20.0, 20.25])  # the process's CPU seconds read before and after each call
    monkeypatch.setattr(bench, "_cpu_seconds", lambda: next(clock))
    spent = bench._time_tokenizer_calls()
    assert spent == [0.0]
    assert encode.batch_token_ids(tiny_tokenizer, texts) == expected
    assert encode.batch_token_ids(tiny_tokenizer, texts[:1]) == expected[:1]
    assert spent == [2.75]
