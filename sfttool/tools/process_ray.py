"""``sfttool process-dataset CONFIG --out DIR --ray [ADDRESS]``: ``process_dataset`` on a Ray cluster.

The driver cuts the raw rows into blocks of ``shard_rows`` (``ray_blocks.plan_blocks``: the local
command's shards, numbered the same way) and Ray Data runs one task per block, on any worker of the
cluster. A task reads its block from the files, runs the pipeline's own stages on it
(``pipeline.run_pipeline``: map fn, template, encode, pack, exactly as ``process_hf_dataset``), writes
one Parquet shard and returns the shard's manifest line and its report; the driver adds the reports
up and writes ``manifest.json`` last, which ``load_processed_dataset`` (``train``) reads as it reads
the local command's folder::

    $ sfttool process-dataset my_config.py --out processed/alpaca --ray auto   # a running cluster

A task whose worker dies is run again by Ray; its shard is written under a temporary name and renamed,
so a retried block's shard replaces, never duplicates, the first attempt's. ``OUT`` must be a folder
every node can write (a shared file system) when the cluster has several machines.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import pickle
import shutil
import socket
import time
from pathlib import Path

from sfttool.dataset import resolve
from sfttool.dataset.errors import DatasetError
from sfttool.dataset.pack import PackStats
from sfttool.dataset.pipeline import (NoRowsLeft, check_settings, content_fingerprint, process_hf_dataset,
                                      run_pipeline)
from sfttool.dataset.report import DROP_SUBSET, PipelineReport, log, log_report
from sfttool.dataset.source import read_failure, reader_errors
from sfttool.registry import build, resolve_type
from sfttool.tools.process_dataset import (DATA_DIR, DEFAULT_SHARD_ROWS, MANIFEST, ProcessedDatasetError,
                                           build_manifest, dataset_config, prepare_out_dir, shard_entry)
from sfttool.tools.ray_blocks import input_files, plan_blocks, read_block

PARQUET = "parquet"  # the manifest's ``format`` for these shards (the local command's are ``save_to_disk``'s)
KEY = "train_dataloader.dataset"


def ray_process_dataset(cfg, out_dir: str | Path, address: str | None = None, overwrite: bool = False,
                        shard_rows: int = DEFAULT_SHARD_ROWS) -> dict:
    """Build ``cfg.train_dataloader.dataset`` on Ray, block by block, and save it under ``out_dir``;
    return the manifest. ``address`` as ``ray.init`` takes it (None: ``RAY_ADDRESS``, else a Ray
    started for this run; ``'auto'``: the cluster running on this machine); a Ray already initialised
    in this process is used as it is."""
    out_dir = Path(out_dir)
    if shard_rows < 1:
        raise ProcessedDatasetError(f"shard_rows must be at least 1, got {shard_rows}")
    node = dataset_config(cfg)
    if resolve_type(node["type"], f"{KEY}.type") is not process_hf_dataset:
        raise ProcessedDatasetError(f"{KEY}: --ray runs process_hf_dataset's stages, not {node['type']!r}; "
                                    "run without --ray")
    kind, files = input_files(resolve.dataset_config(node["dataset"]))
    args = pipeline_args(node)
    subset = args.pop("max_dataset_length")
    blocks, rows_in = plan_blocks(kind, files, shard_rows, args["seed"], subset)
    prepare_out_dir(out_dir, overwrite)
    tmp = out_dir / f".{DATA_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with ray_session(address) as cluster:
        summaries = run_blocks(blocks, kind, args, tmp)
    report, shards = gather(summaries, rows_in, sum(b["rows"] for b in blocks))
    for leftover in tmp.glob("*.tmp"):  # a killed attempt's part-written file
        leftover.unlink()
    tmp.rename(out_dir / DATA_DIR)
    manifest = {**build_manifest(cfg, node, shards, None, shard_rows), "format": PARQUET,
                "ray": {**cluster, **worker_figures(summaries)}, "report": report_summary(report)}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log_report(report, args["max_length"])
    return manifest


def pipeline_args(node: dict) -> dict:
    """``run_pipeline``'s arguments from a ``process_hf_dataset`` node, built (the tokenizer too), checked as
    ``process_hf_dataset`` checks them; one process per worker (``map_num_proc=1``)."""
    built = {k: build(v, f"{KEY}.{k}") for k, v in node.items() if k not in ("type", "dataset", "cache_dir")}
    settings = inspect.signature(process_hf_dataset).bind_partial(dataset=None, **built).arguments
    defaults = {name: p.default for name, p in inspect.signature(process_hf_dataset).parameters.items()}
    values = {**defaults, **settings}
    check_settings(values["max_length"], values["pack_to_max_length"], values["use_varlen_attn"],
                   values["pack_strategy"], values["with_image_token"], values["max_dataset_length"])
    taken = inspect.signature(run_pipeline).parameters
    args = {k: v for k, v in values.items() if k in taken and k != "dataset"}
    args["source"] = args["source"] or resolve.source_name(resolve.dataset_config(node["dataset"]))
    return {**args, "rename_maps": list(args["rename_maps"]), "map_num_proc": 1}


@contextlib.contextmanager
def ray_session(address: str | None):
    """Ray for the run: the one this process already initialised, or ``ray.init(address)`` (shut down
    after). Yields what the manifest records of the cluster."""
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        _require_listening(address)
        try:
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as exc:  # no cluster there, or a bad address
            raise ProcessedDatasetError(f"--ray {address or ''}: Ray could not start or connect: "
                                        f"{str(exc).strip().splitlines()[0]}") from None
    try:
        resources = ray.cluster_resources()
        yield {"address": address or None, "nodes": len([n for n in ray.nodes() if n.get("Alive")]),
               "cpus": int(resources.get("CPU", 0))}
    finally:
        if started:
            ray.shutdown()


def _require_listening(address: str | None) -> None:
    """A ``HOST:PORT`` with nothing listening is said at once (``ray.init`` would retry for minutes)."""
    host, _, port = (address or "").removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # 'auto', or a form ray.init reads itself
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        raise ProcessedDatasetError(f"--ray {address}: nothing answers at {host}:{port} ({exc.strerror or exc}); "
                                    f"start the cluster's head there (ray start --head --port={port}) or fix "
                                    "the address") from None


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ProcessedDatasetError("--ray needs Ray Data: pip install 'sfttool[ray]'") from None
    return ray


def run_blocks(blocks: list[dict], kind: str, args: dict, tmp: Path) -> list[dict]:
    """One Ray Data task per block (``process_blocks``); the blocks' summaries, in block order."""
    import ray.data
    ray.data.DataContext.get_current().enable_progress_bars = False  # one line per block instead
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its execution plan and progress-bar notes
    items = [{"block": json.dumps(block)} for block in blocks]
    dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        process_blocks, batch_size=1, batch_format="pyarrow",
        fn_kwargs=dict(kind=kind, args=args, tmp=str(tmp)))
    summaries = []
    for batch in dataset.iter_batches(batch_size=None, batch_format="pyarrow"):
        for data in batch["summary"].to_pylist():
            summaries.append(pickle.loads(data))
            log(f"Dataset: block {len(summaries)}/{len(blocks)} done")
    return sorted(summaries, key=lambda s: s["index"])


