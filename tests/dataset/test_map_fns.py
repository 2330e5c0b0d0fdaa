"""Dataset map fns (raw format -> standard conversation) and template_map_fn."""
from __future__ import annotations

import json

import copy
import pickle

import pytest

from sfttool.dataset import map_fns
from sfttool.dataset.map_fns import (MapFnError, alpaca_map_fn, alpaca_zh_map_fn, arxiv_map_fn, code_alpaca_map_fn,
                                     colors_map_fn, crime_kg_assitant_map_fn, default_map_fn, law_reference_map_fn,
                                     medical_map_fn, oasst1_map_fn, openai_map_fn, openorca_map_fn, pretrain_map_fn,
                                     sharegpt_map_fn, sql_map_fn, stack_exchange_map_fn, template_map_fn,
                                     template_map_fn_factory, tiny_codes_map_fn, wizardlm_map_fn)
from sfttool.registry import MAP_FUNC, build
from sfttool.utils import PROMPT_TEMPLATE, SYSTEM_TEMPLATE

RAW_FORMAT_FNS = [
    "alpaca_map_fn", "alpaca_zh_map_fn", "oasst1_map_fn", "openai_map_fn", "wizardlm_map_fn", "code_alpaca_map_fn",
    "openorca_map_fn", "sql_map_fn", "medical_map_fn", "law_reference_map_fn", "crime_kg_assitant_map_fn",
    "arxiv_map_fn", "colors_map_fn", "stack_exchange_map_fn", "tiny_codes_map_fn", "default_map_fn",
    "pretrain_map_fn", "sharegpt_map_fn", "msagent_map_fn",
]


def one_turn(input, output, system=None):
    turn = {"system": system} if system is not None else {}
    turn.update(input=input, output=output)
    return {"conversation": [turn]}


@pytest.mark.parametrize("name", RAW_FORMAT_FNS)
def test_registered_and_exported_by_name(name):
    fn = getattr(map_fns, name)
    assert MAP_FUNC.get(name) is fn
    assert name in map_fns.__all__
    assert fn.__doc__ and ">>>" in fn.__doc__


# --- one realistic raw row per format, exact output ---------------------------------------------

