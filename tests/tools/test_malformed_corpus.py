"""Every malformed-file kind through the built-in configs' loading (``data_path``, read through
``load_data_path`` inside ``validation_split``) and through an XTuner-style ``load_dataset`` config: the
same messages and counts from ``check-custom-dataset`` and ``train --dry-run``, the file named on every
row error, row numbers those of the user's file with and without held-out rows.

The built-in config is loaded by name with PART 1 settings given on the command line, as users do; the
XTuner-style one is a ``copy-cfg`` copy of it whose dataset line is edited to ``load_dataset``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sfttool.cli.main import cli
from sfttool.dataset.split import split_indices

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from malformed_corpus import CASES, OPENAI, chat, rows  # noqa: E402

BUILTIN = "qwen2_5_0_5b_instruct_lora_alpaca_e3"
SPLIT_LINE = ("    dataset=dict(type=validation_split, dataset=dict(type=load_data_path, path=data_path), "
              "part='train',\n                 val_ratio=val_ratio, max_val_rows=max_val_rows, "
              "val_data_path=val_data_path, seed=seed),\n")


@pytest.fixture(scope="module")
def xtuner_style(tmp_path_factory) -> Path:
    """The built-in config copied with `copy-cfg` and its dataset read by `load_dataset('json', ...)`."""
    folder = tmp_path_factory.mktemp("copy")
    result = CliRunner().invoke(cli, ["copy-cfg", BUILTIN, str(folder)])
    assert result.exit_code == 0, result.output
    path = folder / f"{BUILTIN}_copy.py"
    text = path.read_text()
    assert SPLIT_LINE in text and "val_ratio = 0.02 " in text
    text = text.replace(SPLIT_LINE, "    dataset=dict(type=load_dataset, path='json', data_files=data_path),\n")
    path.write_text("from datasets import load_dataset\n" + text.replace("val_ratio = 0.02 ", "val_ratio = 0 "))
    return path


def settings(model_dir, data, map_fn, val_ratio: float | None = None) -> list[str]:
    """PART 1 settings on the command line; ``val_ratio`` for the built-in config (the copy reads none)."""
    split = [] if val_ratio is None else [f"val_ratio={val_ratio}"]
    return ["--cfg-options", f"pretrained_model_name_or_path={model_dir}", f"data_path={data}",
            f"dataset_map_fn={map_fn!r}", *split, "evaluation_max_new_tokens=2", "report_to=[]"]


FINDINGS = ("ERROR:", "WARNING:", "dropped ", "changed ", "... and ", "FAILED:", "OK:")


def check(config, options) -> tuple[int, list[str]]:
    result = CliRunner().invoke(cli, ["check-custom-dataset", str(config), "--no-color", *options])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, [line for line in result.stdout.splitlines() if line.startswith(FINDINGS)]


def first_finding(found: list[str], expect: str) -> str:
    kind = expect.split(" ", 1)[0]
    return next((line for line in found if line.startswith(kind)), found[-1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_check_custom_dataset_says_the_same_on_both_paths(case, tmp_path, tiny_qwen2_dir, xtuner_style):
    path = case.write(tmp_path)
    builtin = check(BUILTIN, settings(tiny_qwen2_dir, path, case.map_fn, val_ratio=0))
    xtuner = check(xtuner_style, settings(tiny_qwen2_dir, path, case.map_fn))
    assert builtin == xtuner
    code, found = builtin
    if case.expect == "OK":
        assert code == 0 and found[-1] == "OK: 0 errors, 0 warnings", found
    else:
        expect = case.expect.replace("{path}", str(path))
        assert first_finding(found, expect).startswith(expect), found
        assert code == (1 if case.expect.startswith("ERROR") else 0)
    errors = [line for line in found if line.startswith("ERROR:") and ", row " in line]
    assert all(line.startswith(f"ERROR: {path}, ") for line in errors)  # the file is named on every row error


def train(config, options, work_dir) -> tuple[int, str]:
    """``(exit code, the one Error line)`` of ``train --dry-run``; the run's warnings in ``train.warnings``."""
    result = CliRunner().invoke(cli, ["train", str(config), "--dry-run", "--work-dir", str(work_dir), *options])
    assert "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == (result.exit_code != 0), result.output
    train.warnings = [line.split(" - WARNING - ", 1)[1] for line in result.output.splitlines()
                      if " - WARNING - Dataset: " in line]
    return result.exit_code, errors[0] if errors else ""