def process_blocks(batch, kind: str, args: dict, tmp: str):
    """Ray Data's ``map_batches`` function: each block of ``batch`` processed (``process_block``); one
    pickled summary per block."""
    import datasets
    import pyarrow as pa
    datasets.disable_progress_bars()
    summaries = [pickle.dumps(process_block(json.loads(b), kind, args, Path(tmp)))
                 for b in batch["block"].to_pylist()]
    return pa.table({"summary": pa.array(summaries, pa.binary())})


def process_block(block: dict, kind: str, args: dict, tmp: Path) -> dict:
    """Read a block, run the pipeline on it, write its shard: ``{index, shard, report, seconds}``, or
    ``{index, error}`` for bad data (the error the local command gives for it)."""
    import ray
    from datasets import Dataset
    summary: dict = {"index": block["index"], "shard": None, "pid": os.getpid(),
                     "node": ray.get_runtime_context().get_node_id()}
    start, cpu = time.perf_counter(), time.process_time()
    try:
        table = read_block(kind, block)
    except reader_errors() as exc:
        return {**summary, "error": str(read_failure(exc, args["source"]))}
    read = time.perf_counter()
    try:
        dataset, report = run_pipeline(Dataset(table, fingerprint=content_fingerprint(table)), **args)
    except NoRowsLeft as empty:  # every row of this block dropped: counted, no shard
        return {**summary, "report": _slim(empty.report), "seconds": (read - start, time.perf_counter() - read, 0),
                "cpu_seconds": time.process_time() - cpu}
    except DatasetError as exc:
        return {**summary, "error": str(exc)}
    processed = time.perf_counter()
    name = f"shard-{block['index']:05d}.{PARQUET}"
    write_parquet(dataset.data.table, tmp / name)
    return {**summary, "shard": shard_entry(name, dataset, args["max_length"]), "report": _slim(report),
            "seconds": (read - start, processed - read, time.perf_counter() - processed),
            "cpu_seconds": time.process_time() - cpu}


