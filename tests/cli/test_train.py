"""`sfttool train` from the command line: in-process for one process, torchrun for more."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sfttool.cli.main import cli

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"
if str(ENGINE_TESTS) not in sys.path:
    sys.path.insert(0, str(ENGINE_TESTS))

from engine_helpers import write_config  # noqa: E402


@pytest.fixture
def tiny_cfg(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    return write_config(tmp_path / "tiny.py", tiny_qwen2_dir, tiny_sft_jsonl, max_epochs=0.2, save_steps=4)


@pytest.mark.slow
def test_train_runs_in_process(tmp_path, tiny_cfg):
    work = tmp_path / "work"
    result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(work), "--seed", "3",
                                      "--cfg-options", "default_hooks.logger.interval=2"])
    assert result.exit_code == 0, result.output
    assert f"outputs in {work}" in result.output
    assert (work / "hf_adapter" / "adapter_config.json").is_file()
    assert (work / "iter_8.pth").is_file()

    # --resume with the run finished: picks iter_8 and ends at once, same outputs
    again = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(work), "--resume"])
    assert again.exit_code == 0, again.output


@pytest.mark.slow
def test_in_process_runs_keep_a_one_process_deepspeed_group_usable(tmp_path, tiny_cfg):
    """A DeepSpeed run, a plain run, then DeepSpeed again, all in this process:
    the one-process group (and DeepSpeed's groups cached from it) must survive."""
    import torch.distributed as dist

    for i, extra in enumerate((["--deepspeed", "zero2"], [], ["--deepspeed", "zero2"])):
        result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(tmp_path / f"w{i}"), *extra])
        assert result.exit_code == 0, result.output
        assert (tmp_path / f"w{i}" / "hf_adapter" / "adapter_config.json").is_file()
    assert dist.is_initialized()


@pytest.mark.slow
def test_back_to_back_runs_in_one_process_keep_their_own_checkpoints_and_logs(tmp_path, tiny_cfg):
    """mmengine reuses a message hub and logger of the same name: two runs started within one second used to
    share them, so the second deleted its own checkpoints and logged into the first run's file."""
    for name in ("a", "b"):
        result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    for name in ("a", "b"):
        assert (tmp_path / name / "iter_4.pth").is_file() and (tmp_path / name / "iter_8.pth").is_file()
        logs = list((tmp_path / name).rglob("*.log"))
        assert len(logs) == 1 and logs[0].read_text().count("Dataset: packed 64 samples") == 1  # its own, only


def test_seed_flag_reaches_every_seed_the_config_copied():
    """--seed changes the data order too (the dataset's shuffle before packing and the sampler), not only
    randomness.seed: the same keys --cfg-options seed=... would be redirected to."""
    from sfttool.config import load_config
    from sfttool.engine.preflight import apply_seed
    cfg = load_config("qwen2_5_0_5b_instruct_lora_alpaca_e3")
    assert (cfg.randomness.seed, cfg.train_dataloader.dataset.seed, cfg.train_dataloader.sampler.seed) == (42, 42, 42)
    apply_seed(cfg, 7)
    assert (cfg.randomness.seed, cfg.train_dataloader.dataset.seed, cfg.train_dataloader.sampler.seed) == (7, 7, 7)
    assert cfg.randomness.deterministic is False  # the rest of randomness is kept


def test_checkpoints_inside_an_accumulation_window_are_warned_about():
    from sfttool.config import load_config
    from sfttool.engine.checks import checkpoint_interval_warning
    name = "qwen2_5_0_5b_instruct_lora_alpaca_e3"
    assert checkpoint_interval_warning(load_config(name)) is None  # the built-ins save on step boundaries
    message = checkpoint_interval_warning(load_config(name, ["default_hooks.checkpoint.interval=500"]))
    assert message.startswith("default_hooks.checkpoint.interval=500 is not a multiple of "
                              "optim_wrapper.accumulative_counts=16") and message.endswith("(e.g. 496)")


def test_each_run_of_a_process_gets_its_own_experiment_name(tmp_path, tiny_cfg):
    from sfttool.config import load_config
    from sfttool.engine.spec import TrainOptions, build_spec
    cfg = load_config(tiny_cfg)
    first, second = (build_spec(cfg, TrainOptions(work_dir=str(tmp_path)), 1).name for _ in range(2))
    assert first != second and second.startswith("tiny_run")


def _snapshot(folder: Path) -> dict:
    """Bytes and times of a run's outputs: checkpoints, pointer, dumped config, HF export. (Not its text log:
    later runs in this same process log dataset building to the logger mmengine still holds current.)"""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix != ".log"}


