"""The pieces of sequence parallelism that need no second process: the row split, the whole-row mask and
varlen boundaries, the sampler's data-parallel shares, and the one-line errors of set-up."""
from __future__ import annotations

import pytest
import torch
from mmengine.config import Config

from sfttool.engine.checks import check_built_model, sequence_parallel_problems
from sfttool.parallel.attention import packed_causal_mask, sequence_parallel_name, varlen_arguments
from sfttool.parallel.groups import SequenceParallelError, _State
from sfttool.parallel.sequence import SequenceParallelSampler
from sfttool.parallel.split import RowSplit


def test_the_split_pads_with_a_pseudo_sample_and_gives_each_rank_its_slice():
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 0, 1, 0, 1]])
    halves = [RowSplit.of(positions, size=2, rank=r, group=None) for r in (0, 1)]
    assert halves[0].position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 0, 1, 0, 1, 0]]
    assert [h.local_positions().tolist() for h in halves] == [[[0, 1, 2, 3], [0, 1, 2, 0]],
                                                              [[0, 1, 2, 0], [1, 0, 1, 0]]]
    labels = torch.arange(14).view(2, 7)
    assert halves[1].local(labels, -100).tolist() == [[4, 5, 6, -100], [11, 12, 13, -100]]
    # a batch the model flattened into one row (flash-attention) is flattened the same way
    flat = RowSplit.of(positions.reshape(1, -1), size=4, rank=3, group=None)
    assert flat.local(labels, -100).tolist() == [[12, 13, -100, -100]]


def test_the_mask_isolates_samples_and_the_split_padding_across_the_whole_row():
    mask = packed_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))[0, 0].int()
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    cu, longest = varlen_arguments(torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 9, 10] and longest == 4


