"""Prompt datasets for online RL: the three ways to give a prompt, rendering with the chat template and
the generation prompt (Qwen3's enable_thinking honoured), the other columns kept for the rewards, and the
checks: a prompt ending with an assistant message, a prompt over max_prompt_length (refused, truncated or
dropped, and counted)."""
from __future__ import annotations

from pathlib import Path

import pytest

from sfttool import assets
from sfttool.dataset.data_path import load_data_path
from sfttool.dataset.errors import ROW_COLUMN, DatasetError
from sfttool.dataset.map_fns import MapFnError, gsm8k_map_fn, math_map_fn
from sfttool.dataset.prompts import build_prompt_dataset, reward_columns, run_prompt_pipeline
from sfttool.utils.templates import PROMPT_TEMPLATE

TEMPLATES = Path(__file__).resolve().parents[1] / "assets" / "templates"
CONVERSATIONAL = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                   "solution": "4"},
                  {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                              {"role": "user", "content": "3+4?"}], "solution": "7"}]


def source(tmp_path, rows, name="prompts.jsonl"):
    return dict(type=load_data_path, path=str(assets.write_jsonl(tmp_path / name, rows)))


def generation_prompt_ids(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)["input_ids"]


def test_conversational_prompts_render_with_the_chat_template_and_the_generation_prompt(tmp_path, tiny_tokenizer):
    ds = build_prompt_dataset(source(tmp_path, CONVERSATIONAL), tiny_tokenizer, max_prompt_length=64)
    for row, raw in zip(ds, CONVERSATIONAL):
        assert row["prompt_ids"] == generation_prompt_ids(tiny_tokenizer, raw["prompt"])
        assert row["prompt"] == raw["prompt"] and row["solution"] == raw["solution"]  # as the data gave them
    assert tiny_tokenizer.decode(ds[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert reward_columns(ds) == ["solution"]


def test_a_plain_string_prompt_is_one_user_message_and_system_is_put_first(tmp_path, tiny_tokenizer):
    ds = build_prompt_dataset(source(tmp_path, [{"prompt": "2+2?", "id": 3}]), tiny_tokenizer, max_prompt_length=64,
                              system="Think step by step.")
    expected = [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "2+2?"}]
    assert ds[0]["prompt_ids"] == generation_prompt_ids(tiny_tokenizer, expected)
    assert ds[0]["prompt"] == "2+2?" and reward_columns(ds) == ["id"]
    # a prompt that has its own system message keeps it
    ds = build_prompt_dataset(source(tmp_path, CONVERSATIONAL[:1]), tiny_tokenizer, max_prompt_length=64,
                              system="Ignored.")
    assert ds[0]["prompt_ids"] == generation_prompt_ids(tiny_tokenizer, CONVERSATIONAL[0]["prompt"])


def test_map_fns_for_gsm8k_and_math_rows(tmp_path, tiny_tokenizer):
    gsm8k = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 1,007"}]
    ds = build_prompt_dataset(source(tmp_path, gsm8k), tiny_tokenizer, max_prompt_length=64,
                              dataset_map_fn=gsm8k_map_fn)
    assert ds[0]["solution"] == "1007" and reward_columns(ds) == ["question", "answer", "solution"]
    assert ds[0]["prompt_ids"] == generation_prompt_ids(tiny_tokenizer, [{"role": "user", "content": gsm8k[0]["question"]}])
    math = [{"problem": "What is $1/2+1/2$?", "solution": "It is $\\boxed{1}$."}]
    ds = build_prompt_dataset(source(tmp_path, math, "math.jsonl"), tiny_tokenizer, max_prompt_length=64,
                              dataset_map_fn="math_map_fn")
    assert ds[0]["solution"] == math[0]["solution"] and ds[0]["prompt"] == [{"role": "user", "content": math[0]["problem"]}]
    with pytest.raises(MapFnError, match="gsm8k_map_fn: field 'answer' has no '#### <final answer>' line"):
        gsm8k_map_fn({"question": "q", "answer": "7"})
    with pytest.raises(MapFnError, match="math_map_fn: field 'solution' has no \\\\boxed"):
        math_map_fn({"problem": "q", "solution": "7"})


def test_an_xtuner_template_renders_the_prompt_as_chat_does(tmp_path, tiny_tokenizer):
    from sfttool.dataset.encode import encode_prompt
    ds = build_prompt_dataset(source(tmp_path, CONVERSATIONAL), tiny_tokenizer, max_prompt_length=64,
                              prompt_template=PROMPT_TEMPLATE.qwen_chat)
    history = [{"input": "Hi", "output": "Hello!", "output_with_loss": False}, {"input": "3+4?"}]
    assert ds[1]["prompt_ids"] == encode_prompt(history, tiny_tokenizer, PROMPT_TEMPLATE.qwen_chat)


def test_an_xtuner_template_joins_a_prompts_messages_of_one_role_as_sft_does(tmp_path, tiny_tokenizer):
    """Two system messages and two user messages in a row: the prompt is SFT's conversation of the same
    messages (openai_map_fn) without its answer."""
    from sfttool.dataset.encode import encode_prompt
    from sfttool.dataset.map_fns import openai_map_fn
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use digits."},
              {"role": "user", "content": "2+2?"}, {"role": "user", "content": "And 3+3?"}]
    ds = build_prompt_dataset(source(tmp_path, [{"prompt": prompt}]), tiny_tokenizer, max_prompt_length=64,
                              prompt_template=PROMPT_TEMPLATE.qwen_chat)
    turn, = openai_map_fn({"messages": prompt + [{"role": "assistant", "content": "4 and 6"}]})["conversation"]
    assert turn["system"] == "Be brief.\n\nUse digits." and turn["input"] == "2+2?\n\nAnd 3+3?"
    history = [{"system": turn["system"], "input": turn["input"]}]
    assert ds[0]["prompt_ids"] == encode_prompt(history, tiny_tokenizer, PROMPT_TEMPLATE.qwen_chat)


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    folder = tmp_path_factory.mktemp("qwen3")
    return AutoTokenizer.from_pretrained(assets.build_chat_tokenizer(
        folder, "qwen", (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()))


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_qwen3_enable_thinking_is_honoured(tmp_path, qwen3_tokenizer, enable_thinking):
    template = dict(PROMPT_TEMPLATE.hf_chat_template, ENABLE_THINKING=enable_thinking)
    ds = build_prompt_dataset(source(tmp_path, [{"prompt": "2+2?"}]), qwen3_tokenizer, max_prompt_length=64,
                              prompt_template=template)
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    assert ds[0]["prompt_ids"] == generation_prompt_ids(qwen3_tokenizer, [{"role": "user", "content": "2+2?"}],
                                                        **kwargs)
    text = qwen3_tokenizer.decode(ds[0]["prompt_ids"])
    assert text.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)
    # the built-in chat format renders the same prompt without the tokenizer's jinja
    builtin = PROMPT_TEMPLATE.qwen3_no_think if enable_thinking is False else PROMPT_TEMPLATE.qwen3
    ds = build_prompt_dataset(source(tmp_path, [{"prompt": "2+2?"}], "b.jsonl"), qwen3_tokenizer,
                              max_prompt_length=64, prompt_template=builtin)
    assert qwen3_tokenizer.decode(ds[0]["prompt_ids"]) == text


