"""Image-text rows through the model's processor: ids equal the processor's own, images stay with their
samples, bad images are named (or dropped, counted), max_length never splits an image."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

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

ARCHS = ("qwen2_5_vl", "llava", "gemma3")


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("vlm")
    return {arch: assets.build_tiny_vlm(root / arch, tiny_tokenizer_dir, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def processors(vlm_dirs):
    from transformers import AutoProcessor

    from sfttool.compat import processors_without_torchvision
    processors_without_torchvision()
    return {arch: AutoProcessor.from_pretrained(path) for arch, path in vlm_dirs.items()}


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


def feature_token_id(processor) -> int:
    """The token each image feature replaces: the one its mm_token_type_ids mark (Gemma 3's processor calls
    <start_of_image>, which the template renders before them, its image_token)."""
    return processor.image_token_ids[0]


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
        assert not (labels[ids == feature_token_id(processor)] != IGNORE_INDEX).any()
        assert labels.tolist() == expected_labels(processor, messages)
        # Pixels loaded lazily, as the processor makes them for these images.
        pixels = sample.get("pixel_values")
        if images:
            assert torch.equal(torch.as_tensor(pixels), torch.as_tensor(np.array(expected["pixel_values"])))
        else:
            assert pixels is None


def expected_labels(processor, messages: list[dict]) -> list[int]:
    """The labels derived from the processor alone: answer k is trained from the end of its prompt (the
    render of messages[:k] with the generation prompt) through the first special token after it, in the
    render of messages[:k + 1], whose ids start with the prompt's (checked)."""
    def ids(part, prompt=False):
        return processor.apply_chat_template(part, tokenize=True, return_dict=True,
                                             add_generation_prompt=prompt)["input_ids"][0]
    full = ids(messages)
    labels = [IGNORE_INDEX] * len(full)
    specials = set(processor.tokenizer.all_special_ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, own = ids(messages[:k], prompt=True), ids(messages[:k + 1])
        assert own[:len(prompt)] == prompt and full[:len(own)] == own
        end = next(i for i in range(len(prompt), len(own)) if own[i] in specials) + 1
        labels[len(prompt):end] = own[len(prompt):end]
    return labels


# ---------------------------------------------------------------------------
# Bad input: one line naming the image, the data file and the row; with skip_bad_rows, counted drops.

@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_images")
    assets.write_png(root / "ok.png", 28, 28, 0)
    (root / "corrupt.png").write_bytes(b"not a png at all")
    def row(image, question, answer="A"):
        return {"image": image, "conversations": [{"from": "human", "value": question},
                                                  {"from": "gpt", "value": answer}]}
    rows = [row("ok.png", "<image>\nQ"), row("gone.png", "<image>\nQ"), row("corrupt.png", "<image>Q"),
            row("ok.png", "no placeholder"), row("ok.png", "<image>\nQ", "B")]
    path = assets.write_jsonl(root / "rows.jsonl", rows)
    return root, str(path)


@pytest.mark.parametrize("row,message", [
    (1, "row 1: image {root}/gone.png not found"),
    (2, "row 2: image {root}/corrupt.png cannot be read (UnidentifiedImageError"),
    (3, "row 3: 0 <image> placeholders (or bare image parts) but 1 images given"),
])
def test_a_bad_image_row_is_one_line_naming_image_file_and_row(processors, bad_data, row, message):
    root, path = bad_data
    rows = [json.loads(line) for line in open(path)]
    single = assets.write_jsonl(root / f"only_{row}.jsonl", [rows[0], rows[row]])
    with pytest.raises(DatasetError) as info:
        run(str(single), processors["qwen2_5_vl"], "llava_map_fn")
    text = str(info.value).replace("row 1", f"row {row}")  # the bad row is the file's second
    assert text.startswith(f"{single}, ")
    assert message.format(root=root) in text
    assert "\n" not in str(info.value)


def test_skip_bad_rows_counts_each_cause_with_its_rows(processors, bad_data):
    _, path = bad_data
    dataset, report = run(path, processors["qwen2_5_vl"], "llava_map_fn", skip_bad_rows=True)
    assert len(dataset) == 2
    assert report.dropped == {"image not found (--skip-bad-rows)": 1,
                              "image unreadable or corrupt (--skip-bad-rows)": 1,
                              "<image> placeholders differ from the images given (--skip-bad-rows)": 1}
    assert report.drop_examples["image not found (--skip-bad-rows)"] == ["row 1"]
    assert report.drop_examples["image unreadable or corrupt (--skip-bad-rows)"] == ["row 2"]


def test_image_rows_without_a_processor_are_refused(tiny_tokenizer, data):
    from datasets import load_dataset
    from sfttool.utils import PROMPT_TEMPLATE
    from sfttool.dataset.map_fns import template_map_fn_factory
    with pytest.raises(DatasetError, match="row 0: the row has images but no processor is set"):
        run_pipeline(dict(type=load_dataset, path="json", data_files=data[1]["llava"]), tiny_tokenizer, 256,
                     dataset_map_fn="llava_map_fn",
                     template_map_fn=template_map_fn_factory(PROMPT_TEMPLATE.hf_chat_template))


def test_image_folder_is_where_relative_paths_are_read(processors, data, tmp_path):
    root, files = data
    moved = assets.write_jsonl(tmp_path / "elsewhere.jsonl", [json.loads(line) for line in open(files["llava"])])
    with pytest.raises(DatasetError, match=f"image {tmp_path}/img/big.png not found"):
        run(str(moved), processors["llava"], "llava_map_fn")
    dataset, _ = run(str(moved), processors["llava"], "llava_map_fn", image_folder=str(root))
    assert dataset[0]["images"] == [str(root / "img" / "big.png")]


# ---------------------------------------------------------------------------
# Packing keeps each sample's images with it; max_length never splits an image.

@pytest.mark.parametrize("arch", ARCHS)
def test_packed_rows_hold_each_samples_ids_labels_and_images(processors, data, arch):
    processor = processors[arch]
    samples = []
    for form, map_fn in (("parts", "openai_map_fn"), ("column", "openai_map_fn"), ("llava", "llava_map_fn")):
        unpacked, _ = run(data[1][form], processor, map_fn)
        samples += [(row["input_ids"], row["labels"], row["images"]) for row in unpacked]
    packed_samples = []
    for form, map_fn in (("parts", "openai_map_fn"), ("column", "openai_map_fn"), ("llava", "llava_map_fn")):
        packed, _ = run(data[1][form], processor, map_fn, pack=True)
        for row in packed:
            images, start = list(row["images"]), 0
            for length in row["sample_lengths"]:
                ids = row["input_ids"][start:start + length]
                n = len([i for i, token in enumerate(ids) if token == feature_token_id(processor)])
                own = [s for s in samples if s[0] == ids]
                assert len(own) == 1 and own[0][1] == row["labels"][start:start + length]
                count = len(own[0][2])
                packed_samples.append((ids, row["labels"][start:start + length], images[:count]))
                images, start = images[count:], start + length
                assert n == 0 or count > 0
            assert images == []
    assert sorted(map(repr, packed_samples)) == sorted(map(repr, samples))


def test_collated_pixels_are_the_processors_for_the_batchs_images_in_order(processors, data):
    processor = processors["qwen2_5_vl"]
    dataset, _ = run(data[1]["parts"], processor, "openai_map_fn", pack=True, max_length=512)
    rows = [dataset[i] for i in range(len(dataset))]
    batch = default_collate_fn(rows)["data"]
    images = [path for row in rows for path in row["images"]]
    from sfttool.dataset.pixels import load_images
    expected = processor.image_processor(images=load_images(images), return_tensors="pt")
    assert torch.equal(batch["pixel_values"], expected["pixel_values"])
    assert batch["image_grid_thw"].tolist() == expected["image_grid_thw"].tolist()
    merge = processor.image_processor.merge_size
    assert int((batch["input_ids"] == processor.image_token_id).sum()) == \
        int((expected["image_grid_thw"].prod(-1) // merge**2).sum())
    text_only, _ = run(data[1]["column"], processor, "openai_map_fn")
    assert set(default_collate_fn([text_only[1]])["data"]) == {"input_ids", "labels", "position_ids"}


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory):
    """Qwen: a 16-token image after a first answer (cut before it: kept), and one before any answer (dropped)."""
    root = tmp_path_factory.mktemp("long")
    assets.write_png(root / "big.png", 112, 112, 5)
    rows = [
        {"images": ["big.png"], "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "Noise."}]},
        {"images": ["big.png"], "messages": [
            {"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "Noise."}]},
    ]
    return str(assets.write_jsonl(root / "long.jsonl", rows))


def test_max_length_cuts_before_an_image_or_drops_the_row_counted(processors, long_rows):
    processor = processors["qwen2_5_vl"]
    full, _ = run(long_rows, processor, "openai_map_fn")
    pads = [row["input_ids"].index(processor.image_token_id) for row in full]
    note = "cut before an image that max_length={} would split (the image and what follows it left out)"
    # Row 0: the cut inside its image moves before it; its first answer stays trained.
    cut, report = run(long_rows, processor, "openai_map_fn", max_length=pads[0] + 5)
    kept = [row for row in cut if row["input_ids"][:pads[0]] == full[0]["input_ids"][:pads[0]]]
    assert len(kept) == 1 and kept[0]["input_ids"] == full[0]["input_ids"][:pads[0]]
    assert kept[0]["labels"] == full[0]["labels"][:pads[0]] and set(kept[0]["labels"]) != {IGNORE_INDEX}
    assert kept[0]["images"] == [] and kept[0]["pixel_values"] is None
    assert report.change_examples[note.format(pads[0] + 5)] == ["row 0"]
    # Row 1: nothing trained is left before its image: dropped, counted (here: the only row).
    alone = assets.write_jsonl(Path(long_rows).parent / "row1.jsonl", [json.loads(open(long_rows).readlines()[1])])
    prompt = next(i for i, label in enumerate(full[1]["labels"]) if label != IGNORE_INDEX)
    with pytest.raises(DatasetError, match=re.escape(
            f"no rows left to train on: 1 dropped (prompt longer than max_length={pads[1] + 5}")):
        run(str(alone), processor, "openai_map_fn", max_length=pads[1] + 5)
    assert prompt > pads[1] + 5


def test_a_changed_image_is_a_clear_error_when_its_row_is_read(processors, tmp_path):
    processor = processors["qwen2_5_vl"]
    image = assets.write_png(tmp_path / "x.png", 28, 28, 0)
    path = assets.write_jsonl(tmp_path / "x.jsonl", [{"images": ["x.png"], "messages": [
        {"role": "user", "content": "<image>Q"}, {"role": "assistant", "content": "A"}]}])
    dataset, _ = run(str(path), processor, "openai_map_fn")
    assets.write_png(image, 112, 112, 0)
    with pytest.raises(DatasetError, match=f"images {image} has 1 image tokens but its pixels make 16"):
        dataset[0]
    rebuilt, _ = run(str(path), processor, "openai_map_fn")  # datasets' map cache does not hide the change
    assert rebuilt[0]["input_ids"].count(processor.image_token_id) == 16


def test_process_hf_dataset_builds_the_processor_from_its_config(vlm_dirs, data):
    from datasets import load_dataset
    from transformers import AutoProcessor
    config = dict(type=AutoProcessor.from_pretrained, pretrained_model_name_or_path=str(vlm_dirs["llava"]))
    dataset = process_hf_dataset(dict(type=load_dataset, path="json", data_files=data[1]["llava"]), None, 256,
                                 dataset_map_fn="llava_map_fn", processor=config, pack_to_max_length=False)
    assert dataset[0]["pixel_values"].shape == (1, 3, 28, 28)


def test_cached_image_rows_load_their_pixels(processors, data, tmp_path):
    from datasets import load_dataset
    processor = processors["qwen2_5_vl"]
    args = dict(dataset=dict(type=load_dataset, path="json", data_files=data[1]["parts"]), tokenizer=None,
                max_length=256, dataset_map_fn="openai_map_fn", processor=processor, cache_dir=str(tmp_path))
    first, again = process_hf_dataset(**args), process_hf_dataset(**args)
    assert len(list(tmp_path.iterdir())) == 1
    assert again[0]["input_ids"] == first[0]["input_ids"]
    assert torch.equal(again[0]["pixel_values"], first[0]["pixel_values"])


def test_a_processors_own_settings_make_another_cache_entry(processors, data, tmp_path):
    """Gemma 3's tokens per image are the processor's own setting (image_seq_length), not its image processor's."""
    from datasets import load_dataset
    from transformers import Gemma3Processor
    processor = processors["gemma3"]
    longer = Gemma3Processor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                             chat_template=processor.chat_template, image_seq_length=8)
    args = dict(dataset=dict(type=load_dataset, path="json", data_files=data[1]["llava"]), tokenizer=None,
                max_length=256, dataset_map_fn="llava_map_fn", cache_dir=str(tmp_path))
    first, second = process_hf_dataset(processor=processor, **args), process_hf_dataset(processor=longer, **args)
    assert len(list(tmp_path.iterdir())) == 2
    assert [row["input_ids"].count(feature_token_id(processor)) for row in (first[0], second[0])] == [4, 8]


def test_a_tokenizer_that_adds_bos_gets_it_as_the_processor_adds_it(tmp_path, tiny_tokenizer_bos_dir, data):
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(assets.build_tiny_vlm(tmp_path / "m", tiny_tokenizer_bos_dir, "llava"))
    dataset, report = run(data[1]["llava"], processor, "llava_map_fn")
    (messages, _), = bound_rows(report)
    expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"][0]
    assert dataset[0]["input_ids"] == expected and expected[0] == processor.tokenizer.bos_token_id
    assert dataset[0]["labels"][0] == IGNORE_INDEX


def test_an_encoder_without_a_processor_refuses_image_parts(tiny_tokenizer):
    from sfttool.dataset.encode import encode_batch
    from sfttool.dataset.map_fns import openai_map_fn
    row = openai_map_fn({"messages": [
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "Q"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A"}]}]})
    with pytest.raises(DatasetError, match="data.jsonl, row 7: the row has images, which only process_hf_dataset "
                                           "with processor=... encodes"):
        encode_batch({"conversation": [row["conversation"]]}, [7], tiny_tokenizer, 64, hf_chat_template=True,
                     source="data.jsonl")


def test_text_only_content_parts_become_text():
    from sfttool.dataset.map_fns import openai_map_fn
    parts = openai_map_fn({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}]})
    assert parts == {"conversation": [{"system": "Be brief.", "input": "Hi there", "output": "Hello.",
                                       "output_with_loss": True}]}


def test_processed_image_rows_load_their_pixels_with_the_processor(processors, vlm_dirs, data, tmp_path):
    from datasets import load_dataset
    from mmengine.config import Config
    from transformers import AutoProcessor

    from sfttool.tools.process_dataset import ProcessedDatasetError, load_processed_dataset, process_dataset
    processor = dict(type=AutoProcessor.from_pretrained, pretrained_model_name_or_path=str(vlm_dirs["qwen2_5_vl"]))
    node = dict(type=process_hf_dataset, dataset=dict(type=load_dataset, path="json", data_files=data[1]["parts"]),
                processor=processor, max_length=256, dataset_map_fn="openai_map_fn")
    process_dataset(Config(dict(train_dataloader=dict(dataset=node))), tmp_path / "out")
    with pytest.raises(ProcessedDatasetError, match="the rows hold images: set processor="):
        load_processed_dataset(tmp_path / "out")
    loaded = load_processed_dataset(tmp_path / "out", processor=processor)
    direct = process_hf_dataset(**{k: v for k, v in node.items() if k != "type"})
    assert loaded[0]["input_ids"] == direct[0]["input_ids"] and loaded[0]["images"] == direct[0]["images"]
    assert torch.equal(loaded[0]["pixel_values"], direct[0]["pixel_values"])


def test_image_rows_are_not_streamed(tiny_tokenizer, processors):
    from datasets import Dataset
    from sfttool.dataset.streaming import StreamingPackedDataset
    with pytest.raises(DatasetError, match=r"image-text rows \(processor=...\) are not streamed"):
        StreamingPackedDataset(Dataset.from_list([{"conversation": [{"input": "Q", "output": "A"}]}]),
                               tiny_tokenizer, 64, processor=processors["llava"])


def test_pixels_are_made_with_the_processors_own_image_settings(processors, data):
    """Gemma 3's processor turns pan-and-scan off for its image processor, whatever that one's config says:
    the pixels are the processor's (one 28 x 28 image each), not crops the image processor alone would add."""
    import copy
    processor = copy.deepcopy(processors["gemma3"])
    processor.image_processor.do_pan_and_scan = True  # crops for an image 1.2 times taller than wide, or wider
    processor.image_processor.pan_and_scan_min_crop_size = 4
    processor.image_processor.pan_and_scan_max_num_crops = 4
    processor.image_processor.pan_and_scan_min_ratio_to_activate = 1.2
    dataset, report = run(data[1]["parts"], processor, "openai_map_fn")
    (messages, images), _ = bound_rows(report)
    expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert torch.equal(dataset[0]["pixel_values"], expected["pixel_values"]) and len(images) == 3
    from sfttool.dataset.pixels import load_images
    alone = processor.image_processor(images=load_images(images[:1]), return_tensors="pt")["pixel_values"]
    assert len(alone) > 1  # the image processor alone crops the 56 x 84 image


@pytest.mark.parametrize("mode", ["L", "RGBA"])
def test_pixels_of_grey_and_transparent_images_are_the_processors(processors, tmp_path, mode):
    from PIL import Image
    processor = processors["qwen2_5_vl"]
    Image.open(assets.write_png(tmp_path / "rgb.png", 56, 28, 4)).convert(mode).save(tmp_path / "x.png")
    path = assets.write_jsonl(tmp_path / "x.jsonl", [{"images": ["x.png"], "messages": [
        {"role": "user", "content": "<image>Q"}, {"role": "assistant", "content": "A"}]}])
    dataset, report = run(str(path), processor, "openai_map_fn")
    (messages, _), = bound_rows(report)
    expected = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert torch.equal(dataset[0]["pixel_values"], expected["pixel_values"])


def test_images_outside_user_messages_are_refused(processors, tmp_path):
    from sfttool.dataset.map_fns import MapFnError, openai_map_fn
    with pytest.raises(MapFnError, match=r"messages\[0\] is a system message with an image; images go in user"):
        openai_map_fn({"messages": [{"role": "system", "content": [{"type": "image", "image": "a.png"}]},
                                    {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]})
    assets.write_png(tmp_path / "a.png", 28, 28, 0)
    path = assets.write_jsonl(tmp_path / "x.jsonl", [{"images": ["a.png"], "messages": [
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "Look: <image>"}]}])
    with pytest.raises(DatasetError, match="x.jsonl, row 0: an image in a message of role 'assistant'; images go"):
        run(str(path), processors["qwen2_5_vl"], "openai_map_fn")


def test_relative_paths_are_read_from_each_rows_own_data_file_folder(processors, tmp_path):
    files = []
    for name, size in (("a", 28), ("b", 112)):
        assets.write_png(tmp_path / name / "img.png", size, size, 0)
        files.append(str(assets.write_jsonl(tmp_path / name / "rows.jsonl", [{"image": "img.png", "conversations": [
            {"from": "human", "value": "<image>Q"}, {"from": "gpt", "value": "A"}]}])))
    dataset, _ = run(files, processors["qwen2_5_vl"], "llava_map_fn")
    assert [row["images"] for row in dataset] == [[str(tmp_path / "a" / "img.png")], [str(tmp_path / "b" / "img.png")]]
    assert [row["input_ids"].count(processors["qwen2_5_vl"].image_token_id) for row in dataset] == [1, 16]


def test_llava_map_fn_is_xtuners_and_is_suggested_for_llava_rows():
    from sfttool.dataset.map_fns import llava_map_fn
    from sfttool.dataset.map_fns.suggest import fitting_map_fn
    row = {"image": "a.jpg", "conversations": [
        {"from": "gpt", "value": "skipped"}, {"from": "human", "value": "What is this?\n<image>"},
        {"from": "gpt", "value": "A cat."}, {"from": "human", "value": "<image> <image> both?"},
        {"from": "gpt", "value": "Yes."}]}
    notes = []
    assert llava_map_fn(row, notes) == {"conversation": [{"input": "<image>\nWhat is this?", "output": "A cat."},
                                                         {"input": "<image> <image> both?", "output": "Yes."}]}
    assert notes == ["conversation starts with an assistant message (dropped: nothing asked it)"]
    assert fitting_map_fn(row) == "llava_map_fn"
    assert fitting_map_fn({"conversations": row["conversations"]}) == "sharegpt_map_fn"
