"""Image-text rows through the model's processor: ids equal the processor's own, images stay with their
samples, bad images are named (or dropped, counted), max_length never splits an image."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from sfttool import assets
from sfttool.dataset import process_hf_dataset
from sfttool.dataset.collate_fns import default_collate_fn
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.pipeline import run_pipeline
from sfttool.dataset.pixels import with_pixels
from sfttool.utils.constants import IGNORE_INDEX

ARCHS = ("qwen2_5_vl", "llava")


@pytest.fixture(scope="module")
def processors(tmp_path_factory, tiny_tokenizer_dir):
    from transformers import AutoProcessor

    from sfttool.compat import processors_without_torchvision
    processors_without_torchvision()
    root = tmp_path_factory.mktemp("vlm")
    return {arch: AutoProcessor.from_pretrained(assets.build_tiny_vlm(root / arch, tiny_tokenizer_dir, arch))
            for arch in ARCHS}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Three files, one per row form, with images beside them (sizes give Qwen 6, 1, 16 and 2 tokens)."""
    root = tmp_path_factory.mktemp("image_data")
    assets.write_png(root / "img" / "cat.png", 56, 84, 0)
    assets.write_png(root / "img" / "dog.png", 30, 30, 1)
    assets.write_png(root / "img" / "big.png", 112, 112, 2)
    small = assets.write_png(root / "small.png", 28, 56, 3)
    uri = "data:image/png;base64," + base64.b64encode(small.read_bytes()).decode()
    parts = [
        {"messages": [
            {"role": "system", "content": [{"type": "text", "text": "Look closely."}]},
            {"role": "user", "content": [{"type": "image", "image": "img/cat.png"},
                                         {"type": "text", "text": "What is this?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
            {"role": "user", "content": [{"type": "text", "text": "And these two?"},
                                         {"type": "image_url", "image_url": {"url": "img/dog.png"}},
                                         {"type": "image_url", "image_url": {"url": uri}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A dog and a bird."}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}]},
    ]
    llava = [{"id": "1", "image": "img/big.png", "conversations": [
        {"from": "human", "value": "Describe it.\n<image>"}, {"from": "gpt", "value": "Green blue red."},
        {"from": "human", "value": "Which is first?"}, {"from": "gpt", "value": "Green."}]}]
    column = [
        {"images": ["img/dog.png", str(root / "img" / "cat.png")], "messages": [
            {"role": "user", "content": "<image> then <image>: which is bigger?"},
            {"role": "assistant", "content": "The second."}]},
        {"images": [], "messages": [{"role": "user", "content": "No picture."},
                                    {"role": "assistant", "content": "Fine."}]},
    ]
    files = {}
    for name, rows in (("parts", parts), ("llava", llava), ("column", column)):
        files[name] = str(assets.write_jsonl(root / f"{name}.jsonl", rows))
    return root, files


def messages_of(conversation: list[dict]) -> list[dict]:
    from sfttool.dataset.conversation import to_messages
    return to_messages(conversation)


def run(path, processor, map_fn, max_length=256, pack=False, **kw):
    from datasets import load_dataset
    dataset, report = run_pipeline(dict(type=load_dataset, path="json", data_files=path), None, max_length,
                                   dataset_map_fn=map_fn, processor=processor, pack_to_max_length=pack,
                                   keep_stages=True, **kw)
    return with_pixels(dataset, processor), report


def bound_rows(report):
    """Each loaded row's bound messages and images (the image stage's output)."""
    stage = report.stages["images"]
    return [(messages_of(row["conversation"]), row["images"]) for row in stage]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("form,map_fn", [("parts", "openai_map_fn"), ("llava", "llava_map_fn"),
                                          ("column", "openai_map_fn")])
def test_ids_equal_the_processors_own(processors, data, arch, form, map_fn):
    processor = processors[arch]
    dataset, report = run(data[1][form], processor, map_fn)
    rows = bound_rows(report)
    assert len(dataset) == len(rows)
    for sample, (messages, images) in zip(dataset, rows):
        expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True)
        assert sample["input_ids"] == expected["input_ids"][0]
        assert sample["images"] == images
        # The labels: image tokens and prompts never trained; answers as the text pipeline trains them.
        labels = np.array(sample["labels"])
        ids = np.array(sample["input_ids"])
        assert not (labels[ids == processor.image_token_id] != IGNORE_INDEX).any()
        trained = processor.tokenizer.decode(ids[labels != IGNORE_INDEX])
        answers = [m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
                   for m in messages if m["role"] == "assistant"]
        assert trained.replace(" ", "") == "".join(a.replace(" ", "") + END[arch] for a in answers)
        # Pixels loaded lazily, as the processor makes them for these images.
        pixels = sample.get("pixel_values")
        if images:
            assert torch.equal(torch.as_tensor(pixels), torch.as_tensor(expected["pixel_values"]))
        else:
            assert pixels is None


END = {"qwen2_5_vl": "<|im_end|>", "llava": "<|im_end|>"}
