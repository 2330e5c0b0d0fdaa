"""process_hf_dataset end to end: stages, counts, determinism, packed == unpacked, bad input."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest
from datasets import Dataset, DatasetDict, load_dataset

from sfttool import assets
from sfttool.dataset import DatasetError, process_hf_dataset
from sfttool.dataset.encode import encode_prompt
from sfttool.dataset.map_fns import template_map_fn_factory
from sfttool.utils import PROMPT_TEMPLATE

QWEN = dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat)


@pytest.fixture
def rows():
    return assets.tiny_conversations(64, seed=0)


def logged(fn, *args, **kwargs):
    """``(fn(...), the text it logged through mmengine's logger)``."""
    from mmengine.logging import MMLogger
    messages = []
    logger = MMLogger.get_current_instance()
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger.addHandler(handler)
    try:
        return fn(*args, **kwargs), "\n".join(messages)
    finally:
        logger.removeHandler(handler)


def run(rows_or_ds, tok, **kw):
    ds = rows_or_ds if not isinstance(rows_or_ds, list) else Dataset.from_list(rows_or_ds)
    kw.setdefault("template_map_fn", QWEN)
    kw.setdefault("max_length", 128)
    return process_hf_dataset(ds, tok, **kw)


def test_rows_follow_contract(rows, tiny_tokenizer):
    ds = run(rows, tiny_tokenizer)
    assert ds.column_names == ["input_ids", "labels", "position_ids", "sample_lengths", "length"]
    for row in ds:
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) == row["length"] <= 128
        assert sum(row["sample_lengths"]) == row["length"]
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
        assert [b - a for a, b in zip(starts, starts[1:] + [row["length"]])] == row["sample_lengths"]


def test_packed_equals_unpacked(rows, tiny_tokenizer):
    """Packing only regroups samples: the multiset of (ids, labels) samples is unchanged."""
    unpacked = run(rows, tiny_tokenizer, pack_to_max_length=False)
    packed = run(rows, tiny_tokenizer, pack_to_max_length=True)
    samples = sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in unpacked)
    pieces = []
    for row in packed:
        start = 0
        for n in row["sample_lengths"]:
            pieces.append((tuple(row["input_ids"][start:start + n]), tuple(row["labels"][start:start + n])))
            start += n
    assert sorted(pieces) == samples
    assert len(unpacked) == 64 and len(packed) < 64


def test_deterministic_two_runs(rows, tiny_tokenizer):
    a = run(rows, tiny_tokenizer, max_dataset_length=40, seed=3)
    b = run(rows, tiny_tokenizer, max_dataset_length=40, seed=3)
    assert a.to_list() == b.to_list()
    c = run(rows, tiny_tokenizer, max_dataset_length=40, seed=4)
    assert c.to_list() != a.to_list()


def test_jsonl_config_with_map_fn_name(tmp_path, tiny_tokenizer_dir):
    """XTuner-style config: dataset and tokenizer as config dicts, map fn by registered name."""
    from transformers import AutoTokenizer
    path = assets.write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "Add", "input": "1 and 2", "output": "3"}])
    ds = process_hf_dataset(
        dataset=dict(type=load_dataset, path="json", data_files=str(path)),
        tokenizer=dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=str(tiny_tokenizer_dir)),
        max_length=64, dataset_map_fn="alpaca_map_fn", template_map_fn=QWEN, pack_to_max_length=False,
        remove_unused_columns=True)
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    assert tok.decode([t for t in ds[0]["labels"] if t != -100]) == "hi<|im_end|>"
    assert ds.column_names == ["input_ids", "labels", "position_ids", "sample_lengths", "length"]


def test_unpacked_keeps_columns_unless_removed(tiny_tokenizer):
    ds = run([{"conversation": [{"input": "a", "output": "b"}], "id": 7}], tiny_tokenizer, pack_to_max_length=False)
    assert ds[0]["id"] == 7


def test_dataset_dict_split(rows, tiny_tokenizer):
    dd = DatasetDict(train=Dataset.from_list(rows[:10]), test=Dataset.from_list(rows[10:12]))
    assert len(run(dd, tiny_tokenizer, split="test", pack_to_max_length=False)) == 2
    with pytest.raises(DatasetError, match="no split 'validation'"):
        run(dd, tiny_tokenizer, split="validation")


