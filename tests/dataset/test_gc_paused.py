"""The stages that build many Python objects run with the cyclic garbage collector paused, and give it
back as they found it."""
from __future__ import annotations

import gc

import pytest

from sfttool.dataset.errors import ROW_COLUMN
from sfttool.dataset.stages import gc_paused, template_and_encode_batch


def test_paused_inside_and_restored_after_even_on_error():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError
    assert gc.isenabled()


def test_left_off_when_it_was_off():
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_encode_batch_runs_with_it_paused(tiny_tokenizer):
    seen = []

    def template_map_fn(row):
        seen.append(gc.isenabled())
        return {"conversation": [{"input": "q", "output": "a", "need_eos_token": True}]}
    batch = {"conversation": [[{"input": "q", "output": "a"}]], ROW_COLUMN: [0]}
    out = template_and_encode_batch(batch, [0], template_map_fn, tokenizer=tiny_tokenizer, max_length=8)
    assert seen == [False] and gc.isenabled() and list(out["length"]) == [len(out["input_ids"][0])]


def test_the_stream_encodes_each_chunk_with_it_paused(tiny_tokenizer):
    from sfttool.dataset.report import PipelineReport
    from sfttool.dataset.streaming import StreamingEncoder
    seen = []

    def template_map_fn(row):
        seen.append(gc.isenabled())
        return {"conversation": [{"input": "q", "output": "a", "need_eos_token": True}]}
    encoder = StreamingEncoder(tiny_tokenizer, 8, template_map_fn=template_map_fn)
    samples = encoder([(0, {"conversation": [{"input": "q", "output": "a"}]})], None, PipelineReport())
    assert seen == [False] and gc.isenabled() and len(samples) == 1
