"""DPO's reference when a LoRA run continues an adapter (``peft_model``): ``reference='initial_adapter'``
(the default) is a frozen copy of that adapter, so step 0 is ln 2, it never trains and is neither
checkpointed nor exported; ``reference='base'`` is the base model without any adapter. And the one line a
run with ``label_smoothing > 0`` and ``loss_type='sigmoid'`` logs."""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_preference import (assert_close, batch, load_llm, lora_cfg, make_model, make_pairs,  # noqa: E402
                             perturb, plain_logp, row_of)
from test_preference_distributed import pairs_jsonl  # noqa: E402,F401  (a fixture)
from test_preference_precompute import pair_dataset  # noqa: E402

from sfttool.model.step_metrics import step_means  # noqa: E402
from sfttool.registry import ConfigBuildError  # noqa: E402

EXACT = 1e-6


@pytest.fixture(scope="module")
def sft_adapter(tmp_path_factory, tiny_llama_dir):
    """A LoRA adapter folder whose weights change the model's outputs (an SFT run's adapter)."""
    model = make_model("SupervisedFinetune", tiny_llama_dir, lora=lora_cfg())
    perturb(model.llm, seed=4, scale=0.1)
    folder = tmp_path_factory.mktemp("sft_adapter")
    model.llm.save_pretrained(str(folder))
    return folder


