"""Resume exactness: interrupted after iteration k + `--resume` == uninterrupted, bit for bit."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine_helpers import Interrupted

pytestmark = pytest.mark.timeout(900)  # tests here launch several processes


@pytest.mark.slow
def test_resume_is_bit_identical(tmp_path, tiny_config):
    from sfttool.engine.train import train

    # Dropout on (RNG matters), accumulation 2 (resume at a step boundary), 1.3 epochs
    # (the resume lands mid-epoch and training crosses an epoch boundary afterwards).
    cfg = tiny_config(max_epochs=1.3, dropout=0.1, accumulative_counts=2, save_steps=4, keep=1)
    full = train(str(cfg), work_dir=str(tmp_path / "full"))
    stop = {"custom_hooks": [dict(type="engine_helpers.StopAfterIter", n=28)]}
    with pytest.raises(Interrupted):
        train(str(cfg), work_dir=str(tmp_path / "resumed"), cfg_options=stop)
    assert sorted(p.name for p in (tmp_path / "resumed").glob("iter_*")) == ["iter_28.pth"]
    resumed = train(str(cfg), work_dir=str(tmp_path / "resumed"), resume="auto")

    a = load_file(full / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(resumed / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_lazily_encoded_run_resumes_bit_identically(tmp_path, tiny_config):
    """process_hf_dataset(lazy_encode=True) with rows_per_epoch (30) below the packed rows of a pass (46): an
    epoch by the length is not a pass over the rows; the checkpoint's data position resumes the interrupted
    run on the exact batch (iteration 32: epoch 1 by the length, still the first pass), and the result is
    the uninterrupted run's, bit for bit."""
    from sfttool.engine.train import train

    cfg = tiny_config(max_epochs=1.6, dropout=0.1, accumulative_counts=2, save_steps=4, keep=1)  # 48 iterations
    text = cfg.read_text()
    for old, new in (("map_num_proc=1, seed=seed)", "lazy_encode=True, buffer_size=8, rows_per_epoch=30, seed=seed)"),
                     ("sampler=dict(type=DefaultSampler, shuffle=True, seed=seed)", "sampler=None")):
        assert old in text
        text = text.replace(old, new)
    cfg.write_text(text)
    full = train(str(cfg), work_dir=str(tmp_path / "full"))
    stop = {"custom_hooks": [dict(type="engine_helpers.StopAfterIter", n=32)]}
    with pytest.raises(Interrupted):
        train(str(cfg), work_dir=str(tmp_path / "resumed"), cfg_options=stop)
    resumed = train(str(cfg), work_dir=str(tmp_path / "resumed"), resume="auto")
    assert "Resuming at iteration 32 (epoch 0, batch 32 of 30)" in sorted(resumed.glob("*/*.log"))[-1].read_text()
    a = load_file(full / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(resumed / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_max_steps_stops_with_a_checkpoint_that_resumes_into_the_uninterrupted_run(tmp_path, tiny_config):
    """--max-steps 2 with accumulation 2: a checkpoint after iteration 4 of 8, on the full run's learning-rate
    schedule, so --resume ends where the uninterrupted run ends, bit for bit; the resumed run's logged `time`
    averages only its own 4 iterations, not those before the interruption."""
    from sfttool.engine.train import train

    cfg = tiny_config(max_epochs=0.2, dropout=0.1, accumulative_counts=2, save_steps=100, keep=2,
                      custom_hooks="[dict(type='engine_helpers.TimeProbe')]")
    full = train(str(cfg), work_dir=str(tmp_path / "full"))
    part = train(str(cfg), work_dir=str(tmp_path / "part"), max_steps=2)
    assert sorted(p.name for p in part.glob("iter_*")) == ["iter_4.pth"]
    assert (part / "last_checkpoint").read_text() == str(part / "iter_4.pth")
    resumed = train(str(cfg), work_dir=str(part), resume="auto")
    assert sorted(p.name for p in resumed.glob("iter_*")) == ["iter_4.pth", "iter_8.pth"]
    a = load_file(full / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(resumed / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (resumed / "timed_iterations.txt").read_text() == "4"


def test_latest_checkpoint_ignores_unfinished(tmp_path):
    from sfttool.utils.checkpoint_file import find_latest_checkpoint

    assert find_latest_checkpoint(tmp_path) is None
    (tmp_path / "iter_8.pth").write_bytes(b"x")
    (tmp_path / "iter_12.pth").mkdir()  # DeepSpeed checkpoints are folders
    (tmp_path / "iter_16.pth.tmp").write_bytes(b"partial")  # killed mid-save
    assert find_latest_checkpoint(tmp_path).name == "iter_12.pth"


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    from sfttool.config import ConfigError
    from sfttool.engine.preflight import resolve_resume

    with pytest.raises(ConfigError, match="no checkpoint"):
        resolve_resume("auto", tmp_path)
    with pytest.raises(ConfigError, match="no such checkpoint"):
        resolve_resume(str(tmp_path / "iter_3.pth"), tmp_path)


@pytest.mark.slow
def test_deepspeed_resume_is_bit_identical(tmp_path, tiny_config):
    """The same under DeepSpeed ZeRO-2 (its strategy skips mmengine's checkpoint hooks; the RNG
    states travel in the message hub)."""
    from sfttool.engine.train import train

    cfg = tiny_config(max_epochs=0.5, save_steps=12)
    full = train(str(cfg), work_dir=str(tmp_path / "full"), deepspeed="zero2")
    stop = {"custom_hooks": [dict(type="engine_helpers.StopAfterIter", n=12)]}
    with pytest.raises(Interrupted):
        train(str(cfg), work_dir=str(tmp_path / "resumed"), deepspeed="zero2", cfg_options=stop)
    assert sorted(p.name for p in (tmp_path / "resumed").glob("iter_*")) == ["iter_12.pth"]
    assert (tmp_path / "resumed" / "iter_12.pth").is_dir()  # DeepSpeed's checkpoint, a folder
    resumed = train(str(cfg), work_dir=str(tmp_path / "resumed"), deepspeed="zero2", resume="auto")
    assert "Resuming at iteration 12" in sorted(resumed.glob("*/*.log"))[-1].read_text()

    a = load_file(full / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(resumed / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("deepspeed", [None, "zero2"], ids=["ddp2", "zero2x2"])
def test_two_process_resume_is_bit_identical(tmp_path, two_rank_run, deepspeed):
    """With two processes, DDP and ZeRO-2: each rank's data position and dropout stream must come
    back (rank 0 alone writes the message hub, so the states are gathered to it). The uninterrupted
    run is the lockstep test's (20 iterations per rank, checkpoints every 10); the resumed run starts
    in a new work dir from its iteration-10 checkpoint, which is what a run stopped there saves (the
    runs are deterministic; one launch fewer than stopping a second run). Real interruptions of two
    processes: tests/robustness/test_faults_e2e.py (SIGTERM, then --resume)."""
    from engine_helpers import two_ranks
    from test_distributed import run_sfttool

    go, full, result = two_rank_run(deepspeed)
    assert result.returncode == 0, result.stderr[-3000:]
    work = tmp_path / "resumed"
    result = run_sfttool([str(go), "--work-dir", str(work), *two_ranks(deepspeed), "--resume", str(full / "iter_10.pth")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resuming at iteration 10" in result.stdout + result.stderr

    a = load_file(full / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(work / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_rng_states_of_more_ranks_than_this_run_restore_rank_0s_with_a_warning():
    import logging
    import random
    from types import SimpleNamespace

    from mmengine.logging import MessageHub, MMLogger

    from sfttool.engine.checkpoint import _rng_state, restore_rng_state

    random.seed(1)
    rank0 = _rng_state()
    random.seed(2)
    rank1 = _rng_state()
    expected = random.Random(1).random()
    hub = MessageHub.get_instance("rng_restore_test")
    hub.update_info("rng_state", [rank0, rank1])
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = MMLogger.get_current_instance()
    logger.addHandler(handler)
    try:
        assert restore_rng_state(SimpleNamespace(message_hub=hub))
    finally:
        logger.removeHandler(handler)
    assert random.random() == expected
    assert any("RNG states of 2 process(es) and this run has 1" in r.getMessage() for r in records)


def test_latest_checkpoint_is_the_one_last_checkpoint_names(tmp_path):
    """Mixed runs in one folder: the pointer names the run that was continued last."""
    from sfttool.utils.checkpoint_file import find_latest_checkpoint

    (tmp_path / "iter_3000.pth").write_bytes(b"x")  # an older, longer run
    (tmp_path / "iter_100.pth").write_bytes(b"x")
    (tmp_path / "last_checkpoint").write_text(str(tmp_path / "iter_100.pth"))
    assert find_latest_checkpoint(tmp_path).name == "iter_100.pth"

    moved = tmp_path / "moved"  # a copied work dir: its pointer still names the old folder
    moved.mkdir()
    (moved / "iter_100.pth").write_bytes(b"x")
    (moved / "last_checkpoint").write_text(str(tmp_path / "iter_100.pth"))
    assert find_latest_checkpoint(moved) == moved / "iter_100.pth"


@pytest.mark.parametrize("pointer", ["iter_200.pth", "iter_200.pth.tmp", "", "garbage"])
def test_a_pointer_to_no_complete_checkpoint_falls_back_to_the_newest(tmp_path, pointer):
    from sfttool.utils.checkpoint_file import find_latest_checkpoint

    (tmp_path / "iter_100.pth").write_bytes(b"x")
    (tmp_path / "iter_200.pth.tmp").write_bytes(b"partial")  # killed mid-save, before the pointer moved
    (tmp_path / "last_checkpoint").write_text(str(tmp_path / pointer) if pointer else "")
    assert find_latest_checkpoint(tmp_path).name == "iter_100.pth"


def test_resume_checkpoint_kind_must_match_deepspeed(tmp_path):
    from sfttool.config import ConfigError
    from sfttool.engine.preflight import resolve_resume

    (tmp_path / "iter_4.pth").write_bytes(b"x")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "iter_4.pth").mkdir()  # DeepSpeed saves a folder
    with pytest.raises(ConfigError) as err:
        resolve_resume(str(tmp_path / "iter_4.pth"), tmp_path, deepspeed="zero2")
    assert str(err.value) == (f"--resume {tmp_path}/iter_4.pth was saved without DeepSpeed (a file; DeepSpeed "
                              "saves a folder); resume it without --deepspeed")
    with pytest.raises(ConfigError) as err:
        resolve_resume("auto", tmp_path / "ds")
    assert str(err.value) == (f"--resume {tmp_path}/ds/iter_4.pth is a DeepSpeed checkpoint (a folder); resume "
                              "it with --deepspeed and the preset it was trained with")
    assert resolve_resume("auto", tmp_path / "ds", deepspeed="zero2") == str(tmp_path / "ds" / "iter_4.pth")
    assert resolve_resume("auto", tmp_path) == str(tmp_path / "iter_4.pth")


def _snapshot(folder) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_work_dir_with_an_earlier_runs_checkpoints_is_refused_and_left_alone(tmp_path):
    from sfttool.engine.safety import WorkDirError
    from sfttool.engine.preflight import check_work_dir

    work = tmp_path / "work"
    work.mkdir()
    for name, text in (("iter_2000.pth", "a"), ("iter_3000.pth", "b"), ("tiny.py", "x = 1\n"),
                       ("hf_adapter/adapter_config.json", "{}")):
        (work / name).parent.mkdir(exist_ok=True)
        (work / name).write_text(text)
    (work / "last_checkpoint").write_text(str(work / "iter_3000.pth"))
    before = _snapshot(work)
    with pytest.raises(WorkDirError) as err:
        check_work_dir(work, resume=None)
    assert str(err.value) == (f"{work} already holds checkpoints of an earlier run (newest: iter_3000.pth); pass "
                              "--resume to continue it, or choose another --work-dir (or remove those checkpoints)")
    assert _snapshot(work) == before
    check_work_dir(work, resume="auto")   # continuing it is the point
    check_work_dir(work, resume=str(work / "iter_2000.pth"))


def test_a_work_dir_without_complete_checkpoints_can_be_trained_into(tmp_path):
    from sfttool.utils.checkpoint_file import find_latest_checkpoint
    from sfttool.engine.preflight import check_work_dir
    from sfttool.engine.safety import WorkDirError

    (tmp_path / "iter_4.pth.tmp").write_bytes(b"partial")  # the first save was killed: nothing to continue
    (tmp_path / "20250101_000000").mkdir()                 # a log folder of a run that failed early
    before = _snapshot(tmp_path)
    assert find_latest_checkpoint(tmp_path) is None
    assert check_work_dir(tmp_path, resume=None) is None   # accepted: a new run may start here
    assert _snapshot(tmp_path) == before and (tmp_path / "20250101_000000").is_dir()
    # The same folder once that save had completed holds a checkpoint to protect: refused.
    (tmp_path / "iter_4.pth.tmp").rename(tmp_path / "iter_4.pth")
    with pytest.raises(WorkDirError, match="already holds checkpoints of an earlier run \\(newest: iter_4.pth\\)"):
        check_work_dir(tmp_path, resume=None)


def test_a_work_dir_that_is_a_file_is_a_clear_error(tmp_path):
    from sfttool.engine.safety import WorkDirError
    from sfttool.engine.preflight import check_work_dir

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(WorkDirError) as err:
        check_work_dir(afile, resume=None)
    assert str(err.value) == f"work dir {afile} is a file, not a folder; choose another folder with --work-dir"
    assert afile.read_text() == "x"


class _Adapter(torch.nn.Module):
    """A frozen base weight and a trainable one; like SupervisedFinetune with LoRA,
    its state_dict holds only the trainable weights."""

    def __init__(self, rank: int = 2):
        super().__init__()
        self.base = torch.nn.Parameter(torch.ones(4, 4), requires_grad=False)
        self.lora_a = torch.nn.Parameter(torch.zeros(rank, 4))
        self.lora_b = torch.nn.Parameter(torch.zeros(4, rank))

    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        return type(state)((k, v) for k, v in state.items() if k != "base")


def _save_run(folder, state: dict, cfg_text: str = "lora_rank = 2\n"):
    """An mmengine-style checkpoint and its dumped config (plus DeepSpeed's helper script)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny_lora.py").write_text(cfg_text)
    (folder / "zero_to_fp32.py").write_text("# DeepSpeed's\n")
    torch.save({"meta": {"cfg": cfg_text}, "state_dict": state}, folder / "iter_4.pth")
    return folder / "iter_4.pth"


def test_a_checkpoint_of_another_lora_rank_is_refused_naming_the_config_it_was_trained_with(tmp_path):
    from sfttool.config import ConfigError
    from sfttool.engine.checkpoint import check_checkpoint_fits

    ckpt = _save_run(tmp_path / "w", _Adapter(rank=2).state_dict())
    check_checkpoint_fits(ckpt, _Adapter(rank=2))
    with pytest.raises(ConfigError) as err:
        check_checkpoint_fits(ckpt, _Adapter(rank=4))
    assert str(err.value) == (
        f"--resume {ckpt} does not fit this model (tensors of another shape: 2, first lora_a [2, 4] in the "
        "checkpoint, [4, 4] in the model); resume with the config (and --cfg-options) the checkpoint was trained "
        f"with: {tmp_path}/w/tiny_lora.py")


def test_a_full_checkpoint_into_a_lora_model_counts_what_is_missing_and_unexpected(tmp_path):
    from sfttool.config import ConfigError
    from sfttool.engine.checkpoint import check_checkpoint_fits

    full = torch.nn.Linear(4, 3)
    ckpt = _save_run(tmp_path / "w", {"module." + k: v for k, v in full.state_dict().items()}, "lora = None\n")
    with pytest.raises(ConfigError) as err:
        check_checkpoint_fits(ckpt, _Adapter())
    assert str(err.value) == (
        f"--resume {ckpt} does not fit this model (tensors missing from the checkpoint: 2, first lora_a [2, 4]; "
        "tensors the model does not have: 2, first weight [3, 4]); resume with the config (and --cfg-options) "
        f"the checkpoint was trained with: {tmp_path}/w/tiny_lora.py")


def test_loading_an_adapter_checkpoint_reports_only_real_mismatches(capsys):
    """mmengine's loader lists every frozen weight the adapter-only checkpoint leaves out
    as missing; those are dropped, missing trainable and unexpected keys are kept."""
    from mmengine.runner.checkpoint import load_state_dict

    from sfttool.engine.checkpoint import ignore_frozen_weights_on_load

    model = _Adapter()
    ignore_frozen_weights_on_load(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    load_state_dict(model, state)
    assert capsys.readouterr().out == ""
    load_state_dict(model, {"lora_a": state["lora_a"], "stray": torch.ones(1)})
    out = capsys.readouterr().out
    assert "unexpected key in source state_dict: stray" in out
    assert "missing keys in source state_dict: lora_b\n" in out
    assert "base" not in out
    with pytest.raises(RuntimeError, match="Missing key.*lora_b"):  # torch's strict loading: the same keys
        model.load_state_dict({"lora_a": state["lora_a"]})
    model.load_state_dict(state)                                      # the adapter alone loads strictly


def test_a_file_that_is_no_checkpoint_is_a_clear_error(tmp_path):
    from sfttool.config import ConfigError
    from sfttool.engine.checkpoint import check_checkpoint_fits

    torch.save(torch.ones(2), tmp_path / "iter_4.pth")
    with pytest.raises(ConfigError) as err:
        check_checkpoint_fits(tmp_path / "iter_4.pth", _Adapter())
    assert str(err.value) == (f"--resume {tmp_path}/iter_4.pth holds no state dict (not a checkpoint of sfttool "
                              "train); pass an iter_<N>.pth of the run to continue")
    (tmp_path / "iter_4.pth").write_text("not a checkpoint\n")  # torch.load cannot read it: one line too
    with pytest.raises(ConfigError) as err:
        check_checkpoint_fits(tmp_path / "iter_4.pth", _Adapter())
    assert str(err.value) == (f"--resume {tmp_path}/iter_4.pth: not an sfttool/mmengine checkpoint (torch.load "
                              "cannot read it); give an iter_<n>.pth file or DeepSpeed checkpoint folder from a "
                              "training work dir")
