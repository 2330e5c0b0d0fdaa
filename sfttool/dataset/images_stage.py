"""The image stages of ``process_hf_dataset``: the processor, every row's images bound and checked
(``image_rows``; one labelled ``datasets.map``), bad rows refused or dropped and counted, and the
samples ``max_length`` cut before an image, counted.

    Dataset: dropped 1 rows: image not found (--skip-bad-rows) (row 4)
    Dataset: changed 1 rows: cut before an image that max_length=64 would split (row 9)
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

import numpy as np

from sfttool.compat import processors_without_torchvision
from sfttool.dataset.errors import ROW_COLUMN, DatasetError
from sfttool.dataset.fingerprint import tokenizer_digest
from sfttool.dataset.image_rows import (IMAGES_COLUMN, LLAVA_COLUMN, SIZES_COLUMN, ImageRowError, bind_row)
from sfttool.dataset.report import PipelineReport
from sfttool.dataset.stages import row_name
from sfttool.registry import build_if_config
from sfttool.utils.templates import is_hf_chat_template

__all__ = ["IMAGES_COLUMN", "IMAGE_COLUMNS", "SIZES_COLUMN", "bind_images", "build_processor", "check_image_template",
           "count_cut_before_images", "has_image_rows", "processor_digest"]

# Columns the image stage reads or writes; the encoder replaces them with each sample's ``images``.
IMAGE_COLUMNS = [IMAGES_COLUMN, SIZES_COLUMN, LLAVA_COLUMN]
DROP_COLUMN = "_sfttool_image_drop"  # why a row is dropped ("" when kept), until it is


def build_processor(processor: Any) -> Any:
    """The processor from an object or a config (``dict(type=AutoProcessor.from_pretrained, ...)``), built
    without torchvision where it is missing (``compat.processors_without_torchvision``)."""
    if processor is None or not isinstance(processor, dict):
        return processor
    processors_without_torchvision()
    return build_if_config(processor, "processor")


def check_image_template(template: Any, processor: Any, pack_strategy: Any = None) -> None:
    """With a processor, its own chat template renders the rows (a prompt template would not), and packing
    keeps samples whole (``concat`` would cut a sample from its images)."""
    if processor is None:
        return
    if template is not None and not is_hf_chat_template(template):
        raise DatasetError("with processor=..., rows are rendered by the processor's chat template, as at "
                           "inference: set template_map_fn=None (or PROMPT_TEMPLATE.hf_chat_template)")
    if pack_strategy == "concat":
        raise DatasetError("pack_strategy='concat' cuts samples apart from their images: with processor=..., "
                           "use pack_strategy='bfd' (the default)")


def processor_digest(processor: Any) -> str | None:
    """Hash of what decides the image tokens and pixels: the processor's settings (its image processor's and
    its own, such as Gemma 3's ``image_seq_length`` and LLaVA's ``patch_size``) and chat template."""
    if processor is None:
        return None
    settings = processor.to_json_string() if hasattr(processor, "to_json_string") else ""
    text = json.dumps([type(processor).__name__, settings, str(getattr(processor, "chat_template", "")),
                       getattr(processor, "image_token", None), tokenizer_digest(processor.tokenizer)])
    return hashlib.sha256(text.encode()).hexdigest()


def data_folder(source: Any, row: int) -> str | None:
    """The folder of the data file row ``row`` was read from (``source.DataSource``), or of the file or
    folder ``source`` names; None when unknown (a hub dataset, a built one)."""
    file = source.file_of(row) if hasattr(source, "file_of") else None
    if file is None and isinstance(source, str) and os.path.exists(source):
        file = source
    if file is None:
        return None
    return os.path.abspath(file if os.path.isdir(file) else os.path.dirname(file))


def bind_images_batch(batch: dict[str, list], indices: Sequence[int], image_folder: str | None = None,
                      source: Any = None, skip_bad_rows: bool = False) -> dict[str, list]:
    """Batched ``datasets.map`` form of ``bind_row``: ``conversation``, ``images``, ``image_sizes`` and
    ``DROP_COLUMN`` (the cause, with ``skip_bad_rows``; else a bad row raises)."""
    numbers = batch[ROW_COLUMN] if ROW_COLUMN in batch else list(indices)
    given = batch.get(IMAGES_COLUMN) or batch.get(LLAVA_COLUMN) or [None] * len(numbers)
    out: dict[str, list] = {"conversation": [], IMAGES_COLUMN: [], SIZES_COLUMN: [], DROP_COLUMN: []}
    for conversation, images, number in zip(batch["conversation"], given, numbers):
        try:
            bound = bind_row(conversation, images, image_folder, data_folder(source, number), number, source)
            cause = ""
        except ImageRowError as exc:
            if not skip_bad_rows:
                raise
            bound, cause = (conversation, [], []), exc.cause
        for name, value in zip(out, (*bound, cause)):
            out[name].append(value)
    return out


def bind_images(dataset, processor: Any, image_folder: str | None, num_proc: int | None, source: Any,
                report: PipelineReport, skip_bad_rows: bool):
    """Every row's images bound to its messages, resolved and checked from their headers; with
    ``skip_bad_rows`` a bad row is dropped, counted by cause with the first rows named. Image rows
    without a processor are refused (nothing would expand their images)."""
    removed = [c for c in (LLAVA_COLUMN, IMAGES_COLUMN, "conversation") if c in dataset.column_names]
    # Not cached: the images are read from disk, which a cached result would not see change (the encode
    # stage's fingerprint hashes the sizes read here, ``pipeline._images_digest``).
    dataset = dataset.map(bind_images_batch, batched=True, with_indices=True, num_proc=num_proc,
                          remove_columns=removed, features=_bound_features(dataset.features, removed),
                          load_from_cache_file=False, desc="Checking images",
                          fn_kwargs=dict(image_folder=image_folder, source=source, skip_bad_rows=skip_bad_rows))
    table = dataset.select_columns([DROP_COLUMN] + ([ROW_COLUMN] if ROW_COLUMN in dataset.column_names else [])
                                   ).with_format("arrow")[:]
    causes = np.asarray(table[DROP_COLUMN].to_pylist(), dtype=object)
    numbers = table[ROW_COLUMN].to_numpy() if ROW_COLUMN in table.column_names else np.arange(len(causes))
    for cause in dict.fromkeys(c for c in causes.tolist() if c):
        report.drop(cause, [row_name(int(n)) for n in numbers[causes == cause]])
    kept = np.flatnonzero(causes == "")
    dataset = dataset.remove_columns([DROP_COLUMN])
    dataset = dataset.select(kept) if len(kept) < len(causes) else dataset
    if processor is None:
        counts = pc_lengths(dataset, IMAGES_COLUMN)
        if counts.any():
            number = int(numbers[kept][np.flatnonzero(counts)[0]])
            raise DatasetError(f"{source or 'dataset'}, row {number}: the row has images but no processor is set: "
                               "give process_hf_dataset processor=dict(type=AutoProcessor.from_pretrained, "
                               "pretrained_model_name_or_path=...), the model's own processor, which expands each "
                               "image into its tokens (data_sources and streams do not take images)")
    return dataset


def _bound_features(features, removed: list[str]):
    """The bound rows' features: the turns gain ``messages`` (JSON text) where they had none."""
    from datasets import Features, List, Value
    kept = {name: feature for name, feature in features.items() if name not in removed}
    turn = dict(getattr(features["conversation"], "feature", {}))
    turn.setdefault("messages", Value("string"))
    return Features({**kept, "conversation": List(turn), IMAGES_COLUMN: List(Value("string")),
                     SIZES_COLUMN: List(List(Value("int64"))), DROP_COLUMN: Value("string")})