def test_alpaca():
    row = {"instruction": "Give three tips for staying healthy.", "input": "",
           "output": "1. Eat a balanced diet.\n2. Exercise.\n3. Sleep well."}
    assert alpaca_map_fn(row) == one_turn("Give three tips for staying healthy.\n",
                                          "1. Eat a balanced diet.\n2. Exercise.\n3. Sleep well.")
    row = {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"}
    assert alpaca_map_fn(row) == one_turn("Translate to French.\nGood morning", "Bonjour")
    assert alpaca_map_fn({"instruction": "x", "input": None, "output": "y"}) == one_turn("x\n", "y")
    assert alpaca_map_fn({"instruction": "x", "input": "", "output": "<nooutput>"}) == {"conversation": []}


def test_alpaca_zh():
    row = {"instruction_zh": "把这句话翻译成英文。", "input_zh": "你好", "output_zh": "Hello",
           "instruction": "ignored", "input": "", "output": "ignored"}
    assert alpaca_zh_map_fn(row) == one_turn("把这句话翻译成英文。\n你好", "Hello")


def test_oasst1():
    # Rows alternate Human/Assistant, as the whole dataset does: XTuner 0.2's output, unchanged.
    row = {"text": "### Human: Can you explain contrastive learning?"
                   "### Assistant: Sure! It pulls similar pairs together."
                   "### Human: And negatives?### Assistant: They are pushed apart."
                   "### Human: Thanks"}
    assert oasst1_map_fn(row) == {"conversation": [
        {"input": "Can you explain contrastive learning?", "output": "Sure! It pulls similar pairs together."},
        {"input": "And negatives?", "output": "They are pushed apart."},
    ]}


def test_oasst1_pairs_by_speaker():
    # XTuner paired segments by position: this row trained the human's question as the answer.
    row = {"text": "### Assistant: Hello, how can I help?### Human: What is 2+2?### Assistant: 4"}
    assert oasst1_map_fn(row) == one_turn("What is 2+2?", "4")


def test_oasst1_joins_consecutive_segments_of_one_speaker_as_sharegpt():
    row = {"text": "### Human: A### Human: B### Assistant: C### Assistant: D### Human: E### Assistant: F"}
    joined = _messages(("user", "A"), ("user", "B"), ("assistant", "C"), ("assistant", "D"))
    assert oasst1_map_fn(row) == {"conversation": [{"input": "A\n\nB", "output": "C\n\nD", "messages": joined},
                                                   {"input": "E", "output": "F"}]}
    messages = [{"from": "human", "value": "A"}, {"from": "human", "value": "B"}, {"from": "gpt", "value": "C"}]
    assert oasst1_map_fn({"text": "### Human: A### Human: B### Assistant: C"}) == sharegpt_map_fn(
        {"conversations": messages})


def test_oasst1_without_an_answered_question_is_an_empty_conversation():
    assert oasst1_map_fn({"text": "### Human: Q1### Assistant: A1### Human: Q2### Human: Q3"}) == one_turn("Q1", "A1")
    for text in ("### Human: Unanswered", "### Assistant: Hello!", "### Assistant: Hi### Human: Bye", ""):
        assert oasst1_map_fn({"text": text}) == {"conversation": []}


def test_oasst1_markdown_heading_in_an_answer_is_kept_whole():
    # Split at every `###`, the answer was cut at the heading and the steps silently dropped.
    row = {"text": "### Human: How do I install it?### Assistant: Like this.\n### Steps\n1. a"
                   "### Human: Thanks!### Assistant: You're welcome."}
    assert oasst1_map_fn(row) == {"conversation": [
        {"input": "How do I install it?", "output": "Like this.\n### Steps\n1. a"},
        {"input": "Thanks!", "output": "You're welcome."},
    ]}


def _without_messages(result):
    """A map fn's turns without ``messages`` (the messages a run of one role was joined from)."""
    return {"conversation": [{k: v for k, v in turn.items() if k != "messages"} for turn in result["conversation"]]}


def _messages(*pairs, loss=None):
    """``messages`` JSON text as the map fns write it: ``(role, text)`` pairs, ``loss`` per assistant message."""
    loss = list(loss or [])
    out = [{"role": role, "content": text, **({"loss": loss.pop(0)} if loss and role == "assistant" else {})}
           for role, text in pairs]
    return json.dumps(out, ensure_ascii=False)


def _oasst1_split_at_every_hash(text):
    """The previous segmentation (split at every `###`), paired as oasst1_map_fn pairs."""
    merged = []
    for segment in text.strip().split("###"):
        segment = segment.strip()
        for speaker in ("Human", "Assistant"):
            if segment.startswith(f"{speaker}:"):
                body = segment[len(speaker) + 1:].strip()
                if merged and merged[-1][0] == speaker:
                    merged[-1] = (speaker, merged[-1][1] + "\n\n" + body)
                else:
                    merged.append((speaker, body))
    while merged and merged[0][0] == "Assistant":
        merged.pop(0)
    return {"conversation": [{"input": q, "output": a} for (_, q), (_, a) in zip(merged[0::2], merged[1::2])]}


@pytest.mark.parametrize("text", [
    "### Human: Q1### Assistant: A1### Human: Q2### Assistant: A2",
    "  ### Human:Q\n\n###\nAssistant:  A \n",
    "Human: Q### Assistant: A",
    "preamble ### Human: Q### Assistant: A### Human: unanswered",
    "### Assistant: hi### Human: Q### Human: more### Assistant: A",
])
def test_oasst1_rows_without_other_hashes_are_split_as_before(text):
    assert _without_messages(oasst1_map_fn({"text": text})) == _oasst1_split_at_every_hash(text)
    assert oasst1_map_fn({"text": text})["conversation"]


def test_openai():
    row = {"messages": [
        {"role": "assistant", "content": "Hi! How can I help?"},  # leading assistant: skipped
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "loss": "False"},
        {"role": "user", "content": "And Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "unanswered"},
    ]}
    assert openai_map_fn(row) == {"conversation": [
        {"system": "You are terse.", "input": "Capital of France?", "output": "Paris.", "output_with_loss": False},
        {"input": "And Italy?", "output": "Rome.", "output_with_loss": True},
    ]}


def test_openai_consecutive_messages_of_one_role_are_joined_with_a_blank_line_and_noted():
    # Glued without a separator ("ab"), two messages read as one word; an assistant message after another
    # became a turn with an empty question.
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "c", "loss": True},
                        {"role": "assistant", "content": "d", "loss": False}]}
    notes = []
    # A prompt template renders the joined text; a chat template gets the messages as written, each
    # answer with its own loss flag.
    as_written = _messages(("user", "a"), ("user", "b"), ("assistant", "c"), ("assistant", "d"), loss=[True, False])
    assert openai_map_fn(row, notes) == {"conversation": [{"input": "a\n\nb", "output": "c\n\nd",
                                                           "output_with_loss": True, "messages": as_written}]}
    assert notes == ["two user messages in a row (a prompt template joins them with a blank line; "
                     "a chat template gets them as written)",
                     "two assistant messages in a row (a prompt template joins them with a blank line; "
                     "a chat template gets them as written)"]