def test_the_sampler_shares_rows_by_data_parallel_rank(monkeypatch):
    from sfttool.parallel import groups

    dataset = list(range(10))
    shares = []
    for rank in range(4):  # 4 processes, sequence_parallel_size 2: data-parallel ranks 0, 0, 1, 1
        monkeypatch.setattr(groups, "_state", _State(size=2, rank=rank % 2, dp_size=2, dp_rank=rank // 2))
        shares.append(list(SequenceParallelSampler(dataset, shuffle=False, seed=0)))
    assert shares == [[0, 2, 4, 6, 8]] * 2 + [[1, 3, 5, 7, 9]] * 2
    monkeypatch.setattr(groups, "_state", _State(size=2, rank=0, dp_size=2, dp_rank=0))
    sampler = SequenceParallelSampler(dataset, shuffle=True, seed=3)
    sampler.set_epoch(1)
    assert len(sampler) == 5 and sorted(sampler) != list(sampler)


def config(**kwargs) -> Config:
    base = dict(train_dataloader=dict(sampler=dict(type=SequenceParallelSampler, seed=None, shuffle=True)),
                sequence_parallel_size=2)
    return Config({**base, **kwargs})


@pytest.mark.parametrize("cfg, message", [
    (config(sequence_parallel_size=0), "sequence_parallel_size must be a positive integer"),
    (config(train_dataloader=dict(sampler=dict(type="InfiniteSampler"))),
     "sequence_parallel_size=2 needs train_dataloader.sampler = dict(type=SequenceParallelSampler"),
    (config(val_dataloader=dict(batch_size=1), val_ratio=0.02), "validation does not run with sequence_parallel_size=2"),
    (config(train_dataloader=dict(sampler=dict(type=SequenceParallelSampler),
                                  dataset=dict(type="sfttool.dataset.streaming.StreamingPackedDataset"))),
     "sequence_parallel_size=2 needs a map-style dataset: turn streaming off in train_dataloader.dataset"),
    (config(model=dict(type="sfttool.model.GRPO")),
     "model.type=GRPO does not train with sequence parallelism (SupervisedFinetune and the preference models do)"),
])
def test_config_mistakes_are_one_line_errors(cfg, message):
    problems = sequence_parallel_problems(cfg, world_size=2)
    assert len(problems) == 1 and isinstance(problems[0], SequenceParallelError)
    assert str(problems[0]).startswith(message) and "\n" not in str(problems[0])


def test_every_sequence_parallel_mistake_is_reported_at_once():
    cfg = config(train_dataloader=dict(sampler=dict(type="InfiniteSampler")), val_dataloader=dict(batch_size=1),
                 model=dict(type="sfttool.model.GRPO"))
    assert [str(p) for p in sequence_parallel_problems(cfg, world_size=3)] == [
        "sequence_parallel_size=2 needs train_dataloader.sampler = dict(type=SequenceParallelSampler, seed=None, "
        "shuffle=True) (from sfttool.parallel.sequence), so the ranks of a group read the same rows",
        "validation does not run with sequence_parallel_size=2: set val_ratio = 0 and val_data_path = None "
        "(or val_dataloader = None)",
        "model.type=GRPO does not train with sequence parallelism (SupervisedFinetune and the preference models do): "
        "set sequence_parallel_size = 1",
        "sequence_parallel_size=2 must divide the number of processes (3): launch a multiple of 2 processes or "
        "change sequence_parallel_size"]


def test_the_head_counts_must_divide(tiny_qwen2_dir):
    from sfttool.model import SupervisedFinetune

    llm = dict(type="transformers.AutoModelForCausalLM.from_pretrained", pretrained_model_name_or_path=str(tiny_qwen2_dir),
               dtype="float32")
    model = SupervisedFinetune(llm=llm, use_activation_checkpointing=False)
    check_built_model(model, 2)  # 4 heads, 2 key/value heads
    with pytest.raises(SequenceParallelError, match=r"^sequence_parallel_size=4 must divide the model's attention "
                                                    r"heads \(4\) and key/value heads \(2\)"):
        check_built_model(model, 4)


def test_other_attention_kinds_are_refused_by_name():
    assert sequence_parallel_name("sdpa") == "sequence_parallel_sdpa"
    assert sequence_parallel_name(None) == "sequence_parallel_eager"
    assert sequence_parallel_name("sequence_parallel_sdpa") == "sequence_parallel_sdpa"
    with pytest.raises(SequenceParallelError, match="uses 'flex_attention': set attn_implementation='sdpa'"):
        sequence_parallel_name("flex_attention")


def test_a_default_sampler_becomes_the_sequence_parallel_one_with_its_arguments(monkeypatch):
    from mmengine.dataset import DefaultSampler

    from sfttool.parallel import groups
    from sfttool.parallel.sampler import train_sampler

    for kind in (DefaultSampler, "DefaultSampler", "mmengine.dataset.DefaultSampler"):
        assert sequence_parallel_problems(config(train_dataloader=dict(sampler=dict(type=kind))), 2) == []
        assert train_sampler(dict(type=kind, shuffle=True, seed=7)) == dict(type=kind, shuffle=True, seed=7)  # sp 1
        monkeypatch.setattr(groups, "_state", _State(size=2, rank=0, dp_size=1, dp_rank=0))
        assert train_sampler(dict(type=kind, shuffle=True, seed=7)) == dict(type=SequenceParallelSampler,
                                                                            shuffle=True, seed=7)
        monkeypatch.setattr(groups, "_state", _State())


def test_the_long_context_config_passes_the_checks():
    from sfttool.config import load_config

    cfg = load_config("qwen2_5_7b_instruct_qlora_32k_sp4_custom_json_e3")
    assert (cfg.sequence_parallel_size, cfg.max_length, cfg.accumulative_counts) == (4, 32768, 16)
    assert cfg.optim_wrapper.accumulative_counts == 16 and cfg.default_hooks.checkpoint.interval % 16 == 0
    assert cfg.model.use_varlen_attn is True
    assert sequence_parallel_problems(cfg, world_size=4) == []  # the sampler is DefaultSampler's line; no validation


def test_the_gpu_attention_check_runs_its_code_path_on_cpu(tmp_path):
    """benchmarks/sp_attention_check.py (run by gpu_check.sh): the varlen call, made with a pure-torch
    kernel, matches SDPA with the whole row's mask."""
    import json
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "sp_attention_check.py"
    main = runpy.run_path(str(script))["main"]
    assert main(["--dry-run", "--out", str(tmp_path / "sp.json")]) == 0
    report = json.loads((tmp_path / "sp.json").read_text())
    assert [r["attention"] for r in report["results"]] == ["sdpa_whole_row_mask", "flash_varlen"]
    assert report["results"][1]["max_abs_diff_vs_sdpa"] < 1e-5 and report["results"][1]["samples"] > 2


@pytest.mark.parametrize("inner", ["eager", "sdpa"])
def test_generate_runs_the_plain_attention_under_the_sequence_parallel_name(inner, tiny_qwen2_dir):
    """Sample generations during training (EvaluateChatHook) call generate() without a row split."""
    from transformers import AutoModelForCausalLM

    from sfttool.parallel.setup import use_sequence_parallel_attention

    llm = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32, attn_implementation=inner)
    prompt = torch.tensor([[5, 9, 14, 3, 27]])
    want = llm.generate(prompt, max_new_tokens=6, do_sample=False)
    use_sequence_parallel_attention(llm)
    assert llm.config._attn_implementation == f"sequence_parallel_{inner}"
    assert torch.equal(llm.generate(prompt, max_new_tokens=6, do_sample=False), want)


def test_too_few_processes_stop_the_run_before_the_data_is_processed(tmp_path, tiny_qwen2_dir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from engine_helpers import write_config

    from sfttool.engine.train import train

    data = tmp_path / "bad.jsonl"  # processing the data first would fail on its row instead
    data.write_text('{"no_conversation": 1}\n')
    cfg = write_config(tmp_path / "sp.py", tiny_qwen2_dir, data)
    cfg.write_text(cfg.read_text().replace("seed = 7\n", "seed = 7\nsequence_parallel_size = 2\n"))
    with pytest.raises(SequenceParallelError, match=r"^sequence_parallel_size=2 must divide the number of "
                                                    r"processes \(1\): launch a multiple of 2 processes"):
        train(str(cfg), work_dir=str(tmp_path / "work"))