@pytest.mark.slow
def test_rerunning_into_a_work_dir_with_checkpoints_is_refused_and_resume_checks_the_checkpoint(
        tmp_path, tiny_cfg, tiny_qwen2_dir, tiny_sft_jsonl, capfd):
    """The same command again after a crash must not start over and overwrite the
    earlier run; a checkpoint that does not fit the config is named in one line."""
    work = tmp_path / "work"
    first = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(work)])
    assert first.exit_code == 0, first.output
    before = _snapshot(work)
    assert {"iter_4.pth", "iter_8.pth", "last_checkpoint", "tiny.py", "hf_adapter/adapter_model.safetensors",
            "hf_adapter/sfttool_config.py"} <= set(before)

    again = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(work)])
    assert again.exit_code == 1
    assert again.output.endswith(f"Error: {work} already holds checkpoints of an earlier run (newest: iter_8.pth); "
                                 "pass --resume to continue it, or choose another --work-dir (or remove those "
                                 "checkpoints)\n")

    ckpt = work / "iter_4.pth"
    fit = f"resume with the config (and --cfg-options) the checkpoint was trained with: {work}/tiny.py\n"
    other_rank = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(tmp_path / "r4"), "--resume",
                                          str(ckpt), "--cfg-options", "model.lora.r=4"])
    assert other_rank.exit_code == 1
    assert other_rank.output.endswith(
        f"Error: --resume {ckpt} does not fit this model (tensors of another shape: 28, first "
        "llm.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight [8, 64] in the checkpoint, "
        "[4, 64] in the model); " + fit)
    full_cfg = write_config(tmp_path / "full.py", tiny_qwen2_dir, tiny_sft_jsonl, lora=False)
    full = CliRunner().invoke(cli, ["train", str(full_cfg), "--work-dir", str(tmp_path / "full"), "--resume",
                                    str(ckpt)])
    assert full.exit_code == 1
    assert f"Error: --resume {ckpt} does not fit this model (tensors missing from the checkpoint: 27, " \
           "first llm.model.embed_tokens.weight [512, 64]; tensors the model does not have: 28, first " in full.output
    assert full.output.endswith(fit)
    with_ds = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(tmp_path / "ds"), "--resume",
                                       str(ckpt), "--deepspeed", "zero2"])
    assert with_ds.output.endswith(f"Error: --resume {ckpt} was saved without DeepSpeed (a file; DeepSpeed saves "
                                   "a folder); resume it without --deepspeed\n")
    assert _snapshot(work) == before
    assert not list((tmp_path / "r4").iterdir()) and not list((tmp_path / "full").iterdir())

    capfd.readouterr()
    resumed = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(tmp_path / "cont"), "--resume",
                                       str(ckpt)])
    assert resumed.exit_code == 0, resumed.output
    out, err = capfd.readouterr()
    run_log = "".join(p.read_text() for p in (tmp_path / "cont").rglob("*.log"))  # the resumed run's own log
    assert "Resuming at iteration 4 (epoch 0, batch 4 of 40)" in run_log
    assert "do not match" not in resumed.output + out + err + run_log  # no list of the frozen base weights


def test_a_multi_process_run_refuses_an_earlier_runs_work_dir_before_launching(tmp_path, tiny_cfg):
    work = tmp_path / "work"
    work.mkdir()
    (work / "iter_4.pth").write_bytes(b"x")
    result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(work), "--nproc-per-node", "2"])
    assert result.exit_code == 1
    assert result.output.endswith(f"Error: {work} already holds checkpoints of an earlier run (newest: iter_4.pth); "
                                  "pass --resume to continue it, or choose another --work-dir (or remove those "
                                  "checkpoints)\n")
    assert (work / "iter_4.pth").read_bytes() == b"x"


def test_work_dir_that_is_a_file_is_a_one_line_error(tmp_path, tiny_cfg):
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(afile)])
    assert result.exit_code == 1
    assert result.output.endswith(f"Error: work dir {afile} is a file, not a folder; choose another folder with "
                                  "--work-dir\n")


def test_resume_in_an_empty_work_dir_is_a_one_line_error(tmp_path, tiny_cfg):
    result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(tmp_path / "none"), "--resume"])
    assert result.exit_code == 1
    assert "Error: --resume: no checkpoint" in result.output
    assert "Traceback" not in result.output


def test_unknown_deepspeed_preset_is_a_one_line_error(tmp_path, tiny_cfg):
    result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(tmp_path / "w"),
                                      "--deepspeed", "zero9"])
    assert result.exit_code == 1
    assert "no such preset" in result.output and "zero2_offload" in result.output


