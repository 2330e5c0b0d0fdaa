"""Mixture-of-experts models through ``sfttool train``: the aux loss logged per step, the LoRA targets
named in the summary, the checks that refuse what an MoE model cannot do, and two ZeRO-3 processes
routing differently that finish and resume bit-exactly."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine_helpers import logged, write_config
from sfttool.config import load_config
from sfttool.engine.checks import run_checks
from sfttool.engine.spec import TrainOptions

pytestmark = pytest.mark.timeout(900)


def moe_config(tmp_path, model_dir, data, name="moe.py", extra="", **kwargs):
    path = write_config(tmp_path / name, model_dir, data, **kwargs)
    path.write_text(path.read_text() + extra)
    return path


def test_train_logs_the_aux_loss_and_names_the_lora_targets(tmp_path, tiny_moe_dir, tiny_sft_jsonl, capsys):
    from sfttool.engine.train import train

    cfg = moe_config(tmp_path, tiny_moe_dir("qwen3_moe"), tiny_sft_jsonl, max_epochs=0.25, dropout=0.0,
                     extra="router_aux_loss_coef = 0.02\n")
    work = train(str(cfg), work_dir=str(tmp_path / "work"))
    aux, loss = logged(work, "aux_loss"), logged(work, "loss")
    assert len(aux) == len(loss) > 0 and all(1.0 <= a <= 4.0 for a in aux)  # top-2 of 4 experts: between 1 and 4
    summary = capsys.readouterr().out
    assert "LoRA on self_attn.k_proj, self_attn.o_proj, self_attn.q_proj, self_attn.v_proj and the parameters " \
           "experts.down_proj, experts.gate_up_proj." in summary
    adapter = load_file(work / "hf_adapter" / "adapter_model.safetensors")
    assert any(".experts.lora_A" in k for k in adapter) and not any(".gate." in k for k in adapter)
    # `sfttool convert pth_to_hf` of the last checkpoint gives the adapter the run exported
    from click.testing import CliRunner

    from sfttool.cli.main import cli

    last = sorted(work.glob("iter_*.pth"), key=lambda p: int(p.stem.split("_")[1]))[-1]
    result = CliRunner().invoke(cli, ["convert", "pth_to_hf", str(cfg), str(last), str(tmp_path / "converted")])
    assert result.exit_code == 0, result.output
    converted = load_file(tmp_path / "converted" / "adapter_model.safetensors")
    assert converted.keys() == adapter.keys() and all(torch.equal(converted[k], adapter[k]) for k in adapter)


def problems(cfg_path, world_size=1):
    return [str(e) for e in run_checks(load_config(str(cfg_path)), TrainOptions(dry_run=True), world_size).errors]


@pytest.mark.parametrize("model", ["dense", "deepseek_v3"])
def test_router_aux_loss_coef_on_a_model_without_the_loss_is_one_line_before_building(
        model, tmp_path, tiny_qwen2_dir, tiny_moe_dir, tiny_sft_jsonl):
    model_dir = tiny_qwen2_dir if model == "dense" else tiny_moe_dir(model)
    found = problems(moe_config(tmp_path, model_dir, tiny_sft_jsonl, dropout=0.0, extra="router_aux_loss_coef = 0.01\n"))
    kind = "Qwen2Config" if model == "dense" else "DeepseekV3Config"
    assert found == [f"router_aux_loss_coef=0.01: the model ({kind}) has no router load-balancing loss (a dense "
                     "model, or an MoE balanced otherwise); remove the setting"]


def test_router_aux_loss_coef_is_checked_as_a_number(tmp_path, tiny_moe_dir, tiny_sft_jsonl):
    cfg = moe_config(tmp_path, tiny_moe_dir("mixtral"), tiny_sft_jsonl, dropout=0.0)
    assert problems(cfg) == []
    cfg.write_text(cfg.read_text() + "router_aux_loss_coef = -1\n")
    assert problems(cfg) == ["router_aux_loss_coef must be a number >= 0 (0: leave the loss out), got -1"]


def test_sequence_parallelism_with_an_moe_model_is_refused_before_training(tiny_moe_dir):
    from transformers import AutoModelForCausalLM

    from sfttool.engine.checks import check_built_model
    from sfttool.model import SupervisedFinetune
    from sfttool.parallel.groups import SequenceParallelError

    model = SupervisedFinetune(llm=AutoModelForCausalLM.from_pretrained(tiny_moe_dir("qwen3_moe")),
                               use_activation_checkpointing=False)
    check_built_model(model, 1)
    with pytest.raises(SequenceParallelError, match=r"^sequence_parallel_size=2: mixture-of-experts models do not "
                                                    r"train with sequence parallelism yet; set sequence_parallel_size = 1$"):
        check_built_model(model, 2)


def test_moe_blocks_are_zero3_leaves(tiny_moe_dir):
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM

    from sfttool.engine.deepspeed import register_moe_leaf_modules
    from sfttool.model import SupervisedFinetune

    model = SupervisedFinetune(llm=AutoModelForCausalLM.from_pretrained(tiny_moe_dir("deepseek_v3")),
                               use_activation_checkpointing=False)
    assert register_moe_leaf_modules(model) == ["DeepseekV3MoE"]
    leaves = [n for n, m in model.named_modules() if getattr(m, "_z3_leaf", False)]
    assert leaves == ["llm.model.layers.1.mlp"]  # layer 0 is dense


@pytest.mark.slow
@pytest.mark.parametrize("deepspeed", ["zero3", "zero2", None])
def test_two_ranks_routing_differently_finish_and_zero3_resumes_bit_exactly(tmp_path, tiny_moe_dir, tiny_sft_jsonl,
                                                                           deepspeed):
    """Two processes under ZeRO-3 (MoE blocks as leaves), ZeRO-2 and DDP (gloo, CPU), each reading other
    rows, so their tokens reach the experts in other numbers: the run finishes. Under ZeRO-3, whose
    checkpoints hold the experts' shards, a second run resumed from its mid-run checkpoint ends with the
    same adapter (LoRA on attention and fused experts), bit for bit; ZeRO-2's and DDP's checkpoints resume
    as SFT's do (tests/engine/test_resume.py), with nothing of the experts' own in them."""
    from engine_helpers import two_ranks
    from test_distributed import run_sfttool

    cfg = moe_config(tmp_path, tiny_moe_dir("qwen3_moe"), tiny_sft_jsonl, max_epochs=0.5, dropout=0.0, save_steps=4, keep=3,
                     custom_hooks="[dict(type='moe_helpers.RoutingRecordHook')]")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    result = run_sfttool([str(cfg), "--work-dir", str(full), *two_ranks(deepspeed)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((full / f"routing_rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) == 2 and ranks[0] != ranks[1]
    assert len(logged(full, "aux_loss")) == len(logged(full)) > 0
    a = load_file(full / "hf_adapter" / "adapter_model.safetensors")
    assert any(".experts.lora_B" in k for k in a)
    assert max(v.abs().max().item() for k, v in a.items() if ".experts.lora_B" in k) > 0  # the experts trained
    if deepspeed != "zero3":
        return
    result = run_sfttool([str(cfg), "--work-dir", str(resumed), *two_ranks(deepspeed), "--resume", str(full / "iter_4.pth")])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    b = load_file(resumed / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_part1_coefficient_reaches_the_model_config():
    from sfttool.engine.preflight import model_cfg_in

    model = dict(type="SupervisedFinetune", llm=dict(dtype="float32"))
    assert model_cfg_in(model, "float32") is model
    changed = model_cfg_in(model, "float32", 0.05)
    assert changed == dict(model, router_aux_loss_coef=0.05) and "router_aux_loss_coef" not in model
    assert model_cfg_in(model, "bfloat16", 0.0) == dict(type="SupervisedFinetune", llm=dict(dtype="bfloat16"),
                                                        router_aux_loss_coef=0.0)


def test_a_lora_target_matching_nothing_is_one_line_before_anything_is_built(tmp_path, tiny_moe_dir, tiny_sft_jsonl):
    cfg = moe_config(tmp_path, tiny_moe_dir("qwen3_moe"), tiny_sft_jsonl, dropout=0.0)
    assert problems(cfg) == []
    cfg.write_text(cfg.read_text().replace("lora_dropout=0.0,", "lora_dropout=0.0, target_parameters=['experts.up_proj'],"))
    [found] = problems(cfg)
    assert found.startswith("model.lora.target_parameters: 'experts.up_proj' matches no parameter of "
                            "Qwen3MoeForCausalLM; closest names: experts.gate_up_proj, experts.down_proj")


def test_lora_dropout_on_fused_experts_is_one_line_before_anything_is_built(tmp_path, tiny_moe_dir, tiny_sft_jsonl):
    found = problems(moe_config(tmp_path, tiny_moe_dir("mixtral"), tiny_sft_jsonl, dropout=0.1))
    assert found == ["model.lora.lora_dropout=0.1: LoRA on fused expert weights (experts.down_proj, "
                     "experts.gate_up_proj) runs without dropout in peft; set model.lora.lora_dropout=0 (or "
                     "model.lora_targets='attention')"]


@pytest.mark.parametrize("arch, method", [("mixtral", "qlora"), ("deepseek_v3", "full")])
def test_qlora_and_full_runs_train_and_export(arch, method, tmp_path, tiny_moe_dir, tiny_sft_jsonl):
    """QLoRA (4-bit attention, experts in the load dtype) on Mixtral and full fine-tuning on DeepSeek-V3
    (shared experts, no aux loss) through `sfttool train`: the loss falls, the export loads."""
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from sfttool.engine.train import train

    cfg = moe_config(tmp_path, tiny_moe_dir(arch), tiny_sft_jsonl, max_epochs=0.5, dropout=0.0, lr=5e-3,
                     lora=method != "full", qlora=method == "qlora", accumulative_counts=1)
    work = train(str(cfg), work_dir=str(tmp_path / "work"))
    losses, aux = logged(work), logged(work, "aux_loss")
    assert len(losses) >= 8 and sum(losses[-3:]) < sum(losses[:3])
    assert (len(aux) == len(losses)) == (arch == "mixtral") and (aux == []) == (arch == "deepseek_v3")
    if method == "full":
        exported = AutoModelForCausalLM.from_pretrained(work / "hf_model")
        assert type(exported).__name__ == "DeepseekV3ForCausalLM"
        assert exported(input_ids=torch.tensor([[5, 6, 7]])).logits.isfinite().all()
    else:
        adapter = load_file(work / "hf_adapter" / "adapter_model.safetensors")
        assert any(".experts.lora_B" in k for k in adapter) and all(v.abs().sum() > 0 for k, v in adapter.items()
                                                                     if "lora_B" in k)
