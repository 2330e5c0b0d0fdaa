"""`sfttool check-custom-dataset` on image-text data: each image in its place with its token count, what is
trained, and every bad image named."""
from __future__ import annotations

from click.testing import CliRunner

from sfttool import assets
from sfttool.cli.main import cli

CONFIG = """
from datasets import load_dataset
from transformers import AutoProcessor
from sfttool.dataset import process_hf_dataset

train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=load_dataset, path='json', data_files={data!r}),
    processor=dict(type=AutoProcessor.from_pretrained, pretrained_model_name_or_path={model!r}),
    max_length=128, dataset_map_fn='llava_map_fn', pack_to_max_length=True, remove_unused_columns=True)
train_dataloader = dict(batch_size=2, dataset=train_dataset)
"""


def rows(image):
    return {"image": image, "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                              {"from": "gpt", "value": "Noise."}]}


def check(tmp_path, model_dir, data_rows, *extra):
    data = assets.write_jsonl(tmp_path / "data.jsonl", data_rows)
    cfg = tmp_path / "cfg.py"
    cfg.write_text(CONFIG.format(data=str(data), model=str(model_dir)))
    result = CliRunner().invoke(cli, ["check-custom-dataset", str(cfg), "--no-color", *extra])
    return result.exit_code, result.output


def test_images_shown_in_place_with_their_token_counts(tmp_path, tiny_tokenizer_dir):
    model = assets.build_tiny_vlm(tmp_path / "m", tiny_tokenizer_dir, "qwen2_5_vl")
    assets.write_png(tmp_path / "cat.png", 56, 84, 0)
    code, out = check(tmp_path, model, [rows("cat.png"), rows("cat.png")])
    assert code == 0, out
    assert "<|im_start|>user\n<|vision_start|><image 1: cat.png, 6 tokens><|vision_end|>\nWhat is it?<|im_end|>\n" \
        "<|im_start|>assistant\n]Noise.<|im_end|>[MASKED:\n" in out  # the image masked in place, the answer trained
    assert "images: 2 (in 2 of 2 samples)" in out
    assert "== after binding images (row 0) ==" in out


def test_every_bad_image_is_listed(tmp_path, tiny_tokenizer_dir):
    model = assets.build_tiny_vlm(tmp_path / "m", tiny_tokenizer_dir, "llava")
    assets.write_png(tmp_path / "ok.png", 28, 28, 0)
    code, out = check(tmp_path, model, [rows("ok.png"), rows("gone.png"), rows("lost.png")])
    assert code == 1
    data = tmp_path / "data.jsonl"
    assert f"{data}, row 1: image {tmp_path}/gone.png not found" in out
    assert f"{data}, row 2: image {tmp_path}/lost.png not found" in out
    code, out = check(tmp_path, model, [rows("ok.png"), rows("gone.png"), rows("lost.png")], "--skip-bad-rows")
    assert code == 0, out
    assert "dropped 2 rows: image not found (--skip-bad-rows) (row 1, row 2)" in out


def test_decode_images_finds_a_file_cut_short(tmp_path, tiny_tokenizer_dir):
    model = assets.build_tiny_vlm(tmp_path / "m", tiny_tokenizer_dir, "llava")
    whole = assets.write_png(tmp_path / "ok.png", 28, 28, 0).read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[:len(whole) // 2])  # the header reads, the pixels do not
    code, out = check(tmp_path, model, [rows("ok.png"), rows("cut.png")])
    assert code == 0, out  # headers only: building never decodes a pixel
    code, out = check(tmp_path, model, [rows("ok.png"), rows("cut.png")], "--decode-images")
    assert code == 1
    assert f"data.jsonl, row 1: image {tmp_path}/cut.png cannot be decoded (OSError" in out