def test_a_misspelt_deepspeed_preset_names_the_close_match(tmp_path, tiny_cfg):
    result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(tmp_path / "w"),
                                      "--deepspeed", "zeor2"])
    assert result.exit_code == 1
    assert result.output.endswith("\nError: --deepspeed zeor2: no such file and no such preset; did you mean "
                                  "zero2? presets: zero1, zero2, zero2_offload, zero3, zero3_offload (or a path to "
                                  "a DeepSpeed JSON file)\n")


def test_a_deepspeed_json_that_does_not_fit_fails_before_launching_and_before_the_work_dir(tmp_path, tiny_cfg):
    """Checked by the launcher for the planned process count (once, not once per rank), and in a worker
    before the work dir is made."""
    import json
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 3, "train_micro_batch_size_per_gpu": "auto",
                              "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}}))
    for extra in (["--nproc-per-node", "2"], []):
        work = tmp_path / f"w{len(extra)}"
        result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(work), "--deepspeed", str(ds),
                                          *extra], env={"LOCAL_RANK": None, "WORLD_SIZE": None})
        assert result.exit_code == 1, result.output
        assert "train_batch_size" in result.output and "torchrun" not in result.output
        assert ("× 2 processes" if extra else "× 1 process") in result.output
        assert not work.exists()


def test_worker_command_line(monkeypatch):
    from sfttool.engine.launch import plan_from_env, torchrun_command
    from sfttool.engine.spec import TrainOptions

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name, value in (("NPROC_PER_NODE", "4"), ("NNODES", "2"), ("NODE_RANK", "1"), ("ADDR", "10.0.0.1"),
                        ("PORT", "29511")):
        monkeypatch.setenv(name, value)
    plan = plan_from_env()
    assert (plan.nproc_per_node, plan.world_size) == (4, 8)
    assert plan_from_env(nproc_per_node=2).nproc_per_node == 2  # the flag wins over the environment
    options = TrainOptions(work_dir="wd", deepspeed="zero2", resume="auto", seed=5, cfg_options=("a=1", "b=[1,2]"),
                           max_steps=3, dry_run=False, verbose=True, strict=True)
    args = ["cfg.py", *options.command_line()]
    assert args == ["cfg.py", "--work-dir", "wd", "--deepspeed", "zero2", "--resume", "auto", "--seed", "5",
                    "--cfg-options", "a=1", "--cfg-options", "b=[1,2]", "--max-steps", "3", "--verbose", "--strict"]
    # what each process parses back is the same options
    parsed = {}
    train_command = next(c for c in cli.commands.values() if c.name == "train")
    with train_command.make_context("train", args) as ctx:
        parsed = dict(ctx.params)
    assert parsed.pop("config") == "cfg.py" and parsed.pop("nproc_per_node") is None
    assert TrainOptions(**dict(parsed, cfg_options=tuple(parsed["cfg_options"]))) == options
    cmd = torchrun_command(plan, args)
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nnodes=2" in cmd and "--node-rank=1" in cmd and "--master-addr=10.0.0.1" in cmd
    assert "--master-port=29511" in cmd
    assert cmd[-len(args) - 2:] == ["sfttool.cli.main", "train", *args]


def test_bad_nproc_is_a_one_line_error(tiny_cfg):
    result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--nproc-per-node", "0"])
    assert result.exit_code == 1 and "at least 1" in result.output


def test_bad_launch_variable_is_a_one_line_error_naming_it(tiny_cfg):
    result = CliRunner().invoke(cli, ["train", str(tiny_cfg)], env={"PORT": "99999", "LOCAL_RANK": None})
    assert result.exit_code == 1
    assert result.output.strip() == "Error: environment variable PORT='99999': expected a TCP port from 1 to 65535"


def test_cfg_options_take_several_pairs_after_one_flag(tmp_path):
    """XTuner's spelling `--cfg-options a=1 b=2` equals repeating the flag."""
    from sfttool.cli.options import merge_cfg_options

    assert merge_cfg_options(("a=1",), ["b.c=2"]) == ["a=1", "b.c=2"]
    cfg = tmp_path / "c.py"
    cfg.write_text("x = 1\n")
    result = CliRunner().invoke(cli, ["check-custom-dataset", str(cfg), "--cfg-options", "a=1", "stray"])
    assert result.exit_code == 2 and "--cfg-options takes KEY=VALUE pairs" in result.output
    result = CliRunner().invoke(cli, ["train", str(cfg), "b=2"])
    assert result.exit_code == 2 and "write --cfg-options b=2" in result.output


