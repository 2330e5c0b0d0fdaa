"""Reuse a processed dataset when nothing that changes it has changed.

The key is a hash of everything the output depends on: the data files'
content, the dataset/tokenizer configs, the map fn's and template map fn's
source, the template, the tokenizer itself (vocabulary, merges, special tokens,
chat template), every pipeline argument (max_length, seed, pack strategy, ...)
and the source of the pipeline modules. The processed dataset is written with
``save_to_disk`` into a temporary folder that is renamed into place only when
complete, so an interrupted run never leaves a half-written cache.

    process_hf_dataset(..., cache_dir='~/.cache/sfttool/datasets')
    # first run: processes and saves <cache_dir>/<key>/; later runs: loads it
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any, Callable

from sfttool.dataset.data_path import data_source
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.fingerprint import describe, file_digest, tokenizer_digest
from sfttool.dataset.images_stage import processor_digest
from sfttool.dataset.load import expand_data_files
from sfttool.dataset.resolve import json_source_files, resolve_dataset, rows_config, source_name
from sfttool.registry import build_if_config, type_name

CACHE_FORMAT = 1
REPORT_FILE = "sfttool_report.json"


def data_files_digest(dataset_cfg: Any) -> list:
    """Content hashes of the local files a dataset config reads (under a ``validation_split`` too:
    ``rows_config``); ``data_path``'s files as ``load_data_path`` finds them (a glob, a folder)."""
    dataset_cfg = rows_config(dataset_cfg)
    if not isinstance(dataset_cfg, dict):
        return []
    if type_name(dataset_cfg.get("type")) == "load_data_path" and isinstance(dataset_cfg.get("path"), str):
        try:
            dataset_cfg = data_source(dataset_cfg["path"])
        except DatasetError:
            return []  # a missing path: loading it names it
    files = expand_data_files(dataset_cfg.get("data_files"))
    for folder in (dataset_cfg.get("path"), dataset_cfg.get("data_dir")):
        if isinstance(folder, str) and Path(folder).exists():
            files.append(folder)
    out = []
    for file in files:
        p = Path(file)
        if p.is_file():
            out.append([str(p), file_digest(p)])
        elif p.is_dir():
            out += [[str(f), file_digest(f)] for f in sorted(p.rglob("*")) if f.is_file()]
    return out


PIPELINE_MODULES = ("chat_format", "chat_messages", "chat_targets", "conversation", "encode", "encode_columns", "pack",
                    "pipeline", "resolve", "stages", "unrendered", "image_rows", "image_tokens", "images_stage")


def _pipeline_code_digest() -> str:
    # Read as files, not imported: the pipeline imports this module.
    here = Path(__file__).parent
    text = "".join((here / f"{name}.py").read_text(encoding="utf-8") for name in PIPELINE_MODULES)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_key(args: dict, tokenizer: Any) -> str:
    """The cache folder name for one ``process_hf_dataset`` call."""
    parts = {
        "format": CACHE_FORMAT,
        "code": _pipeline_code_digest(),
        "args": describe({k: v for k, v in args.items() if k not in ("tokenizer", "map_num_proc", "processor")}),
        "data_files": data_files_digest(args.get("dataset")),
        "tokenizer": tokenizer_digest(tokenizer),
        "processor": processor_digest(args.get("processor")),  # image rows: how images become tokens
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cached_pipeline(cache_dir: str | os.PathLike, args: dict, run_pipeline: Callable):
    """``run_pipeline(**args)`` (``process_hf_dataset``'s) with a disk cache under ``cache_dir``."""
    from datasets import load_from_disk

    from sfttool.dataset.report import PipelineReport, log, log_report
    tokenizer = build_if_config(args["tokenizer"], "tokenizer")
    args = {**args, "tokenizer": tokenizer}
    if not json_source_files(args["dataset"]):
        # A hub dataset, a custom loader, load_from_disk...: its config does not say what it holds (local
        # JSON files are hashed by data_files_digest), so build it and key the cache by its datasets
        # fingerprint, which follows its content.
        args["source"] = args.get("source") or source_name(args["dataset"])
        args["dataset"] = resolve_dataset(args["dataset"], args.get("split", "train"))
    target = Path(cache_dir).expanduser() / cache_key(args, tokenizer)
    if (target / REPORT_FILE).exists():
        log(f"Dataset: reusing the processed dataset cached at {target}")
        return load_from_disk(str(target))
    dataset, report = run_pipeline(**args)
    log_report(report, args["max_length"])
    save_atomically(dataset, target, _report_json(report, PipelineReport))
    log(f"Dataset: cached at {target}")
    return load_from_disk(str(target))


def _report_json(report, cls) -> str:
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(cls) if f.name not in ("stages", "emptied", "sources")}
    fields["pack"] = dataclasses.asdict(report.pack) if report.pack is not None else None
    fields["sample_lengths"] = len(fields["sample_lengths"])  # the count is enough
    return json.dumps(fields, indent=1)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_abandoned_partials(cache_dir: Path) -> list[Path]:
    """Delete temporary folders left by a run that was killed mid-save.

    Only those written on this host by a process that no longer exists: a
    cache shared between machines may hold another host's save in progress.
    """
    host = socket.gethostname()
    removed = []
    for path in cache_dir.glob(".*.tmp-*"):
        fields = path.name.rsplit(".tmp-", 1)[1].rsplit("-", 2)  # host may contain '-'
        if len(fields) == 3 and fields[0] == host and fields[1].isdigit() and not _pid_alive(int(fields[1])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def save_atomically(dataset, target: Path, report_json: str) -> None:
    """Write to ``<target>.tmp-<id>`` then rename: readers see all or nothing.

    If another process finished the same key first, its copy is kept.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_partials(target.parent)
    tmp = target.parent / f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        dataset.save_to_disk(str(tmp))
        (tmp / REPORT_FILE).write_text(report_json, encoding="utf-8")  # written last: marks completeness
        from sfttool.utils.atomic import before_rename
        before_rename(tmp, target)  # fsync before the rename; the kill -9 test pauses here
        if target.exists() and not (target / REPORT_FILE).exists():
            shutil.rmtree(target)  # not ours to trust: no completeness marker
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / REPORT_FILE).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