@pytest.mark.parametrize("rows,message", [
    ([{"prompt": "ok"}, {"prompt": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}],
     "row 1, field 'prompt': the prompt ends with an assistant message; a prompt ends with the message the model "
     "answers (a user message): remove the answer from the prompt"),
    ([{"prompt": 3}], "row 0, field 'prompt': expected a string or a non-empty list of messages"),
    ([{"question": "Q"}], "prompt rows need a `prompt` column (columns: question); set a dataset_map_fn such as "
                          "gsm8k_map_fn (question/answer) or math_map_fn (problem/solution)"),
])
def test_bad_prompts_are_errors_naming_the_row(tmp_path, tiny_tokenizer, rows, message):
    with pytest.raises(DatasetError) as err:
        build_prompt_dataset(source(tmp_path, rows), tiny_tokenizer, max_prompt_length=64)
    assert message in str(err.value)


LENGTHS = [{"prompt": "one"}, {"prompt": "one two three four five six seven eight nine ten " * 3}, {"prompt": "two"},
           {"prompt": "the river and the city at night, " * 4}]


def test_a_prompt_over_max_prompt_length_is_an_error_naming_the_rows(tmp_path, tiny_tokenizer):
    with pytest.raises(DatasetError) as err:
        build_prompt_dataset(source(tmp_path, LENGTHS), tiny_tokenizer, max_prompt_length=20)
    assert "prompts.jsonl: 2 prompts are longer than max_prompt_length=20 tokens (row 1, row 3; the longest has" \
        in str(err.value)
    assert str(err.value).endswith("raise max_prompt_length, or set prompt_overflow='truncate' (keep each prompt's "
                                   "last max_prompt_length tokens) or 'drop'")