def test_cfg_options_pairs_reach_the_config(tmp_path):
    from sfttool.config import load_config
    from sfttool.cli.options import merge_cfg_options

    cfg = tmp_path / "c.py"
    cfg.write_text("model = dict(a=1, b=dict(c=2))\n")
    loaded = load_config(cfg, merge_cfg_options(("model.a=5",), ["model.b.c=[1,2]"]))
    assert loaded.model.a == 5 and loaded.model.b.c == [1, 2]


def _progress(line: str) -> bool:
    return line.startswith("iter ")


@pytest.mark.slow
def test_the_terminal_shows_the_summary_and_progress_and_the_log_file_the_rest(tmp_path, tiny_cfg):
    """A run of 8 iterations (2 per optimizer step) with the logger's interval 10: progress from the
    first optimizer step, the interval capped so the loss is logged, the config dump and hook table only
    in the log file, no library noise, under 60 lines apart from progress."""
    from engine_helpers import logged
    work = tmp_path / "work"
    result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(work),
                                      "--cfg-options", "default_hooks.logger.interval=10"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split(" | ")[0] for line in lines if _progress(line)] == ["iter 2/8  25%", "iter 8/8 100%"]
    assert len([line for line in lines if not _progress(line)]) < 60
    summary = next(line for line in lines if line.startswith("[sfttool] Training "))
    assert " with LoRA (r=8) in float32 on CPU (1 thread): " in summary and " parameters trained (" in summary
    assert "Data: 40 rows, " in summary and "(batch 1 x 2 accumulation x 1 process)" in summary
    assert f"8 iterations = 4 optimizer steps = 0.2 epochs. Outputs in {work} " in summary
    assert summary.endswith(f"the adapter goes to {work / 'hf_adapter'}.")
    for noise in ("Config:", "Hooks will be executed", "GPU number", "backend", "FileClient", "has no metainfo",
                  "Detected call of", "Setting accelerator to CPU", "is_gradient_checkpointing"):
        assert noise not in result.output, noise
    log = next(work.rglob("*.log")).read_text()
    assert "Hooks will be executed in the following order" in log and summary[len("[sfttool] "):] in log
    assert len(logged(work)) == 1  # interval 8: one loss line, at the last iteration


@pytest.mark.slow
def test_dry_run_runs_one_iteration_and_leaves_no_work_dir_behind(tmp_path, tiny_cfg):
    work = tmp_path / "work" / "run"
    result = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(work), "--dry-run", "--verbose"])
    assert result.exit_code == 0, result.output
    (progress,) = [line for line in result.output.splitlines() if _progress(line)]
    # One micro-batch of a 2-iteration step: no optimizer step is taken, its own loss is shown.
    assert progress.startswith("iter 1/1 100% | step 1/1 | loss ")
    assert "1 iteration = 0 optimizer steps (2 iterations make one) = 0.025 epochs of the run's 8 iterations " \
           "(--dry-run)" in result.output
    assert "Hooks will be executed in the following order" in result.output  # --verbose
    assert result.output.rstrip().endswith("Dry run finished: the config, data and one training step work")
    assert list(tmp_path.iterdir()) == [tiny_cfg]  # neither the work dir nor the folder above it, both made by it
    again = CliRunner().invoke(cli, ["train", str(tiny_cfg), "--work-dir", str(work), "--max-steps", "1"])
    assert again.exit_code == 0, again.output  # nothing left behind to refuse
    assert sorted(p.name for p in work.glob("iter_*")) == ["iter_2.pth"]


def test_a_template_of_another_model_family_is_a_warning_and_with_strict_an_error(
        tmp_path, tiny_qwen2_dir, tiny_sft_jsonl):
    """train runs check-custom-dataset's template check before processing the data."""
    cfg = write_config(tmp_path / "llama3.py", tiny_qwen2_dir, tiny_sft_jsonl, template="llama3_chat")
    strict = CliRunner().invoke(cli, ["train", str(cfg), "--work-dir", str(tmp_path / "w"), "--strict"])
    assert strict.exit_code == 1
    error = strict.output.splitlines()[-1]
    assert re.match(re.escape(f"Error: {cfg}: the configured template renders differently from the tokenizer's "
                              "chat_template (first difference at character ") + r"\d+\); template: ", error)
    assert error.endswith("(--strict; without it this is a warning)")
    assert "<|start_header_id|>" in error and "<|im_start|>" in error  # the first differing texts
    assert not list((tmp_path / "w").rglob("*.pth"))
