"""Tokenize and pack a config's training dataset once, save it, and load it back.

``process_dataset(cfg, out)`` builds ``train_dataloader.dataset`` exactly as
training does (usually ``process_hf_dataset``), on ``num_proc`` processes, and
saves it with ``datasets``' ``save_to_disk`` next to a ``manifest.json``. A
config then trains from the saved rows without re-tokenizing::

    from sfttool.tools.process_dataset import load_processed_dataset
    train_dataset = dict(type=load_processed_dataset, path='processed/alpaca')

Memory stays bounded on data larger than RAM: the raw rows are processed one
shard at a time, every ``datasets`` file is memory-mapped, and the statistics
are computed one Arrow batch at a time (docs/scale.md has the measurements).
"""
from __future__ import annotations

import copy
import datetime
import hashlib
import inspect
import json
import shutil
from pathlib import Path
from typing import Any

from sfttool import __version__
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.image_rows import IMAGES_COLUMN
from sfttool.dataset.images_stage import build_processor
from sfttool.dataset.pack import packing_efficiency
from sfttool.dataset.settings import LAZY_SETTINGS
from sfttool.dataset.pipeline import process_hf_dataset
from sfttool.dataset.rows import number_rows, select_rows
from sfttool.dataset.pixels import with_pixels
from sfttool.dataset.report import PipelineReport, log
from sfttool.dataset import resolve
from sfttool.dataset.stats import dataset_stats
from sfttool.registry import BUILDER, build, resolve_type

MANIFEST = "manifest.json"
DATA_DIR = "data"
MANIFEST_VERSION = 1
TOKEN_COLUMNS = ("input_ids", "labels", "position_ids", "sample_lengths")


class ProcessedDatasetError(DatasetError):
    """A processed dataset cannot be written or read; the message says how to fix it. A DatasetError, so
    every command (``train`` loading the folder too) prints it as one line."""


def dataset_config(cfg) -> dict:
    """The node training builds its dataset from: ``train_dataloader.dataset``."""
    node = cfg.get("train_dataloader", {}).get("dataset") if hasattr(cfg, "get") else None
    if not isinstance(node, dict) or "type" not in node:
        raise ProcessedDatasetError(
            f"{cfg.filename}: no `train_dataloader.dataset` with a `type` to process; "
            "set train_dataloader = dict(dataset=dict(type=process_hf_dataset, ...), ...)")
    # A deep copy, not ``to_dict()``: that would turn imported objects into dotted strings.
    return copy.deepcopy(node)


def with_num_proc(node: dict, num_proc: int | None) -> dict:
    """Set the builder's process count (``map_num_proc`` as in XTuner, or ``num_proc``).

    >>> with_num_proc({'type': process_hf_dataset, 'map_num_proc': 32}, 4)['map_num_proc']
    4
    """
    if num_proc is None:
        return node
    params = inspect.signature(resolve_type(node["type"], "train_dataloader.dataset.type")).parameters
    for name in ("map_num_proc", "num_proc"):
        if name in params:
            return {**node, name: num_proc}
    raise ProcessedDatasetError(
        f"train_dataloader.dataset: {node['type']!r} takes no `map_num_proc`/`num_proc` argument; "
        "drop --num-proc or process a `process_hf_dataset` node")


def config_hash(node: dict) -> str:
    """A stable hash of the dataset node, to tell whether a saved dataset is stale."""
    text = json.dumps(node, sort_keys=True, default=_describe)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _describe(obj: Any) -> str:
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '')}.{obj.__qualname__}"
    return repr(obj)


def shard_entry(name: str, dataset, max_length: int | None, batch_size: int = 10_000) -> dict:
    """A shard's line of the manifest: its counts (``dataset.stats.dataset_stats``; the packing
    efficiency only when the config names ``max_length``) and a fingerprint of its token columns,
    so equal data gives an equal value. One Arrow batch at a time (memory stays at one batch)."""
    if "input_ids" not in dataset.column_names:
        raise ProcessedDatasetError("the processed dataset has no `input_ids` column: it is not encoded")
    stats = dataset_stats(dataset, max_length, batch_size)
    efficiency = stats["packing_efficiency"] if max_length else None
    return {"name": name, **{k: stats[k] for k in ("rows", "tokens", "trained_tokens")},
            "packing_efficiency": None if efficiency is None else round(efficiency, 4),
            "fingerprint": token_fingerprint(dataset, batch_size)}


