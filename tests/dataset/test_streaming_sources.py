"""``data_sources`` streamed: interleaving streams as ``datasets.interleave_datasets`` interleaves datasets,
and ``StreamingDataSources`` giving the samples ``process_data_sources`` gives, drops counted by source."""
from __future__ import annotations

import numpy as np
import pytest
from datasets import Dataset, interleave_datasets

from sfttool import assets
from sfttool.dataset import DatasetError
from sfttool.dataset.data_sources import run_sources
from sfttool.dataset.map_fns import alpaca_map_fn, template_map_fn_factory
from sfttool.dataset.mix import interleave_streams
from sfttool.dataset.streaming_sources import StreamingDataSources
from sfttool.utils import PROMPT_TEMPLATE

QWEN = dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat)
MIXES = [("concat", None, "first_exhausted"), ("interleave", None, "first_exhausted"),
         ("interleave", None, "all_exhausted"), ("interleave", [0.3, 0.7], "first_exhausted"),
         ("interleave", [0.3, 0.7], "all_exhausted")]


@pytest.mark.parametrize("sizes", [(3, 4, 5), (10, 4), (1, 7), (6, 6)])
@pytest.mark.parametrize("stopping", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("weighted", [False, True])
def test_interleave_streams_draws_what_datasets_draws(sizes, stopping, weighted):
    """Sources of unknown length, restarted when all_exhausted needs it: the items datasets draws from
    map-style datasets holding them, for three seeds."""
    items = [[f"{k}-{j}" for j in range(n)] for k, n in enumerate(sizes)]
    for seed in (0, 1, 7):
        probabilities = np.random.default_rng(seed).dirichlet([1] * len(sizes)).tolist() if weighted else None
        if probabilities is not None:
            probabilities = [p / sum(probabilities) for p in probabilities]
        expected = interleave_datasets([Dataset.from_dict({"t": t}) for t in items], probabilities=probabilities,
                                       seed=seed, stopping_strategy=stopping)["t"]
        drawn = interleave_streams([lambda t=t: iter(t) for t in items], probabilities, seed, stopping)
        assert [item for _, item in drawn] == expected


def test_interleave_streams_refuses_an_empty_source():
    with pytest.raises(DatasetError, match=r"^interleave: source\(s\) 1 hold no sample to draw$"):
        list(interleave_streams([lambda: iter("ab"), lambda: iter("")], [0.5, 0.5], 0, "first_exhausted"))


def drop_q5(row):
    return None if row["instruction"] == "q 5" else alpaca_map_fn(row)


def not_three(row):
    return len(row["conversation"][0]["output"]) != 3


@pytest.fixture
def sources(tmp_path):
    chat = assets.write_jsonl(tmp_path / "chat.jsonl", assets.tiny_conversations(10, seed=2))
    alpaca = assets.write_jsonl(tmp_path / "alpaca.jsonl",
                                [{"instruction": f"q {i}", "input": "", "output": "a" * (i + 1)} for i in range(8)])
    return [dict(name="chat", data_path=str(chat)),
            dict(name="b", data_path=str(alpaca), map_fn=drop_q5, filter_fn=not_three)]


@pytest.mark.parametrize("strategy,probabilities,stopping", MIXES)
def test_one_reader_streams_the_samples_process_data_sources_makes(sources, tiny_tokenizer, strategy, probabilities,
                                                                    stopping):
    kw = dict(mix_strategy=strategy, mix_probabilities=probabilities, stopping_strategy=stopping,
              pack_to_max_length=False, seed=4)
    mapped, report = run_sources(sources, tiny_tokenizer, 64, QWEN, shuffle_before_pack=False, **kw)
    stream = StreamingDataSources(sources, tiny_tokenizer, 64, QWEN, encode_chunk=3, **kw)
    streamed = [(list(r["input_ids"]), list(r["labels"])) for r in stream]
    assert streamed == [(r["input_ids"], r["labels"]) for r in mapped]
    assert stream.used == [s.used for s in report.sources]
    if strategy == "concat":  # every source read once, to its end: the map-style pipeline's drops
        assert stream.pass_stats.dropped == report.dropped and len(report.dropped) == 2


def test_drops_are_counted_by_source_in_each_pass(sources, tiny_tokenizer):
    stream = StreamingDataSources(sources, tiny_tokenizer, 64, QWEN, pack_to_max_length=False)
    assert len(list(stream)) == 10 + 6
    assert stream.pass_stats.dropped == {"data_sources[1] (b): map_fn drop_q5 returned None": 1,
                                         "data_sources[1] (b): filter_fn not_three returned False": 1}
    assert stream.pass_stats.drop_examples["data_sources[1] (b): filter_fn not_three returned False"] == ["row 2"]
    assert stream.pass_stats.rows_in == 18 and stream.used == [10, 6]


def test_packed_stream_keeps_every_sample(sources, tiny_tokenizer):
    kw = dict(mix_strategy="interleave", mix_probabilities=[0.5, 0.5], seed=1)
    unpacked = StreamingDataSources(sources, tiny_tokenizer, 64, QWEN, pack_to_max_length=False, **kw)
    packed = StreamingDataSources(sources, tiny_tokenizer, 64, QWEN, buffer_size=4, **kw)
    samples = sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in unpacked)
    pieces = []
    for row in packed:
        starts = np.cumsum([0] + list(row["sample_lengths"]))
        pieces += [(tuple(row["input_ids"][s:e]), tuple(row["labels"][s:e])) for s, e in zip(starts, starts[1:])]
    assert sorted(pieces) == samples


