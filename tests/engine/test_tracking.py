"""Trackers from report_to: each backend, offline on CPU, records the same scalars as the log file
(scalars.json), plus the config and the sample generations; a missing package is one line."""
from __future__ import annotations

import json
import struct

import pytest

from validation_helpers import validation_config

from sfttool.engine import tracking

HOOKS = ("[dict(type=ThroughputHook), dict(type='validation_helpers.RecordValMetrics'), dict(type=EvaluateChatHook, tokenizer=tokenizer, every_n_iters=None, "
         "evaluation_inputs=['Hi'], prompt_template=prompt_template, max_new_tokens=4)]")
TRACKED = ("loss", "lr", "grad_norm", "tokens_per_sec", "val/loss", "val/ppl")


TRACKERS = ("tensorboard", "wandb", "mlflow")
AVAILABLE = [name for name in TRACKERS if tracking._installed(name)]


def needs(name: str) -> None:
    if name not in AVAILABLE:
        pytest.skip(f"{name} is not installed (pip install 'sfttool[{name}]')")


def logged_scalars(vis_data) -> dict[str, dict[int, float]]:
    """key -> {step: value} from the log's scalars.json (the values every tracker must hold)."""
    out: dict[str, dict[int, float]] = {}
    for record in map(json.loads, (vis_data / "scalars.json").read_text().splitlines()):
        for key, value in record.items():
            if key not in ("step", "iter"):
                out.setdefault(key, {})[record["step"]] = value
    return out


def tracker_settings(names: list[str]) -> str:
    """report_to, except wandb: set as XTuner users do, through a lazily built visualizer in the
    config (its config upload failed on a Python config's classes there)."""
    lines = [f"report_to = {[n for n in names if n != 'wandb']!r}"]
    if "wandb" in names:
        lines += ["from mmengine.visualization import Visualizer, WandbVisBackend",
                  "visualizer = dict(type=Visualizer, vis_backends=[dict(type=WandbVisBackend)])"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_qwen2_dir, tiny_sft_jsonl):
    """One short run with validation, throughput, a sample generation and every installed tracker."""
    if not AVAILABLE:
        pytest.skip("no tracker is installed (pip install 'sfttool[trackers]')")
    from engine_helpers import write_config

    from sfttool.engine.train import train

    tmp = tmp_path_factory.mktemp("tracked")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        def tiny_config(name, **overrides):
            return write_config(tmp / name, tiny_qwen2_dir, tiny_sft_jsonl, **overrides)

        cfg = validation_config(tiny_config, val_interval=4, custom_hooks=HOOKS, save_steps=100,
                                extra=tracker_settings(AVAILABLE))
        work = train(str(cfg), work_dir=str(tmp / "w"))
    finally:
        mp.undo()
    (vis_data,) = work.glob("*/vis_data")
    return vis_data


@pytest.mark.slow
def test_val_loss_is_each_validations_own(tracked_run):
    """Not a mean over the validations before it (mmengine's log default for keys with 'loss')."""
    expected = logged_scalars(tracked_run)
    assert set(TRACKED) <= set(expected)
    metrics = [json.loads(line) for line in (tracked_run.parents[1] / "val_metrics.jsonl").read_text().splitlines()]
    assert expected["val/loss"] == {m["step"]: m["val/loss"] for m in metrics}
    assert len(set(expected["val/loss"].values())) == len(metrics) >= 3 and len(expected["loss"]) > 10


@pytest.mark.slow
@pytest.mark.parametrize("name", TRACKERS)
def test_the_tracker_holds_the_logged_scalars(tracked_run, name):
    needs(name)
    expected = logged_scalars(tracked_run)
    recorded = {"tensorboard": tensorboard_scalars, "wandb": wandb_scalars, "mlflow": mlflow_scalars}[name](tracked_run)
    for key, values in expected.items():
        assert recorded.get(key, {}).keys() == values.keys(), key
        for step, value in values.items():
            assert recorded[key][step] == pytest.approx(value, rel=1e-6), (key, step)


