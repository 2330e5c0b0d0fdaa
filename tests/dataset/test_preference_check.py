"""`sfttool check-custom-dataset` on a preference config: every row validated, a chosen and a
rejected sequence shown with their masked parts, counts by reason, exit codes."""
from __future__ import annotations

from click.testing import CliRunner

from sfttool import assets
from sfttool.cli.main import cli

CONFIG = """
from datasets import load_dataset
from transformers import AutoTokenizer
from sfttool.dataset import build_preference_dataset

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path={tok!r})
train_dataset = dict(
    type=build_preference_dataset,
    dataset=dict(type=load_dataset, path='json', data_files={data!r}),
    tokenizer=tokenizer, max_length=48, max_packed_length=256, dataset_map_fn={map_fn})
train_dataloader = dict(batch_size=2, dataset=train_dataset)
"""


def pair(question, good, bad):
    return {"prompt": [{"role": "user", "content": question}], "chosen": [{"role": "assistant", "content": good}],
            "rejected": [{"role": "assistant", "content": bad}]}


def check(tmp_path, tok_dir, rows, map_fn="None"):
    data = assets.write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = tmp_path / "cfg.py"
    cfg.write_text(CONFIG.format(tok=str(tok_dir), data=str(data), map_fn=map_fn))
    return CliRunner().invoke(cli, ["check-custom-dataset", str(cfg)])


def test_good_pairs_show_both_sides_and_the_counts(tmp_path, tiny_tokenizer_dir):
    rows = [pair(f"question {i}?", f"answer {i}.", "no.") for i in range(6)]
    rows.append(pair("same?", "yes.", "yes."))
    result = check(tmp_path, tiny_tokenizer_dir, rows)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Validating all 7 rows" in out
    assert ("== chosen (pair 0: " in out) and ("== rejected (pair 0: " in out)
    assert "[MASKED:<|im_start|>user\nquestion 0?<|im_end|>\n<|im_start|>assistant\n]answer 0.<|im_end|>" in out
    assert "]no.<|im_end|>" in out
    assert "rows in: 7   pairs: 6   rows out: 1" in out
    assert "dropped: 1 pairs (chosen and rejected answers are identical)" in out
    assert "iterations per epoch (batch_size=2, one process): 1" in out
    assert out.rstrip().endswith("OK: 0 errors, 0 warnings")


def test_every_bad_row_is_listed_and_the_exit_code_is_1(tmp_path, tiny_tokenizer_dir):
    rows = [pair("q?", "a.", "b."),
            {"prompt": [{"role": "user", "content": "q"}], "chosen": "a string", "rejected": []},
            {"prompt": [{"role": "assistant", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]}]
    result = check(tmp_path, tiny_tokenizer_dir, rows)
    assert result.exit_code == 1
    assert "row 1, field 'chosen': expected a non-empty list of messages" in result.output
    assert "row 2, field 'prompt': the prompt must end with a user message" in result.output
    assert "FAILED: 2 errors" in result.output


def test_a_map_fn_is_applied_before_the_checks(tmp_path, tiny_tokenizer_dir):
    rows = [{"prompt": "q?", "chosen": "a.", "rejected": "b."}]
    assert check(tmp_path, tiny_tokenizer_dir, rows).exit_code == 1  # strings need the map fn
    result = check(tmp_path, tiny_tokenizer_dir, rows, map_fn="'preference_strings_map_fn'")
    assert result.exit_code == 0, result.output
    assert "== after dataset_map_fn (row 0) ==" in result.output