FAILING = [c for c in CASES if c.expect.startswith("ERROR") and not c.dropped]
RUNNING = [c for c in CASES if c not in FAILING]


@pytest.mark.slow
@pytest.mark.parametrize("case", FAILING, ids=lambda c: c.name)
def test_train_stops_with_the_same_one_line_on_both_paths(case, tmp_path, tiny_qwen2_dir, xtuner_style):
    path = case.write(tmp_path)
    builtin = train(BUILTIN, settings(tiny_qwen2_dir, path, case.map_fn, val_ratio=0), tmp_path / "a")
    assert builtin == train(xtuner_style, settings(tiny_qwen2_dir, path, case.map_fn), tmp_path / "b")
    code, error = builtin
    assert code == 1 and str(path) in error


@pytest.mark.slow
@pytest.mark.parametrize("case", RUNNING, ids=lambda c: c.name)
def test_train_runs_where_rows_are_fine_or_dropped_with_the_checks_words(case, tmp_path, tiny_qwen2_dir,
                                                                         xtuner_style):
    path = case.write(tmp_path)
    builtin = train(BUILTIN, settings(tiny_qwen2_dir, path, case.map_fn, val_ratio=0), tmp_path / "a")
    said = train.warnings
    assert builtin == train(xtuner_style, settings(tiny_qwen2_dir, path, case.map_fn), tmp_path / "b") == (0, "")
    assert said == train.warnings
    if case.dropped:  # the check's error and train's drop name one cause, in the same words
        assert f"Dataset: dropped 1 rows: {case.dropped} (row 1)" in said
        assert f"row 1: {case.dropped} (this row would be dropped)" in case.expect
    elif case.expect.startswith(("WARNING", "dropped")):
        assert any(case.expect.split(": ", 1)[-1] in line or case.expect in line for line in said), said


# ---------------------------------------------------------------------------
# Held-out rows: a bad row after a held-out one is still named by its row in the file.

BAD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]}
BAD_ROW = 5


@pytest.fixture
def held_out_file(tmp_path) -> Path:
    """8 rows, row 5 bad; val_ratio=0.1 with the built-in's seed 42 holds out row 3, before it."""
    assert split_indices(8, 1, seed=42)[1].tolist() == [3]
    path = tmp_path / "held_out.jsonl"
    path.write_text(rows(*[BAD if i == BAD_ROW else chat(f"Question {i}?") for i in range(8)]))
    return path


EXPECTED_ROW_ERROR = ("{}, row 5: dataset_map_fn openai_map_fn failed: MapFnError: openai_map_fn (messages[1]): "
                      "field 'content' must be a string, got int 5")


def test_a_held_out_row_before_a_bad_one_does_not_shift_its_number(held_out_file, tiny_qwen2_dir, xtuner_style):
    held_out = check(BUILTIN, settings(tiny_qwen2_dir, held_out_file, OPENAI, val_ratio=0.1))
    whole = check(xtuner_style, settings(tiny_qwen2_dir, held_out_file, OPENAI))
    assert held_out == whole == (1, ["ERROR: " + EXPECTED_ROW_ERROR.format(held_out_file),
                                     "FAILED: 1 errors, 0 warnings"])


@pytest.mark.slow
def test_train_names_the_row_of_the_file_after_a_held_out_row(held_out_file, tiny_qwen2_dir, xtuner_style, tmp_path):
    held_out = train(BUILTIN, settings(tiny_qwen2_dir, held_out_file, OPENAI, val_ratio=0.1), tmp_path / "a")
    whole = train(xtuner_style, settings(tiny_qwen2_dir, held_out_file, OPENAI), tmp_path / "b")
    assert held_out == whole == (1, "Error: " + EXPECTED_ROW_ERROR.format(held_out_file))


