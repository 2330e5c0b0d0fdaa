"""Prompt map fns for online RL: raw math rows -> ``{"prompt": [...], "solution": ...}`` (TRL's prompt format).

The reward functions receive ``solution`` by name; ``accuracy`` compares a completion's final answer
with it. The raw columns stay in the row as well.
"""
from __future__ import annotations

from sfttool.registry import MAP_FUNC

from ._fields import text_field
from .errors import MapFnError


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@MAP_FUNC.register_module()
def gsm8k_map_fn(example: dict) -> dict:
    """GSM8K-style rows: ``question``, and an ``answer`` (the worked solution) ending in ``#### n``.

    >>> gsm8k_map_fn({'question': 'Tom has 3 apples and buys 4. How many?', 'answer': '3 + 4 = 7\\n#### 7'})
    {'prompt': [{'role': 'user', 'content': 'Tom has 3 apples and buys 4. How many?'}], 'solution': '7'}

    ``solution`` is the number after ``####``, thousands separators removed.
    """
    answer = text_field(example, "answer", "gsm8k_map_fn")
    if "####" not in answer:
        raise MapFnError("gsm8k_map_fn: field 'answer' has no '#### <final answer>' line; GSM8K answers end with one "
                         "(use math_map_fn for solutions with \\boxed{})")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise MapFnError("gsm8k_map_fn: field 'answer' has nothing after '####'")
    return {"prompt": _user(text_field(example, "question", "gsm8k_map_fn")), "solution": final}


@MAP_FUNC.register_module()
def math_map_fn(example: dict) -> dict:
    """MATH-style rows: ``problem``, and a ``solution`` whose final answer is in ``\\boxed{}``.

    >>> math_map_fn({'problem': 'What is $1/2 + 1/2$?', 'solution': '$1/2 + 1/2 = \\\\boxed{1}$.'})
    {'prompt': [{'role': 'user', 'content': 'What is $1/2 + 1/2$?'}], 'solution': '$1/2 + 1/2 = \\\\boxed{1}$.'}

    The solution is kept whole: ``accuracy`` reads its last ``\\boxed{}``.
    """
    solution = text_field(example, "solution", "math_map_fn")
    if "\\boxed{" not in solution:
        raise MapFnError("math_map_fn: field 'solution' has no \\boxed{...} final answer; MATH solutions box it "
                         "(use gsm8k_map_fn for answers ending with '#### n')")
    return {"prompt": _user(text_field(example, "problem", "math_map_fn")), "solution": solution}
