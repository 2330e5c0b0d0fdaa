"""The tokenizer-limit benchmark counts the CPU time of the pipeline's tokenizer calls and of
``load_dataset`` without changing what they return, and loads other entry points to measure."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from sfttool.dataset import encode

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "tokenizer_limit.py"


def test_tokenizer_calls_are_timed_and_return_the_same_ids(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(encode, "batch_token_ids", encode.batch_token_ids)  # put back after the test
    bench = _bench()
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


def _bench():
    spec = importlib.util.spec_from_file_location("tokenizer_limit_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_load_dataset_is_timed_apart_and_keeps_its_name(tmp_path, monkeypatch):
    """``load_dataset``'s CPU is counted apart (the fraction after loading); the wrapper keeps the name a
    config's ``type=load_dataset`` is recognised by (its JSON files are checked first)."""
    import datasets

    from sfttool.registry import type_name
    bench = _bench()
    data = tmp_path / "rows.jsonl"
    data.write_text('{"a": 1}\n{"a": 2}\n')
    clock = iter([0.0, 1.0, 4.0, 5.0])  # start, load_dataset's call, end
    monkeypatch.setattr(bench, "_cpu_seconds", lambda: next(clock))
    original = datasets.load_dataset
    with bench.CpuMeter() as meter:
        assert type_name(datasets.load_dataset) == "load_dataset" and datasets.load_dataset is not original
        rows = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(tmp_path / "c"))
    assert rows["a"] == [1, 2] and datasets.load_dataset is original
    assert (meter.cpu_seconds, meter.load_cpu_seconds, meter.cpu_after_load) == (5.0, 3.0, 2.0)
    assert meter.fractions(20, limit_per_cpu_s=10.0)["cpu_fraction_after_load"] == 1.0


def test_an_entry_point_is_loaded_from_a_file_or_a_module(tmp_path):
    bench = _bench()
    (tmp_path / "my_bench.py").write_text("def run(tok, data_file, max_length, packed, template):\n    return 7\n")
    assert bench.load_entry(f"{tmp_path / 'my_bench.py'}:run")(None, "", 8, True, "qwen_chat") == 7
    assert bench.load_entry("json:dumps") is json.dumps