def trainable(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_initial_adapter_reference_gives_ln2_at_step_0(tiny_llama_dir, sft_adapter):
    model = make_model("DPO", tiny_llama_dir, lora=lora_cfg(), peft_model=str(sft_adapter))
    assert model.reference_adapter == "reference"
    out = model(batch([row_of(make_pairs(4, seed=5))]), mode="loss")
    shown = step_means(out)
    assert abs(out["loss"].item() - math.log(2)) < EXACT and abs(shown["loss"] - math.log(2)) < EXACT
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(shown[key]) < EXACT, key


def test_base_reference_is_the_base_model_without_the_adapter(tiny_llama_dir, sft_adapter, caplog):
    with caplog.at_level("WARNING", logger="sfttool.model.dpo"):
        model = make_model("DPO", tiny_llama_dir, lora=lora_cfg(), peft_model=str(sft_adapter), reference="base")
    assert model.reference_adapter is None
    assert any("model.reference='base' with model.peft_model" in m for m in caplog.messages)
    pairs = make_pairs(4, seed=8)
    data = batch([row_of(pairs)])
    ref, _ = model.reference_logps(data)
    base = load_llm(tiny_llama_dir)
    assert_close(ref, [plain_logp(base, *pair[side])[0] for pair in pairs for side in ("chosen", "rejected")])
    assert abs(model(data, mode="loss")["loss"].item() - math.log(2)) > 1e-3  # the adapter moved the policy


def test_initial_adapter_reference_stays_frozen_while_the_adapter_trains(tiny_llama_dir, sft_adapter):
    model = make_model("DPO", tiny_llama_dir, lora=lora_cfg(), peft_model=str(sft_adapter))
    trained = trainable(model)
    assert trained and all(".default." in name for name in trained)
    assert not any(".reference." in name for name in model.state_dict())  # rebuilt from peft_model at start
    pairs = make_pairs(4, seed=3)
    data = batch([row_of(pairs)])
    start, _ = model.sequence_logps(data)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        model(data, mode="loss")["loss"].backward()
        assert trainable(model) == trained  # switching to the reference adapter put every flag back
        assert all(p.grad is None for n, p in model.named_parameters() if ".reference." in n)
        optimizer.step()
    ref, _ = model.reference_logps(data)
    policy, _ = model.sequence_logps(data)
    assert torch.equal(ref, start)  # the reference is the adapter as it started
    assert not torch.allclose(policy, start)
    assert model.llm.active_adapter == "default"


def test_the_export_holds_the_trained_adapter_only(tiny_llama_dir, sft_adapter, tmp_path):
    from mmengine.config import Config
    from peft import PeftModel

    from sfttool.model.hf_folder import write_hf_folder

    model = make_model("DPO", tiny_llama_dir, lora=lora_cfg(), peft_model=str(sft_adapter))
    perturb(model.llm, seed=9, scale=0.05)  # the trained adapter now differs from the reference
    write_hf_folder(model, None, Config(dict(model=dict())), tmp_path / "hf_adapter", OSError)
    assert not (tmp_path / "hf_adapter" / "reference").exists()
    loaded = PeftModel.from_pretrained(load_llm(tiny_llama_dir), str(tmp_path / "hf_adapter"))
    data = batch([row_of(make_pairs(2, seed=1))])
    policy, _ = model.sequence_logps(data)
    with torch.no_grad():
        want, _ = make_model("DPO", tiny_llama_dir).sequence_logps(data, loaded)
    assert_close(policy, want)


def test_precomputing_frees_the_reference_adapter(tiny_llama_dir, sft_adapter):
    model = make_model("DPO", tiny_llama_dir, lora=lora_cfg(), peft_model=str(sft_adapter),
                       precompute_ref_log_probs=True)
    trained = trainable(model)
    dataset = pair_dataset(make_pairs(4, seed=6), per_row=2)
    rows = model.prepare_train_data(dataset)
    assert model.reference_adapter is None and model.reference_freed
    assert "reference" not in model.llm.peft_config and trainable(model) == trained
    out = model(batch([rows[i] for i in range(len(rows))]), mode="loss")
    assert abs(out["loss"].item() - math.log(2)) < EXACT  # the precomputed values are the starting adapter's


def test_a_bad_reference_names_the_key(tiny_llama_dir):
    with pytest.raises(ConfigBuildError, match="model.reference must be one of 'initial_adapter', 'base'"):
        make_model("DPO", tiny_llama_dir, reference="sft")


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("loss_type,label_smoothing,lines", [("sigmoid", 0.1, 1), ("sigmoid", 0.0, 0),
                                                             ("robust", 0.1, 0)])
def test_label_smoothing_with_sigmoid_says_which_formula(tiny_llama_dir, loss_type, label_smoothing, lines):
    from mmengine.logging import MMLogger

    kept = _Kept()
    logger = MMLogger.get_current_instance()
    logger.addHandler(kept)
    try:
        make_model("DPO", tiny_llama_dir, loss_type=loss_type, label_smoothing=label_smoothing)
    finally:
        logger.removeHandler(kept)
    said = [m for m in kept.messages if "label_smoothing" in m]
    assert len(said) == lines
    if lines:
        assert said[0] == ("model.label_smoothing=0.1 with loss_type='sigmoid': the loss is cDPO's -(1-ε) log σ(βh) "
                           "- ε log σ(-βh), as in XTuner (TRL 1.16 ignores label_smoothing for 'sigmoid'; see "
                           "docs/preference.md)")


@pytest.mark.slow
def test_two_ranks_with_the_initial_adapter_reference_equal_one_rank(tmp_path, tiny_qwen2_dir, pairs_jsonl):
    """DDP: switching to the reference adapter (and back) inside the forward leaves every rank's
    gradients to be all-reduced: 2 ranks x 1 row train the adapter exactly as 1 rank x 2 rows."""
    from peft import LoraConfig
    from safetensors.torch import load_file
    from test_distributed import run_sfttool
    from test_preference_distributed import write

    from sfttool.engine.train import train

    sft = make_model("SupervisedFinetune", tiny_qwen2_dir, lora=dict(type=LoraConfig, r=8, lora_alpha=16,
                                                                       lora_dropout=0.0, bias="none"))
    perturb(sft.llm, seed=4, scale=0.1)
    sft.llm.save_pretrained(str(tmp_path / "sft_adapter"))
    data = pairs_jsonl
    continued = f"\nmodel['peft_model'] = {str(tmp_path / 'sft_adapter')!r}\n"
    configs = {}
    for name, batch_size in (("two", 1), ("one", 2)):
        path = write(tmp_path / f"{name}.py", tiny_qwen2_dir, data, batch_size=batch_size, dropout=0.0)
        path.write_text(path.read_text() + continued)
        configs[name] = path
    result = run_sfttool([str(configs["two"]), "--work-dir", str(tmp_path / "two"), "--nproc-per-node", "2"],
                         timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    single = train(str(configs["one"]), work_dir=str(tmp_path / "one"))
    a = load_file(tmp_path / "two" / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(single / "hf_adapter" / "adapter_model.safetensors")
    start = load_file(tmp_path / "sft_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() == start.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert any(not torch.equal(a[k], start[k]) for k in a)  # it trained
