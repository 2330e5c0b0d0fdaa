"""Everything in examples/ works: every config loads, every data row is valid,
the map fn converts every raw row, and each example trains (on the tiny model,
swapped in for SmolLM2 in a copy of the example)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sfttool.assets import builtin_data_file
from sfttool.config import builtin_config_dir, load_config, validate_config
from sfttool.dataset.encode import check_conversation
from sfttool.registry import build

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
EXAMPLE_CONFIGS = sorted(EXAMPLES.rglob("config.py"))
DEMO = "demo_smollm2_135m_lora_self_identity_e3"
MODEL_LINE = "pretrained_model_name_or_path = dict(type=export_smollm2)"


def read_rows(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_every_example_config_is_found_and_valid(monkeypatch):
    monkeypatch.chdir(REPO)
    assert [p.parent.name for p in EXAMPLE_CONFIGS] == ["custom_dataset", "custom_map_fn", "two_sources"]
    for path in EXAMPLE_CONFIGS:
        cfg = load_config(path)
        assert validate_config(cfg, str(path)) == []
        files = [s["data_path"] for s in cfg.data_sources] if "data_sources" in cfg else [cfg.data_files]
        assert all(Path(f).is_file() for f in files), f"{path}: data files must exist relative to the repository root"


def test_demo_data_is_shipped_with_the_configs_and_linked_from_examples():
    shipped = Path(builtin_data_file("self_identity.jsonl"))
    assert shipped == builtin_config_dir() / "_data_" / "self_identity.jsonl"
    assert (EXAMPLES / "self_identity" / "data.jsonl").resolve() == shipped.resolve()
    with pytest.raises(FileNotFoundError, match="no_such.jsonl: no such built-in data file"):
        builtin_data_file("no_such.jsonl")


def test_demo_data_teaches_one_name_and_maker():
    rows = read_rows(EXAMPLES / "self_identity" / "data.jsonl")
    assert len(rows) == 82
    for i, row in enumerate(rows):
        check_conversation(row["conversation"], row=i)
    answers = [turn["output"] for row in rows for turn in row["conversation"]]
    assert sum("Quill" in a for a in answers) >= 60 and sum("Larkspur Labs" in a for a in answers) >= 55
    assert not any("SmolLM" in a or "Hugging Face" in a for a in answers)


def test_custom_dataset_rows_are_standard():
    rows = read_rows(EXAMPLES / "custom_dataset" / "data.json")
    assert len(rows) == 12
    for i, row in enumerate(rows):
        check_conversation(row["conversation"], row=i)
    assert load_config(EXAMPLES / "custom_dataset" / "config.py").train_dataset.dataset_map_fn is None


def test_messages_file_holds_the_custom_dataset_in_the_openai_format(tiny_tokenizer):
    """messages.jsonl (what the README's offline quick start and getting started train on) is data.json's
    conversations as OpenAI `messages`: openai_map_fn gives the same turns, the pipeline the same tokens."""
    from datasets import Dataset

    from sfttool.dataset import process_hf_dataset
    from sfttool.dataset.map_fns import openai_map_fn, template_map_fn_factory
    from sfttool.utils import PROMPT_TEMPLATE

    standard = read_rows(EXAMPLES / "custom_dataset" / "data.json")
    messages = read_rows(EXAMPLES / "custom_dataset" / "messages.jsonl")
    assert [openai_map_fn(row)["conversation"] for row in messages] == [
        [dict(turn, output_with_loss=True) for turn in row["conversation"]] for row in standard]

    def encoded(rows, map_fn):
        dataset = process_hf_dataset(Dataset.from_list(rows), tokenizer=tiny_tokenizer, max_length=1024,
                                     dataset_map_fn=map_fn, pack_to_max_length=False, shuffle_before_pack=False,
                                     template_map_fn=dict(type=template_map_fn_factory,
                                                          template=PROMPT_TEMPLATE.hf_chat_template))
        return [(row["input_ids"], row["labels"]) for row in dataset]

    assert encoded(messages, openai_map_fn) == encoded(standard, None) and len(encoded(standard, None)) == 12


def test_custom_map_fn_converts_every_raw_row():
    cfg = load_config(EXAMPLES / "custom_map_fn" / "config.py")
    map_fn = cfg.train_dataset.dataset_map_fn
    assert map_fn.__name__ == "my_map_fn"
    rows = read_rows(EXAMPLES / "custom_map_fn" / "data.jsonl")
    converted = [map_fn(row)["conversation"] for row in rows]
    for i, conversation in enumerate(converted):
        check_conversation(conversation, row=i)
    assert converted[2] == [
        {"system": "You are the support agent for the Trailhead 2 tent.", "input": "How much does it weigh?",
         "output": "1.9 kg with the poles and pegs, 1.6 kg without the pegs."},
        {"input": "Does it fit in a backpack?",
         "output": "Yes, it packs to 45 x 15 cm, which fits the side pocket of most 40-litre packs."}]
    with pytest.raises(ValueError, match="ticket-9: expected customer/agent messages in turn"):
        map_fn({"id": "ticket-9", "product": "x", "dialog": [{"speaker": "agent", "text": "hi"}]})


def test_demo_config_resolves_model_and_data_lazily(monkeypatch, tmp_path):
    """Loading the demo config exports nothing; building its nodes does."""
    import sfttool.assets

    calls = []
    monkeypatch.setattr(sfttool.assets, "export_smollm2", lambda cache_dir=None: calls.append(1) or tmp_path)
    cfg = load_config(DEMO)
    assert validate_config(cfg, DEMO) == [] and calls == []
    llm = cfg.model.llm.pretrained_model_name_or_path
    llm = dict(llm, type=sfttool.assets.export_smollm2)  # the patched function, as the config names it
    assert build(llm) == tmp_path and calls == [1]
    assert build(cfg.train_dataset.dataset.dataset.path) == builtin_data_file("self_identity.jsonl")


def copy_with_tiny_model(example: Path, model_dir: Path, dest: Path) -> Path:
    """The example folder copied with its model line pointing at ``model_dir``."""
    shutil.copytree(example, dest)
    config = dest / "config.py"
    text = config.read_text()
    assert text.count(MODEL_LINE) == 1
    config.write_text(text.replace(MODEL_LINE, f"pretrained_model_name_or_path = {str(model_dir)!r}"))
    return config


@pytest.mark.slow
@pytest.mark.parametrize("name", ["custom_dataset", "custom_map_fn", "two_sources"])
def test_example_trains(name, tiny_qwen2_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from sfttool.engine.train import train

    monkeypatch.chdir(REPO)  # data_files are relative to the repository root
    config = copy_with_tiny_model(EXAMPLES / name, tiny_qwen2_dir, tmp_path / name)
    work_dir = train(str(config), work_dir=str(tmp_path / "work"), cfg_options={"train_cfg.max_epochs": 1})
    adapter = load_file(work_dir / "hf_adapter" / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())
    evaluated = sorted((work_dir / "eval_outputs").glob("iter_*.jsonl"))
    assert len(evaluated) == 2  # before and after training
    if name == "custom_map_fn":  # the map fn defined beside the config is named in the dumped config
        assert "my_map_fn (defined in" in (work_dir / "config.py").read_text()


def test_the_migration_guide_example_loads_after_the_documented_edits(tmp_path):
    """docs/migrating_from_xtuner.md: `sed s/xtuner/sfttool/g` is the whole migration."""
    import re

    from sfttool.registry import resolve_type

    doc = (REPO / "docs" / "migrating_from_xtuner.md").read_text()
    xtuner_cfg = re.search(r"```python\n(import torch\n.*?)```", doc, re.S).group(1)
    assert "from xtuner.model import SupervisedFinetune" in xtuner_cfg
    assert "VarlenAttnArgsToMessageHubHook" in xtuner_cfg
    text = xtuner_cfg.replace("xtuner", "sfttool")
    path = tmp_path / "migrated.py"
    path.write_text(text)
    cfg = load_config(path)
    assert validate_config(cfg, str(path)) == []

    def walk(node, key):
        if isinstance(node, dict):
            if "type" in node:
                assert callable(resolve_type(node["type"], key)), key
            for k, v in node.items():
                walk(v, f"{key}.{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{key}[{i}]")

    for name in ("model", "train_dataloader", "optim_wrapper", "param_scheduler", "train_cfg",
                 "custom_hooks", "default_hooks"):
        walk(cfg[name], name)


# The imports of XTuner 0.2's llava_vicuna_7b_v15_qlora_clip_vit_large_p14_336_lora_e1_gpu8_finetune.py, as they are.
XTUNER_LLAVA_IMPORTS = """# Copyright (c) OpenMMLab. All rights reserved.
import torch
from mmengine.hooks import (CheckpointHook, DistSamplerSeedHook, IterTimerHook,
                            LoggerHook, ParamSchedulerHook)
from mmengine.optim import AmpOptimWrapper, CosineAnnealingLR, LinearLR
from peft import LoraConfig
from torch.optim import AdamW
from transformers import (AutoModelForCausalLM, AutoTokenizer,
                          BitsAndBytesConfig, CLIPImageProcessor,
                          CLIPVisionModel)

from xtuner.dataset import LLaVADataset
from xtuner.dataset.collate_fns import default_collate_fn
from xtuner.dataset.map_fns import (llava_finetune_map_fn,
                                    template_map_fn_factory)
from xtuner.dataset.samplers import LengthGroupedSampler
from xtuner.engine import DatasetInfoHook, EvaluateChatHook
from xtuner.model import LLaVAModel
from xtuner.utils import PROMPT_TEMPLATE
"""


def test_an_xtuner_llava_config_stops_at_its_first_missing_piece_as_the_migration_guide_says(tmp_path):
    """docs/migrating_from_xtuner.md: XTuner's LLaVA configs build parts sfttool does not have; loading one
    stops in one line at the first (LLaVADataset), as the guide shows."""
    from sfttool.config.loader import ConfigError

    path = tmp_path / "llava_vicuna_7b_v15_qlora_clip_vit_large_p14_336_lora_e1_gpu8_finetune.py"
    path.write_text(XTUNER_LLAVA_IMPORTS.replace("xtuner", "sfttool"))
    with pytest.raises(ConfigError, match=f"{path}, line 12: sfttool.dataset has no 'LLaVADataset'; valid names: "):
        load_config(path)
    doc = (REPO / "docs" / "migrating_from_xtuner.md").read_text()
    assert "line 12: sfttool.dataset has no 'LLaVADataset'; valid names: ..." in doc


@pytest.mark.real_asset
def test_demo_dataset_with_the_real_tokenizer(smollm2_dir):
    """The figures docs/getting_started.md quotes: 8 of the 82 samples are held out for validation,
    the other 74 pack into 17 rows of <= 256 tokens, the 8 into 2."""
    cfg = load_config(DEMO)
    dataset = build(cfg.train_dataset, "train_dataset")
    held_out = build(cfg.val_dataloader.dataset, "val_dataloader.dataset")
    lengths = [n for row in dataset for n in row["sample_lengths"]]
    assert len(dataset) == 17 and len(lengths) == 74
    assert all(len(row["input_ids"]) <= 256 for row in dataset)
    assert len(held_out) == 2 and sum(len(row["sample_lengths"]) for row in held_out) == 8


@pytest.mark.parametrize("name", ["custom_dataset", "custom_map_fn", "two_sources"])
def test_check_custom_dataset_passes_on_each_example(name, tiny_qwen2_dir, tmp_path, monkeypatch):
    """The READMEs' first command: `sfttool check-custom-dataset examples/<name>/config.py`."""
    from click.testing import CliRunner

    from sfttool.cli.main import cli

    monkeypatch.chdir(REPO)
    config = copy_with_tiny_model(EXAMPLES / name, tiny_qwen2_dir, tmp_path / name)
    result = CliRunner().invoke(cli, ["check-custom-dataset", str(config)])
    assert result.exit_code == 0, result.output
    assert "OK: 0 errors" in result.output


def test_two_sources_example_mixes_both_sources(tiny_tokenizer, monkeypatch):
    """examples/two_sources: the identity source filtered to its 78 one-turn rows, the 12 support rows used
    three times in order, interleaved 75/25 until the identity rows run out, as datasets interleaves them."""
    from datasets import Dataset, interleave_datasets

    from sfttool.dataset.data_sources import run_sources

    monkeypatch.chdir(REPO)
    cfg = load_config(EXAMPLES / "two_sources" / "config.py")
    node = cfg.train_dataset
    _, report = run_sources(cfg.data_sources, tiny_tokenizer, 512, node.template_map_fn, cfg.mix_strategy,
                            cfg.mix_probabilities, cfg.stopping_strategy, seed=cfg.seed)
    identity, support = report.sources
    assert (identity.read, identity.kept, support.read, support.sliced, support.kept) == (82, 78, 12, 36, 36)
    assert identity.report.dropped == {"filter_fn one_turn returned False": 4}
    reference = interleave_datasets([Dataset.from_dict({"s": [0] * 78}), Dataset.from_dict({"s": [1] * 36})],
                                    probabilities=[0.75, 0.25], seed=0, stopping_strategy="first_exhausted")
    assert (identity.used, support.used) == (reference["s"].count(0), reference["s"].count(1))
