"""Pixels, loaded when a row is read: in the ``Dataset``'s ``__getitem__``, so DataLoader workers do it.

A row of image-text data holds its images' paths (``images``, in token order: packed rows hold each
sample's in sample order). Reading the row loads each image as the processor does at inference
(transformers' ``load_image``: EXIF rotation, RGB) and runs the processor's image processor on them, with
the settings the processor's own call gives it (``images_kwargs``: Gemma 3's turn pan-and-scan off);
the row then also holds ``pixel_values`` and, for Qwen-style processors, ``image_grid_thw``, exactly as
the processor returns them for those images (None for a row without images)::

    >>> rows = with_pixels(dataset, processor)       # doctest: +SKIP
    >>> rows[0]['pixel_values'].shape, rows[0]['image_grid_thw'].tolist()  # doctest: +SKIP
    (torch.Size([28, 1176]), [[1, 6, 4], [1, 2, 2]])

Each row's image tokens are counted against what its pixels make (a file changed since the dataset was
built would otherwise fail deep in the model, as a shape error).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from sfttool.dataset.errors import DatasetError
from sfttool.dataset.image_rows import IMAGES_COLUMN, image_name
from sfttool.dataset.image_tokens import image_token_counts, image_token_id


def with_pixels(dataset, processor: Any):
    """``dataset`` whose rows load their pixels when read (unchanged without a processor or images)."""
    if processor is None or IMAGES_COLUMN not in getattr(dataset, "column_names", ()):
        return dataset
    return dataset.with_transform(PixelLoader(processor), output_all_columns=True)


def load_images(paths: list[str]) -> list:
    """PIL images as the processor's ``apply_chat_template`` loads them; a failure names the image."""
    from transformers.image_utils import load_image
    images = []
    for path in paths:
        try:
            images.append(load_image(path))
        except Exception as exc:  # PIL and transformers raise many types for a bad file
            raise DatasetError(f"image {image_name(path)} cannot be loaded ({type(exc).__name__}: {exc}); it was "
                               "readable when the dataset was built: replace it, or rebuild the dataset") from None
    return images


class PixelLoader:
    """The ``datasets`` transform that adds ``pixel_values`` (and ``image_grid_thw``) to rows with images."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.token_id = image_token_id(processor)
        # what the processor's own call hands its image processor (Gemma 3's: no pan-and-scan crops, whatever
        # the image processor's config says)
        own = getattr(processor, "images_kwargs", None)
        self.image_kwargs = dict(own) if isinstance(own, dict) else {}

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        if IMAGES_COLUMN not in batch:  # a column read on its own (``dataset['length']``)
            return batch
        pixels, grids = [], []
        for i, paths in enumerate(batch[IMAGES_COLUMN]):
            out = self.row_pixels(paths or [], batch["input_ids"][i] if "input_ids" in batch else None)
            pixels.append(out.get("pixel_values"))
            grids.append(out.get("image_grid_thw"))
        extra = {"pixel_values": pixels}
        if any(g is not None for g in grids):
            extra["image_grid_thw"] = grids
        return {**batch, **extra}

    def row_pixels(self, paths: list[str], input_ids) -> dict[str, Any]:
        if not paths:
            return {}
        images = load_images(paths)
        out = dict(self.processor.image_processor(images=images, **{**self.image_kwargs, "return_tensors": "pt"}))
        if input_ids is not None:
            self.check_tokens(paths, images, out, input_ids)
        return out

    def check_tokens(self, paths: list[str], images: list, out: dict, input_ids) -> None:
        """The row's image tokens equal what its pixels make."""
        grid = out.get("image_grid_thw")
        if grid is not None:
            merge = getattr(self.processor.image_processor, "merge_size", 1) or 1
            made = int((grid.prod(-1) // merge**2).sum())
        else:
            made = sum(image_token_counts(self.processor, [(im.height, im.width) for im in images]))
        tokens = int((np.asarray(input_ids) == self.token_id).sum())
        if tokens != made:
            names = ", ".join(image_name(p) for p in paths)
            raise DatasetError(f"a row with images {names} has {tokens} image tokens but its pixels make {made}: "
                               "an image changed since the dataset was built; rebuild it (clear its cache_dir)")