@pytest.mark.slow
def test_the_config_and_samples_are_recorded(tracked_run):
    for name in TRACKERS:
        needs(name)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked_run), size_guidance={"tensors": 0})
    events.Reload()
    texts = {tag: [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)]
             for tag in events.Tags()["tensors"]}
    assert "model = dict(" in texts["config/text_summary"][0]
    assert any("Hi" in text for text in texts["samples/text_summary"])
    (path,) = (tracked_run / "wandb").glob("offline-run-*/run-*.wandb")
    config = {item.key: json.loads(item.value_json) for record in _wandb_records(path)
              if record.WhichOneof("record_type") == "config" for item in record.config.update}
    model = config["model"].get("value", config["model"])  # (wandb may wrap a value as {"value": ...})
    assert model["type"].startswith("sfttool.model.") and model["type"].endswith(".SupervisedFinetune")  # by name
    samples = sorted(tracked_run.glob("mlflow_artifacts/*/artifacts/samples/step_*.txt"))
    assert samples and "Hi" in samples[-1].read_text()


def tensorboard_scalars(vis_data) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(vis_data), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def mlflow_scalars(vis_data) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{vis_data / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sfttool")
    (run,) = client.search_runs([experiment.experiment_id])
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            for key in run.data.metrics}


def wandb_scalars(vis_data) -> dict:
    """History rows of the offline run file; wandb's own history has no step of ours, so each row is
    matched to its step through the `step` logged beside it... which mmengine does not log: rows are
    taken in order and matched with scalars.json's lines, train and val alike."""
    (path,) = (vis_data / "wandb").glob("offline-run-*/run-*.wandb")
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in _wandb_records(path) if record.WhichOneof("record_type") == "history"]
    rows = [row for row in rows if set(row) & set(TRACKED)]
    lines = [r for r in map(json.loads, (vis_data / "scalars.json").read_text().splitlines())]
    assert len(rows) == len(lines)
    out: dict = {}
    for row, line in zip(rows, lines):
        for key, value in row.items():
            if not key.startswith("_"):
                out.setdefault(key, {})[line["step"]] = value
    return out