def test_drops_are_counted_and_logged(tiny_tokenizer):
    data = [{"conversation": []},
            {"conversation": [{"input": "q", "output": "a", "output_with_loss": False}]},
            {"conversation": [{"input": "hello " * 100, "output": "a"}]},
            {"conversation": [{"input": "q", "output": "answer"}]}]
    ds, text = logged(run, data, tiny_tokenizer, max_length=32, pack_to_max_length=True)
    assert len(ds) == 1 and ds[0]["sample_lengths"] == [ds[0]["length"]]
    prompt = len(encode_prompt([{"input": "hello " * 100}], tiny_tokenizer, "qwen_chat"))
    lines = text.splitlines()
    assert lines[:5] == [
        "Dataset: 4 rows in, 1 rows out",
        "Dataset: dropped 1 rows: empty conversation (row 0)",
        "Dataset: dropped 1 rows: answer masked away (output_with_loss=False on every turn) (row 1)",
        f"Dataset: dropped 1 rows: prompt longer than max_length=32 (the answer was cut away) "
        f"(row 2 (prompt of {prompt} tokens))",
        f"Dataset: truncated 1 samples at max_length=32 ({len(encode_rows([data[2]], tiny_tokenizer)[0]) - 32} "
        "tokens cut)"]
    assert "packing efficiency" in text


def test_each_drop_cause_names_its_first_rows_and_counts_the_rest(tiny_tokenizer):
    from sfttool.dataset.pipeline import run_pipeline
    masked = {"conversation": [{"input": "q", "output": "a", "output_with_loss": False}]}
    kept = {"conversation": [{"input": "q", "output": "a"}]}
    rows = [masked if i % 2 else kept for i in range(16)]
    _, report = run_pipeline(Dataset.from_list(rows), tiny_tokenizer, 64, template_map_fn=QWEN)
    cause = "answer masked away (output_with_loss=False on every turn)"
    assert report.dropped == {cause: 8}
    assert report.drop_examples == {cause: ["row 1", "row 3", "row 5", "row 7", "row 9"]}
    from sfttool.dataset.report import drop_lines
    assert drop_lines(report) == [f"dropped 8 rows: {cause} (row 1, row 3, row 5, row 7, row 9 and 3 more)"]


def test_concat_strategy_loses_nothing(rows, tiny_tokenizer):
    unpacked = run(rows, tiny_tokenizer, pack_to_max_length=False)
    concat = run(rows, tiny_tokenizer, pack_strategy="concat", shuffle_before_pack=False)
    assert [t for r in concat for t in r["input_ids"]] == [t for r in unpacked for t in r["input_ids"]]


# ---------------------------------------------------------------------------
# Bad input and settings.

def test_map_fn_that_raises_names_row_and_fn(tiny_tokenizer):
    def broken_map_fn(row):
        if row["n"] == 2:
            raise KeyError("output")
        return {"conversation": [{"input": "q", "output": "a"}]}
    with pytest.raises(DatasetError, match=r"row 2: dataset_map_fn broken_map_fn failed: KeyError"):
        run([{"n": i} for i in range(4)], tiny_tokenizer, dataset_map_fn=broken_map_fn)


def test_unknown_map_fn_name_lists_valid(tiny_tokenizer):
    with pytest.raises(DatasetError, match="unknown dataset_map_fn 'alpaca_mapfn'; valid names: alpaca_map_fn"):
        run([{"a": 1}], tiny_tokenizer, dataset_map_fn="alpaca_mapfn")


def test_unknown_template_name_lists_valid(tiny_tokenizer):
    with pytest.raises(DatasetError, match="qwen_chat"):
        run([{"conversation": [{"input": "q", "output": "a"}]}], tiny_tokenizer,
            template_map_fn=dict(type=template_map_fn_factory, template="qwen_caht"))


def test_raw_rows_without_map_fn_name_the_map_fn_their_fields_fit(tiny_tokenizer):
    with pytest.raises(DatasetError) as exc:
        run([{"instruction": "q", "output": "a"}], tiny_tokenizer)
    assert str(exc.value) == ("row 0: no `conversation` (fields: instruction, output); data that is not in the "
                              "standard format needs a dataset_map_fn (set dataset_map_fn=alpaca_map_fn)")