def token_fingerprint(dataset, batch_size: int = 10_000) -> str:
    """A hash of the token columns' lengths and values."""
    import pyarrow.compute as pc

    columns = [c for c in TOKEN_COLUMNS if c in dataset.column_names]
    digest = hashlib.sha256()
    for table in dataset.select_columns(columns).with_format("arrow").iter(batch_size=batch_size):
        for name in columns:
            digest.update(name.encode())
            digest.update(pc.list_value_length(table[name]).to_numpy(zero_copy_only=False).tobytes())
            digest.update(pc.list_flatten(table[name]).to_numpy(zero_copy_only=False).tobytes())
    return digest.hexdigest()[:16]


# At ~600 tokens a row, 100k rows peaked at 3.5 GiB (docs/benchmarks.md); one part-filled row per shard.
DEFAULT_SHARD_ROWS = 100_000


def process_dataset(cfg, out_dir: str | Path, num_proc: int | None = None, overwrite: bool = False,
                    shard_rows: int = DEFAULT_SHARD_ROWS) -> dict:
    """Build ``cfg.train_dataloader.dataset`` and save it under ``out_dir``; return the manifest.

    A ``process_hf_dataset`` node is run on ``shard_rows`` raw rows at a time
    (each shard tokenized and packed on its own, then saved), so memory follows
    the shard size, not the dataset size; a dataset of at most ``shard_rows``
    rows gives exactly the rows training would build. ``out_dir/data/shard-*``
    hold the Arrow files, ``out_dir/manifest.json`` the fingerprint and counts,
    written last: its presence means the folder is complete.
    """
    out_dir = Path(out_dir)
    if shard_rows < 1:
        raise ProcessedDatasetError(f"shard_rows must be at least 1, got {shard_rows}")
    prepare_out_dir(out_dir, overwrite)
    node = with_num_proc(dataset_config(cfg), num_proc)
    tmp = out_dir / f".{DATA_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    shards = []
    for i, dataset in enumerate(_shard_datasets(node, shard_rows)):
        name = f"shard-{i:05d}"
        if dataset.format.get("type") == "custom":  # image rows: the pixel loader is not saved; loading adds it
            dataset = dataset.with_format(None)
        dataset.save_to_disk(str(tmp / name))
        shards.append(shard_entry(name, dataset, node.get("max_length")))
        del dataset  # the next shard starts from a clean slate
    tmp.rename(out_dir / DATA_DIR)
    manifest = build_manifest(cfg, node, shards, num_proc, shard_rows)
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _shard_datasets(node: dict, shard_rows: int):
    """Yield the processed dataset shard by shard (one shard for other builders)."""
    import datasets

    key = "train_dataloader.dataset"
    if resolve_type(node["type"], f"{key}.type") is not process_hf_dataset:
        dataset = build(node, key)
        if not isinstance(dataset, datasets.Dataset):
            raise ProcessedDatasetError(
                f"{key} built a {type(dataset).__name__}, not a datasets.Dataset; "
                "only map-style datasets (process_hf_dataset) can be saved")
        yield dataset
        return

    # Built once for all shards; the saved folder replaces any pipeline cache. Processing is encoding ahead:
    # a config's lazy_encode (and its settings) are for training from the raw rows.
    lazy = ("cache_dir", "lazy_encode", *LAZY_SETTINGS)
    args = {k: build(v, f"{key}.{k}") for k, v in node.items() if k not in ("type", "dataset", *lazy)}
    dataset_cfg = resolve.dataset_config(node["dataset"])  # the raw data's node (this module's is the packed one's)
    args.setdefault("source", resolve.source_name(dataset_cfg))
    raw = resolve.resolve_dataset(dataset_cfg, args.pop("split", "train"))
    # Rows are numbered and selected globally (the same rows training would pick), sharded after.
    raw = number_rows(raw) if args.get("do_dataset_tokenization", True) else raw
    raw = select_rows(raw, args.pop("max_dataset_length", None), args.get("seed", 0), PipelineReport())
    n_shards = max(1, -(-len(raw) // shard_rows))
    for i in range(n_shards):
        part = raw if n_shards == 1 else raw.shard(n_shards, i, contiguous=True)
        yield process_hf_dataset(dataset=part, **args)


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise ProcessedDatasetError(f"{out_dir}: the folder exists and is not empty; "
                                        "choose another --out or pass --overwrite")
        for name in (MANIFEST, DATA_DIR):  # remove only what we wrote, never the user's files
            target = out_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def build_manifest(cfg, node: dict, shards: list[dict], num_proc: int | None, shard_rows: int) -> dict:
    import datasets

    max_length = node.get("max_length")
    totals = {k: sum(s[k] for s in shards) for k in ("rows", "tokens", "trained_tokens")}
    efficiency = packing_efficiency(totals["tokens"], totals["rows"], max_length)
    fingerprint = hashlib.sha256(" ".join(s["fingerprint"] for s in shards).encode()).hexdigest()[:16]
    return {
        "manifest_version": MANIFEST_VERSION,
        "config": str(cfg.filename),
        "config_hash": config_hash(node),
        "fingerprint": fingerprint,
        "max_length": max_length,
        "pack_to_max_length": node.get("pack_to_max_length", True),
        **totals,
        "packing_efficiency": None if efficiency is None else round(efficiency, 4),
        "shard_rows": shard_rows,
        "shards": shards,
        "num_proc": num_proc,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sfttool_version": __version__,
        "datasets_version": datasets.__version__,
    }


def read_manifest(path: str | Path) -> dict:
    """The manifest of a folder written by ``process_dataset``."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        raise ProcessedDatasetError(
            f"{path}: not a processed dataset (no {MANIFEST}); "
            f"create it with `sfttool process-dataset CONFIG --out {path}`")
    return json.loads(manifest.read_text())


@BUILDER.register_module()
def load_processed_dataset(path: str | Path, expected_fingerprint: str | None = None,
                           max_length: int | None = None, processor: Any = None):
    """Open a dataset saved by ``sfttool process-dataset`` (memory-mapped, nothing re-tokenized).

    ``expected_fingerprint`` refuses a folder whose data changed; ``max_length``
    one packed for another row length. Image-text rows (an ``images`` column) need the ``processor``
    they were encoded with: their pixels are loaded when a row is read (``dataset.pixels``). What was
    loaded is logged.

    >>> ds = load_processed_dataset('processed/alpaca')  # doctest: +SKIP
    >>> ds.column_names  # doctest: +SKIP
    ['input_ids', 'labels', 'position_ids', 'sample_lengths']
    """
    import datasets

    manifest = read_manifest(path)
    if expected_fingerprint is not None and manifest["fingerprint"] != expected_fingerprint:
        raise ProcessedDatasetError(
            f"{path}: fingerprint {manifest['fingerprint']} differs from the expected "
            f"{expected_fingerprint}; re-run `sfttool process-dataset` or update expected_fingerprint")
    if max_length is not None and manifest["max_length"] != max_length:
        raise ProcessedDatasetError(
            f"{path}: processed with max_length={manifest['max_length']}, but this config asks for "
            f"max_length={max_length}; re-run `sfttool process-dataset` with this config")
    log(f"Dataset: {manifest['rows']} processed rows from {path} (max_length {manifest['max_length']}, "
        f"fingerprint {manifest['fingerprint']}, config_hash {manifest['config_hash']})")
    files = [str(Path(path) / DATA_DIR / s["name"]) for s in manifest["shards"]]
    if manifest.get("format") == "parquet":  # written by `process-dataset --ray` (tools/process_ray.py)
        dataset = datasets.load_dataset("parquet", data_files=files, split="train")
    else:
        parts = [datasets.load_from_disk(file) for file in files]
        dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    processor = build_processor(processor)
    if IMAGES_COLUMN in dataset.column_names and processor is None:
        raise ProcessedDatasetError(f"{path}: the rows hold images: set processor=dict(type=AutoProcessor."
                                    "from_pretrained, ...) (the one they were encoded with) to load their pixels")
    return with_pixels(dataset, processor)
