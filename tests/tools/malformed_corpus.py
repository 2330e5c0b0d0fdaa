"""Malformed data files, one per kind a user meets (truncated JSON, bad encodings, missing fields,
wrong roles, empty conversations, ...), each with what check-custom-dataset says about it: its first
ERROR line (``{path}`` is the file), or the WARNING a counted drop gives, or ``OK``.

Every file has a few good rows around the bad one, so each message names a row in the middle."""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass

OPENAI = "openai_map_fn"


def chat(user: str = "Say hi", answer: str = "Hi there.") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def standard(user: str = "Say hi", answer: str = "Hi there.") -> dict:
    return {"conversation": [{"input": user, "output": answer}]}


GOOD = json.dumps(chat())
CUT_AFTER_MESSAGE = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}'


def lines(*rows: str, end: str = "\n") -> str:
    return end.join(rows) + end


def rows(*objects: dict) -> str:
    return lines(*(json.dumps(o) for o in objects))


@dataclass
class Case:
    name: str            # the file's name: its suffix is part of the case
    content: str | bytes
    map_fn: str | None   # the dataset_map_fn the config sets
    expect: str          # the first ERROR/WARNING line, or "OK"
    # A row check-custom-dataset calls an error but train drops, counted: the cause both name.
    dropped: str | None = None

    def write(self, folder):
        path = folder / self.name
        data = self.content.encode() if isinstance(self.content, str) else self.content
        path.write_bytes(gzip.compress(data) if self.name.endswith(".gz") else data)
        return path


CUT = ("ERROR: {path}, line %d: invalid JSON: the line ends before its last object, array or string is closed (%s); "
       "it was cut off (a writer stopped mid-row?): complete it or remove it")
SYNTAX = ("ERROR: {path}, line %d: invalid JSON (%s); each line must be one JSON object (or the file one JSON "
          "array)")

