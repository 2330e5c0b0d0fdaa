"""`sfttool train` of a GRPO config end to end on the tiny Qwen2 (one process): the logged metrics are the
step's exact values; groups of equal rewards with beta 0 leave the weights unchanged; any micro-batch split
trains alike; SIGTERM inside a generation round, then --resume, continues bit for bit; --dry-run shows one
scored group."""
from __future__ import annotations

import json
import signal

import pytest
import torch

from engine_helpers import logged
from grpo_helpers import adapter, addition_rows, write_grpo_config

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def prompts_jsonl(tmp_path_factory):
    from sfttool import assets
    return assets.write_jsonl(tmp_path_factory.mktemp("grpo_data") / "add.jsonl", addition_rows(16))


@pytest.fixture
def grpo_config(tmp_path, tiny_qwen2_dir, prompts_jsonl):
    def make(name="grpo.py", **overrides):
        return write_grpo_config(tmp_path / name, tiny_qwen2_dir, prompts_jsonl, **overrides)
    return make


def scalars(work_dir) -> list[dict]:
    runs = sorted(work_dir.glob("*/vis_data/scalars.json"))
    return [json.loads(line) for line in runs[-1].read_text().splitlines()]


@pytest.mark.slow
def test_logged_metrics_are_each_steps_exact_values(grpo_config, tmp_path, capsys):
    """Every step trains on one whole round (2 prompts x 4 completions, two micro-batches of 4): its logged
    reward is the mean of the 8 completions written to completions/step_<n>.jsonl, each function's mean and
    std over those, and the fraction of groups without reward spread."""
    from sfttool.engine.train import train

    work = train(str(grpo_config(max_epochs=0.5)), work_dir=str(tmp_path / "work"))
    records = [r for r in scalars(work) if "reward" in r]
    assert [r["step"] for r in records] == [2, 4, 6, 8]  # logged at each step's last micro-batch
    for step, record in enumerate(records, start=1):
        groups = [json.loads(line) for line in (work / "completions" / f"step_{step}.jsonl").read_text().splitlines()]
        rewards = torch.tensor([r for g in groups for r in g["rewards"]], dtype=torch.float64)
        letter_e = torch.tensor([p[0] for g in groups for p in g["reward_parts"]], dtype=torch.float64)
        assert len(rewards) == 8
        assert record["reward"] == pytest.approx(rewards.mean().item(), abs=1e-9)
        assert record["rewards/letter_e/mean"] == pytest.approx(letter_e.mean().item(), abs=1e-9)
        assert record["rewards/letter_e/std"] == pytest.approx(letter_e.std().item(), abs=1e-9)
        group_stds = [torch.tensor(g["rewards"], dtype=torch.float64).std().item() for g in groups]
        assert record["reward_std"] == pytest.approx(sum(group_stds) / 2, abs=1e-9)
        assert record["frac_reward_zero_std"] == sum(s == 0 for s in group_stds) / 2
        assert 1 <= record["completions/mean_length"] <= 8 and 0 <= record["completions/clipped_ratio"] <= 1
        assert record["clip_ratio/region_mean"] == 0.0  # one pass over each round: ratio 1, nothing clipped
    assert "kl" not in records[0]  # beta 0: no reference, no KL
    # the progress line shows the step's reward, mean completion length and clipped fraction
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("iter 2/8"))
    assert (f"| reward {records[0]['reward']:.3f} | len {records[0]['completions/mean_length']:.3f} | clip 0.000 | lr "
            in line)
    log = next(work.glob("*/*.log")).read_text()
    assert "Completions sampled for optimizer step 1 (rewards: letter_e, accuracy):" in log
    from sfttool.model.rewards import accuracy_backend
    assert f"accuracy reward: compares final answers with {accuracy_backend()}" in log  # which verifier applies
    assert (work / "hf_adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_equal_rewards_with_beta_zero_leave_the_weights_unchanged(grpo_config, tmp_path):
    from sfttool.engine.train import train

    cfg = grpo_config(reward_funcs="['grpo_helpers.constant_one']",
                      custom_hooks="[dict(type='grpo_helpers.InitialWeightsHook')]", max_epochs=0.25)
    work = train(str(cfg), work_dir=str(tmp_path / "work"))
    initial = torch.load(work / "initial_weights.pt")
    final = adapter(work)
    assert len(final) == len(initial) > 0
    for name, value in initial.items():
        key = name.replace("llm.base_model.model.", "base_model.model.").replace(".default", "")
        assert torch.equal(final[key], value), name
    assert logged(work, "frac_reward_zero_std") == [1.0, 1.0]
    assert logged(work, "reward") == [1.0, 1.0]


@pytest.mark.slow
def test_any_micro_batch_split_trains_alike(grpo_config, tmp_path):
    """A round of 8 completions as 1 micro-batch of 8, 2 of 4 or 4 of 2 per optimizer step (dapo, beta > 0):
    the same rollouts and the same updates, step after step. (A constant learning rate: a schedule in
    iterations gives each split other rates.)"""
    from sfttool.engine.train import train

    runs = {}
    for micro, accumulation in ((8, 1), (4, 2), (2, 4)):
        cfg = grpo_config(f"split_{micro}.py", batch_size=micro, accumulative_counts=accumulation, beta=0.04,
                          scheduler="None")
        runs[micro] = train(str(cfg), work_dir=str(tmp_path / f"work_{micro}"))
    whole = adapter(runs[8])
    for micro in (4, 2):
        split = adapter(runs[micro])
        for k in whole:
            torch.testing.assert_close(split[k], whole[k], rtol=1e-4, atol=1e-5, msg=k)
        assert logged(runs[micro], "reward") == pytest.approx(logged(runs[8], "reward"), abs=1e-9)
        assert logged(runs[micro], "kl") == pytest.approx(logged(runs[8], "kl"), rel=1e-3, abs=1e-8)


@pytest.mark.slow
def test_sigterm_inside_a_round_then_resume_is_bit_identical(grpo_config, tmp_path):
    """mu = 2 and two optimizer steps per pass: a round spans 4 optimizer steps. SIGTERM during iteration 9
    (the round's third step) stops after it with a checkpoint holding the round; --resume trains on that
    round, not on one sampled anew with the moved weights, and ends as the uninterrupted run, bit for bit.
    Dropout on: the RNG comes back too."""
    from sfttool.engine.hooks.preemption_hook import TrainingPreempted
    from sfttool.engine.train import train

    common = dict(num_iterations=2, batch_size=2, accumulative_counts=2, dropout=0.1, save_steps=100, beta=0.04)
    full = train(str(grpo_config("full.py", **common)), work_dir=str(tmp_path / "full"))
    cut = grpo_config("cut.py", custom_hooks="[dict(type='grpo_helpers.SigtermAt', at=9)]", **common)
    work = tmp_path / "resumed"
    with pytest.raises(TrainingPreempted) as stopped:
        train(str(cut), work_dir=str(work))
    assert stopped.value.code == 128 + signal.SIGTERM
    assert sorted(p.name for p in work.glob("iter_*")) == ["iter_10.pth"]
    resumed = train(str(grpo_config("full.py", **common)), work_dir=str(work), resume="auto")
    log = sorted(resumed.glob("*/*.log"))[-1].read_text()
    assert "Resuming at iteration 10" in log
    assert "Completions sampled" not in log.split("Resuming at iteration 10")[1].split("Iter(train) [12/")[0]
    a, b = adapter(full), adapter(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert logged(resumed, "reward") == logged(full, "reward")[5:]  # steps 6 to 16, the same values


@pytest.mark.slow
def test_dry_run_generates_scores_and_shows_one_group(grpo_config, tmp_path, capsys):
    from sfttool.engine.train import train

    work = tmp_path / "work"
    train(str(grpo_config()), work_dir=str(work), dry_run=True)  # shown on the quiet terminal, without --verbose
    out = capsys.readouterr()
    text = out.out + out.err
    shown = text.split("Completions sampled for optimizer step 1 (rewards: letter_e, accuracy):")[1]
    assert shown.count("prompt (row ") == 1 and shown.count("--- completion ") == 4
    assert "advantage" in shown and "What is" in shown
    assert not work.exists() or not any(work.iterdir())  # a dry run keeps nothing


@pytest.mark.parametrize("args,message", [
    ((4, 8, 6, 1, 1), "train_cfg.micro_batch_size=6: a generation round of 4 prompts x 8 completions = 32 "
                      "completions per process is not a whole number of micro-batches; set micro_batch_size to a "
                      "divisor of 32"),
    ((4, 8, 8, 1, 3), "optim_wrapper.accumulative_counts=3: a generation round has 4 micro-batches of 8 completions, "
                      "not a whole number of optimizer steps; set accumulative_counts to a divisor of 4 (or change "
                      "train_dataloader.batch_size, the prompts per round)"),
    ((4, 8, 8, 0, 1), "train_cfg.num_iterations must be a positive integer (μ), got 0"),
])
def test_a_round_must_be_whole_micro_batches_and_optimizer_steps(args, message):
    from sfttool.config import ConfigError
    from sfttool.engine.grpo_loop import round_iterations
    with pytest.raises(ConfigError) as err:
        round_iterations(*args)
    assert str(err.value) == message
    assert round_iterations(4, 8, 8, 2, 2) == 8  # 4 micro-batches, passed over twice


def test_the_config_check_names_the_setting_before_anything_is_built(grpo_config):
    from sfttool.config import ConfigError, load_config
    from sfttool.engine import checks
    from sfttool.engine.spec import TrainOptions
    cfg = load_config(str(grpo_config(batch_size=3)))
    with pytest.raises(ConfigError, match="train_cfg.micro_batch_size=3: a generation round of 2 prompts x 4 "
                                          "completions = 8 completions per process"):
        checks.report(checks.run_checks(cfg, TrainOptions(dry_run=True), world_size=1))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_5_7b_instruct_qlora_grpo_gsm8k_e1", "qwen3_8b_lora_grpo_math_e1"])
def test_a_builtin_grpo_config_dry_runs_on_tiny_assets(name, tmp_path, tiny_qwen2_dir, prompts_jsonl, capsys):
    """The shipped dicts fit the real components: the prompt data (GSM8K's layout; MATH's for Qwen3), the model
    with its rewards (4-bit on this CPU for QLoRA), the loop; PART 1 settings from the command line."""
    from sfttool import assets
    from sfttool.engine.train import train

    data = prompts_jsonl
    if "math" in name:
        rows = [{"problem": f"What is {a} + {a}?", "solution": f"$\\boxed{{{2 * a}}}$"} for a in range(8)]
        data = assets.write_jsonl(tmp_path / "math.jsonl", rows)
    options = [f"pretrained_model_name_or_path={tiny_qwen2_dir}", f"data_path={data}", "data_subset=None",
               "max_completion_length=6", "generation_batch_size=4", "num_generations=2", "batch_size=2",
               "accumulative_counts=2", "model.llm.dtype=float32", "evaluation_max_new_tokens=4",
               "max_packed_length=256"]
    train(name, work_dir=str(tmp_path / "work"), cfg_options=options, dry_run=True, verbose=True)
    shown = capsys.readouterr()
    text = (shown.out + shown.err).split("Completions sampled for optimizer step 1")[1]
    assert text.count("--- completion ") == 2 and "prompt (row " in text
