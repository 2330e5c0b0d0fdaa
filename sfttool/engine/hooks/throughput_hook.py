"""Throughput in the training log: tokens/s and trained tokens/s per device;
on GPUs also achieved TFLOP/s and MFU.

``tokens`` counts every position the model processes in a micro-batch
(padding included: it costs compute); ``trained`` counts positions with a
label. Each logged value covers the last ``interval`` iterations (the
LoggerHook's, so normally those since the previous log line): their tokens
over their summed time, so a window that mixes accumulation iterations with
optimizer steps reports their average, not whichever iteration the log line
falls on. FLOPs use the usual dense estimate ``6 x parameters x tokens``
(forward + backward), plus ``2 x parameters x tokens`` with activation
checkpointing (the recomputed forward); parameters are counted at their
logical size (``logical_numel``: 4-bit and ZeRO-3-partitioned weights at
full size). MFU divides by the device's peak dense bf16/fp16 TFLOP/s
(``peak_tflops``, or looked up from the device name).
"""
from __future__ import annotations

import math
import time
from collections import deque

from mmengine.hooks import Hook

from sfttool.engine.runner import unwrap_model
from sfttool.registry import BUILDER
from sfttool.utils.constants import IGNORE_INDEX

# Dense bf16/fp16 tensor-core peak TFLOP/s by device-name fragment.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "L40": 181.0, "A10G": 125.0, "A10": 125.0, "4090": 165.0, "3090": 71.0, "V100": 125.0,
               "T4": 65.0}


def peak_tflops_of(device_name: str) -> float | None:
    for fragment, peak in PEAK_TFLOPS.items():
        if fragment in device_name:
            return peak
    return None


def logical_numel(param) -> int:
    """Elements ``param`` stands for in the model's matmuls, whatever its storage.

    A bitsandbytes 4-bit weight packs two values per byte (a ``[64, 64]`` weight
    is stored as ``[2048, 1]`` uint8) and keeps its shape in ``quant_state``;
    under DeepSpeed ZeRO-3 a partitioned parameter is empty (``numel() == 0``)
    and keeps its full size in ``ds_numel``.
    """
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    if shape is not None:
        return math.prod(shape)
    return int(getattr(param, "ds_numel", param.numel()))


@BUILDER.register_module()
class ThroughputHook(Hook):
    # Above mmengine's LoggerHook (BELOW_NORMAL): the logger reads the message hub
    # in its own after_train_iter, so this iteration's values must be there first.
    priority = "NORMAL"

    def __init__(self, peak_tflops: float | None = None):
        self.peak_tflops = peak_tflops
        self.params = None  # counted for the FLOPs at before_train
        self._start = None
        self._window = deque(maxlen=1)  # (tokens, trained, seconds) of the last `interval` iterations

    def before_train(self, runner) -> None:
        from mmengine.hooks import LoggerHook

        import torch
        model = unwrap_model(runner.model)
        self.params = sum(logical_numel(p) for p in model.parameters())
        interval = [h.interval for h in runner.hooks if isinstance(h, LoggerHook)]
        self._window = deque(maxlen=max(interval[0] if interval else 1, 1))
        llm = getattr(model, "llm", None)
        base = llm.get_base_model() if hasattr(llm, "get_base_model") else llm  # under peft
        # transformers 5 renamed the flag (the old name warns)
        flag = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") \
            else "is_gradient_checkpointing"
        self._recompute = bool(getattr(base, flag, False))
        if torch.cuda.is_available() and self.peak_tflops is None:
            self.peak_tflops = peak_tflops_of(torch.cuda.get_device_name())

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        import torch
        if self._start is None or not data_batch:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = max(time.perf_counter() - self._start, 1e-9)
        data = data_batch["data"]
        self._window.append((data["input_ids"].numel(), int((data["labels"] != IGNORE_INDEX).sum()), seconds))
        tokens, trained, seconds = (sum(column) for column in zip(*self._window))
        hub = runner.message_hub
        hub.update_scalar("train/tokens_per_sec", tokens / seconds)
        hub.update_scalar("train/trained_tokens_per_sec", trained / seconds)
        if torch.cuda.is_available():
            flops = (8 if self._recompute else 6) * self.params * tokens
            tflops = flops / seconds / 1e12
            hub.update_scalar("train/tflops", tflops)
            if self.peak_tflops:
                hub.update_scalar("train/mfu", tflops / self.peak_tflops)
