"""``process_hf_dataset``'s own checks of its settings, which the stream, the data sources and ``sfttool
train``'s early checks run too (a module of its own: they sit below every pipeline that shares them)."""
from __future__ import annotations

from typing import Any

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
        raise DatasetError("with_image_token (XTuner's LLaVA encoding) is not supported: image rows go through the "
                           "model's processor here; set processor=... instead (docs/multimodal.md)")


# lazy_encode's own settings and their defaults (sfttool.dataset.lazy)
LAZY_SETTINGS = dict(buffer_size=1000, encode_chunk=64, rows_per_epoch=None)


def check_lazy_settings(lazy_encode: bool, given: dict[str, int | None], rename_maps: Any,
                        do_dataset_tokenization: bool, pack_strategy: str) -> None:
    """``lazy_encode`` and its settings (``given``: ``LAZY_SETTINGS``' names, None where unset) against
    process_hf_dataset's other arguments; run again by ``sfttool train``'s checks before anything is built."""
    if not lazy_encode:
        named = [name for name, value in given.items() if value is not None]
        if named:
            raise DatasetError(f"{', '.join(named)} only applies with lazy_encode=True (rows encoded as the loader "
                               "reads them); set lazy_encode=True, or remove it")
        return
    for name, value in given.items():
        if value is not None:
            check_positive_int(value, name)
    refuse_changed_rows(rename_maps, do_dataset_tokenization, pack_strategy)


def refuse_changed_rows(rename_maps: Any, do_dataset_tokenization: bool, pack_strategy: str) -> None:
    """process_hf_dataset's arguments lazy encoding cannot honour: ignoring them would change the rows."""
    if rename_maps:
        raise DatasetError("rename_maps is not available with lazy_encode=True; rename the fields in a "
                           "dataset_map_fn")
    if not do_dataset_tokenization:
        raise DatasetError("do_dataset_tokenization=False (pre-tokenized rows) leaves nothing to encode lazily; "
                           "remove lazy_encode")
    if pack_strategy != "bfd":
        raise DatasetError(f"pack_strategy={pack_strategy!r} is not available with lazy_encode=True: rows are "
                           "packed best-fit-decreasing within a buffer (buffer_size) and no sample is split; "
                           "remove pack_strategy")