@pytest.mark.parametrize("fn, row", [
    (sharegpt_map_fn, {"conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Q"},
                                         {"from": "gpt", "value": "A"}, {"from": "human", "value": "more?"}]}),
    (openai_map_fn, {"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Q"},
                                  {"role": "assistant", "content": "A"}, {"role": "user", "content": "more?"}]}),
    (oasst1_map_fn, {"text": "### Assistant: Hi!### Human: Q### Assistant: A### Human: more?"}),
    (wizardlm_map_fn, {"conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Q"},
                                         {"from": "gpt", "value": "A"}, {"from": "human", "value": "more?"}]}),
])
def test_message_map_fns_note_what_they_dropped(fn, row):
    notes = []
    conversation = fn(row, notes)["conversation"]
    assert [(t["input"], t["output"]) for t in conversation] == [("Q", "A")]
    assert notes == ["conversation starts with an assistant message (dropped: nothing asked it)",
                     "final user message without an answer (dropped)"]
    assert fn(row) == fn(row, [])  # notes change nothing in the row


def test_wizardlm():
    row = {"idx": "1", "conversations": [
        {"from": "gpt", "value": "ignored greeting"},
        {"from": "human", "value": "Write a haiku about rain."},
        {"from": "gpt", "value": "Soft rain on the roof"},
        {"from": "human", "value": "Another?"},
        {"from": "gpt", "value": "Puddles hold the sky"},
    ]}
    assert wizardlm_map_fn(row) == {"conversation": [
        {"input": "Write a haiku about rain.", "output": "Soft rain on the roof"},
        {"input": "Another?", "output": "Puddles hold the sky"},
    ]}


def test_code_alpaca():
    row = {"prompt": "Create a function that adds two numbers.", "completion": "def add(a, b):\n    return a + b"}
    assert code_alpaca_map_fn(row) == one_turn("Create a function that adds two numbers.",
                                               "def add(a, b):\n    return a + b", SYSTEM_TEMPLATE.coder)


def test_openorca():
    row = {"id": "niv.1", "system_prompt": "You are an AI assistant.", "question": "What is 2+2?", "response": "4"}
    assert openorca_map_fn(row) == one_turn("What is 2+2?", "4", "You are an AI assistant.")
    row["system_prompt"] = ""
    assert openorca_map_fn(row) == one_turn("What is 2+2?", "4", "")


