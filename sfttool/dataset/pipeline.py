"""``process_hf_dataset``: load -> map fn -> template -> encode -> pack.

Each stage is one labelled ``datasets.map`` (or one Arrow step for packing),
except that the built-in template map fn runs inside the encode stage's
``map``, and every count that changes is logged with its reason::

    train_dataset = dict(type=process_hf_dataset,
                         dataset=dict(type=load_dataset, path='json', data_files='data.jsonl'),
                         tokenizer=tokenizer, max_length=2048,
                         dataset_map_fn=None,
                         template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.qwen_chat),
                         pack_to_max_length=True)

Rows hold ``input_ids``, ``labels``, ``position_ids``,
``sample_lengths`` (plus ``length``, for length-grouped samplers).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from sfttool.dataset.errors import ROW_COLUMN, DatasetError, where
from sfttool.dataset.fingerprint import stage_fingerprint, tokenizer_digest
from sfttool.dataset.images_stage import (IMAGE_COLUMNS, IMAGES_COLUMN, SIZES_COLUMN, bind_images, build_processor,
                                          check_image_template, count_cut_before_images, has_image_rows,
                                          processor_digest)
from sfttool.dataset.pixels import with_pixels
from sfttool.dataset.report import (DROP_SUBSET, PipelineReport, count_split, log,  # noqa: F401  (imported from here)
                                   log_report, stage_recorder)
from sfttool.dataset.rows import default_num_proc, number_rows, select_rows
from sfttool.dataset.resolve import (dataset_config, resolve_dataset, resolve_map_fn, resolve_template_map_fn,
                                     source_name, template_of)
from sfttool.dataset.settings import check_settings  # noqa: F401  (imported from here too)
from sfttool.dataset.stages import (NOTES_COLUMN, count_ignored_fields, count_notes, count_tokens, drop_empty_rows,
                                    drop_untrained_rows, fn_name, map_batch, map_batch_or_drop, missing_conversation,
                                    note_emptied, pretokenized_table, record_truncation, to_table)
from sfttool.registry import build_if_config


# ---------------------------------------------------------------------------
# Stages. Each takes a dataset and returns a new one, updating the report.

def apply_map_fn(dataset, map_fn: Callable, num_proc: int, source: str | None, report: PipelineReport,
                 role: str = "dataset_map_fn", none_drops: bool = False):
    """The dataset map fn on every row; what it changed in a row is counted (``stages.count_notes``).
    ``none_drops``: a row the fn returns None for is left out (``stages.map_batch_or_drop``)."""
    import pyarrow.compute as pc
    batch_fn, remove = (map_batch_or_drop, dataset.column_names) if none_drops else (map_batch, None)
    dataset = dataset.map(batch_fn, batched=True, with_indices=True, num_proc=num_proc, remove_columns=remove,
                          fn_kwargs=dict(fn=map_fn, source=source, role=role), desc=f"Map fn {fn_name(map_fn)}")
    notes = _column(dataset, NOTES_COLUMN)
    changed = np.flatnonzero(pc.utf8_length(notes).to_numpy(zero_copy_only=False) > 0)
    if len(changed):  # few rows: only those pass through Python
        changes = [n.split("\n") for n in notes.take(changed).to_pylist()]
        numbers = _row_numbers(dataset)[changed].tolist()
        count_notes(report, changes, numbers)
        if "conversation" in dataset.column_names:  # what emptied a conversation is the cause of its drop
            note_emptied(report, dataset.select(changed)["conversation"], changes, numbers)
    return dataset.remove_columns([NOTES_COLUMN])


def folds_into_encode(template_map_fn: Callable | None, rename_maps, do_dataset_tokenization: bool) -> bool:
    """Whether the template map fn runs inside the encode stage's ``map`` (as the stream applies it), saving
    a pass that reads and writes every conversation through Arrow. Only the built-in one: it keeps every
    turn and key, so the drops and counts before encoding see what they saw after a template stage; a
    user's template map fn (which may add columns or empty a conversation) and renames keep the stage."""
    from sfttool.dataset.map_fns.template_map_fn import template_map_fn as builtin
    return getattr(template_map_fn, "func", None) is builtin and not rename_maps and do_dataset_tokenization