def pc_lengths(dataset, name: str) -> np.ndarray:
    """Each row's list length in column ``name``, read in Arrow."""
    import pyarrow.compute as pc
    column = dataset.select_columns([name]).with_format("arrow")[:][name]
    return pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)


def has_image_rows(dataset) -> bool:
    """Whether rows may hold images: an ``images``/``image`` column, or content parts in some turn's
    ``messages`` (found in Arrow, without reading rows into Python)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    if IMAGES_COLUMN in dataset.column_names or LLAVA_COLUMN in dataset.column_names:
        return True
    column = dataset.select_columns(["conversation"]).with_format("arrow")[:]["conversation"]
    struct = column.type.value_type if pa.types.is_list(column.type) else None
    if struct is None or not pa.types.is_struct(struct) or struct.get_field_index("messages") < 0:
        return False
    messages = pc.struct_field(pc.list_flatten(column.combine_chunks()), "messages")
    if not pa.types.is_string(messages.type) and not pa.types.is_large_string(messages.type):
        return True  # objects rather than JSON text: look at them row by row
    return any(bool(pc.any(pc.match_substring(messages, pattern)).as_py())
               for pattern in ('"type": "image', '"type":"image'))


def count_cut_before_images(dataset, max_length: int, report: PipelineReport) -> None:
    """Samples cut before an image that ``max_length`` would have split (shorter than the cut)."""
    table = dataset.select_columns(["num_tokens", "length"]
                                   + ([ROW_COLUMN] if ROW_COLUMN in dataset.column_names else [])
                                   ).with_format("arrow")[:]
    full, kept = table["num_tokens"].to_numpy(), table["length"].to_numpy()
    moved = np.flatnonzero(kept < np.minimum(full, max_length))
    if len(moved):
        numbers = table[ROW_COLUMN].to_numpy()[moved] if ROW_COLUMN in table.column_names else moved
        report.change(f"cut before an image that max_length={max_length} would split (the image and what "
                      "follows it left out)", [row_name(int(n)) for n in numbers])