def test_sql():
    row = {"context": "CREATE TABLE head (age INTEGER)", "question": "How many heads are older than 56?",
           "answer": "SELECT COUNT(*) FROM head WHERE age > 56"}
    assert sql_map_fn(row) == one_turn("CREATE TABLE head (age INTEGER)\nHow many heads are older than 56?",
                                       "SELECT COUNT(*) FROM head WHERE age > 56", SYSTEM_TEMPLATE.sql)


def test_medical():
    row = {"instruction": "我头痛，怎么办？", "input": "持续两天", "output": "建议休息并就医。"}
    assert medical_map_fn(row) == one_turn("我头痛，怎么办？\n持续两天", "建议休息并就医。", SYSTEM_TEMPLATE.medical)


def test_law_reference():
    row = {"question": "合同无效的情形有哪些？", "answer": "违反法律强制性规定的合同无效。", "reference": ["民法典"]}
    assert law_reference_map_fn(row) == one_turn("合同无效的情形有哪些？", "违反法律强制性规定的合同无效。",
                                                 SYSTEM_TEMPLATE.lawyer)


def test_crime_kg_assitant():
    row = {"input": "盗窃罪如何量刑？", "output": "根据数额大小量刑。"}
    assert crime_kg_assitant_map_fn(row) == one_turn("盗窃罪如何量刑？", "根据数额大小量刑。", SYSTEM_TEMPLATE.lawyer)


def test_arxiv():
    row = {"id": "0704.0001", "abstract": "  We compute QCD cross sections.", "title": "Calculation of QCD"}
    assert arxiv_map_fn(row) == one_turn("  We compute QCD cross sections.", "Calculation of QCD",
                                         SYSTEM_TEMPLATE.arxiv_gentile)


def test_colors():
    row = {"color": "#2f4f4f", "description": "Dark slate gray: a deep, muted green-gray: like a stormy sea"}
    assert colors_map_fn(row) == one_turn("a deep, muted green-gray: like a stormy sea", "#2f4f4f",
                                          SYSTEM_TEMPLATE.colorist)


def test_stack_exchange():
    row = {"qid": 1, "question": "How do I reverse a list in Python?", "response": "Use `lst[::-1]`.",
           "date": "2020/01/01"}
    assert stack_exchange_map_fn(row) == one_turn("How do I reverse a list in Python?", "Use `lst[::-1]`.")


def test_tiny_codes():
    row = {"prompt": "Write a Rust snippet printing hi.", "response": "fn main() { println!(\"hi\"); }"}
    assert tiny_codes_map_fn(row) == one_turn("Write a Rust snippet printing hi.",
                                              "fn main() { println!(\"hi\"); }", SYSTEM_TEMPLATE.coder)


def test_default():
    assert default_map_fn({"input": "Hello", "output": "Hi there!", "extra": 1}) == one_turn("Hello", "Hi there!")


def test_pretrain():
    assert pretrain_map_fn({"text": "\n  The quick brown fox.  \n"}) == {
        "conversation": [{"input": "", "output": "The quick brown fox.", "need_eos_token": False}]}


# --- bad rows -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fn, row, field", [
    (alpaca_map_fn, {"instruction": "x", "input": ""}, "output"),
    (alpaca_map_fn, {"input": "", "output": "y"}, "instruction"),
    (sql_map_fn, {"context": "c", "answer": "a"}, "question"),
    (pretrain_map_fn, {"content": "text"}, "text"),
    (openai_map_fn, {"conversations": []}, "messages"),
    (wizardlm_map_fn, {"messages": []}, "conversations"),
])
def test_missing_field_is_a_map_fn_error_naming_it(fn, row, field):
    with pytest.raises(MapFnError, match=f"no '{field}' field"):
        fn(row)


