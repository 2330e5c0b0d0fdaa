"""Rows that already have ``input`` and ``output`` columns."""
from sfttool.registry import MAP_FUNC

from ._fields import text_field


@MAP_FUNC.register_module()
def default_map_fn(example: dict) -> dict:
    """One turn from ``input`` / ``output``.

    >>> default_map_fn({'input': 'Hi', 'output': 'Hello!'})
    {'conversation': [{'input': 'Hi', 'output': 'Hello!'}]}
    """
    return {"conversation": [{
        "input": text_field(example, "input", "default_map_fn"),
        "output": text_field(example, "output", "default_map_fn"),
    }]}
