"""Hook helpers and hook behaviour on a built dataset."""
from __future__ import annotations

import pytest

from sfttool.engine.hooks import DatasetInfoHook, EvaluateChatHook, ThroughputHook
from sfttool.engine.hooks.dataset_info_hook import dataset_stats, trained_spans
from sfttool.engine.hooks.evaluate_chat_hook import cut_at_stop_words
from sfttool.engine.hooks.throughput_hook import peak_tflops_of


def test_trained_spans():
    assert trained_spans([5, 6, 7, 8, 9], [-100, 6, 7, -100, 9]) == [[6, 7], [9]]
    assert trained_spans([1, 2], [-100, -100]) == []


def test_cut_at_stop_words():
    assert cut_at_stop_words("Hi.<|im_end|>junk<|endoftext|>", ["<|endoftext|>", "<|im_end|>"]) == "Hi."
    assert cut_at_stop_words("no stop", ["<|im_end|>"]) == "no stop"


def test_peak_lookup():
    assert peak_tflops_of("NVIDIA H200") == 989.0
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops_of("Mystery GPU") is None


def test_dataset_stats_on_packed_rows():
    from datasets import Dataset

    rows = Dataset.from_dict({
        "input_ids": [[1, 2, 3, 4], [5, 6]],
        "labels": [[-100, 2, -100, 4], [-100, 6]],
        "position_ids": [[0, 1, 0, 1], [0, 1]],
        "sample_lengths": [[2, 2], [2]],
    })
    assert dataset_stats(rows) == {"rows": 2, "samples": 3, "tokens": 6, "trained_tokens": 3,
                                   "max_length": 4, "efficiency": 0.75}


def test_evaluate_chat_prompt_is_the_chat_prompt(tiny_tokenizer):
    """The hook renders exactly what `encode_prompt` (training / chat) renders, and
    takes its stop words from the template."""
    from sfttool.dataset.encode import encode_prompt
    from sfttool.utils import PROMPT_TEMPLATE

    hook = EvaluateChatHook(tiny_tokenizer, ["hello?"], system="Be brief.",
                            prompt_template=PROMPT_TEMPLATE.qwen_chat, stop_words=["###"])
    expected = encode_prompt([{"system": "Be brief.", "input": "hello?"}], tiny_tokenizer,
                             PROMPT_TEMPLATE.qwen_chat)
    assert hook.prompt_ids("hello?") == expected
    assert hook.stop_words == list(PROMPT_TEMPLATE.qwen_chat.STOP_WORDS) + ["###"]
    assert hook.generation_kwargs["do_sample"] is False


def test_hooks_accept_tokenizer_configs(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    cfg = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=str(tiny_tokenizer_dir))
    assert DatasetInfoHook(cfg).tokenizer.eos_token == "<|im_end|>"
    assert EvaluateChatHook(cfg, "one input").evaluation_inputs == ["one input"]
    assert ThroughputHook().peak_tflops is None


def test_images_are_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="evaluation_images"):
        EvaluateChatHook(tiny_tokenizer, ["x"], evaluation_images=["a.png"])