def test_null_field_is_named_as_null_and_missing_field_lists_the_fields_found():
    with pytest.raises(MapFnError) as null:
        default_map_fn({"input": "x", "instruction": "y", "output": None})
    assert str(null.value) == "default_map_fn: field 'output' is null; fill it in or drop this row from the dataset."
    with pytest.raises(MapFnError) as missing:
        default_map_fn({"input": "x", "instruction": "y"})
    assert str(missing.value) == ("default_map_fn: no 'output' field; found fields ['input', 'instruction']. Use the "
                                  "map fn that matches this dataset's format, or rename the column to 'output'.")
    with pytest.raises(MapFnError) as null_list:
        openai_map_fn({"messages": None})
    assert str(null_list.value) == ("openai_map_fn: field 'messages' is null; "
                                    "fill it in or drop this row from the dataset.")
    with pytest.raises(MapFnError) as missing_list:
        openai_map_fn({"conversations": []})
    assert str(missing_list.value) == "openai_map_fn: no 'messages' field; found fields ['conversations']."


@pytest.mark.parametrize("fn, row, field", [
    (default_map_fn, {"input": "x", "output": 3}, "output"),
    (alpaca_map_fn, {"instruction": ["x"], "input": "", "output": "y"}, "instruction"),
    (openai_map_fn, {"messages": [{"role": "user", "content": 3}]}, "content"),  # content parts are read
])
def test_non_string_field_is_a_map_fn_error_naming_it(fn, row, field):
    with pytest.raises(MapFnError, match=f"field '{field}' must be a string, got"):
        fn(row)


def test_map_fn_error_is_a_value_error():
    assert issubclass(MapFnError, ValueError)


def test_openai_unknown_role_names_role_and_position():
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "{}"}]}
    with pytest.raises(MapFnError, match=r"messages\[1\] has role 'robot'"):
        openai_map_fn(row)
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "{}"}], "tools": [{}]}
    with pytest.raises(MapFnError, match=r"messages\[2\] has role 'robot'; expected one of system, user, "
                                         r"assistant, tool"):
        openai_map_fn({**row, "messages": row["messages"] + [{"role": "robot", "content": ""}]})


def test_openai_system_message_after_the_first_turn_is_an_error_naming_its_position():
    # Carried to turn 2 the encoder would reject it ("move it to conversation[0]"), advice this format cannot take.
    row = {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                        {"role": "user", "content": "Q2"}, {"role": "system", "content": "Now be terse."},
                        {"role": "assistant", "content": "A2"}]}
    with pytest.raises(MapFnError) as error:
        openai_map_fn(row)
    assert str(error.value) == ("openai_map_fn: messages[3] is a system message after the first turn, which the "
                                "standard format does not support (only the first turn has a system prompt); "
                                "move it before the first assistant message or drop it")
    # Before the first answer it is still the first turn's system prompt.
    row = {"messages": [{"role": "user", "content": "Q"}, {"role": "system", "content": "S"},
                        {"role": "assistant", "content": "A"}]}
    assert openai_map_fn(row) == {"conversation": [{"system": "S", "input": "Q", "output": "A",
                                                    "output_with_loss": True}]}


def test_openai_error_positions_count_skipped_leading_assistant_messages():
    row = {"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Q"},
                        {"role": "robot", "content": "{}"}]}
    with pytest.raises(MapFnError, match=r"messages\[2\] has role 'robot'"):
        openai_map_fn(row)


def test_openai_system_messages_before_the_first_answer_are_joined_as_sharegpt():
    # Only the last one used to be kept: the earlier system prompts were lost.
    row = {"messages": [{"role": "system", "content": "You are terse."},
                        {"role": "system", "content": "Answer in French."},
                        {"role": "user", "content": "Capital of Italy?"}, {"role": "system", "content": "No lists."},
                        {"role": "assistant", "content": "Rome."},
                        {"role": "user", "content": "And Spain?"}, {"role": "assistant", "content": "Madrid."}]}
    assert openai_map_fn(row) == {"conversation": [
        {"system": "You are terse.\n\nAnswer in French.\n\nNo lists.", "input": "Capital of Italy?",
         "output": "Rome.", "output_with_loss": True},
        {"input": "And Spain?", "output": "Madrid.", "output_with_loss": True},
    ]}
    # Consecutive system messages, the one layout both formats accept: the same system prompt.
    both = {"messages": row["messages"][:3] + row["messages"][4:5]}
    assert openai_map_fn(both)["conversation"][0]["system"] == sharegpt_map_fn(both)["conversation"][0]["system"]