def apply_template(dataset, template_map_fn: Callable, num_proc: int, source: str | None):
    return dataset.map(map_batch, batched=True, with_indices=True, num_proc=num_proc,
                       fn_kwargs=dict(fn=template_map_fn, source=source, role="template_map_fn"),
                       desc="Applying the prompt template")


def _row_numbers(dataset) -> np.ndarray:
    """Each row's number as loaded (``ROW_COLUMN``), or its index when the rows are not numbered."""
    if ROW_COLUMN in dataset.column_names:
        return _column(dataset, ROW_COLUMN).to_numpy()
    return np.arange(len(dataset))


def require_conversation(dataset, map_fn: Callable | None, source: str | None) -> None:
    """Rows without ``conversation``: say which map fn to set (XTuner's first check)."""
    if "conversation" not in dataset.column_names:
        first = dataset[0] if len(dataset) else {name: None for name in dataset.column_names}
        number = first.get(ROW_COLUMN, 0)
        raise DatasetError(f"{where(number, source)}: {missing_conversation(first, map_fn)}")


def drop_empty(dataset, report: PipelineReport):
    """Drop rows whose conversation is empty (counted, never silent)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    column = _column(dataset, "conversation")
    if not pa.types.is_list(column.type):
        return dataset  # not a list at all: the encoder reports the row
    empty = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False) == 0
    if not empty.any():
        return dataset  # no indices mapping: later stages read the table without a copy
    drop_empty_rows(report, [True] * int(empty.sum()), _row_numbers(dataset)[empty].tolist())
    return dataset.select(np.flatnonzero(~empty))


def _column(dataset, name: str):
    """One column as Arrow (honours select/filter indices), without decoding rows into Python."""
    return dataset.select_columns([name]).with_format("arrow")[:][name]


def encode(dataset, tokenizer, max_length: int, input_ids_with_output: bool, template, remove_unused_columns: bool,
           num_proc: int, source: str | None, report: PipelineReport, template_map_fn: Callable | None = None,
           skip_bad_rows: bool = False, processor=None):
    """Conversations -> samples (one each, or several in HF chat-template mode; counted in ``report.split``).
    ``template_map_fn`` (``folds_into_encode``) is applied to each batch first. A row whose trained answer
    the template cannot render stops the pipeline, or with ``skip_bad_rows`` is dropped with the rows left
    without a trained token (``drop_untrained``)."""
    from datasets.fingerprint import Hasher

    from sfttool.dataset.chat_format import renderer
    from sfttool.dataset.stages import json_turns, template_and_encode_batch
    from sfttool.utils.templates import chat_template_options, is_hf_chat_template
    hf_chat_template, chat_options = is_hf_chat_template(template), chat_template_options(template)
    if processor is not None:  # image rows: the processor's chat template renders them
        hf_chat_template, chat_options = True, {k: v for k, v in chat_options.items() if k != "chat_format"}
    count_structured_fields(dataset, processor or renderer(tokenizer, chat_options), hf_chat_template, report)
    remove = dataset.column_names if remove_unused_columns else ["conversation"]
    remove += IMAGE_COLUMNS if processor is not None else []  # the encoder writes each sample's own images
    remove = [name for name in dict.fromkeys(remove) if name in dataset.column_names and name != ROW_COLUMN]
    mode = "chat template" if hf_chat_template else "template"
    settings = dict(max_length=max_length, source=source, input_ids_with_output=input_ids_with_output,
                    hf_chat_template=hf_chat_template, chat_options=chat_options,
                    carry=[name for name in dataset.column_names if name not in remove], skip_bad_rows=skip_bad_rows)
    # Hashed here once: left to datasets, fingerprinting this map pickles the tokenizer (seconds per call).
    fingerprint = stage_fingerprint(dataset._fingerprint, "encode", tokenizer_digest(tokenizer), settings, remove,
                                    template_map_fn and Hasher.hash(template_map_fn), processor_digest(processor),
                                    _images_digest(dataset))
    desc = f"{'Templating and tokenizing' if template_map_fn else 'Tokenizing'} ({mode} mode)"
    # Turns held as JSON text reach the stage as Arrow and are parsed a batch at a time (``python_batch``).
    features = dataset.features if json_turns(dataset.features) else None
    dataset = (dataset.with_format("arrow") if features else dataset).map(
        template_and_encode_batch, batched=True, with_indices=True, num_proc=num_proc, remove_columns=remove,
        features=_encoded_features(dataset, remove, processor is not None), new_fingerprint=fingerprint, desc=desc,
        fn_kwargs=dict(tokenizer=tokenizer, template_map_fn=template_map_fn, processor=processor, features=features,
                       **settings)).with_format(None)
    if hf_chat_template:
        count_split(report, _row_numbers(dataset))
    return dataset


def _images_digest(dataset) -> str | None:
    """The images' paths and sizes as read from disk this run (the image stage is never cached): an image
    replaced by one of another size changes the encoded samples."""
    if SIZES_COLUMN not in dataset.column_names:
        return None
    return content_fingerprint(dataset.select_columns([IMAGES_COLUMN, SIZES_COLUMN]).with_format("arrow")[:])


def count_structured_fields(dataset, tokenizer, hf_chat_template: bool, report: PipelineReport) -> None:
    """Rows whose reasoning, tool calls or tool schemas the template leaves out, counted by field. Only rows
    with ``messages`` or ``tools`` (found in Arrow) pass through Python."""
    import pyarrow as pa
    import pyarrow.compute as pc
    column = _column(dataset, "conversation")
    struct = column.type.value_type if pa.types.is_list(column.type) else pa.null()
    fields = [f for f in struct if f.name in ("messages", "tools")] if pa.types.is_struct(struct) else []
    if not fields:
        return
    column = column.combine_chunks()
    turns = pc.list_flatten(column)
    # JSON text, or a list where standard-format files hold the objects themselves.
    length = {True: pc.list_value_length, False: pc.utf8_length}
    used = [pc.fill_null(pc.greater(length[pa.types.is_list(f.type)](pc.struct_field(turns, f.name)), 0), False)
            for f in fields]
    mask = used[0] if len(used) == 1 else pc.or_(*used)
    rows = np.unique(pc.list_parent_indices(column).to_numpy()[mask.to_numpy(zero_copy_only=False)])
    if len(rows):
        subset = dataset.select(rows)
        count_ignored_fields(report, subset["conversation"], _row_numbers(subset).tolist(), tokenizer,
                             hf_chat_template)


def _encoded_features(dataset, removed: list[str], images: bool = False):
    """int32 token columns: half the memory and disk of the int64 Python ints infer."""
    from datasets import Features, List, Value
    kept = {name: feature for name, feature in dataset.features.items() if name not in removed}
    return Features({**kept, "input_ids": List(Value("int32")), "labels": List(Value("int32")),
                     "length": Value("int32"), "num_tokens": Value("int32"), "num_trained": Value("int32"),
                     "first_trained": Value("int32"), **({IMAGES_COLUMN: List(Value("string"))} if images else {})})


def drop_untrained(dataset, report: PipelineReport, max_length: int):
    """Drop rows without a trained token, counted by cause with the first rows named."""
    trained = _column(dataset, "num_trained").to_numpy()
    untrained = np.flatnonzero(trained == 0)
    if not len(untrained):
        return dataset
    first = _column(dataset, "first_trained").to_numpy()[untrained]
    numbers = _row_numbers(dataset)[untrained]
    drop_untrained_rows(report, [0] * len(untrained), first.tolist(), numbers.tolist(), max_length)
    return dataset.select(np.flatnonzero(trained > 0))


# Which of several data sources a sample came from (``data_sources``): its index in the list.
SOURCE_COLUMN = "_sfttool_source"

# Columns the stages add for their own counts and messages; not part of a training row.
HELPER_COLUMNS = ("num_tokens", "num_trained", "first_trained", ROW_COLUMN, SOURCE_COLUMN)


def count_truncated(dataset, report: PipelineReport) -> None:
    """Samples cut at max_length, counted before rows left without labels are dropped."""
    table = dataset.select_columns(["num_tokens", "length"]).with_format("arrow")[:]
    record_truncation(table["num_tokens"].to_numpy(), table["length"].to_numpy(), report)


class NoRowsLeft(DatasetError):
    """Every row was dropped; ``report`` holds the counts so far (a part of a larger dataset, such as one
    block of ``process-dataset --ray``, may be left empty where the whole is not)."""

    def __init__(self, report: PipelineReport):
        super().__init__("no rows left to train on: " + (
            "; ".join(f"{n} dropped ({why})" for why, n in report.dropped.items()) or "the dataset is empty"))
        self.report = report

    def __reduce__(self):  # to another process: the message, as a DatasetError (the report may hold datasets)
        return DatasetError, (str(self),)


def require_rows(dataset, report: PipelineReport):
    """Stop with the drop counts when nothing is left (instead of an empty-table crash later)."""
    if len(dataset) == 0:
        raise NoRowsLeft(report)
    return dataset


def finish_rows(table, pack_to_max_length: bool, max_length: int, strategy: str, shuffle: bool, seed: int,
                report: PipelineReport, samples=None):
    """Pack (or lay out one sample per row) and wrap as a ``datasets.Dataset``; ``samples``: the rows of
    ``table`` to use, in order (``pack.pack_table``), default every row."""
    from datasets import Dataset
    from sfttool.dataset.pack import pack_table, unpacked_table
    if pack_to_max_length:
        rows, report.pack = pack_table(table, max_length, strategy, shuffle, seed, samples)
    else:
        rows = unpacked_table(table, samples)
        for name in table.column_names:
            if name not in rows.column_names and name not in HELPER_COLUMNS:
                rows = rows.append_column(name, table[name] if samples is None else table[name].take(samples))
    return Dataset(rows, fingerprint=content_fingerprint(rows))


def content_fingerprint(table) -> str:
    """A fingerprint of an in-memory Arrow table from its buffers, read in place.

    Left to itself, ``datasets.Dataset(table)`` fingerprints an in-memory table
    by pickling all of it: a transient copy of about three times the packed data,
    which was the largest allocation of the whole pipeline. Equal content built
    the same way gives an equal fingerprint, which is what its caching needs. xxh3 (a ``datasets``
    dependency, its own fingerprints' hash) reads the buffers ten times faster than blake2b."""
    import xxhash
    digest = xxhash.xxh3_128()
    for name in table.column_names:
        digest.update(name.encode())
        for chunk in table[name].chunks:
            digest.update(f"{chunk.type}:{len(chunk)}:{chunk.offset}".encode())
            for buffer in chunk.buffers():
                if buffer is not None:
                    digest.update(memoryview(buffer))
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# The pipeline.

def run_pipeline(dataset, tokenizer, max_length: int, dataset_map_fn=None, template_map_fn=None,
                 max_dataset_length=None, split="train", remove_unused_columns=False, rename_maps=(),
                 shuffle_before_pack=True, pack_to_max_length=True, input_ids_with_output=True,
                 map_num_proc=None, seed=0, pack_strategy="bfd", do_dataset_tokenization=True,
                 source=None, keep_stages=False, skip_bad_rows=False, processor=None, image_folder=None):
    """All stages in order; returns ``(dataset, PipelineReport)``.

    ``keep_stages`` stores the dataset after each stage in ``report.stages``
    (``check-custom-dataset`` prints them); the template stage then runs as a ``map`` of its own, which
    the encode stage reads, instead of inside the encode stage's ``map``: each runs once either way.
    """
    source = source or source_name(dataset)
    check_image_template(template_of(template_map_fn), processor, pack_to_max_length and pack_strategy)
    processor = build_processor(processor)
    tokenizer = processor.tokenizer if processor is not None and tokenizer is None else tokenizer
    tokenizer = build_if_config(tokenizer, "tokenizer")
    dataset = resolve_dataset(dataset, split)
    if do_dataset_tokenization:
        dataset = number_rows(dataset)
    report = PipelineReport(rows_in=len(dataset))
    if keep_stages:
        report.stages["loaded"] = dataset
    dataset = select_rows(dataset, max_dataset_length, seed, report)
    table = sample_table(dataset, tokenizer, max_length, report, dataset_map_fn, template_map_fn, rename_maps,
                         remove_unused_columns or pack_to_max_length,  # packing keeps only token columns
                         input_ids_with_output, map_num_proc, do_dataset_tokenization, source, keep_stages,
                         skip_bad_rows, processor, image_folder)
    dataset = finish_rows(table, pack_to_max_length, max_length, pack_strategy, shuffle_before_pack, seed, report)
    if keep_stages:
        report.stages["packed" if pack_to_max_length else "rows"] = dataset
    report.rows_out = len(dataset)
    return dataset, report


def sample_table(dataset, tokenizer, max_length: int, report: PipelineReport, dataset_map_fn=None,
                 template_map_fn=None, rename_maps=(), remove_unused_columns=False, input_ids_with_output=True,
                 map_num_proc=None, do_dataset_tokenization=True, source=None, keep_stages=False,
                 skip_bad_rows=False, processor=None, image_folder=None):
    """The stages from the map fn to the encoded samples, on rows already loaded (and numbered): an
    Arrow table of one sample per row, with the token counts packing and the reports read. With a
    ``processor``, rows may hold images (``image_rows``), each sample keeps its own (``images``)."""
    template = template_of(template_map_fn)
    tokenizer = build_if_config(tokenizer, "tokenizer")
    map_fn, template_map_fn = resolve_map_fn(dataset_map_fn), resolve_template_map_fn(template_map_fn)
    stage = stage_recorder(report, keep_stages)
    num_proc = default_num_proc(len(dataset), map_num_proc)
    # datasets 5 starts a process pool for num_proc=1 too, pickling the tokenizer to send it there.
    num_proc = num_proc if num_proc > 1 else None
    if map_fn is not None:
        dataset = apply_map_fn(dataset, map_fn, num_proc, source, report)
        stage("map_fn", dataset)
    if do_dataset_tokenization and all(new != "conversation" for _, new in rename_maps):
        require_conversation(dataset, map_fn, source)  # before the template map fn, which would see none
    fold = folds_into_encode(template_map_fn, rename_maps, do_dataset_tokenization) and not keep_stages
    if template_map_fn is not None and not fold:
        dataset = apply_template(dataset, template_map_fn, num_proc, source)
        stage("template", dataset)
    for old, new in rename_maps:
        dataset = dataset.rename_column(old, new)
    if not do_dataset_tokenization:
        return pretokenized_table(dataset, max_length, report)
    require_conversation(dataset, map_fn, source)
    dataset = require_rows(drop_empty(dataset, report), report)
    if processor is not None or has_image_rows(dataset):
        dataset = require_rows(bind_images(dataset, processor, image_folder, num_proc, source, report,
                                           skip_bad_rows), report)
        stage("images", dataset)
    dataset = encode(dataset, tokenizer, max_length, input_ids_with_output, template, remove_unused_columns,
                     num_proc, source, report, template_map_fn if fold else None, skip_bad_rows, processor)
    count_truncated(dataset, report)
    if processor is not None:
        count_cut_before_images(dataset, max_length, report)
    if input_ids_with_output:
        dataset = require_rows(drop_untrained(dataset, report, max_length), report)
    stage("encoded", dataset)
    table = to_table(dataset)
    count_tokens(table, report)
    return table


def process_hf_dataset(dataset, tokenizer=None, max_length=None, dataset_map_fn=None, template_map_fn=None,
                       max_dataset_length=None, split="train", remove_unused_columns=False, rename_maps=[],
                       shuffle_before_pack=True, pack_to_max_length=True, use_varlen_attn=False,
                       input_ids_with_output=True, with_image_token=False, map_num_proc=None, seed=0,
                       pack_strategy="bfd", cache_dir=None, do_dataset_tokenization=True, source=None,
                       skip_bad_rows=False, processor=None, image_folder=None, lazy_encode=False,
                       buffer_size=None, encode_chunk=None, rows_per_epoch=None):
    """XTuner's ``process_hf_dataset``: a training ``datasets.Dataset`` from raw data.

    >>> ds = process_hf_dataset(rows, tokenizer, max_length=2048,
    ...                         template_map_fn=template_map_fn_factory('qwen_chat'))  # doctest: +SKIP
    >>> ds[0].keys()                                                                  # doctest: +SKIP
    dict_keys(['input_ids', 'labels', 'position_ids', 'sample_lengths', 'length'])

    New arguments: ``seed`` (every shuffle and subset), ``pack_strategy``
    (``'bfd'`` never splits a sample; ``'concat'`` is XTuner's cut),
    ``cache_dir`` (reuse a processed dataset when nothing that changes it did),
    ``source`` (the data file(s) errors name when ``dataset`` is already built),
    ``skip_bad_rows`` (drop, counted, the rows whose trained answers the template cannot render, such as
    tool calls under a template without tools, instead of stopping at the first: ``unrendered``;
    ``--skip-bad-rows`` sets it).
    ``processor`` (the model's ``AutoProcessor``, or its config) encodes image-text rows through its own
    chat template and image expansion (the tokenizer is then the processor's); ``image_folder`` is where
    relative image paths are read from (default: the data file's folder); rows keep their ``images``,
    whose pixels are loaded when a row is read (``pixels``; see docs/multimodal.md).
    ``map_num_proc=None`` picks a process count from the CPU count and data size.
    ``use_varlen_attn`` only matters to the collate fn and model (rows always
    carry per-sample position_ids); as in XTuner it requires packing.
    ``lazy_encode=True``: load as always, but map, template and encode each row when the dataloader reads
    it, in its workers, packing ``buffer_size`` samples at a time (``sfttool.dataset.lazy``; ``encode_chunk``
    and ``rows_per_epoch`` as ``StreamingPackedDataset`` takes them).
    """
    check_settings(max_length, pack_to_max_length, use_varlen_attn, pack_strategy, with_image_token,
                   max_dataset_length)
    processor = build_processor(processor)
    if processor is not None and tokenizer is None:
        tokenizer = processor.tokenizer  # the processor's own: its chat template and image tokens
    args = dict(dataset=dataset_config(dataset), tokenizer=tokenizer, max_length=max_length,
                dataset_map_fn=dataset_map_fn, template_map_fn=template_map_fn,
                max_dataset_length=max_dataset_length, split=split, remove_unused_columns=remove_unused_columns,
                rename_maps=list(rename_maps),
                shuffle_before_pack=shuffle_before_pack, pack_to_max_length=pack_to_max_length,
                input_ids_with_output=input_ids_with_output, map_num_proc=map_num_proc, seed=seed,
                pack_strategy=pack_strategy, do_dataset_tokenization=do_dataset_tokenization, source=source,
                skip_bad_rows=skip_bad_rows, processor=processor, image_folder=image_folder)
    lazy = dict(lazy_encode=lazy_encode, buffer_size=buffer_size, encode_chunk=encode_chunk,
                rows_per_epoch=rows_per_epoch)
    if any(value is not None and value is not False for value in lazy.values()):
        from sfttool.dataset.lazy import lazy_dataset
        return lazy_dataset(args, use_varlen_attn=use_varlen_attn, cache_dir=cache_dir, **lazy)
    if cache_dir is not None:
        from sfttool.dataset.cache import cached_pipeline
        return with_pixels(cached_pipeline(cache_dir, args, run_pipeline), args["processor"])
    result, report = run_pipeline(**args)
    log_report(report, max_length)
    return with_pixels(result, args["processor"])


# The registry hands `dataset` over as its config, unbuilt: local JSON files are then checked line by
# line before Arrow reads them, errors name the file, and the cache key hashes the files' content.
process_hf_dataset.build_args_lazily = ("dataset",)