def _wandb_records(path) -> list:
    """The records of a .wandb file: a LevelDB-style log (7-byte header, 32 KiB blocks, records of
    checksum u32 + length u16 + type u8) of protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data, records, pending, pos = path.read_bytes(), [], b"", 7
    while pos + 7 <= len(data):
        block_left = 32768 - pos % 32768
        if block_left < 7:
            pos += block_left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_report_to_names_become_backends():
    from mmengine.config import Config
    from mmengine.visualization import LocalVisBackend, TensorboardVisBackend, Visualizer, WandbVisBackend

    assert tracking.tracker_names(["tensorboard", "none"]) == ["tensorboard"]
    cfg = tracking.visualizer_cfg(Config(), ("tensorboard",))
    assert cfg["type"] is tracking.TrackingVisualizer
    assert [b["type"] for b in cfg["vis_backends"]] == [LocalVisBackend, TensorboardVisBackend]
    assert tracking.tracker_names("none") == []
    assert [b["type"] for b in tracking.visualizer_cfg(Config(), ())["vis_backends"]] == [LocalVisBackend]
    # a config's own (lazily built) visualizer keeps its backends, gains report_to's and the plain config
    own = Config(dict(visualizer=dict(type=Visualizer, vis_backends=[dict(type=WandbVisBackend)])))
    cfg = tracking.visualizer_cfg(own, ("wandb",))
    assert cfg["type"] is tracking.TrackingVisualizer
    assert [b["type"] for b in cfg["vis_backends"]] == [WandbVisBackend, LocalVisBackend]


def test_unknown_tracker_and_missing_package_are_one_line(monkeypatch):
    from mmengine.config import Config

    with pytest.raises(tracking.TrackingError, match="unknown tracker 'comet'; choose from tensorboard, wandb, mlflow"):
        tracking.check_trackers(Config(dict(report_to=["comet"])))
    monkeypatch.setattr(tracking, "_installed", lambda package: package != "wandb")
    with pytest.raises(tracking.TrackingError) as error:
        tracking.check_trackers(Config(dict(report_to=["tensorboard", "wandb"])))
    assert str(error.value) == ("report_to: 'wandb' needs the wandb package, which is not installed: "
                                "pip install 'sfttool[wandb]' (or remove 'wandb' from report_to)")


@pytest.mark.parametrize("installed", [False, True])
def test_auto_is_tensorboard_where_it_is_installed_and_nothing_elsewhere(monkeypatch, installed):
    """report_to='auto' (the built-ins' setting) never asks for a package: on the base install it is no
    tracker, and the summary's sentence says so and how to turn TensorBoard on."""
    from mmengine.config import Config
    from mmengine.visualization import LocalVisBackend, TensorboardVisBackend

    monkeypatch.setattr(tracking, "_installed", lambda package: installed)
    for report_to in ("auto", ["auto"], ["auto", "tensorboard"] if installed else ["auto", "none"]):
        cfg = Config(dict(report_to=report_to))
        tracking.check_trackers(cfg)
        assert tracking.tracker_names(report_to) == (["tensorboard"] if installed else [])
        backends = tracking.visualizer_cfg(cfg, tuple(tracking.tracker_names(report_to)))["vis_backends"]
        assert [b["type"] for b in backends] == [LocalVisBackend] + ([TensorboardVisBackend] if installed else [])
        assert tracking.auto_tracking_note(cfg) == (
            " report_to='auto': tensorboard is on (installed)." if installed else
            " report_to='auto': tensorboard is off, as its package is not installed "
            "(pip install 'sfttool[tensorboard]' turns it on).")
    # Only 'auto' adds a sentence to the summary: a named tracker is there or stops the run.
    assert [tracking.auto_tracking_note(Config(dict(report_to=r))) for r in (None, [], "none", ["wandb"])] == [""] * 4


@pytest.mark.slow
@pytest.mark.parametrize("installed", [False, True])
def test_a_run_with_auto_trains_on_the_base_install_and_says_what_it_tracks(tmp_path, tiny_config, monkeypatch,
                                                                          capsys, installed):
    """The case of a copied built-in's first run on the base install (no tensorboard): it trains, and the
    summary says TensorBoard is off; where tensorboard is installed the run writes its event files."""
    from mmengine.config import Config

    from sfttool.engine.train import train

    if installed:
        needs("tensorboard")
    monkeypatch.setattr(tracking, "_installed", lambda package: installed)
    cfg = tiny_config()
    cfg.write_text(cfg.read_text() + "report_to = 'auto'\n")
    work = train(str(cfg), work_dir=str(tmp_path / "w"), max_steps=1)
    summary = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[sfttool] Training "))
    assert summary.endswith(tracking.auto_tracking_note(Config(dict(report_to="auto"))))
    (vis_data,) = work.glob("*/vis_data")
    assert (vis_data / "scalars.json").is_file()
    assert bool(list(vis_data.glob("events.out.tfevents.*"))) is installed


def test_missing_package_stops_before_training(tmp_path, tiny_config, monkeypatch):
    from sfttool.engine.train import train

    monkeypatch.setattr(tracking, "_installed", lambda package: False)
    cfg = validation_config(tiny_config, extra="report_to = ['mlflow']\n")
    with pytest.raises(tracking.TrackingError, match=r"pip install 'sfttool\[mlflow\]'"):
        train(str(cfg), work_dir=str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def test_plain_config_names_classes():
    from mmengine.config import Config

    from sfttool.model import SupervisedFinetune

    plain = tracking.plain_config(Config(dict(model=dict(type=SupervisedFinetune, r=(8, 16)))))
    assert plain.to_dict() == {"model": {"type": "sfttool.model.sft.SupervisedFinetune", "r": [8, 16]}}