@pytest.mark.parametrize("row, fitting", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "openai_map_fn"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, "sharegpt_map_fn"),
    ({"instruction": "q", "input": "", "output": "a"}, "alpaca_map_fn"),
    ({"conversation": [{"input": "q", "output": "a"}]}, "dataset_map_fn=None"),
])
def test_a_map_fn_that_fails_on_the_fields_it_found_names_the_one_that_fits(tiny_tokenizer, row, fitting):
    wrong = "oasst1_map_fn"
    with pytest.raises(DatasetError) as exc:
        run([row], tiny_tokenizer, dataset_map_fn=wrong, source="data.jsonl")
    assert str(exc.value).startswith(f"data.jsonl, row 0: dataset_map_fn {wrong} failed: MapFnError: ")
    setting = fitting if fitting.startswith("dataset_map_fn") else f"dataset_map_fn={fitting}"
    assert str(exc.value).endswith(f" (the row's fields fit {fitting}: set {setting})")


def test_bad_row_names_row_and_field(tiny_tokenizer):
    data = [{"conversation": [{"input": "q", "output": "a"}]}, {"conversation": [{"input": "q"}]}]
    with pytest.raises(DatasetError, match=r"row 1, field 'conversation\[0\].output': expected a string, got missing"):
        run(data, tiny_tokenizer, template_map_fn=None)


@pytest.mark.parametrize("kw, message", [
    (dict(max_length=0), "max_length must be a positive integer"),
    (dict(use_varlen_attn=True, pack_to_max_length=False), "use_varlen_attn=True needs pack_to_max_length"),
    (dict(pack_strategy="ffd"), "pack_strategy must be one of bfd, concat"),
    (dict(max_dataset_length=-1), r"max_dataset_length must be a positive integer or None, got -1"),
    (dict(max_dataset_length=2.5), r"max_dataset_length must be a positive integer or None, got 2.5"),
])
def test_bad_settings(kw, message, tiny_tokenizer):
    with pytest.raises(DatasetError, match=message):
        run([{"conversation": [{"input": "q", "output": "a"}]}], tiny_tokenizer, **kw)


def test_hf_chat_template_mode_in_pipeline(rows, tiny_tokenizer):
    hf = run(rows, tiny_tokenizer, pack_to_max_length=False,
             template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.hf_chat_template))
    builtin = run(rows, tiny_tokenizer, pack_to_max_length=False)
    assert hf.to_list() == builtin.to_list()


def test_pretokenized_rows(tiny_tokenizer):
    data = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]
    ds = run(data, tiny_tokenizer, do_dataset_tokenization=False, max_length=8, template_map_fn=None)
    assert ds[0]["sample_lengths"] in ([3, 2], [2, 3])


def test_pretokenized_rows_are_checked_and_cut_like_encoded_ones(tiny_tokenizer):
    from sfttool.dataset.pipeline import run_pipeline
    bad = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5, 6], "labels": [-100, 6]}]
    with pytest.raises(DatasetError, match=r"row 1: 3 input_ids but 2 labels"):
        run(bad, tiny_tokenizer, do_dataset_tokenization=False, max_length=8, template_map_fn=None)
    long = [{"input_ids": list(range(1, 12)), "labels": list(range(1, 12))}, {"input_ids": [4, 5], "labels": [4, 5]}]
    for pack in (True, False):
        ds, report = run_pipeline(Dataset.from_list(long), tiny_tokenizer, max_length=8, do_dataset_tokenization=False,
                                  pack_to_max_length=pack)
        assert (report.truncated, report.tokens_cut, report.tokens) == (1, 3, 10)
        assert max(len(r) for r in ds["input_ids"]) == 8 and sum(len(r) for r in ds["input_ids"]) == 10