def test_wizardlm_unknown_speaker_names_it_and_position():
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "assistant", "value": "a"}]}
    with pytest.raises(MapFnError, match=r"conversations\[1\] is from 'assistant'"):
        wizardlm_map_fn(row)


def test_wizardlm_error_positions_count_skipped_leading_gpt_messages():
    row = {"conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "q"},
                             {"from": "assistant", "value": "a"}]}
    with pytest.raises(MapFnError, match=r"conversations\[2\] is from 'assistant'"):
        wizardlm_map_fn(row)
    row = {"conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "gpt", "value": "Welcome."},
                             {"from": "human", "value": "q"}, {"from": "gpt", "value": None}]}
    with pytest.raises(MapFnError, match=r"wizardlm_map_fn \(conversations\[3\]\): field 'value' is null"):
        wizardlm_map_fn(row)


# --- sharegpt -----------------------------------------------------------------------------------

@pytest.mark.parametrize("user, assistant", [
    ("human", "gpt"), ("user", "assistant"), ("Human", "ChatGPT"), ("user", "bing"), ("USER", "bard"),
    ("user", "model"),
])
def test_sharegpt_role_spellings(user, assistant):
    row = {"conversations": [{"from": user, "value": "Hi"}, {"from": assistant, "value": "Hello"}]}
    assert sharegpt_map_fn(row) == one_turn("Hi", "Hello")


