"""The data pipeline: load -> map fn -> template -> encode -> pack -> collate.

``from sfttool.dataset import process_hf_dataset`` (XTuner's name and arguments).
"""
from sfttool.registry import BUILDER

from .errors import DatasetError
from .load import load_json_dataset
from .data_sources import process_data_sources
from .mix import mix_datasets
from .pipeline import process_hf_dataset
from .preference import build_preference_dataset
from .prompts import build_prompt_dataset

BUILDER.register_module(name="process_hf_dataset", module=process_hf_dataset, force=True)
BUILDER.register_module(name="build_preference_dataset", module=build_preference_dataset, force=True)
BUILDER.register_module(name="build_prompt_dataset", module=build_prompt_dataset, force=True)

__all__ = ["DatasetError", "build_preference_dataset", "build_prompt_dataset", "load_json_dataset", "mix_datasets",
           "process_data_sources", "process_hf_dataset"]