def test_tokens_cut_counts_only_truncation(tiny_tokenizer):
    """A dropped row (nothing trained) is not counted as cut tokens."""
    from sfttool.dataset.pipeline import run_pipeline
    long = {"conversation": [{"input": "q", "output": " ".join(["word"] * 40)}]}
    masked = {"conversation": [{"input": "q", "output": "a", "output_with_loss": False}]}
    ds, report = run_pipeline(Dataset.from_list([long, masked]), tiny_tokenizer, max_length=24, template_map_fn=QWEN)
    full = len(encode_rows([long], tiny_tokenizer)[0])
    assert report.dropped == {"answer masked away (output_with_loss=False on every turn)": 1}
    assert (report.truncated, report.tokens_cut) == (1, full - 24)


def encode_rows(rows, tokenizer):
    from sfttool.dataset.encode import encode_batch
    conversations = [template_map_fn_factory("qwen_chat")(r)["conversation"] for r in rows]
    return encode_batch({"conversation": conversations}, range(len(rows)), tokenizer, 10**6)["input_ids"]


def test_nothing_left_is_an_error(tiny_tokenizer):
    with pytest.raises(DatasetError, match=r"no rows left to train on: 1 dropped \(empty conversation\)"):
        run([{"conversation": []}], tiny_tokenizer)


# ---------------------------------------------------------------------------
# Cache and mixing.

def _jsonl_cfg(path):
    return dict(type=load_dataset, path="json", data_files=str(path))


def test_cache_reused_and_keyed(tmp_path, tiny_tokenizer):
    from sfttool.dataset.cache import REPORT_FILE
    data = tmp_path / "d.jsonl"
    assets.write_jsonl(data, assets.tiny_conversations(32, seed=5))
    cache = tmp_path / "cache"
    first = run(_jsonl_cfg(data), tiny_tokenizer, cache_dir=cache)
    entries = {p.name for p in cache.iterdir()}
    assert len(entries) == 1 and (cache / entries.pop() / REPORT_FILE).exists()
    second = run(_jsonl_cfg(data), tiny_tokenizer, cache_dir=cache)
    assert second.to_list() == first.to_list()
    assert len(list(cache.iterdir())) == 1  # reused, not rebuilt
    run(_jsonl_cfg(data), tiny_tokenizer, cache_dir=cache, max_length=64)
    run(_jsonl_cfg(data), tiny_tokenizer, cache_dir=cache, seed=1)
    run(_jsonl_cfg(data), tiny_tokenizer, cache_dir=cache,
        template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.default))
    assets.write_jsonl(data, assets.tiny_conversations(32, seed=6))  # same name, new content
    run(_jsonl_cfg(data), tiny_tokenizer, cache_dir=cache)
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 5


def load_saved_rows(dataset_path):
    """A custom loader: its config (a folder path) says nothing about what the folder holds."""
    from datasets import load_from_disk
    return load_from_disk(dataset_path)


def test_cache_follows_the_content_of_a_dataset_its_config_does_not_describe(tmp_path, tiny_tokenizer):
    from sfttool.registry import build
    saved = tmp_path / "saved"
    cfg = dict(type=process_hf_dataset, dataset=dict(type=load_saved_rows, dataset_path=str(saved)),
               tokenizer=tiny_tokenizer, max_length=128, cache_dir=str(tmp_path / "cache"),
               template_map_fn=dict(type=template_map_fn_factory, template="qwen_chat"))
    Dataset.from_list(assets.tiny_conversations(3, seed=1)).save_to_disk(str(saved))
    first = build(cfg)
    assert sum(len(r) for r in first["sample_lengths"]) == 3
    Dataset.from_list(assets.tiny_conversations(5, seed=2)).save_to_disk(str(saved))  # same path, new rows
    second = build(cfg)
    assert sum(len(r) for r in second["sample_lengths"]) == 5
    assert len([p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]) == 2


def test_cache_key_changes_with_tokenizer(tiny_tokenizer, tiny_tokenizer_bos):
    from sfttool.dataset.cache import cache_key
    args = dict(dataset=None, max_length=8)
    assert cache_key(args, tiny_tokenizer) != cache_key(args, tiny_tokenizer_bos)
    assert cache_key(args, tiny_tokenizer) == cache_key(dict(args), tiny_tokenizer)