def write_parquet(table, path: Path) -> None:
    """Write under a temporary name, then rename: a reader (or a retried task) never sees half a shard."""
    import pyarrow.parquet as pq
    part = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, part)
    os.replace(part, path)


def _slim(report: PipelineReport) -> PipelineReport:
    report.stages, report.sample_lengths = {}, []  # the datasets stay on the worker; lengths are in the shard
    return report


def gather(summaries: list[dict], rows_in: int, used: int) -> tuple[PipelineReport, list[dict]]:
    """The first block's error, if any, else one report for the run and the shards' manifest lines."""
    for summary in summaries:
        if "error" in summary:
            raise DatasetError(summary["error"])
    report = PipelineReport(rows_in=rows_in)
    report.drop(DROP_SUBSET, [], count=rows_in - used)
    for summary in summaries:
        add_report(report, summary["report"])
    if not report.rows_out:
        raise NoRowsLeft(report)
    return report, [s["shard"] for s in summaries if s["shard"] is not None]


def add_report(total: PipelineReport, part: PipelineReport) -> None:
    """A block's counts added to the run's; the first rows named per cause stay the first in row order
    when blocks are added in order."""
    for why, n in part.dropped.items():
        total.drop(why, part.drop_examples.get(why, []), count=n)
    for what, n in part.changed.items():
        total.change(what, part.change_examples.get(what, []), count=n)
    for name in ("encoded", "truncated", "tokens_cut", "tokens", "trained_tokens", "rows_out"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    for many, n in part.split.items():
        total.split[many] = total.split.get(many, 0) + n
    if part.pack is not None:
        pack = total.pack or PackStats(0, 0, 0, 0, 0, 0, part.pack.max_length)
        for name in ("samples", "rows", "tokens", "capacity", "split_samples", "rows_without_labels"):
            setattr(pack, name, getattr(pack, name) + getattr(part.pack, name))
        total.pack = pack


def report_summary(report: PipelineReport) -> dict:
    """The report's counts as the manifest keeps them."""
    names = ("rows_in", "rows_out", "dropped", "drop_examples", "changed", "change_examples", "encoded",
             "truncated", "tokens_cut", "tokens", "trained_tokens", "split")
    summary = {name: getattr(report, name) for name in names}
    summary["packed_samples"] = report.pack.samples if report.pack is not None else None
    return summary


def worker_figures(summaries: list[dict]) -> dict:
    """Blocks, nodes and worker processes used, the seconds the tasks spent reading, processing and writing
    and their CPU seconds (each summed over the tasks: worker time, not wall-clock)."""
    timed = [s["seconds"] for s in summaries if "seconds" in s]
    seconds = [round(sum(t[i] for t in timed), 3) for i in range(3)]
    cpu = round(sum(s.get("cpu_seconds", 0) for s in summaries), 3)
    return {"blocks": len(summaries), "nodes_used": len({s["node"] for s in summaries}),
            "worker_processes": len({(s["node"], s["pid"]) for s in summaries}),
            "read_seconds": seconds[0], "pipeline_seconds": seconds[1], "write_seconds": seconds[2],
            "cpu_seconds": cpu}
