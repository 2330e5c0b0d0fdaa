"""Every shipped config loads, every `type=` in it resolves, and the set of
configs covers the families, methods and datasets the docs promise."""
from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest
from mmengine.config.lazy import LazyAttr, LazyObject

from sfttool.config import builtin_config_dir, list_configs, load_config, validate_config
from sfttool.config.loader import config_at_a_glance
from sfttool.dataset.data_path import load_data_path
from sfttool.registry import build, resolve_type

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
# Shared parts live in folders starting with '_' (_base_/, data folders).
SHIPPED = sorted(p for p in CONFIG_DIR.rglob("*.py")
                 if p.name != "__init__.py" and not any(part.startswith("_") for part in
                                                        p.relative_to(CONFIG_DIR).parts[:-1]))
NAME_RE = re.compile(r"^(?P<model>[a-z0-9_]+?)_(?P<method>full|lora|qlora)_"
                     r"(?P<data>alpaca|oasst1|custom_json)_e(?P<epochs>\d+)$")
# Model-family configs (the table in docs/configs.md) and the other configs shipped.
FAMILY_COUNT = 28
OTHER_CONFIGS = {"demo_smollm2_135m_lora_self_identity_e3", "qwen3_8b_lora_reasoning_e3", "qwen3_8b_qlora_reasoning_e3",
                 "qwen3_8b_qlora_function_call_e3", "llama3_1_8b_instruct_qlora_function_call_e3",
                 # preference training (docs/preference.md)
                 "demo_smollm2_135m_lora_dpo_helpful_e3", "demo_smollm2_135m_lora_reward_helpful_e3",
                 "qwen2_5_7b_instruct_lora_dpo_ultrafeedback_e1",
                 "qwen2_5_7b_instruct_qlora_dpo_ultrafeedback_e1", "llama3_1_8b_instruct_lora_dpo_ultrafeedback_e1",
                 "llama3_1_8b_instruct_qlora_dpo_ultrafeedback_e1", "qwen2_5_7b_instruct_qlora_orpo_ultrafeedback_e1",
                 "qwen2_5_7b_instruct_lora_reward_ultrafeedback_e1", "qwen2_5_7b_instruct_lora_kto_mix14k_e1",
                 # long context: sequence parallelism (docs/long_context.md)
                 "qwen2_5_7b_instruct_qlora_32k_sp4_custom_json_e3",
                 # online RL from rewards (docs/rl.md)
                 "demo_smollm2_135m_lora_grpo_addition_e1", "qwen2_5_7b_instruct_lora_grpo_gsm8k_e1",
                 "qwen2_5_7b_instruct_qlora_grpo_gsm8k_e1", "qwen3_8b_lora_grpo_math_e1",
                 # mixture-of-experts models (docs/moe.md)
                 "qwen3_30b_a3b_moe_lora_alpaca_e3", "qwen3_30b_a3b_moe_qlora_alpaca_e3",
                 "mixtral_8x7b_instruct_v0_1_moe_lora_alpaca_e3",
                 # image-text fine-tuning (docs/multimodal.md)
                 "qwen2_5_vl_3b_instruct_lora_llava_instruct_e1", "qwen2_5_vl_3b_instruct_qlora_llava_instruct_e1",
                 "qwen2_5_vl_7b_instruct_lora_llava_instruct_e1", "qwen2_5_vl_7b_instruct_qlora_llava_instruct_e1",
                 "llava_1_5_7b_hf_qlora_llava_instruct_e1", "gemma3_4b_it_qlora_llava_instruct_e1"}
FAMILIES = {  # model prefix -> (template, needs trust_remote_code)
    "qwen2_5_0_5b_instruct": ("qwen_chat", False),
    "qwen2_5_1_5b_instruct": ("qwen_chat", False),
    "qwen2_5_7b_instruct": ("qwen_chat", False),
    "qwen3_8b": ("qwen3_chat", False),
    "llama3_1_8b_instruct": ("llama3_chat", False),
    "internlm2_5_7b_chat": ("internlm2_chat", True),
    "mistral_7b_instruct_v0_3": ("mistral_v3", False),
    "gemma2_9b_it": ("gemma2", False),
    "phi3_mini_4k_instruct": ("phi3_chat", False),
}


def _materialise(value):
    """A lazily imported name in a config -> the object it names."""
    return value.build() if isinstance(value, (LazyObject, LazyAttr)) else value