def test_a_held_out_bad_row_is_checked_too(tmp_path, tiny_qwen2_dir):
    """Training reads the held-out rows as well (validation): the check validates every row."""
    path = tmp_path / "bad_held_out.jsonl"
    path.write_text(rows(*[BAD if i == 3 else chat() for i in range(8)]))
    code, found = check(BUILTIN, settings(tiny_qwen2_dir, path, OPENAI, val_ratio=0.1))
    assert (code, found[0]) == (1, "ERROR: " + EXPECTED_ROW_ERROR.format(path).replace("row 5", "row 3"))


def test_errors_are_counted_by_row_and_say_how_many_were_listed(tmp_path, tiny_qwen2_dir):
    """41 failing rows said `FAILED: 11 errors` (10 listed, and the '... and 31 more' line counted as one)."""
    path = tmp_path / "many.jsonl"
    path.write_text(rows(*[BAD if i % 2 else chat() for i in range(82)]))
    code, found = check(BUILTIN, settings(tiny_qwen2_dir, path, OPENAI, val_ratio=0))
    assert code == 1 and len([line for line in found if line.startswith("ERROR:")]) == 10
    assert found[-2:] == ["... and 31 more rows with errors (--max-errors 10: raise it to list them)",
                          "FAILED: 41 errors (10 listed), 0 warnings"]


# ---------------------------------------------------------------------------
# Mixing: each dataset of a mix is loaded as a single one is.

MIX = '''
from sfttool.dataset import mix_datasets
second_data_path = {second!r}
second = dict(train_dataset, dataset={second_dataset})
train_dataloader = dict(train_dataloader, dataset=dict(type=mix_datasets, datasets=[train_dataset, second],
                                                       ratios=[1.0, 0.5], seed=seed))
'''


def mixed(config: Path, second: Path, builtin_loading: bool) -> Path:
    """``config`` with its dataset mixed with a second file's, read the way ``config`` reads its own."""
    second_dataset = ("dict(train_dataset['dataset'], dataset=dict(type=load_data_path, path=second_data_path))"
                      if builtin_loading else "dict(type=load_dataset, path='json', data_files=second_data_path)")
    path = second.with_name(f"mix_{config.stem}.py")
    text = config.read_text() + MIX.format(second=str(second), second_dataset=second_dataset)
    path.write_text(text.replace("from ._base_", "from sfttool.configs._base_"))
    return path


def test_a_mix_of_built_in_loaders_is_checked_and_trained_like_a_mix_of_load_dataset(tmp_path, tiny_qwen2_dir,
                                                                                     xtuner_style):
    from sfttool.config import find_config
    first = tmp_path / "first.jsonl"
    first.write_text(rows(*[chat(f"Question {i}?") for i in range(6)]))
    second = CASES[[c.name for c in CASES].index("cut_last_line.jsonl")].write(tmp_path)
    builtin = mixed(find_config(BUILTIN), second, builtin_loading=True)
    xtuner = mixed(xtuner_style, second, builtin_loading=False)
    expected = CASES[[c.name for c in CASES].index("cut_last_line.jsonl")].expect.replace("{path}", str(second))
    found = check(builtin, settings(tiny_qwen2_dir, first, OPENAI, val_ratio=0))
    assert found == check(xtuner, settings(tiny_qwen2_dir, first, OPENAI)) == \
        (1, [expected, "FAILED: 1 errors, 0 warnings"])
    trained = train(builtin, settings(tiny_qwen2_dir, first, OPENAI, val_ratio=0), tmp_path / "a")
    assert trained == train(xtuner, settings(tiny_qwen2_dir, first, OPENAI), tmp_path / "b") == \
        (1, "Error: " + expected.removeprefix("ERROR: "))
