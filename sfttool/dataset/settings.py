"""``process_hf_dataset``'s own checks of its settings, which the stream, the data sources and ``sfttool
train``'s early checks run too (a module of its own: they sit below every pipeline that shares them)."""
from __future__ import annotations

from sfttool.dataset.errors import DatasetError, check_positive_int
from sfttool.dataset.pack import STRATEGIES


def check_settings(max_length, pack_to_max_length, use_varlen_attn, pack_strategy, with_image_token,
                    max_dataset_length=None) -> None:
    check_positive_int(max_length, "max_length")
    if max_dataset_length is not None:
        check_positive_int(max_dataset_length, "max_dataset_length", " or None")
    if use_varlen_attn and not pack_to_max_length:
        raise DatasetError("use_varlen_attn=True needs pack_to_max_length=True (as in XTuner)")
    if pack_strategy not in STRATEGIES:
        raise DatasetError(f"pack_strategy must be one of {', '.join(STRATEGIES)}, got {pack_strategy!r}")
    if with_image_token:
        raise DatasetError("with_image_token (multimodal data) is not supported")