def test_sharegpt_role_content_keys_and_messages_column():
    row = {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello"}]}
    assert sharegpt_map_fn(row) == one_turn("Hi", "Hello", "Be kind.")


def test_sharegpt_full_conversation():
    row = {"id": "abc", "conversations": [
        {"from": "system", "value": "You are helpful."},
        {"from": "human", "value": "What is 2+2?"},
        {"from": "gpt", "value": "4."},
        {"from": "human", "value": "And 3+3?"},
        {"from": "gpt", "value": "6."},
    ]}
    assert sharegpt_map_fn(row) == {"conversation": [
        {"system": "You are helpful.", "input": "What is 2+2?", "output": "4."},
        {"input": "And 3+3?", "output": "6."},
    ]}


def test_sharegpt_merges_consecutive_same_role_messages():
    row = {"conversations": [
        {"from": "human", "value": "Part one."}, {"from": "human", "value": "Part two."},
        {"from": "gpt", "value": "Answer A."}, {"from": "chatgpt", "value": "Answer B."},
        {"from": "human", "value": "Next?"}, {"from": "gpt", "value": "Done."},
    ]}
    as_written = _messages(("user", "Part one."), ("user", "Part two."), ("assistant", "Answer A."),
                           ("assistant", "Answer B."))
    assert sharegpt_map_fn(row) == {"conversation": [
        {"input": "Part one.\n\nPart two.", "output": "Answer A.\n\nAnswer B.", "messages": as_written},
        {"input": "Next?", "output": "Done."},
    ]}


def test_sharegpt_drops_leading_assistant_and_trailing_user():
    row = {"conversations": [
        {"from": "system", "value": "S"}, {"from": "gpt", "value": "Welcome!"},
        {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}, {"from": "human", "value": "Unanswered"},
    ]}
    assert sharegpt_map_fn(row) == one_turn("Q", "A", "S")
    assert sharegpt_map_fn({"conversations": [{"from": "gpt", "value": "x"}]}) == {"conversation": []}
    assert sharegpt_map_fn({"conversations": []}) == {"conversation": []}


def test_sharegpt_unknown_role_names_role_and_position():
    row = {"conversations": [{"from": "human", "value": "Q"}, {"from": "narrator", "value": "?"}]}
    with pytest.raises(MapFnError, match=r"conversations\[1\] has unknown role 'narrator'"):
        sharegpt_map_fn(row)
    with pytest.raises(MapFnError, match=r"conversations\[0\] has unknown role None"):
        sharegpt_map_fn({"conversations": [{"value": "Q"}]})


def test_sharegpt_late_system_message_is_an_error():
    row = {"conversations": [{"from": "human", "value": "Q"}, {"from": "system", "value": "S"}]}
    with pytest.raises(MapFnError, match=r"conversations\[1\] is a system message after the conversation started"):
        sharegpt_map_fn(row)


def test_sharegpt_bad_rows():
    with pytest.raises(MapFnError, match="no 'conversations'"):
        sharegpt_map_fn({"text": "hello"})
    with pytest.raises(MapFnError, match=r"conversations\[0\].*'value' must be a string"):
        sharegpt_map_fn({"conversations": [{"from": "human", "value": 5}]})


# --- template_map_fn ----------------------------------------------------------------------------

def test_template_map_fn_does_not_mutate_its_input():
    row = {"conversation": [{"system": "S", "input": "Q", "output": "A", "output_with_loss": False},
                            {"input": "Q2", "output": "A2"}]}
    before = copy.deepcopy(row)
    out = template_map_fn_factory("qwen_chat")(row)
    assert row == before
    assert out["conversation"][0] == {
        "system": "S", "input": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
                                "<|im_start|>assistant\n",
        "output": "A<|im_end|>", "output_with_loss": False, "need_eos_token": False, "sep": "\n"}


def test_template_map_fn_round_and_null_input():
    row = {"conversation": [{"input": None, "output": "A"}, {"input": "Q2", "output": "B"}]}
    turns = template_map_fn_factory("chatglm2")(row)["conversation"]
    assert [t["input"] for t in turns] == ["[Round 1]\n\n问：\n\n答：", "[Round 2]\n\n问：Q2\n\n答："]


def test_template_map_fn_prompt_turn_keeps_no_output():
    turns = template_map_fn_factory("llama3_chat")({"conversation": [{"input": "Q"}]})["conversation"]
    assert turns == [{"input": "<|start_header_id|>user<|end_header_id|>\n\nQ<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n",
                      "need_eos_token": False, "sep": ""}]


def test_template_map_fn_with_hf_chat_template_leaves_rows_unchanged():
    row = {"conversation": [{"system": "S", "input": "Q", "output": "A"}]}
    assert template_map_fn_factory(PROMPT_TEMPLATE.hf_chat_template)(row) == row
    assert template_map_fn_factory("hf_chat_template")(row) == row


def test_template_map_fn_factory_accepts_name_or_dict_and_is_picklable():
    by_name = template_map_fn_factory("phi3_chat")
    by_dict = template_map_fn_factory(PROMPT_TEMPLATE.phi3_chat)
    row = {"conversation": [{"input": "Q", "output": "A"}]}
    assert by_name(row) == by_dict(row)
    assert pickle.loads(pickle.dumps(by_name))(row) == by_name(row)
    with pytest.raises(ValueError, match="valid names"):
        template_map_fn_factory("phi_3")


def test_template_map_fn_factory_has_a_stable_datasets_fingerprint():
    from datasets.fingerprint import Hasher
    assert Hasher.hash(template_map_fn_factory("qwen_chat")) == Hasher.hash(template_map_fn_factory("qwen_chat"))
    assert Hasher.hash(template_map_fn_factory("qwen_chat")) != Hasher.hash(template_map_fn_factory("llama3_chat"))


def test_map_fns_chain_through_datasets_map():
    from datasets import Dataset
    rows = [{"instruction": "Add.", "input": "1 2", "output": "3"},
            {"instruction": "Sub.", "input": "", "output": "<nooutput>"}]
    ds = Dataset.from_list(rows).map(alpaca_map_fn, remove_columns=["instruction", "input", "output"])
    ds = ds.filter(lambda r: len(r["conversation"]) > 0)
    ds = ds.map(template_map_fn_factory("default"))
    assert ds[0]["conversation"] == [{"input": "<|User|>:Add.\n1 2\n<|Bot|>:", "output": "3",
                                      "need_eos_token": True, "sep": "\n"}]


def test_built_from_config_dicts():
    from sfttool.registry import resolve_type
    assert resolve_type("sharegpt_map_fn") is sharegpt_map_fn
    assert resolve_type("sfttool.dataset.map_fns.alpaca_map_fn") is alpaca_map_fn
    # XTuner configs: template_map_fn=dict(type=template_map_fn_factory, template=PROMPT_TEMPLATE.x)
    for type_ in (template_map_fn_factory, "template_map_fn_factory",
                  "sfttool.dataset.map_fns.template_map_fn.template_map_fn_factory"):
        fn = build(dict(type=type_, template=PROMPT_TEMPLATE.qwen_chat))
        assert fn({"conversation": [{"input": "Q", "output": "A"}]})["conversation"][0]["output"] == "A<|im_end|>"


def test_sharegpt_mixed_key_spellings_with_nulls():
    # A dataset built from files using both spellings has the other key present but null.
    row = {"conversations": [{"from": "human", "value": "Q", "role": None, "content": None},
                             {"from": None, "value": None, "role": "assistant", "content": "A"}]}
    assert sharegpt_map_fn(row) == one_turn("Q", "A")


def test_openai_tool_calls_reasoning_and_tools_ride_on_the_turns():
    row = {"tools": '[{"type": "function", "function": {"name": "add"}}]', "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "assistant", "content": "3.", "loss": False}, {"role": "user", "content": "unanswered"}]}
    notes = []
    turns = openai_map_fn(row, notes)["conversation"]
    assert notes == ["final user message without an answer (dropped)"]
    assert [(t.get("system"), t.get("tools"), t["input"], t["output"], t["output_with_loss"]) for t in turns] == [
        ("S", '[{"type": "function", "function": {"name": "add"}}]', "1+2?", "", True), (None, None, "", "3.", False)]
    assert json.loads(turns[0]["messages"]) == [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "reasoning_content": "Use the tool.", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}, "id": "c1"}]}]
    assert json.loads(turns[1]["messages"]) == [{"role": "tool", "tool_call_id": "c1", "content": "3"},
                                                {"role": "assistant", "content": "3.", "loss": False}]


