"""``check_conversation``'s quick pass for plain turns accepts only turns the full check accepts."""
import itertools

import numpy as np
import pytest

from sfttool.dataset.conversation import _is_plain_turn, check_conversation, check_turn_fully
from sfttool.dataset.errors import DatasetError


class Text(str):
    pass


ABSENT = object()
VALUES = {
    "input": [ABSENT, None, "Q", "", 3, Text("Q")],
    "output": [ABSENT, None, "A", "", 3],
    "system": [ABSENT, None, "", "S", 0],
    "tools": [ABSENT, None, "", "[]", "[1]", "not json", [], 0, False],
    "messages": [ABSENT, None, "", '[{"role": "user", "content": "x"}]', 0],
    "output_with_loss": [ABSENT, None, True, False, 0, 1, 1.0, 2, "false", np.bool_(False)],
    "need_eos_token": [ABSENT, None, True, 0, "true"],
}


def turns():
    """Every combination of two keys' values, the others absent or set plainly."""
    plain = {"input": "Q", "output": "A"}
    for a, b in itertools.combinations(VALUES, 2):
        for va, vb in itertools.product(VALUES[a], VALUES[b]):
            turn = dict(plain)
            for key, value in ((a, va), (b, vb)):
                if value is ABSENT:
                    turn.pop(key, None)
                else:
                    turn[key] = value
            yield turn


def full_check_passes(turn, i, need_output):
    try:
        check_turn_fully(turn, i, None, None, need_output)
    except DatasetError:
        return False
    return True


@pytest.mark.parametrize("need_output", [True, False])
@pytest.mark.parametrize("i", [0, 1])
def test_quick_pass_only_where_the_full_check_passes(i, need_output):
    quick = full = 0
    for turn in turns():
        if _is_plain_turn(turn, i == 0, need_output):
            quick += 1
            assert full_check_passes(turn, i, need_output), turn
        full += full_check_passes(turn, i, need_output)
    assert 0 < quick <= full  # the quick pass takes the common turns; the rest go the long way


def test_turns_that_are_not_dicts_and_turns_without_text_are_named():
    with pytest.raises(DatasetError, match=r"row 3, field 'conversation\[0\]': expected a dict"):
        check_conversation([["Q", "A"]], 3)
    with pytest.raises(DatasetError, match=r"row 3, field 'conversation\[0\]': no `input`/`output`"):
        check_conversation([{"system": "S"}], 3, need_output=False)
    with pytest.raises(DatasetError, match=r"row 3, field 'conversation\[1\].system': `system` is only allowed on the first"):
        check_conversation([{"input": "Q", "output": "A"}, {"input": "Q", "output": "A", "system": "S"}], 3)
    assert not _is_plain_turn({"input": Text("Q"), "output": "A"}, True, True)  # checked the long way
