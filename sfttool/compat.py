"""Narrow workarounds for dependency bugs on current versions.

Each patch says which versions it is for and why, so it can be deleted when
the dependency is fixed. ``apply_all()`` is idempotent and cheap.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib.abc
import importlib.metadata
import importlib.util
import itertools
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

_APPLIED: set[str] = set()


def _once(name: str) -> bool:
    if name in _APPLIED:
        return False
    _APPLIED.add(name)
    return True


def patch_mmengine_package_lookup() -> None:
    """mmengine 0.10.x: absolute imports inside ``read_base()`` call
    ``is_installed``/``get_installed_path``, which import ``pkg_resources``;
    setuptools >= 81 no longer ships it. Answer the same questions with
    ``importlib`` instead.

    mmengine resolves ``from pkg.configs.x import *`` as
    ``get_installed_path('pkg') + '/configs/x.py'``. An editable install of a
    source checkout maps ``sfttool.configs`` to the top-level ``configs/``
    folder, outside ``sfttool/``; there the folder holding ``configs`` is
    returned instead, so absolute base imports work in both layouts."""
    if not _once("mmengine_package_lookup"):
        return
    import mmengine.config.config as mm_config

    def is_installed(package: str) -> bool:
        try:
            importlib.metadata.distribution(package)
            return True
        except importlib.metadata.PackageNotFoundError:
            spec = importlib.util.find_spec(package)
            return spec is not None and spec.origin is not None

    def get_installed_path(package: str) -> str:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"package {package!r} is not installed")
        root = os.path.dirname(spec.origin)
        if not os.path.isdir(os.path.join(root, "configs")):
            try:
                configs = importlib.util.find_spec(f"{package}.configs")
            except ImportError:  # `package` is a plain module
                configs = None
            folder = os.path.dirname(configs.origin) if configs and configs.origin else ""
            if os.path.basename(folder) == "configs":  # mmengine appends 'configs/...'
                return os.path.dirname(folder)
        return root

    mm_config.is_installed = is_installed
    mm_config.get_installed_path = get_installed_path


@contextlib.contextmanager
def substituted_assignments(values: dict[tuple[Path, int], ast.expr]) -> Iterator[None]:
    """While a config loads, execute each ``(file, line)`` assignment with the given value instead
    (``--cfg-options NAME=VALUE``, ``sfttool.config.overrides``).

    mmengine 0.10.x offers no way to change a pure-Python config before it runs: it parses each
    file with ``ast`` and hands the tree to its ``ImportTransformer`` (looked up in
    ``mmengine.config.config`` at each call) before executing it. A subclass that first swaps the
    assigned values, installed for the time of one load, is the one narrow place to do it."""
    from mmengine.config import config as mm_config

    original = mm_config.ImportTransformer

    class Substituting(original):
        def __init__(self, *args, filename=None, **kwargs):
            super().__init__(*args, filename=filename, **kwargs)
            self._file = Path(filename).resolve() if filename else None

        def visit(self, node):
            if isinstance(node, ast.Module):
                for stmt in node.body:
                    value = values.get((self._file, getattr(stmt, "lineno", None)))
                    if value is not None and isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                        stmt.value = value
            return super().visit(node)

    mm_config.ImportTransformer = Substituting
    try:
        yield
    finally:
        mm_config.ImportTransformer = original


def disable_bnb_cpu_weight_repacking(model) -> int:
    """bitsandbytes 0.50 (CPU with AVX512-BF16): ``Linear4bit.forward`` in eval
    mode without grad repacks its 4-bit weight into an inference-only layout
    (``packing_format_for_cpu``) whose kernel has no backward. After any
    eval-mode forward or ``generate()`` (an evaluation hook), gradients no
    longer flow through those layers: LoRA gradients come out silently wrong
    or None and the loss stalls. Each layer's ``support_avx512bf16_for_cpu`` flag
    gates the repacking; clearing it keeps the trainable layout (inference on
    CPU is a little slower). Returns how many layers were changed.

    Call on every model that may hold bnb 4-bit layers, once it is built.
    """
    changed = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            changed += 1
    return changed


# ---------------------------------------------------------------------------
# Training-side patches (runner, distributed, DeepSpeed, resume).

_runs_in_this_process = itertools.count(1)


@contextlib.contextmanager
def peft_targets_as_given() -> Iterator[None]:
    """peft 0.21 with transformers 5: creating or loading an adapter rewrites its targets as if they were
    transformers 4 names of a fused MoE model (``convert_peft_config_for_transformers``). On models mapped
    to Qwen2-MoE's pattern (Qwen3-MoE, DeepSeek-V3, ...) every module target ending in ``gate_proj``,
    ``up_proj`` or ``down_proj`` becomes an expert parameter target, so LoRA silently leaves the shared
    experts and the dense MLP layers; on Mixtral a ``gate`` target becomes the router. sfttool's targets
    are already transformers 5 names (checked against the model), so the rewrite is skipped inside the
    block. For peft >= 0.21 (the rewrite's first release) on transformers >= 5."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # an older peft: no rewrite
        yield
        return
    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def numbered_run_name(name: str) -> str:
    """The run's name, numbered from the second run of a process (``name_run2`` ...).

    mmengine 0.10.x names a run's message hub and logger ``<name>_<timestamp to the second>``, and
    their ``get_instance`` hands back an existing instance of that name, so a second run started in
    the same process within the same second (tests, notebooks) inherited the first run's checkpoint
    bookkeeping -- and deleted its own new checkpoints as "older than the last K" -- and logged
    into the first run's file. Every rank trains the same number of times, so the numbers agree
    across ranks."""
    n = next(_runs_in_this_process)
    return name if n == 1 else f"{name}_run{n}"


def register_mmengine_deepspeed_wrapper() -> None:
    """mmengine 0.10.x registers its ``DeepSpeedOptimWrapper`` (the name ``optim_wrapper.type`` gives)
    only when its private ``mmengine._strategy`` package is imported, which imports deepspeed
    (seconds): import it where that name must resolve."""
    import mmengine._strategy  # noqa: F401


def patch_mmengine_deepspeed_optimizers() -> None:
    """mmengine 0.10.x with deepspeed >= 0.16: ``register_deepspeed_optimizers``
    (called by ``DeepSpeedStrategy.__init__``) imports the 1-bit optimizers from
    ``deepspeed.runtime.fp16.onebit``, which deepspeed removed; every DeepSpeed
    run dies with ImportError. sfttool passes a torch optimizer to DeepSpeed, so
    registering only the optimizers that still exist is enough."""
    if not _once("mmengine_deepspeed_optimizers"):
        return
    import mmengine._strategy.deepspeed as mm_ds
    from mmengine.registry import OPTIMIZERS

    def register_deepspeed_optimizers() -> list:
        names = []
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
            from deepspeed.ops.lamb import FusedLamb
        except ImportError:
            return names
        for cls in (DeepSpeedCPUAdam, FusedAdam, FusedLamb):
            if cls.__name__ not in OPTIMIZERS:
                OPTIMIZERS.register_module(module=cls)
            names.append(cls.__name__)
        return names

    mm_ds.register_deepspeed_optimizers = register_deepspeed_optimizers


def no_deepspeed_cpu_shm_op() -> None:
    """deepspeed 0.17-0.20 on its CPU accelerator compiles a shared-memory all-reduce op with the C++
    compiler as its communication backend starts: 30-60 s at a machine's first DeepSpeed run (again for
    each virtual environment, whose paths are in the build), under a lock every other DeepSpeed process
    waits on. The op serves ``inference_all_reduce`` only (DeepSpeed's inference engine), which training
    never calls, and without it DeepSpeed uses torch.distributed's all-reduce there. On CPU, skip it."""
    if not _once("deepspeed_cpu_shm_op"):
        return
    try:  # by its full name: ``deepspeed.comm``'s own ``torch`` attribute (the torch package) hides it
        ds_torch = importlib.import_module("deepspeed.comm.torch")
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return
    if hasattr(ds_torch, "build_shm_op") and get_accelerator().device_name() == "cpu":
        ds_torch.build_shm_op = lambda: None


def allow_mmengine_checkpoint_globals() -> None:
    """torch >= 2.6: ``torch.load`` defaults to ``weights_only=True`` and refuses
    the few non-tensor objects an mmengine checkpoint holds (the message hub's
    ``HistoryBuffer`` and the numpy arrays inside it), so ``--resume`` fails
    with an UnpicklingError. Allow-list exactly those types instead of turning
    ``weights_only`` off for everything."""
    if not _once("mmengine_checkpoint_globals"):
        return
    import numpy as np
    import torch
    from mmengine.logging.history_buffer import HistoryBuffer

    try:  # numpy >= 2 moved the pickling helper
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct, scalar
    dtype_classes = [type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool", "uint32")]
    torch.serialization.add_safe_globals(
        [HistoryBuffer, np.ndarray, np.dtype, _reconstruct, scalar, *dtype_classes])


def init_cpu_process_group(timeout_s: float = 1800.0) -> bool:
    """mmengine 0.10.x: ``init_dist`` calls ``torch.cuda.set_device`` even on a
    CPU-only machine, so multi-process CPU runs crash before training; it skips
    its own set-up when a process group already exists. Under ``torchrun``
    without CUDA, create the group ourselves with gloo. Returns True when this
    call created the group."""
    import datetime

    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.cuda.is_available():
        return False
    if dist.is_available() and dist.is_initialized():
        return False
    dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


def cpu_ddp_wrapper_cfg(model_wrapper_cfg: dict | None, find_unused_parameters: bool = False) -> dict | None:
    """mmengine 0.10.x: with no ``model_wrapper_cfg`` the runner wraps the model
    in ``MMDistributedDataParallel(device_ids=[LOCAL_RANK])``, which torch
    rejects for CPU modules. On CPU return an explicit wrapper config with
    ``device_ids=None``; elsewhere return the config unchanged."""
    import torch

    if torch.cuda.is_available() or model_wrapper_cfg is not None:
        return model_wrapper_cfg
    return dict(type="MMDistributedDataParallel", device_ids=None, broadcast_buffers=False,
                find_unused_parameters=find_unused_parameters)


def _warn(message: str) -> None:
    """One warning line through the current mmengine logger (terminal and the run's log file)."""
    from mmengine.logging import print_log

    print_log(message, logger="current", level=logging.WARNING)


def cpu_optim_wrapper_type(optim_wrapper_cfg: dict) -> dict:
    """mmengine 0.10.x: ``AmpOptimWrapper`` raises on a machine without CUDA.
    XTuner configs use it everywhere; on CPU fall back to the plain
    ``OptimWrapper`` (dropping AMP-only keys) with a warning."""
    import torch

    from sfttool.registry import type_name  # here: `import sfttool` runs this module and needs no mmengine

    if torch.cuda.is_available() or not type_name(optim_wrapper_cfg.get("type")).endswith("AmpOptimWrapper"):
        return optim_wrapper_cfg
    _warn("AmpOptimWrapper needs a GPU; training in float32 with OptimWrapper on this CPU machine")
    cfg = {k: v for k, v in optim_wrapper_cfg.items() if k not in ("loss_scale", "dtype", "use_fsdp")}
    cfg["type"] = "OptimWrapper"
    return cfg


def cpu_dist_backend(backend: str | None, warn: bool = True) -> str:
    """``nccl`` needs GPUs: on a CPU-only machine use ``gloo`` (with a warning
    when the config asked for nccl and ``warn``)."""
    import torch

    if torch.cuda.is_available():
        return backend or "nccl"
    if backend not in (None, "gloo") and warn:
        _warn(f"dist backend {backend!r} needs GPUs; using 'gloo' on this CPU machine")
    return "gloo"


def limit_cpu_threads() -> None:
    """DeepSpeed 0.19 on CPU (and torch CPU DDP with several processes) is
    ~50x slower with OpenMP's default of one thread per core in every process,
    which oversubscribes the cores. On a machine without CUDA, default
    ``OMP_NUM_THREADS`` to 1 unless the user set it."""
    import torch

    if "OMP_NUM_THREADS" in os.environ or torch.cuda.is_available():
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def patch_mmengine_dump_local_functions() -> None:
    """mmengine 0.10.x: a function defined in a config's own files (a custom map
    fn imported with ``with read_base(): from .map_fn import my_map_fn``) has no
    importable path, so ``Config.pretty_text`` writes ``<function ...>``, fails
    to format it, and the runner (which logs ``pretty_text`` and dumps the
    config into the work dir) raises SyntaxError. Write such a function as a
    string naming it and its file instead; the config that was run is still the
    user's own file."""
    if not _once("mmengine_dump_local_functions"):
        return
    import sys

    from mmengine.config import Config

    def describe(node):
        if isinstance(node, dict):
            return {k: describe(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(describe(v) for v in node)
        code = getattr(node, "__code__", None)
        if callable(node) and code is not None and getattr(node, "__module__", None) not in sys.modules:
            return f"{node.__qualname__} (defined in {code.co_filename})"
        return node

    original = Config.pretty_text.fget

    def pretty_text(self) -> str:
        try:
            return original(self)
        except SyntaxError:
            return original(Config(describe(self.to_dict()), filename=self.filename))

    Config.pretty_text = property(pretty_text)


@functools.lru_cache(maxsize=8)
def _yapf_format(text: str, style: tuple) -> tuple:
    from yapf.yapflib.yapf_api import FormatCode

    return FormatCode(text, style_config=dict(style))


def cache_mmengine_config_formatting() -> None:
    """mmengine 0.10.x formats the whole config with yapf (~0.4 s) on every ``Config.pretty_text``:
    the log, each dump and each checkpoint's metadata, about 7 times per run of the same text.
    The formatting is a pure function of the text, so the last few results are kept."""
    if not _once("mmengine_config_formatting"):
        return
    import mmengine.config.config as mm_config

    format_code = mm_config.FormatCode

    def format_once(text, style_config=None, **kwargs):
        if kwargs or not isinstance(style_config, dict):
            return format_code(text, style_config=style_config, **kwargs)
        return _yapf_format(text, tuple(sorted(style_config.items())))

    mm_config.FormatCode = format_once


def quiet_bnb_cpu_kernel_warning() -> None:
    """bitsandbytes 0.50 on a CPU with AVX512-BF16 tries, at import, to fetch an
    inference kernel from the model hub (``kernels`` package) and logs a warning
    on every command when it cannot. That kernel only serves the inference-only
    weight layout that ``disable_bnb_cpu_weight_repacking`` turns off for
    training, so the warning is noise here: show it only at ERROR level."""
    if _once("bnb_cpu_kernel_warning"):
        import logging
        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


# Modules that call ``torch.compile`` on functions as they are imported (see ``compile_on_first_call``).
COMPILING_AT_IMPORT = ("bitsandbytes", "deepspeed.runtime.zero.muon.original_muon")


def compile_on_first_call() -> None:
    """bitsandbytes 0.46-0.50 wraps its default kernels (blockwise and 4-bit dequantize, the 32-bit
    optimizer update) in ``torch.compile`` as it is imported, and deepspeed 0.18-0.20 its Muon optimizer's
    Newton-Schulz step, imported by every DeepSpeed run's optimizer check. Nothing is compiled before such
    a function's first call, but the ``torch.compile`` call itself imports torch's inductor: 1.6 s of CPU
    in every process that imports peft or mmengine's optimizers (both import bitsandbytes), each rank of
    every run, though most runs never call those functions. While these modules are imported,
    ``torch.compile`` of a function returns one that compiles it on its first call; a compile that fails
    there gives the plain function, as bitsandbytes does when ``torch.compile`` fails at import."""
    if _once("compile_on_first_call"):
        for name in COMPILING_AT_IMPORT:
            _IMPORT_HOOKS.during_import(name, _compiling_on_first_call)


@contextlib.contextmanager
def _compiling_on_first_call() -> Iterator[None]:
    import inspect

    import torch

    compile_now = torch.compile

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(...) with options
            return lambda function: compile_later(function, **options)
        if not inspect.isfunction(model):  # a module keeps torch.compile's own wrapper
            return compile_now(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                try:
                    compiled = compile_now(model, **options)
                except Exception:
                    compiled = model
            return compiled(*args, **kwargs)
        return call

    torch.compile = compile_later
    try:
        yield
    finally:
        torch.compile = compile_now


def _parallelism_requested() -> bool:
    """``TOKENIZERS_PARALLELISM`` read as the tokenizers library reads it: set, and not a "no" word."""
    value = os.environ.get("TOKENIZERS_PARALLELISM")
    return value is not None and value.strip().lower() not in ("", "off", "false", "f", "no", "n", "0")


def _tokenizer_pool_off_in_child() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _say_tokenizer_pool_off() -> None:
    if _parallelism_requested() and _once("tokenizer_pool_off_said"):
        message = ("TOKENIZERS_PARALLELISM=true: worker processes tokenize on one thread each "
                   "(the tokenizer's thread pool deadlocks after a fork); this process keeps its pool")
        if "mmengine.logging" in sys.modules:  # no import inside a fork hook
            sys.modules["mmengine.logging"].print_log(message, logger="current", level=logging.WARNING)
        else:
            print(message, file=sys.stderr)


def tokenizer_fork_safety() -> None:
    """tokenizers (all versions to 0.22): once a fast tokenizer has used its Rust thread pool, a forked
    child that uses it again waits forever on the pool's threads, which a fork does not copy. With
    ``TOKENIZERS_PARALLELISM`` unset the library turns the pool off in the child itself (and warns);
    with ``=true`` it trusts the user and the child hangs: a DataLoader worker, a ``datasets.map``
    process (``num_proc``), any forked worker. Turn the pool off in every forked child (each child is
    one of several parallel workers already, so the pool would only oversubscribe the cores) and keep
    it in this process, where the batched encode uses it. The variable is read at each batch call,
    so setting it in the child takes effect there. Spawned and forkserver children start clean."""
    if _once("tokenizer_fork_safety"):
        os.register_at_fork(before=_say_tokenizer_pool_off, after_in_child=_tokenizer_pool_off_in_child)


# ---------------------------------------------------------------------------
# The terminal: quiet by default (the run's log file keeps everything).

class _ConsoleFilter(logging.Filter):
    """On mmengine loggers' terminal handlers: below WARNING only with ``--verbose`` or for ``inform``."""
    verbose = True

    def filter(self, record: logging.LogRecord) -> bool:
        return self.verbose or record.levelno >= logging.WARNING or getattr(record, "console", False)


_CONSOLE = _ConsoleFilter()


@contextlib.contextmanager
def quiet_console(verbose: bool) -> Iterator[None]:
    """mmengine 0.10.x logs the whole config, the environment and a ~90-line hook table to the
    terminal at INFO, with no setting to send them to the log file only. While the block runs,
    the terminal handler of every MMLogger created from now on shows warnings and errors, and INFO
    only with ``verbose`` (or for ``inform``); the log file in the work dir keeps everything."""
    before = _CONSOLE.verbose
    _CONSOLE.verbose = verbose
    _patch_mmlogger()
    try:
        yield
    finally:
        _CONSOLE.verbose = before


def console_is_verbose() -> bool:
    return _CONSOLE.verbose


def inform(message: str) -> None:
    """An INFO line the quiet terminal shows too (e.g. where a resumed run continues)."""
    from mmengine.logging import MMLogger

    MMLogger.get_current_instance().info(message, extra={"console": True})


class _DropMessages(logging.Filter):
    """Drops records whose message starts with one of ``starts`` (and holds ``holding``, when given)."""

    def __init__(self, *starts: str, holding: str = "") -> None:
        super().__init__()
        self.starts, self.holding = starts, holding

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not (message.startswith(self.starts) and self.holding in message)


# mmengine 0.10's own WARNING lines that a user cannot act on: the visualizer wants a `metainfo` our
# datasets do not have ("Dataset Dataset has no metainfo", "Dataset StreamingPackedDataset has no
# metainfo" for a stream), and its checkpoint code builds the FileClient it deprecated itself.
MMENGINE_NOISE = (_DropMessages("Dataset ", holding="has no metainfo"),
                  _DropMessages('"FileClient" will be deprecated', '"HardDiskBackend" is the alias of "LocalBackend"'))


class _OneLineLoadReport(logging.Filter):
    """transformers 5 logs a table (``<Class> LOAD REPORT from: <path>``) of the weights a load left
    newly initialised or unused, which is expected where sfttool loads a model for another head (a
    reward model's score head; its adapter then brings the trained one): one line with the same facts."""

    MEANING = {"MISSING": "newly initialised", "UNEXPECTED": "unused", "MISMATCH": "shape mismatch"}

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if " LOAD REPORT" not in text.split("\n", 1)[0]:
            return True
        head = re.sub(r"\x1b\[[0-9;]*m", "", text.split("\n", 1)[0]).replace(" LOAD REPORT", "")
        by_status: dict[str, list[str]] = {}
        for line in text.splitlines()[1:]:
            cells = [cell.strip() for cell in line.split("|")]
            if len(cells) > 2 and cells[0] and cells[0] != "Key" and not set(cells[0]) <= {"-", "+"}:
                by_status.setdefault(cells[1], []).append(cells[0])
        parts = [f"{len(keys)} {self.MEANING.get(status, status.lower())} ({', '.join(keys[:3])}"
                 f"{', ...' if len(keys) > 3 else ''})" for status, keys in by_status.items()]
        record.msg, record.args = f"loaded {head}: weights {'; '.join(parts) or 'as listed by transformers'}", ()
        return True


# transformers 5's progress bars for steps that take a fraction of a second; its others (downloads) stay.
QUIET_PROGRESS_BARS = ("Loading weights", "Writing model shards")


def _quiet_transformers_progress_bars(module: ModuleType) -> None:
    """``transformers.utils.logging`` (5.x, ``set_tqdm_hook``): ``QUIET_PROGRESS_BARS`` drawn by its no-op bar."""
    def hook(factory: Callable, args: tuple, kwargs: dict) -> Any:
        quiet = kwargs.get("desc") in QUIET_PROGRESS_BARS
        return module.EmptyTqdm(*args, **kwargs) if quiet else factory(*args, **kwargs)

    if hasattr(module, "set_tqdm_hook"):
        module.set_tqdm_hook(hook)


class _ImportHooks(importlib.abc.MetaPathFinder):
    """Runs code around a module's first import (inside its loader's ``exec_module``) or right after it,
    for what a library does as it is imported, without importing it (transformers takes seconds) in
    commands that never use it."""

    def __init__(self) -> None:
        self.actions: dict[str, Callable[[ModuleType], None]] = {}
        self.contexts: dict[str, Callable[[], contextlib.AbstractContextManager]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        action, context = self.actions.pop(name, None), self.contexts.pop(name, None)
        if action is None and context is None:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                load = spec.loader.exec_module

                def exec_module(module: ModuleType) -> None:
                    with context() if context is not None else contextlib.nullcontext():
                        load(module)
                    if action is not None:
                        action(module)

                spec.loader.exec_module = exec_module
                return spec
        return None

    def _watch(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def after_import(self, name: str, action: Callable[[ModuleType], None]) -> None:
        if name in sys.modules:
            action(sys.modules[name])
        else:
            self.actions[name] = action
            self._watch()

    def during_import(self, name: str, context: Callable[[], contextlib.AbstractContextManager]) -> None:
        """``with context(): <the module's code>`` at its first import; nothing if it is imported already."""
        if name not in sys.modules:
            self.contexts[name] = context
            self._watch()


_IMPORT_HOOKS = _ImportHooks()


def quiet_library_noise() -> None:
    """Messages of dependencies that are wrong or useless for sfttool's commands, each silenced
    narrowly at its source, for every command (the CLI's group applies it, before any subcommand):

    - deepspeed 0.17-0.20 on a machine without a GPU warns "Setting accelerator to CPU. If
      you have GPU ..." at import (mmengine's runner, and peft, import it even when DeepSpeed is unused);
    - bitsandbytes 0.50 tries, at import, to fetch a CPU inference kernel from the hub (see
      ``quiet_bnb_cpu_kernel_warning``), and ``kernels`` 0.11+ says offline that it skips the trust
      check of that very kernel: both are noise here;
    - transformers 5 draws "Loading weights" and "Writing model shards" progress bars (a
      fraction of a second each; ``QUIET_PROGRESS_BARS``) and logs a ``LOAD REPORT`` table (kept as one
      line, ``_OneLineLoadReport``);
    - mmengine 0.10 (its own copy of torch's check) warns "Detected call of `scheduler.step()`
      before `optimizer.step()`" when the first iteration falls inside a gradient-accumulation
      window: it steps iteration-based schedules every iteration by design, so the order is intended;
    - peft 0.17-0.29 reads ``is_gradient_checkpointing``, which transformers 5 deprecated
      (a FutureWarning on every LoRA model built or merged).

    mmengine's own ``MMENGINE_NOISE`` is dropped from the terminal by ``quiet_console`` (the run's
    log file keeps it). Nothing here imports a library: each filter waits for its logger or module."""
    if not _once("library_noise"):
        return
    logging.getLogger("DeepSpeed").addFilter(_DropMessages("Setting accelerator to CPU."))
    quiet_bnb_cpu_kernel_warning()
    logging.getLogger("kernels._internals.hf_hub").addFilter(
        _DropMessages("Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"))
    logging.getLogger("transformers.modeling_utils").addFilter(_OneLineLoadReport())
    _IMPORT_HOOKS.after_import("transformers.utils.logging", _quiet_transformers_progress_bars)
    warnings.filterwarnings("ignore", message=r"Detected call of `(lr_)?scheduler\.step\(\)` before "
                                              r"`optimizer\.step\(\)`", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def _patch_mmlogger() -> None:
    """Every MMLogger created from now on: on its terminal handler, the filter of ``quiet_console``
    and the ``MMENGINE_NOISE`` filters (its log file handler keeps everything)."""
    if not _once("mmlogger_filters"):
        return
    from mmengine.logging import MMLogger

    original = MMLogger.__init__

    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        for handler in self.handlers:
            if type(handler) is logging.StreamHandler:  # the terminal; a FileHandler is a subclass
                handler.addFilter(_CONSOLE)
                for noise in MMENGINE_NOISE:
                    handler.addFilter(noise)

    MMLogger.__init__ = __init__


class _NoVideoProcessor(dict):
    """A processor's video processor without torchvision: nothing to run, saved as ``{}`` in
    ``processor_config.json`` (a dict, so transformers serialises and deep-copies it as it is)."""

    _auto_class = None

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> "_NoVideoProcessor":
        return cls()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("videos need torchvision, which is not installed")


def processors_without_torchvision() -> None:
    """Let image-text processors (Qwen2-VL's, Qwen2.5-VL's, ...) be built and loaded without torchvision.

    transformers 5 gives such a processor a video processor, whose classes need torchvision; without it,
    building the processor fails inside transformers (``VIDEO_PROCESSOR_MAPPING`` has no
    ``_extra_content``), images or not. Training on images needs only the image processor (its PIL
    backend), and PyPI's torchvision does not install beside every torch build, so without torchvision
    the video processor is an empty stand-in: videos are refused, images work as with torchvision."""
    if importlib.util.find_spec("torchvision") is not None or not _once("processors_without_torchvision"):
        return
    # on import only: transformers.processing_utils pulls in torch and the modelling code (seconds), which
    # config loading and the light commands should not pay for
    _IMPORT_HOOKS.after_import("transformers.processing_utils", _patch_processors_without_video)


def _patch_processors_without_video(processing_utils: ModuleType) -> None:
    mixin = processing_utils.ProcessorMixin
    init, check = mixin.__init__, mixin.check_argument_for_proper_class

    def __init__(self, *args, **kwargs):
        names = type(self).get_attributes()
        args = [_NoVideoProcessor() if value is None and _is_video(name) else value for name, value in zip(names, args)
                ] + list(args[len(names):])
        kwargs = {name: _NoVideoProcessor() if value is None and _is_video(name) else value
                  for name, value in kwargs.items()}
        init(self, *args, **kwargs)

    def check_argument_for_proper_class(self, argument_name, argument):
        if isinstance(argument, _NoVideoProcessor):
            return _NoVideoProcessor
        return check(self, argument_name, argument)

    def _is_video(name: str) -> bool:
        return processing_utils._get_modality_for_attribute(name) == "video_processor"

    mixin.__init__, mixin.check_argument_for_proper_class = __init__, check_argument_for_proper_class
    mapping = processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING
    get = type(mapping).__getitem__

    class _Mapping(type(mapping)):
        def __getitem__(self, key):
            return _NoVideoProcessor if key == "video_processor" else get(self, key)

    mapping.__class__ = _Mapping


# ---------------------------------------------------------------------------
# Rendering every prefix of one conversation through a tokenizer's jinja chat template.

def chat_prefix_renderer(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                         **kwargs: Any) -> Callable[[int, bool], str] | None:
    """``render(k, add_generation_prompt)`` = ``tokenizer.apply_chat_template(messages[:k], tools=tools,
    tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)``, the same text at about half
    the cost, or None where that cannot be promised (the caller calls ``apply_chat_template`` then).

    transformers 5.x (checked on 5.25): each ``apply_chat_template`` call rebuilds every message it is
    given (drops None values, copies them as plain data, aliases the reasoning fields; message by message)
    and the template's keyword arguments before its jinja render, so rendering each prefix of a
    conversation, as the chat-template encoder does for every answer, rebuilds its first messages again
    and again: half of the render's time. Here transformers' own helpers rebuild the messages once and each
    prefix is a slice of them (the sandboxed template cannot modify them). None when the tokenizer's
    ``apply_chat_template`` is not transformers' own (a processor, a built-in ``ChatFormat``), a tool is
    not a JSON schema, or these helpers moved; ``tests/test_compat.py`` compares both renders."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.utils.chat_template_utils import (_alias_reasoning_fields, _compile_jinja_template,
                                                            _normalize_chat_messages, _plain_template_data)
    except ImportError:
        return None
    if (getattr(type(tokenizer), "apply_chat_template", None) is not PreTrainedTokenizerBase.apply_chat_template
            or not messages or any(not isinstance(tool, dict) for tool in tools or [])):
        return None
    template = _compile_jinja_template(tokenizer.get_chat_template(None, tools))
    chat = _alias_reasoning_fields(_plain_template_data(_normalize_chat_messages(messages)))
    context = dict(tools=_plain_template_data(tools), documents=None,
                   **_plain_template_data({**tokenizer.special_tokens_map, **kwargs}))

    def render(k: int, add_generation_prompt: bool) -> str:
        if k == 0:  # as apply_chat_template refuses it
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        return template.render(messages=chat[:k], add_generation_prompt=add_generation_prompt, **context)
    return render


def apply_all() -> None:
    """Apply every patch sfttool needs (config loading and training)."""
    patch_mmengine_package_lookup()
    processors_without_torchvision()
    patch_mmengine_dump_local_functions()
    cache_mmengine_config_formatting()
    quiet_bnb_cpu_kernel_warning()


def patch_history_buffer_pickling() -> None:
    """mmengine 0.10.x: ``HistoryBuffer.__getstate__`` pickles its class-level
    table of statistics functions (``HistoryBuffer.min`` ...), which torch's
    pickle protocol 2 writes as ``getattr(HistoryBuffer, 'min')``. Loading that
    with ``weights_only=True`` would need ``builtins.getattr`` on the
    allow-list, which would let a checkpoint reach attributes of any allowed
    object. The table is rebuilt by the class itself (defaults on first use,
    custom methods at import), so save the buffer's data without it."""
    if not _once("history_buffer_pickling"):
        return
    from mmengine.logging.history_buffer import HistoryBuffer

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "statistics_methods"}

    HistoryBuffer.__getstate__ = __getstate__


def _first_free_run_folder(work_dir: str, timestamp: str) -> str:
    """``timestamp`` if ``work_dir/timestamp`` is free, else ``timestamp_2``, ``timestamp_3`` ... (these
    sort after it, so "the newest folder" stays the last in name order)."""
    name, n = timestamp, 1
    while os.path.exists(os.path.join(work_dir, name)):
        n += 1
        name = f"{timestamp}_{n}"
    return name


def patch_mmengine_unique_run_folders() -> None:
    """mmengine 0.10.x names a run's folder (log, config copy, ``vis_data/scalars.json``) after the second
    it started in. A run resumed within the same second as the one it continues -- a quick crash and
    ``--resume``, a short run on a fast machine -- wrote into the earlier run's folder and appended to its
    scalars, so its plot showed both runs as one. Give such a run the first free ``<timestamp>_<n>``.
    Rank 0 decides and broadcasts it: on a shared disk another rank may look after rank 0 made the folder."""
    if not _once("unique_run_folders"):
        return
    import torch
    from mmengine._strategy.base import BaseStrategy
    from mmengine.dist import broadcast, get_rank
    from mmengine.runner import Runner

    def unique(self) -> None:
        suffix = torch.tensor(0, dtype=torch.int64)
        if get_rank() == 0:
            name = _first_free_run_folder(self._work_dir, self._timestamp)
            suffix.fill_(int(name.rpartition("_")[2]) if name != self._timestamp else 0)
        broadcast(suffix)
        if suffix.item():
            self._timestamp = f"{self._timestamp}_{suffix.item()}"

    def wrap(setup_env):
        @functools.wraps(setup_env)
        def setup_env_in_a_new_folder(self, *args, **kwargs):
            setup_env(self, *args, **kwargs)
            unique(self)
        return setup_env_in_a_new_folder

    Runner.setup_env = wrap(Runner.setup_env)
    BaseStrategy._setup_env = wrap(BaseStrategy._setup_env)


def apply_training() -> None:
    """``apply_all()`` plus the runner-side patches. Kept apart because they
    import torch, mmengine's runner and deepspeed (seconds), which config
    loading and the light subcommands should not pay for."""
    apply_all()
    patch_mmengine_deepspeed_optimizers()
    no_deepspeed_cpu_shm_op()
    allow_mmengine_checkpoint_globals()
    patch_history_buffer_pickling()  # keeps `getattr` off the weights_only allow-list
    patch_mmengine_unique_run_folders()