CASES = [
    # Whole-file and JSON syntax problems: one line naming the file and the line.
    Case("empty.jsonl", "", OPENAI, "ERROR: {path}: the file holds no rows"),
    Case("blank.jsonl", "\n  \n\n", OPENAI, "ERROR: {path}: the file holds no rows"),
    Case("latin1.jsonl", (GOOD + "\n").encode() + '{"messages": [{"role": "user", "content": "café"}]}\n'
         .encode("latin-1"), OPENAI, "ERROR: {path}, line 2: not UTF-8 text (byte 0xe9 at column 47); save the file "
                                     "as UTF-8"),
    Case("trailing_comma.json", "[" + GOOD + ",\n" + GOOD + ",\n]\n", OPENAI,
         "ERROR: {path}, line 3: invalid JSON: a comma before ']' at column 1; JSON allows no trailing comma: "
         "remove it"),
    Case("trailing_comma_in_line.jsonl", lines(GOOD, GOOD[:-1] + ", }", GOOD), OPENAI,
         "ERROR: {path}, line 2: invalid JSON: a comma before '}' at column 102; JSON allows no trailing comma: "
         "remove it"),
    Case("cut_mid_object.jsonl", lines(GOOD, '{"messages": [{"role": "us', GOOD), OPENAI,
         CUT % (2, "Invalid control character at column 27")),
    Case("cut_last_line.jsonl", lines(GOOD, GOOD, GOOD) + CUT_AFTER_MESSAGE, OPENAI,
         CUT % (4, "Expecting ',' delimiter at column 88")),
    Case("cut_after_message.jsonl", lines(GOOD, CUT_AFTER_MESSAGE, GOOD), OPENAI,
         CUT % (2, "Expecting ',' delimiter at column 88")),
    Case("cut_array.json", "[" + GOOD + ",\n" + GOOD[:40], OPENAI,
         CUT.replace("the line", "the file") % (2, "Expecting ':' delimiter at column 41")),
    Case("missing_comma.jsonl", lines(GOOD, '{"messages": [{"role": "user" "content": "hi"}]}', GOOD), OPENAI,
         SYNTAX % (2, "Expecting ',' delimiter at column 31")),
    Case("stray_text.jsonl", lines(GOOD, "oops " + GOOD, GOOD), OPENAI,
         SYNTAX % (2, "Expecting value at column 1")),
    Case("stray_after.jsonl", lines(GOOD, GOOD + " ok", GOOD), OPENAI,
         SYNTAX % (2, "Extra data at column 102")),
    Case("array_line.jsonl", lines(GOOD, "[1, 2]", GOOD), OPENAI,
         "ERROR: {path}, line 2 (row 1): expected a JSON object, got list"),
    Case("null_line.jsonl", lines(GOOD, "null", GOOD), OPENAI,
         "ERROR: {path}, line 2 (row 1): expected a JSON object, got null"),
    Case("one_object.json", json.dumps(chat(), indent=2), OPENAI,
         "ERROR: {path}: expected a JSON array of rows, got a dict; write [{...}, {...}], one object per line, or "
         "pass field=... to load_dataset"),
    Case("lone_surrogate.jsonl", lines(GOOD, '{"messages": [{"role": "user", "content": "hi \\ud83d"}, '
                                             '{"role": "assistant", "content": "yo"}]}'), OPENAI,
         "ERROR: {path}, line 2: a lone surrogate escape (e.g. \\ud83d without its pair) is not text; the string was "
         "probably cut in the middle of an emoji"),
    Case("repeated_key.jsonl", lines(GOOD, '{"messages": [{"role": "user", "content": "a", "content": "b"}, '
                                           '{"role": "assistant", "content": "yo"}]}'), OPENAI,
         "ERROR: {path}: 1 rows have an object with a repeated key, which the JSON reader refuses: line 2 (row 1) "
         "('content'); keep one value per key"),
    Case("type_changes.jsonl", rows(standard(), {"conversation": [{"input": "q", "output": "a", "score": 1}]},
                                    {"conversation": [{"input": "q", "output": "a", "score": "high"}]}), None,
         "ERROR: {path}, line 3 (row 2), field 'conversation[].score': a string here but a number at line 2; every "
         "row must use the same type per field"),
    Case("cut.jsonl.gz", lines(GOOD, GOOD) + CUT_AFTER_MESSAGE, OPENAI,
         CUT % (3, "Expecting ',' delimiter at column 88")),
    # Files that are fine: read as datasets reads them.
    Case("crlf.jsonl", lines(GOOD, GOOD, GOOD, end="\r\n"), OPENAI, "OK"),
    Case("blank_line_with_spaces.jsonl", lines(GOOD, "   ", GOOD), OPENAI, "OK"),
    Case("bom.jsonl", b"\xef\xbb\xbf" + lines(GOOD, GOOD).encode(), OPENAI, "OK"),
    # Rows: every bad row listed, with the file, the row and the field.
    Case("missing_output.json", json.dumps([standard(), standard(), {"conversation": [{"input": "q"}]}]), None,
         "ERROR: {path}, row 2, field 'conversation[0].output': expected a string, got missing; fix the data or the "
         "dataset_map_fn so every turn's `system`, `input` and `output` are strings"),
    Case("output_not_text.jsonl", rows(standard(), {"conversation": [{"input": "q", "output": 5}]}), None,
         "ERROR: {path}, line 2 (row 1), field 'conversation[].output': a number here but a string at line 1; every "
         "row must use the same type per field"),
    Case("output_list.json", json.dumps([{"conversation": [{"input": "q", "output": ["a"]}]}] * 2), None,
         "ERROR: {path}, row 0, field 'conversation[0].output': expected a string, got a list"),
    Case("empty_conversation.jsonl", rows(standard(), {"conversation": []}, standard()), None,
         "ERROR: {path}, row 1: empty conversation (this row would be dropped)", dropped="empty conversation"),
    Case("other_format_keys.jsonl", rows(standard(), {"conversation": [{"from": "human", "value": "q"}]}), None,
         "ERROR: {path}, row 1, field 'conversation[0]': no `input`/`output` (keys: from, value); convert roles to the "
         "standard format with a dataset_map_fn"),
    Case("not_standard.jsonl", rows({"instruction": "Say hi", "input": "", "output": "hi"}), None,
         "ERROR: {path}, row 0: no `conversation` (fields: instruction, input, output); data that is not in the "
         "standard format needs a dataset_map_fn (set dataset_map_fn=alpaca_map_fn), or convert the data to "
         "{'conversation': [...]}"),
    Case("missing_messages.jsonl", rows(chat(), {"other": 1}, chat()), OPENAI,
         "ERROR: {path}, row 1: dataset_map_fn openai_map_fn failed: MapFnError: openai_map_fn: no 'messages' "
         "field; found fields ['other']."),
    Case("null_messages.jsonl", rows(chat(), {"messages": None}, chat()), OPENAI,
         "ERROR: {path}, row 1: dataset_map_fn openai_map_fn failed: MapFnError: openai_map_fn: field 'messages' is "
         "null; fill it in or drop this row from the dataset."),
    Case("wrong_role.jsonl", rows(chat(), {"messages": [{"role": "human", "content": "hi"},
                                                        {"role": "assistant", "content": "yo"}]}), OPENAI,
         "ERROR: {path}, row 1: dataset_map_fn openai_map_fn failed: MapFnError: openai_map_fn: messages[0] has role "
         "'human'; expected 'system', 'user' or 'assistant' (tool and function messages are not supported)"),
    Case("content_null.jsonl", rows(chat(), {"messages": [{"role": "user", "content": None},
                                                          {"role": "assistant", "content": "yo"}]}), OPENAI,
         "ERROR: {path}, row 1: dataset_map_fn openai_map_fn failed: MapFnError: openai_map_fn (messages[0]): field "
         "'content' is null; fill it in or drop this row from the dataset."),
    Case("assistant_first.jsonl", rows(chat(), {"messages": [{"role": "assistant", "content": "Hi!"}]}), OPENAI,
         "ERROR: {path}, row 1: empty conversation after dataset_map_fn: conversation starts with an assistant "
         "message (dropped: nothing asked it) (this row would be dropped)",
         dropped="empty conversation after dataset_map_fn: conversation starts with an assistant message (dropped: "
                 "nothing asked it)"),
    Case("no_messages.jsonl", rows(chat(), {"messages": []}), OPENAI,
         "ERROR: {path}, row 1: empty conversation (this row would be dropped)", dropped="empty conversation"),
    Case("unanswered.jsonl", rows(chat(), {"messages": [{"role": "user", "content": "hi"}]}), OPENAI,
         "ERROR: {path}, row 1: empty conversation after dataset_map_fn: final user message without an answer "
         "(dropped) (this row would be dropped)",
         dropped="empty conversation after dataset_map_fn: final user message without an answer (dropped)"),
    Case("standard_with_map_fn.jsonl", rows(standard(), standard()), OPENAI,
         "ERROR: {path}: the data is already in the standard `conversation` format but a dataset_map_fn is set: "
         "set dataset_map_fn=None"),
    # Counted, not errors: what the map fn changed, and a row cut away at max_length.
    Case("leading_assistant.jsonl", rows(chat(), {"messages": [{"role": "assistant", "content": "Hi!"},
                                                               *chat()["messages"]]}), OPENAI,
         "WARNING: changed 1 rows: conversation starts with an assistant message (dropped: nothing asked it) (row 1)"),
    Case("prompt_too_long.jsonl", rows(chat(), chat(user="word " * 3000)), OPENAI,
         "dropped 1 rows: prompt longer than max_length=2048 (the answer was cut away) (row 1 (prompt of "),
]
