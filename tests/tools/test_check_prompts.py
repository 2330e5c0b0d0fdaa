"""`sfttool check-custom-dataset` on a prompt (online RL) config: each shown prompt is exactly the text
generation continues from, with the columns the reward functions receive; every row is checked."""
from __future__ import annotations

from click.testing import CliRunner

from sfttool import assets
from sfttool.cli.main import cli

CONFIG = """
from transformers import AutoTokenizer
from sfttool.dataset import build_prompt_dataset
from sfttool.dataset.data_path import load_data_path

tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path={tok!r})
train_dataset = dict(type=build_prompt_dataset, dataset=dict(type=load_data_path, path={data!r}),
                     tokenizer=tokenizer, max_prompt_length={max_prompt_length}, dataset_map_fn={map_fn})
train_dataloader = dict(batch_size=2, dataset=train_dataset)
"""

GSM8K = [{"question": f"What is {a} plus {a + 1}?", "answer": f"{a} + {a + 1} = {2 * a + 1}\n#### {2 * a + 1}"}
         for a in range(5)]


def check(tmp_path, tok_dir, rows, map_fn="'gsm8k_map_fn'", max_prompt_length=64):
    data = assets.write_jsonl(tmp_path / "prompts.jsonl", rows)
    cfg = tmp_path / "cfg.py"
    cfg.write_text(CONFIG.format(tok=str(tok_dir), data=str(data), map_fn=map_fn, max_prompt_length=max_prompt_length))
    return CliRunner().invoke(cli, ["check-custom-dataset", str(cfg)])


def test_prompts_are_shown_as_the_model_sees_them_with_the_reward_columns(tmp_path, tiny_tokenizer_dir,
                                                                         tiny_tokenizer):
    result = check(tmp_path, tiny_tokenizer_dir, GSM8K)
    assert result.exit_code == 0, result.output
    rendered = tiny_tokenizer.apply_chat_template([{"role": "user", "content": GSM8K[0]["question"]}],
                                                  add_generation_prompt=True, tokenize=False)
    ids = tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert (f"== prompt of row 0 as the model sees it ({len(ids)} tokens; the completion follows the last line) ==\n"
            f"{tiny_tokenizer.decode(ids)}\n") in result.output
    assert ("reward functions receive: prompts=[{'role': 'user', 'content': 'What is 0 plus 1?'}], "
            "question='What is 0 plus 1?', answer='0 + 1 = 1\\n#### 1', solution='1'") in result.output
    assert "(2 more prompts are rendered the same way)" in result.output
    assert "rows in: 5   prompts: 5" in result.output
    assert "generation rounds per epoch (batch_size=2 prompts per round, one process): 3" in result.output
    assert result.output.rstrip().endswith("OK: 0 errors, 0 warnings")


def test_every_bad_row_is_listed_with_its_number(tmp_path, tiny_tokenizer_dir):
    rows = [{"prompt": "fine"}, {"prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
            {"prompt": "also fine"}, {"question": "no prompt"}]
    result = check(tmp_path, tiny_tokenizer_dir, rows, map_fn="None")
    assert result.exit_code == 1
    assert "prompts.jsonl, row 1, field 'prompt': the prompt ends with an assistant message" in result.output
    assert "prompts.jsonl, row 3: no `prompt`; set a dataset_map_fn for this format" in result.output
    assert "FAILED: 2 errors" in result.output


def test_prompts_over_max_prompt_length_are_an_error(tmp_path, tiny_tokenizer_dir):
    result = check(tmp_path, tiny_tokenizer_dir, GSM8K, max_prompt_length=10)
    assert result.exit_code == 1
    assert "5 prompts are longer than max_prompt_length=10 tokens (row 0, row 1, row 2, row 3, row 4;" in result.output