def test_truncate_keeps_each_long_prompts_last_tokens_and_counts_them(tmp_path, tiny_tokenizer):
    ds, report = run_prompt_pipeline(source(tmp_path, LENGTHS), tiny_tokenizer, 20, prompt_overflow="truncate")
    full = [generation_prompt_ids(tiny_tokenizer, [{"role": "user", "content": r["prompt"]}]) for r in LENGTHS]
    assert ds["prompt_ids"] == [ids if len(ids) <= 20 else ids[-20:] for ids in full]
    assert ds["prompt_tokens"] == [len(ids) for ids in full]
    assert (report.truncated, report.dropped, report.prompts) == (2, {}, 4)


def test_drop_leaves_long_prompts_out_and_counts_them(tmp_path, tiny_tokenizer):
    ds, report = run_prompt_pipeline(source(tmp_path, LENGTHS), tiny_tokenizer, 20, prompt_overflow="drop")
    assert ds[ROW_COLUMN] == [0, 2] and report.dropped == {"prompt longer than max_prompt_length": 2}
    assert report.prompts == 2 and report.rows_in == 4
    with pytest.raises(DatasetError, match="no prompts left to train on \\(4 over max_prompt_length=2 dropped\\)"):
        run_prompt_pipeline(source(tmp_path, LENGTHS), tiny_tokenizer, 2, prompt_overflow="drop")
    with pytest.raises(DatasetError, match="prompt_overflow must be one of error, truncate, drop, got 'cut'"):
        run_prompt_pipeline(source(tmp_path, LENGTHS), tiny_tokenizer, 20, prompt_overflow="cut")


def test_max_dataset_length_keeps_a_seeded_subset_and_counts_the_rest(tmp_path, tiny_tokenizer):
    rows = [{"prompt": f"q{i}"} for i in range(10)]
    a, report = run_prompt_pipeline(source(tmp_path, rows), tiny_tokenizer, 20, max_dataset_length=4, seed=1)
    b, _ = run_prompt_pipeline(source(tmp_path, rows), tiny_tokenizer, 20, max_dataset_length=4, seed=1)
    assert a[ROW_COLUMN] == b[ROW_COLUMN] and len(a) == 4
    assert report.dropped == {"not in the max_dataset_length subset": 6}


def test_a_prompt_config_that_asks_for_validation_is_refused_in_one_line():
    from sfttool.dataset.prompts import validation_problems as validate_config  # engine.checks runs it
    cfg = dict(model=dict(type="GRPO"), optim_wrapper=dict(optimizer=dict(lr=1e-4)), train_cfg=dict(max_epochs=1),
               train_dataloader=dict(batch_size=1, dataset=dict(type=build_prompt_dataset)), val_ratio=0.1)
    assert validate_config(cfg, "grpo.py") == [
        "grpo.py: val_ratio: online RL (GRPO) has no validation yet (the validation loop measures the SFT token loss "
        "of answers, and prompts have none); remove val_ratio (or set them to None)"]
    assert validate_config(dict(cfg, val_ratio=None), "grpo.py") == []