def test_openai_tool_call_errors_name_the_message():
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}
    with pytest.raises(MapFnError, match=r"openai_map_fn: messages\[1\]\.tool_calls\[0\]: tool call 'f' has "
                                         r"arguments that are not JSON"):
        openai_map_fn({"messages": [{"role": "user", "content": "q"}, call]})
    with pytest.raises(MapFnError, match=r"messages\[2\] is a system message after the conversation started"):
        openai_map_fn({"messages": [{"role": "user", "content": "q"}, {**call, "tool_calls": []},
                                    {"role": "system", "content": "s"}, {"role": "tool", "content": "x"}]})


def test_runs_of_one_role_in_tool_rows_are_noted_and_kept_as_written():
    from sfttool.dataset.conversation import NOTE_TWO_ASSISTANTS, NOTE_TWO_USERS
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "42"}, {"role": "assistant", "content": "c"},
                        {"role": "assistant", "content": "d"}]}
    notes = []
    turns = openai_map_fn(row, notes)["conversation"]
    assert notes == [NOTE_TWO_USERS, NOTE_TWO_ASSISTANTS]
    assert [[m["content"] for m in json.loads(t["messages"])] for t in turns] == [["a", "b", ""], ["42", "c"], ["d"]]
    notes = []
    openai_map_fn({"messages": row["messages"][1:5]}, notes)  # one question, a call, its result, one answer
    assert notes == []
