"""`sfttool.engine.train.train` end to end on a tiny LoRA config (single process)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from engine_helpers import logged, mean, write_config

HOOKS = """[
    dict(type=DatasetInfoHook, tokenizer=tokenizer),
    dict(type=EvaluateChatHook, tokenizer=tokenizer, every_n_iters=10, max_new_tokens=8,
         evaluation_inputs=['hello world?', 'the cat?'], system='You are a helpful assistant.',
         prompt_template=prompt_template),
    dict(type=ThroughputHook),
]"""


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_qwen2_dir, tiny_sft_jsonl):
    from sfttool.engine.train import train

    root = tmp_path_factory.mktemp("lora_run")
    cfg = write_config(root / "tiny_lora.py", tiny_qwen2_dir, tiny_sft_jsonl, lr=5e-3, max_epochs=2,
                       save_steps=10, keep=2, custom_hooks=HOOKS)
    work_dir = train(str(cfg), work_dir=str(root / "work"))
    return work_dir


@pytest.mark.slow
def test_loss_falls(lora_run):
    losses = logged(lora_run)
    assert len(losses) == 40  # 40 packed rows x 2 epochs = 80 iterations: one loss per optimizer step of 2
    assert mean(losses[-5:]) < mean(losses[:5]) - 0.15  # each step's own loss: 6.27 at the first, ~6.0 at the end


@pytest.mark.slow
def test_work_dir_layout(lora_run):
    names = {p.name for p in lora_run.iterdir()}
    assert "tiny_lora.py" in names  # the dumped config
    # every 10 iterations, newest 2 kept, no unfinished save left behind
    assert sorted(n for n in names if n.startswith("iter_")) == ["iter_70.pth", "iter_80.pth"]
    assert (lora_run / "last_checkpoint").read_text().endswith("iter_80.pth")
    assert list(lora_run.glob("*/*.log")), "no text log"
    log = next(lora_run.glob("*/*.log")).read_text()
    for field in ("loss:", "lr:", "grad_norm:", "tokens_per_sec:", "eta:"):
        assert field in log


@pytest.mark.slow
def test_adapter_loads_with_peft(lora_run, tiny_qwen2_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(lora_run / "hf_adapter"))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained (lora_B starts at zero)
    assert (lora_run / "hf_adapter" / "tokenizer_config.json").is_file()


@pytest.mark.slow
def test_generation_hook_outputs(lora_run):
    files = sorted(p.name for p in (lora_run / "eval_outputs").glob("*.jsonl"))
    # before training, every 10 iterations, after training (iter 80 written once more)
    assert files == sorted({f"iter_{i}.jsonl" for i in range(0, 81, 10)})
    records = [json.loads(line) for line in (lora_run / "eval_outputs" / "iter_0.jsonl").read_text().splitlines()]
    assert [r["input"] for r in records] == ["hello world?", "the cat?"]
    assert records[0]["prompt"].startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert records[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert not any(stop in r["output"] for r in records for stop in ("<|im_end|>", "<|endoftext|>"))


@pytest.mark.slow
def test_full_finetune_exports_an_hf_model(tmp_path, tiny_config, tiny_qwen2_dir, monkeypatch):
    """A bfloat16 config on a machine without a GPU trains in float32 and exports in bfloat16."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from sfttool.engine.train import train

    monkeypatch.delenv("SFTTOOL_CPU_HALF_PRECISION", raising=False)
    cfg = tiny_config(lora=False, max_epochs=0.2, save_steps=4, dtype="bfloat16",
                      custom_hooks="[dict(type='engine_helpers.DtypeProbe')]")
    work_dir = train(str(cfg), work_dir=str(tmp_path / "w"))
    assert (work_dir / "trained_dtype.txt").read_text() == ("torch.bfloat16" if torch.cuda.is_available()
                                                            else "torch.float32")
    assert json.loads((work_dir / "hf_model" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(work_dir / "hf_model" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    trained = AutoModelForCausalLM.from_pretrained(work_dir / "hf_model", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    assert (work_dir / "hf_model" / "tokenizer_config.json").is_file()
    assert trained.config.use_cache is True  # training turns the KV cache off; the export is for inference
    changed = [n for n, p in trained.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert len(changed) == len(list(base.parameters()))  # every weight trained


@pytest.mark.parametrize("dtype, on_gpu, env, loaded", [
    ("bfloat16", False, None, "float32"), ("torch.float16", False, None, "float32"),
    ("bfloat16", False, "1", "bfloat16"), ("bfloat16", True, None, "bfloat16"), ("float32", False, None, "float32"),
])
def test_half_precision_loads_in_float32_without_a_gpu(monkeypatch, dtype, on_gpu, env, loaded):
    from sfttool.engine.preflight import model_cfg_for_device

    if env is None:
        monkeypatch.delenv("SFTTOOL_CPU_HALF_PRECISION", raising=False)
    else:
        monkeypatch.setenv("SFTTOOL_CPU_HALF_PRECISION", env)
    model_cfg = dict(type="SupervisedFinetune", llm=dict(type="AutoModelForCausalLM", dtype=dtype))
    built, note = model_cfg_for_device(model_cfg, on_gpu)
    assert built["llm"]["dtype"].replace("torch.", "") == loaded
    assert model_cfg["llm"]["dtype"] == dtype  # the config (what the run dumps) keeps its dtype
    if loaded == "float32" and dtype != "float32":
        assert note == ("no GPU: the model is loaded in float32, not the config's float16 (about 2x faster on "
                        "CPU); the export is saved in float16. Set SFTTOOL_CPU_HALF_PRECISION=1 to train in "
                        "float16").replace("float16", dtype.replace("torch.", ""))
    elif env:
        assert note.startswith("no GPU: training in bfloat16 as the config asks (SFTTOOL_CPU_HALF_PRECISION=1)")
    else:
        assert note is None


def test_one_process_rank_env_puts_back_what_was_there(monkeypatch):
    from sfttool.engine.processes import one_process_rank_env

    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with one_process_rank_env(deepspeed=True):
        assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("3", "0", "1")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    assert os.environ["RANK"] == "3"
    assert "LOCAL_RANK" not in os.environ and "WORLD_SIZE" not in os.environ


def test_token_ids_beyond_the_embedding_table_are_refused_before_training(tiny_llama_dir):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from sfttool.config import ConfigError
    from sfttool.engine.preflight import check_vocabulary
    from sfttool.model import SupervisedFinetune
    model = SupervisedFinetune(llm=AutoModelForCausalLM.from_pretrained(tiny_llama_dir), use_activation_checkpointing=False)
    rows = model.llm.get_input_embeddings().num_embeddings
    check_vocabulary(Dataset.from_dict({"input_ids": [[1, 2], [rows - 1]]}), model)
    with pytest.raises(ConfigError, match=rf"^the data holds token id {rows + 2} but the model's embedding table "
                                          rf"has {rows} rows: .*set model=dict\(\.\.\., tokenizer=tokenizer\)"):
        check_vocabulary(Dataset.from_dict({"input_ids": [[1, 2], [rows + 2, 3]]}), model)


def test_the_template_check_is_a_warning_naming_the_first_difference(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    """The check `check-custom-dataset` runs, before any data is processed: llama3_chat on a ChatML tokenizer."""
    from sfttool.config import load_config
    from sfttool.engine.preflight import check_template, template_problems

    cfg = load_config(str(write_config(tmp_path / "llama3.py", tiny_qwen2_dir, tiny_sft_jsonl,
                                       template="llama3_chat")))
    problems = template_problems(cfg)
    assert problems[0].startswith("the configured template renders differently from the tokenizer's chat_template "
                                  "(first difference at character ")
    assert "template:      '" in problems[0] and "<|start_header_id|>" in problems[0]
    assert "chat_template: '" in problems[0] and "<|im_start|>" in problems[0]
    check_template(cfg, strict=False)  # a warning only
    same = load_config(str(write_config(tmp_path / "qwen.py", tiny_qwen2_dir, tiny_sft_jsonl)))
    assert template_problems(same) == []
