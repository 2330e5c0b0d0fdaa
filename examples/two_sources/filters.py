"""The per-source functions of `config.py`.

`one_turn` is the identity source's filter: row -> bool, run after the source's map fn; False drops the
row, counted in the report as `filter_fn one_turn returned False`.
"""


def one_turn(row):
    """Keep single-turn conversations only."""
    return len(row["conversation"]) == 1