def test_interrupted_save_leaves_no_cache(tmp_path):
    from sfttool.dataset.cache import save_atomically

    class Interrupted:
        def save_to_disk(self, path):
            os.makedirs(path)
            open(os.path.join(path, "data-00000.arrow"), "w").write("partial")
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_atomically(Interrupted(), tmp_path / "key", "{}")
    assert list(tmp_path.iterdir()) == []


def test_mix_with_ratios(rows, tiny_tokenizer):
    from sfttool.dataset import mix_datasets
    from sfttool.registry import build
    a = run(rows, tiny_tokenizer, pack_to_max_length=False)
    b = run(rows[:10], tiny_tokenizer, pack_to_max_length=False)
    mixed = mix_datasets([a, b], ratios=[0.5, 2.0], seed=0)
    assert len(mixed) == 32 + 20
    assert mixed.to_list() == mix_datasets([a, b], ratios=[0.5, 2.0], seed=0).to_list()
    assert mixed.to_list()[32:42] == b.to_list() == mixed.to_list()[42:]
    built = build(dict(type="mix_datasets", datasets=[a, b]))
    assert len(built) == len(a) + len(b)
    with pytest.raises(DatasetError, match="2 datasets but 1 ratios"):
        mix_datasets([a, b], ratios=[1.0])


def test_mix_rounds_half_up_checks_ratios_and_logs_counts():
    from sfttool.dataset import mix_datasets
    from sfttool.dataset.mix import sample_indices
    rng = np.random.default_rng(0)
    assert [sample_indices(n, 0.5, rng).size for n in (1, 5, 7)] == [1, 3, 4]
    a, b = Dataset.from_dict({"x": list(range(5))}), Dataset.from_dict({"x": list(range(100, 103))})
    for bad in (float("nan"), float("inf"), -1, True):
        with pytest.raises(DatasetError, match="ratios must be finite numbers >= 0"):
            mix_datasets([a, b], ratios=[1.0, bad])
    with pytest.raises(DatasetError, match=r"no rows to train on \(dataset sizes \[0\], ratios \[1.0\]\)"):
        mix_datasets([Dataset.from_dict({"x": []})], ratios=[1.0])
    mixed, text = logged(mix_datasets, [a, b], ratios=[0.5, 1e-9], seed=0)
    assert len(mixed) == 3
    assert "datasets[0]: 5 rows x 0.5 -> 3 rows" in text
    assert "datasets[1]: ratio 1e-09 of 3 rows selects none" in text
    assert "3 rows from 1 of 2 datasets" in text


def test_default_num_proc():
    from sfttool.dataset.rows import default_num_proc
    cpus = os.cpu_count() or 1
    assert default_num_proc(100, 32) == 1
    assert default_num_proc(10**7, 32) == min(32, cpus)
    assert default_num_proc(10**7, None) == min(8, cpus)