def _walk_types(node, key="cfg"):
    """Yield (key path, type) for every typed dict in a loaded config."""
    node = _materialise(node)
    if isinstance(node, dict):
        if "type" in node:
            yield f"{key}.type", _materialise(node["type"])
        for k, v in node.items():
            if k != "type":
                yield from _walk_types(v, f"{key}.{k}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _walk_types(v, f"{key}[{i}]")


def _parts(name):
    return NAME_RE.match(name).groupdict()


FAMILY_CONFIGS = [p for p in SHIPPED if NAME_RE.match(p.stem) and _parts(p.stem)["model"] in FAMILIES]


def test_config_count_is_pinned():
    # Adding or removing a config is deliberate: the docs list every config, and so does this file.
    family = sorted(p.stem for p in FAMILY_CONFIGS)
    assert len(family) == FAMILY_COUNT, (
        f"{len(family)} model-family configs ({family}), FAMILY_COUNT says {FAMILY_COUNT}: set FAMILY_COUNT in "
        f"{Path(__file__).name} to {len(family)} and update the table in docs/configs.md")
    others = {p.stem for p in SHIPPED} - set(family)
    assert others == OTHER_CONFIGS, (
        f"configs shipped but not in OTHER_CONFIGS: {sorted(others - OTHER_CONFIGS)}; in OTHER_CONFIGS but not "
        f"shipped: {sorted(OTHER_CONFIGS - others)}. Add a new config to OTHER_CONFIGS in {Path(__file__).name} "
        "and to the docs page of its kind; take a removed one out of both")
    # Flat: what list-cfg shows (and copy-cfg copies) is every shipped config.
    assert list_configs() == sorted(p.stem for p in SHIPPED)
    assert builtin_config_dir().resolve() == CONFIG_DIR


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_config_runs_on_the_base_install_without_a_tracker_package(path, monkeypatch):
    """A copied built-in's first run on the base install (no tensorboard, wandb or mlflow) must not stop
    with "install the extra": report_to asks for no package (TensorBoard only where installed)."""
    from sfttool.engine import tracking

    cfg = load_config(path.stem)
    monkeypatch.setattr(tracking, "_installed", lambda package: False)
    tracking.check_trackers(cfg)
    assert tracking.tracker_names(cfg.get("report_to")) == []


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_config_loads_and_every_type_resolves(path):
    cfg = load_config(path.stem)
    types = dict(_walk_types(dict(cfg.items())))
    assert len(types) >= 10, types  # model, llm, tokenizer, dataset, hooks, schedulers ...
    for key, type_ in types.items():
        assert callable(resolve_type(type_, key)), key
    # A custom JSON config names a placeholder file: training it unedited stops at validation.
    placeholder = [f"{path}: train_dataloader.dataset.dataset.dataset.path: data_path '/path/to/your/data.jsonl': no such "
                   "file or folder; set data_path (PART 1 of the config) to your data file, a folder or a glob, or "
                   "a dataset name on the hub"]
    assert validate_config(cfg, str(path)) == (placeholder if path.stem.endswith("custom_json_e3") else [])


@pytest.mark.parametrize("path", FAMILY_CONFIGS, ids=lambda p: p.stem)
def test_config_matches_its_name(path):
    parts = _parts(path.stem)
    template, remote = FAMILIES[parts["model"]]
    cfg = load_config(path.stem)
    llm = cfg.model.llm
    assert cfg.max_epochs == int(parts["epochs"])
    assert cfg.train_cfg.max_epochs == cfg.max_epochs
    assert ("quantization_config" in llm) == (parts["method"] == "qlora")
    assert (cfg.model.get("lora") is not None) == (parts["method"] in ("lora", "qlora"))
    assert llm.trust_remote_code is remote and cfg.tokenizer.trust_remote_code is remote
    assert llm.pretrained_model_name_or_path == cfg.tokenizer.pretrained_model_name_or_path
    from sfttool.utils import PROMPT_TEMPLATE
    assert cfg.prompt_template == PROMPT_TEMPLATE[template]
    # The hook renders prompts with the same template and tokenizer as training.
    chat_hook = next(h for h in cfg.custom_hooks if _materialise(h["type"]).__name__ == "EvaluateChatHook")
    assert chat_hook["prompt_template"] == cfg.prompt_template
    assert chat_hook["tokenizer"] == cfg.tokenizer == cfg.train_dataset.tokenizer


@pytest.mark.parametrize("path", FAMILY_CONFIGS, ids=lambda p: p.stem)
def test_config_reads_top_to_bottom_in_five_parts(path):
    text = path.read_text()
    positions = [text.find(f"PART {i} ") for i in range(1, 6)]
    assert -1 not in positions and positions == sorted(positions), positions
    assert text.startswith('"""')  # a docstring saying what it trains and how to run it
    assert f"sfttool copy-cfg {path.stem} ." in text


TECHNIQUES = {"full": "full", "lora": "LoRA", "qlora": "QLoRA"}
OBJECTIVES = {"dpo": "DPO", "orpo": "ORPO", "kto": "KTO", "reward": "reward model", "grpo": "GRPO"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_docstring_holds_the_line_list_cfg_prints(path):
    """`sfttool list-cfg` prints each config's `At a glance:` docstring line: method, model size, data,
    memory estimate. It agrees with the config's name, its data_path and the rest of its docstring."""
    fields = config_at_a_glance(path)
    assert fields is not None, (f"{path.name}: its docstring needs a line 'At a glance: METHOD | MODEL SIZE | "
                                "DATA | MEMORY' (e.g. 'At a glance: QLoRA SFT | 7.6B | Alpaca, 52k instructions "
                                "(hub) | one 16 GB GPU'), which `sfttool list-cfg` prints")
    method, size, data, memory = fields
    technique = re.search(r"_(full|lora|qlora)_", path.stem).group(1)
    objective = next((OBJECTIVES[k] for k in OBJECTIVES if f"_{k}_" in path.stem), "SFT")
    assert method.startswith(f"{TECHNIQUES[technique]} {objective}"), method
    docstring = " ".join(ast.get_docstring(ast.parse(path.read_text())).replace(f"At a glance: {' | '.join(fields)}",
                                                                                "").split())
    if path.stem.startswith("demo_"):  # a CPU run: the size is in the name, the data bundled
        assert f"_{size.lower()}_" in path.stem and memory.startswith("CPU, ") and "bundled" in data
    else:  # the figures of the docstring's memory estimate
        assert f"{size} params" in docstring and f": {memory}" in docstring, (size, memory)
    data_path = load_config(path.stem).data_path
    on_the_hub = isinstance(data_path, str) and not data_path.startswith("/")
    assert data.endswith("(hub)") == on_the_hub, (data, data_path)


def test_families_methods_and_custom_json_are_covered():
    names = [p.stem for p in FAMILY_CONFIGS]
    have = {(_parts(n)["model"], _parts(n)["method"], _parts(n)["data"]) for n in names}
    for model in FAMILIES:
        if model in ("qwen2_5_0_5b_instruct", "qwen2_5_1_5b_instruct"):
            assert (model, "full", "alpaca") in have
            continue
        assert (model, "qlora", "alpaca") in have and (model, "lora", "alpaca") in have, model
    # One custom_json config per template family.
    custom_templates = {FAMILIES[m][0] for m, _, d in have if d == "custom_json"}
    assert custom_templates == {t for t, _ in FAMILIES.values()}


@pytest.mark.parametrize("name", [p.stem for p in FAMILY_CONFIGS if _parts(p.stem)["data"] == "custom_json"])
def test_custom_json_configs_read_a_local_file_in_the_standard_format(name):
    cfg = load_config(name)
    assert cfg.dataset_map_fn is None and cfg.train_dataset.dataset_map_fn is None
    assert cfg.data_path == "/path/to/your/data.jsonl"
    assert cfg.train_dataloader.dataset.dataset.dataset == dict(type=load_data_path, path=cfg.data_path)


def test_data_path_points_a_custom_json_config_at_a_real_file(tiny_sft_jsonl):
    cfg = load_config("qwen2_5_0_5b_instruct_full_custom_json_e3", [f"data_path={tiny_sft_jsonl}"])
    node = cfg.train_dataloader.dataset.dataset.dataset
    rows = build(node, "train_dataloader.dataset.dataset.dataset")
    assert rows["train"].column_names == ["conversation"] and len(rows["train"]) == 64


def _parts_3_to_5(path: Path) -> str:
    text = path.read_text()
    return text[text.rfind("\n#####", 0, text.index("PART 3 ")):]


REFERENCE = CONFIG_DIR / "qwen2_5_7b_instruct_qlora_alpaca_e3.py"
# The families of configs that share PART 3-5, by the model class of PART 2, and the config each
# family is pinned to. SFT; DPO and ORPO (the method, its loss and reference model are PART 1-2
# settings); reward models (a score head: the data ends every sequence with the reward token,
# and there is nothing to generate); online RL (GRPO: prompts, generation rounds).
PART_3_TO_5_REFERENCES = {
    "SupervisedFinetune": REFERENCE,
    "DPO": CONFIG_DIR / "qwen2_5_7b_instruct_qlora_dpo_ultrafeedback_e1.py",
    "ORPO": CONFIG_DIR / "qwen2_5_7b_instruct_qlora_dpo_ultrafeedback_e1.py",
    "RewardModel": CONFIG_DIR / "qwen2_5_7b_instruct_lora_reward_ultrafeedback_e1.py",
    # KTO: unpaired rows, each micro-batch its own KL baseline, so no validation
    "KTO": CONFIG_DIR / "qwen2_5_7b_instruct_lora_kto_mix14k_e1.py",
    "GRPO": CONFIG_DIR / "qwen2_5_7b_instruct_qlora_grpo_gsm8k_e1.py",
    # image-text SFT: a processor renders the rows, a sample answer is about an image
    "SupervisedFinetune (image-text)": CONFIG_DIR / "qwen2_5_vl_7b_instruct_qlora_llava_instruct_e1.py",
}


def _model_class(path: Path) -> str:
    cfg = load_config(path.stem)
    return _materialise(cfg.model["type"]).__name__ + (" (image-text)" if cfg.get("processor") else "")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_parts_3_to_5_are_the_same_in_every_builtin_config_of_a_family(path):
    """Configs differ only where the runs differ: PART 1 (settings, the data source and its map fn)
    and PART 2 (model and tokenizer). The demos are no exception."""
    model_class = _model_class(path)
    assert model_class in PART_3_TO_5_REFERENCES, f"{path.stem}: no family for {model_class}"
    assert _parts_3_to_5(path) == _parts_3_to_5(PART_3_TO_5_REFERENCES[model_class])


def test_the_families_have_different_references():
    # Two references that were equal would be one family: keep the mapping honest.
    texts = {ref: _parts_3_to_5(ref) for ref in PART_3_TO_5_REFERENCES.values()}
    assert len(set(texts.values())) == len(texts) == 6


def _chat_hooks(cfg) -> list[dict]:
    return [h for h in cfg.custom_hooks if _materialise(h["type"]).__name__ == "EvaluateChatHook"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_sample_generation_length_is_a_part1_setting(path):
    """Every config generates sample answers (EvaluateChatHook) as long as PART 1 says, except a
    reward model's: it scores conversations and writes none, so it has neither hook nor setting."""
    text = path.read_text()
    if _model_class(path) == "RewardModel":
        assert _chat_hooks(load_config(path.stem)) == [] and "evaluation_max_new_tokens" not in text
        return
    (chat_hook,) = _chat_hooks(load_config(path.stem, ["evaluation_max_new_tokens=7"]))
    assert chat_hook["max_new_tokens"] == 7
    assert text.index("evaluation_max_new_tokens = ") < text.index("PART 2 ")


def test_shared_peft_parts_build_real_objects():
    import torch
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    cfg = load_config("qwen2_5_7b_instruct_qlora_alpaca_e3", ["model.lora.r=8"])
    lora = build(cfg.model.lora, "model.lora")
    quant = build(cfg.model.llm.quantization_config, "model.llm.quantization_config")
    assert isinstance(lora, LoraConfig) and (lora.r, lora.lora_alpha, lora.task_type) == (8, 16, "CAUSAL_LM")
    assert isinstance(quant, BitsAndBytesConfig) and quant.load_in_4bit
    assert quant.bnb_4bit_compute_dtype == torch.bfloat16 and quant.bnb_4bit_quant_type == "nf4"


def test_optimizer_and_schedule_build_for_a_tiny_parameter():
    import torch
    cfg = load_config("llama3_1_8b_instruct_qlora_alpaca_e3")
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = build(dict(cfg.optim_wrapper.optimizer, params=params), "optim_wrapper.optimizer")
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == cfg.lr == 2e-4
    warmup, cosine = cfg.param_scheduler
    assert warmup.end == pytest.approx(0.03 * 3) == cosine.begin and cosine.end == 3
    assert cfg.default_hooks.checkpoint.interval == cfg.save_steps == 512
    assert cfg.save_steps % cfg.optim_wrapper.accumulative_counts == 0  # checkpoints on step boundaries
    assert set(cfg.default_hooks) == {"timer", "logger", "param_scheduler", "sampler_seed", "checkpoint"}


@pytest.mark.slow
def test_non_editable_install_ships_the_configs(tmp_path):
    """`pip install .` (no editable finder): list-cfg still sees the configs and a
    config using an absolute `from sfttool.configs._base_...` import loads."""
    import shutil
    import subprocess

    root = CONFIG_DIR.parent
    src = tmp_path / "src"
    # Build from a copy so the shared checkout gets no build/ or egg-info churn.
    shutil.copytree(root, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "work_dirs", "tests", "benchmarks"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True, capture_output=True)
    assert (site / "sfttool" / "configs" / "_base_" / "runtime.py").is_file()
    user_cfg = tmp_path / "mine.py"
    user_cfg.write_text("from mmengine.config import read_base\n"
                        "with read_base():\n    from sfttool.configs._base_.runtime import *\n"
                        "max_epochs = 1\n")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    code = ("import sfttool; from sfttool.cli.main import cli; "
            f"assert sfttool.__file__.startswith({str(site)!r}), sfttool.__file__; cli()")
    out = subprocess.run([sys.executable, "-c", code, "list-cfg", "-p", "QWEN"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout
    lines = out.split("DEEPSPEED PRESETS")[0].splitlines()
    assert lines[1].startswith("NAME  ")  # a header, then one line per config starting with its name
    listed = [line.split()[0] for line in lines[2:-1]]
    assert listed == [n for n in list_configs() if "qwen" in n] and len(listed) >= 10
    code = (f"from sfttool.config import load_config; print(load_config({str(user_cfg)!r}).log_level)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "INFO"


def _point_at_tiny_assets(name, model_dir, data_file):
    """Load a built-in config with the model and the data redirected to offline assets, the way
    a user would: PART 1 settings from the command line."""
    return load_config(name, [f"pretrained_model_name_or_path={model_dir}", f"data_path={data_file}",
                              "max_length=256", "model.llm.dtype=float32",
                              "train_dataloader.dataset.map_num_proc=1"])


@pytest.fixture(scope="module")
def tiny_alpaca_jsonl(tmp_path_factory):
    """Alpaca's raw columns: instruction, input (often empty), output."""
    from sfttool import assets
    rows = [dict(instruction=f"Name the colour number {i}.", input="" if i % 2 else "the sky",
                 output=f"Colour {i} is blue.") for i in range(24)]
    return assets.write_jsonl(tmp_path_factory.mktemp("alpaca") / "alpaca.jsonl", rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_5_0_5b_instruct_full_custom_json_e3",
                                  "qwen2_5_7b_instruct_qlora_custom_json_e3",
                                  "phi3_mini_4k_instruct_lora_alpaca_e3"])
def test_builtin_config_builds_and_takes_a_step_on_tiny_assets(name, tiny_qwen2_dir, tiny_sft_jsonl,
                                                                tiny_alpaca_jsonl):
    """The shipped dicts fit the real sfttool components: dataset, collate, model, hooks."""
    import torch
    data = tiny_alpaca_jsonl if "alpaca" in name else tiny_sft_jsonl
    cfg = _point_at_tiny_assets(name, tiny_qwen2_dir, data)
    dataset = build(cfg.train_dataloader.dataset, "train_dataloader.dataset")
    assert len(dataset) > 0 and sum(sum(row["sample_lengths"]) for row in dataset) == \
        sum(len(row["input_ids"]) for row in dataset)
    # mmengine's runner binds the collate_fn arguments (functools.partial); so do we.
    collate_cfg = dict(cfg.train_dataloader.collate_fn)
    collate = functools.partial(_materialise(collate_cfg.pop("type")), **collate_cfg)
    batch = collate([dataset[0], dataset[1]])
    model = build(cfg.model, "model")
    adapters = getattr(model.llm, "peft_config", {})
    assert ("default" in adapters and adapters["default"].r == 64) == ("lora" in name)
    if "qlora" in name:  # the base weights really are 4-bit
        import bitsandbytes as bnb
        assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.llm.modules())
    loss = model(**batch, mode="loss")["loss"]
    loss.backward()
    assert torch.isfinite(loss) and loss.item() > 0
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None for p in trained)
    hooks = [build(h, f"custom_hooks[{i}]") for i, h in enumerate(cfg.custom_hooks)]
    assert [type(h).__name__ for h in hooks] == ["DatasetInfoHook", "EvaluateChatHook", "ThroughputHook",
                                                 "EarlyStoppingHook"]
    assert hooks[-1].enabled is False  # early_stopping_patience = None: validations never stop the run
    # The held-out rows go through the same pipeline, and no row is in both parts.
    held_out = build(cfg.val_dataloader.dataset, "val_dataloader.dataset")
    assert len(held_out) > 0 and cfg.val_dataloader.dataset.dataset.part == "val"
    assert cfg.train_cfg.val_interval == cfg.val_interval * cfg.accumulative_counts
