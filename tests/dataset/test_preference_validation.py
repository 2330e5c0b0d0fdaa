"""A preference config that asks for validation is refused in one line naming the keys: the
validation loop measures the SFT token loss, which says nothing about ranking chosen over rejected."""
from __future__ import annotations

import pytest

from sfttool.config.validate import validate_config
from sfttool.dataset import build_preference_dataset, process_hf_dataset


def config(dataset_type, **extra) -> dict:
    return dict(model=dict(type="DPO"), optim_wrapper=dict(optimizer=dict(lr=1e-4)), train_cfg=dict(max_epochs=1),
                train_dataloader=dict(batch_size=1, dataset=dict(type=dataset_type)), **extra)


@pytest.mark.parametrize("extra,keys", [
    (dict(val_ratio=0.1), "val_ratio"),
    (dict(val_data_path="val.jsonl", val_dataloader=dict(batch_size=1)), "val_data_path, val_dataloader"),
])
def test_validation_settings_in_a_preference_config_are_one_line_errors(extra, keys):
    for dataset_type in (build_preference_dataset, "sfttool.dataset.build_preference_dataset"):
        errors = validate_config(config(dataset_type, **extra), "dpo.py")
        assert errors == [f"dpo.py: {keys}: preference training has no validation yet (the validation loop "
                          "measures the SFT token loss, not how the model ranks chosen over rejected); remove "
                          f"{keys.replace(', ', ' and ')} (or set them to None)"]


def test_unset_validation_and_sft_configs_pass():
    assert validate_config(config(build_preference_dataset, val_ratio=None, val_data_path=None), "dpo.py") == []
    assert validate_config(config(process_hf_dataset, val_ratio=0.1), "sft.py") == []
