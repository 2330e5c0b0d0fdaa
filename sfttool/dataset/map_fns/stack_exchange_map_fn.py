"""Stack Exchange paired Q&A (ArmelR/stack-exchange-instruction): ``question``, ``response``."""
from sfttool.registry import MAP_FUNC

from ._fields import text_field


@MAP_FUNC.register_module()
def stack_exchange_map_fn(example: dict) -> dict:
    """One turn from ``question`` / ``response``.

    >>> stack_exchange_map_fn({'question': 'Why?', 'response': 'Because.'})
    {'conversation': [{'input': 'Why?', 'output': 'Because.'}]}
    """
    return {"conversation": [{
        "input": text_field(example, "question", "stack_exchange_map_fn"),
        "output": text_field(example, "response", "stack_exchange_map_fn"),
    }]}