def test_what_a_stream_cannot_do_is_refused(sources, tiny_tokenizer):
    sources[1].update(slice=range(4), ratio=2)
    with pytest.raises(DatasetError) as err:
        StreamingDataSources(sources, tiny_tokenizer, 64, QWEN, pack_per_source=True)
    assert str(err.value).splitlines() == [
        "data_sources[1].slice is not available when streaming: row indices need the source's length, which a "
        "stream does not know; remove it, or use process_data_sources",
        "data_sources[1].ratio is not available when streaming: a share of a source's rows needs its length, which "
        "a stream does not know (mix_strategy='interleave' with mix_probabilities sets shares); remove it, or use "
        "process_data_sources",
        "pack_per_source=True is not available when streaming: the stream packs the mixed samples in one buffer; "
        "remove it, or use process_data_sources"]


def test_an_empty_share_draws_nothing_or_from_the_others():
    """A stream reader's share of a source may be empty (fewer files than readers)."""
    sources = [lambda: iter("ab"), lambda: iter("")]
    assert list(interleave_streams(sources, None, 0, "first_exhausted", skip_empty=True)) == []
    assert list(interleave_streams(sources, [0.5, 0.5], 0, "all_exhausted", skip_empty=True)) == [(0, "a"), (0, "b")]


@pytest.mark.parametrize("strategy", ["concat", "interleave"])
def test_dataloader_workers_share_the_sources_files(tmp_path, tiny_tokenizer, strategy):
    """Two workers over sources of two files each: every sample once (concat), or each worker's share
    interleaved (every sample drawn is one of the sources')."""
    from torch.utils.data import DataLoader

    sources = []
    for tag in "ab":
        folder = tmp_path / tag
        for part in range(2):
            assets.write_jsonl(folder / f"{part}.jsonl", [{"instruction": f"{tag} {part} {i}", "input": "",
                                                           "output": f"{tag} answer {part} {i}"} for i in range(5)])
        sources.append(dict(name=tag, data_path=str(folder), map_fn=alpaca_map_fn))
    kw = dict(mix_strategy=strategy, pack_to_max_length=False, stopping_strategy="all_exhausted")
    one = [(tuple(r["input_ids"]), tuple(r["labels"])) for r in StreamingDataSources(sources, tiny_tokenizer, 64,
                                                                                     QWEN, **kw)]
    loader = DataLoader(StreamingDataSources(sources, tiny_tokenizer, 64, QWEN, **kw), batch_size=None,
                        num_workers=2)
    two = [(tuple(r["input_ids"]), tuple(r["labels"])) for r in loader]
    assert len(one) == 20 and sorted(set(two)) == sorted(set(one))
    if strategy == "concat":
        assert sorted(two) == sorted(one)