def test_two_processes_same_result_and_row_errors(tiny_tokenizer):
    """map_num_proc=2: identical rows; a failing row is still reported with its global index."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs")
    data = Dataset.from_list(assets.tiny_conversations(10000, seed=7, max_turns=1))
    one = run(data, tiny_tokenizer, map_num_proc=1)
    two = run(data, tiny_tokenizer, map_num_proc=2)
    assert one.to_list() == two.to_list()

    def fails_late(row):
        if row["conversation"][0]["input"] == data[7500]["conversation"][0]["input"]:
            raise ValueError("bad row")
        return row
    with pytest.raises(DatasetError, match=r"row 7500: dataset_map_fn fails_late failed: ValueError: bad row"):
        run(data, tiny_tokenizer, map_num_proc=2, dataset_map_fn=fails_late)


def test_abandoned_cache_partials_are_removed_only_when_their_writer_is_gone(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from sfttool.dataset.cache import remove_abandoned_partials

    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    names = {"killed": f".abc.tmp-{host}-{dead}-0000aaaa",           # this host, process gone
             "running": f".abc.tmp-{host}-{os.getpid()}-0000bbbb",   # this host, still alive
             "elsewhere": f".abc.tmp-other-host-{dead}-0000cccc"}    # another machine's save
    for name in names.values():
        (tmp_path / name).mkdir()
    (tmp_path / "abc").mkdir()  # a complete entry
    removed = remove_abandoned_partials(tmp_path)
    assert [p.name for p in removed] == [names["killed"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["abc", names["running"], names["elsewhere"]])


# ---------------------------------------------------------------------------
# Errors name the row as loaded, from every entry point.

def test_a_config_built_by_the_registry_checks_json_first(tmp_path, tiny_tokenizer_dir):
    """Training builds process_hf_dataset from its config: the dataset argument reaches it unbuilt, so a bad
    line is reported by file and line (not Arrow's traceback) and row errors name the file."""
    from sfttool.registry import build
    good = '{"conversation": [{"input": "q", "output": "a"}]}'
    path = tmp_path / "d.jsonl"
    path.write_text(good + "\n{oops}\n")
    cfg = dict(type=process_hf_dataset, dataset=dict(type=load_dataset, path="json", data_files=str(path)),
               tokenizer=dict(type="transformers.AutoTokenizer.from_pretrained",
                              pretrained_model_name_or_path=str(tiny_tokenizer_dir)),
               max_length=32, template_map_fn=dict(type=template_map_fn_factory, template="qwen_chat"))
    with pytest.raises(DatasetError, match=r"d.jsonl, line 2: invalid JSON"):
        build(cfg)
    path.write_text('{"instruction": "q", "output": "a"}\n{"instruction": "q", "output": null}\n')
    cfg["dataset_map_fn"] = "alpaca_map_fn"
    with pytest.raises(DatasetError, match=r"d.jsonl, row 1: dataset_map_fn alpaca_map_fn failed"):
        build(cfg)


def test_errors_name_the_loaded_row_after_max_dataset_length(tiny_tokenizer):
    data = [{"conversation": [{"input": "q", "output": "a"}]} for _ in range(10)]
    data[7] = {"conversation": [{"input": "q", "output": None}]}
    ds = Dataset.from_list(data)
    with pytest.raises(DatasetError, match=r"^row 7, field 'conversation\[0\].output'"):
        run(ds, tiny_tokenizer, template_map_fn=None, max_dataset_length=9, seed=1)


def my_template_map_fn(row):
    """A user's template fn (module level: datasets may run a copy of it)."""
    from sfttool.dataset.errors import ROW_COLUMN
    if ROW_COLUMN in row:
        raise AssertionError("sfttool's row-number column reached the template fn")
    if row["conversation"][0]["input"] == "bad":
        raise ValueError("no template for this")
    return {"conversation": [dict(t, output=t["output"] + "<|im_end|>") for t in row["conversation"]]}


def test_a_custom_template_fn_sees_the_rows_as_loaded_and_its_failure_is_named(tiny_tokenizer):
    data = [{"conversation": [{"input": "q", "output": "a"}], "meta": 1}]
    assert len(run(data, tiny_tokenizer, template_map_fn=my_template_map_fn, pack_to_max_length=False)) == 1
    data.append({"conversation": [{"input": "bad", "output": "a"}], "meta": 2})
    with pytest.raises(DatasetError, match=r"^row 1: template_map_fn my_template_map_fn failed: ValueError: no template"):
        run(data, tiny_tokenizer, template_map_fn=my_template_map_fn)


def test_the_built_in_template_failing_on_a_row_names_it(tiny_tokenizer):
    # The built-in template renders a batch with its template read once; a row it cannot render (an answer
    # that is a list, from rows the JSON file check did not see) is named as any template fn's failure is.
    data = [{"conversation": [{"input": "q", "output": ["a"]}]} for _ in range(3)]
    data[0] = {"conversation": [{"input": "q", "output": None}]}
    with pytest.raises(DatasetError, match=r"^row 1: template_map_fn template_map_fn failed: TypeError: "):
        run(data, tiny_tokenizer)


def test_the_built_in_template_renders_a_batch_as_row_by_row():
    from sfttool.dataset.map_fns.template_map_fn import template_map_fn
    from sfttool.dataset.stages import templated
    conversations = [None, [], [{"system": "s", "input": None, "output": "a", "output_with_loss": False},
                                {"input": "q2", "output": None, "extra": 1}]]
    for name in ("qwen_chat", "llama3_chat", "default", "hf_chat_template"):
        template = PROMPT_TEMPLATE[name]
        batch = templated(conversations, [0, 1, 2], template_map_fn_factory(name), None)
        assert batch == [template_map_fn({"conversation": c}, template)["conversation"] for c in conversations]
        assert batch[2] != conversations[2] or name == "hf_chat_template"


def test_row_numbers_stay_out_of_the_rows(tiny_tokenizer):
    from sfttool.dataset.errors import ROW_COLUMN
    data = [{"conversation": [{"input": "q", "output": "a"}], "id": i} for i in range(3)]
    out = run(data, tiny_tokenizer, pack_to_max_length=False)
    assert ROW_COLUMN not in out.column_names and out["id"] == [0, 1, 2]


def test_encoding_never_pickles_the_tokenizer_and_its_fingerprint_follows_the_tokenizer(
        tiny_tokenizer, tiny_tokenizer_bos, monkeypatch):
    # datasets fingerprints a map by pickling its arguments: seconds for a real tokenizer, on every call.
    from sfttool.dataset.pipeline import run_pipeline

    def refuse(self, protocol):
        raise AssertionError("the tokenizer was pickled")

    monkeypatch.setattr(type(tiny_tokenizer), "__reduce_ex__", refuse)
    rows = Dataset.from_list([{"conversation": [{"input": "q", "output": "a"}]}])

    def encoded(tok):
        _, report = run_pipeline(rows, tok, 64, template_map_fn=QWEN, keep_stages=True, map_num_proc=1)
        return report.stages["encoded"]._fingerprint

    assert encoded(tiny_tokenizer) == encoded(tiny_tokenizer)  # not a random one: computed, from the files
    assert encoded(tiny_tokenizer) != encoded(tiny_tokenizer_bos)


SHAREGPT_ROWS = [
    {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
    {"conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Q"},
                       {"from": "gpt", "value": "A"}]},
    {"conversations": [{"from": "human", "value": "Q"}, {"from": "human", "value": "more"},
                       {"from": "gpt", "value": "A"}, {"from": "human", "value": "bye"}]},
]


