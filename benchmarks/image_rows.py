"""Image-text rows: building the dataset without decoding a pixel, and loading the pixels when rows are read.

Synthetic LLaVA-style rows (one image each, random RGB PNGs of ``--size`` pixels, a two-turn conversation)
are built with ``process_hf_dataset(processor=...)`` (header reads, the processor's chat template, the
expansion of each image into its tokens, packing), against the processor's own
``apply_chat_template(messages, tokenize=True)`` on each row, which decodes and processes every image (what
a pipeline that checks its ids by running the processor would pay); then the built rows are read back
(``dataset[i]``: each image loaded, converted to RGB and run through the image processor). The processor is
Qwen2.5-VL's (its PIL image processor with the released defaults: 14-pixel patches, 2 x 2 merged) over the
tiny tokenizer.

    python benchmarks/image_rows.py --rows 2000 --out benchmarks/results/image_rows.json
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def processor_for(folder: Path):
    """Qwen2.5-VL's processor with the released image settings over the tiny tokenizer (tiny VLM checkpoint)."""
    from transformers import AutoProcessor, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    from sfttool import assets
    from sfttool.compat import processors_without_torchvision
    processors_without_torchvision()
    tiny = AutoProcessor.from_pretrained(assets.build_tiny_vlm(folder / "vlm", assets.build_tiny_tokenizer(
        folder / "tok"), "qwen2_5_vl"))
    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tiny.tokenizer,
                               video_processor=None, chat_template=tiny.chat_template)


def write_rows(folder: Path, rows: int, size: tuple[int, int], images: int) -> Path:
    """``rows`` LLaVA rows over ``images`` distinct PNGs (reused in turn)."""
    from sfttool import assets
    for i in range(images):
        assets.write_png(folder / "img" / f"{i}.png", size[0], size[1], i)
    data = [{"image": f"img/{i % images}.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is in this picture? Describe it in a few words."},
        {"from": "gpt", "value": "Coloured noise: red, green and blue dots without a pattern."},
        {"from": "human", "value": "Is there a cat?"}, {"from": "gpt", "value": "No."}]} for i in range(rows)]
    return assets.write_jsonl(folder / "rows.jsonl", data)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def processor_reference(processor, path: Path, rows: int) -> float:
    """Seconds for the processor's own ``apply_chat_template(tokenize=True)`` on the first ``rows`` rows."""
    import json
    folder = path.parent
    lines = path.read_text().splitlines()[:rows]
    start = time.perf_counter()
    for line in lines:
        row = json.loads(line)
        turns = row["conversations"]
        messages = [{"role": "user", "content": [{"type": "image", "image": str(folder / row["image"])},
                                                 {"type": "text", "text": turns[0]["value"][len("<image>\n"):]}]},
                    {"role": "assistant", "content": turns[1]["value"]},
                    {"role": "user", "content": turns[2]["value"]}, {"role": "assistant", "content": turns[3]["value"]}]
        processor.apply_chat_template(messages, tokenize=True, return_dict=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--reference-rows", type=int, default=200, help="rows the processor's own path encodes")
    parser.add_argument("--read-rows", type=int, default=200, help="built rows read back (pixels loaded)")
    parser.add_argument("--size", type=int, nargs=2, default=[448, 336], metavar=("WIDTH", "HEIGHT"))
    parser.add_argument("--images", type=int, default=50, help="distinct image files")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from datasets import load_dataset

    from report import write_report
    from sfttool.dataset import process_hf_dataset

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        processor = processor_for(folder)
        path = write_rows(folder, args.rows, tuple(args.size), args.images)
        config = dict(type=load_dataset, path="json", data_files=str(path))
        dataset, build_s = timed(process_hf_dataset, config, None, args.max_length, dataset_map_fn="llava_map_fn",
                                 processor=processor, map_num_proc=1)
        reference_rows = min(args.reference_rows, args.rows)
        reference_s = processor_reference(processor, path, reference_rows)
        read_rows = min(args.read_rows, len(dataset))
        read, read_s = timed(lambda: [dataset[i] for i in range(read_rows)])
        images_read = sum(len(row["images"]) for row in read)
        image_tokens = sum(row["input_ids"].count(processor.image_token_id) for row in read)
    build = dict(rows=args.rows, seconds=round(build_s, 3), rows_per_s=round(args.rows / build_s, 1),
                 packed_rows=len(dataset))
    reference = dict(rows=reference_rows, seconds=round(reference_s, 3),
                     rows_per_s=round(reference_rows / reference_s, 1))
    reading = dict(rows=read_rows, images=images_read, image_tokens=image_tokens, seconds=round(read_s, 3),
                   images_per_s=round(images_read / read_s, 1))
    print(f"{'stage':<52} {'rows':>6} {'rows/s':>9}")
    print(f"{'build, no pixel decoded (process_hf_dataset)':<52} {build['rows']:>6} {build['rows_per_s']:>9}")
    print(f"{'processor.apply_chat_template(tokenize=True), per row':<52} {reference['rows']:>6} "
          f"{reference['rows_per_s']:>9}")
    print(f"read back, pixels loaded: {images_read} images ({image_tokens} image tokens) in {read_s:.2f} s, "
          f"{reading['images_per_s']} images/s")
    write_report(args.out, "image_rows", meta=dict(size=args.size, max_length=args.max_length,
                                                   distinct_images=args.images),
                 build=build, processor_reference=reference, read=reading)


if __name__ == "__main__":
    main()