def test_rows_a_map_fn_changed_are_counted_and_named_as_in_a_stream(tiny_tokenizer):
    from sfttool.dataset.pipeline import run_pipeline
    from sfttool.dataset.report import change_lines
    from sfttool.dataset.streaming import StreamingPackedDataset
    _, report = run_pipeline(Dataset.from_list(SHAREGPT_ROWS), tiny_tokenizer, 64, template_map_fn=QWEN,
                             dataset_map_fn="sharegpt_map_fn")
    assert change_lines(report) == [
        "changed 1 rows: conversation starts with an assistant message (dropped: nothing asked it) (row 1)",
        "changed 1 rows: two user messages in a row (a prompt template joins them with a blank line; "
        "a chat template gets them as written) (row 2)",
        "changed 1 rows: final user message without an answer (dropped) (row 2)"]
    stream = StreamingPackedDataset(SHAREGPT_ROWS, tiny_tokenizer, 64, dataset_map_fn="sharegpt_map_fn",
                                    template_map_fn=QWEN)
    list(stream)
    assert (stream.pass_stats.changed, stream.pass_stats.change_examples) == (report.changed, report.change_examples)


def test_a_map_fn_may_set_system_only_on_rows_that_have_one(tiny_tokenizer):
    # datasets writes a map's output in batches of 1000 rows, each column with the type of the first:
    # `system` (or `output_with_loss`) first seen after 1000 rows without it failed to cast.
    plain = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    with_system = {"conversations": [{"from": "system", "value": "Be brief."}] + plain["conversations"]}
    rows = [plain] * 1000 + [with_system] * 3
    ds = run(rows, tiny_tokenizer, dataset_map_fn="sharegpt_map_fn", pack_to_max_length=False, max_length=64)
    with_prompt = encode_rows([{"conversation": [{"system": "Be brief.", "input": "q", "output": "a"}]}],
                              tiny_tokenizer)[0]
    assert len(ds) == 1003 and ds[1002]["input_ids"] == with_prompt
    assert ds[0]["input_ids"] == encode_rows([{"conversation": [{"input": "q", "output": "a"}]}], tiny_tokenizer)[0]
