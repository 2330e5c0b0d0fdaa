"""Alpaca (tatsu-lab/alpaca): ``instruction``, ``input``, ``output``."""
from sfttool.registry import MAP_FUNC

from ._fields import text_field


@MAP_FUNC.register_module()
def alpaca_map_fn(example: dict) -> dict:
    """One turn: the instruction and its input on two lines.

    >>> alpaca_map_fn({'instruction': 'Add.', 'input': '1 2', 'output': '3'})
    {'conversation': [{'input': 'Add.\\n1 2', 'output': '3'}]}

    Rows whose output is Alpaca's ``<nooutput>`` marker become an empty
    conversation (the pipeline drops them). A null ``input`` counts as empty.
    """
    output = text_field(example, "output", "alpaca_map_fn")
    if output == "<nooutput>":
        return {"conversation": []}
    instruction = text_field(example, "instruction", "alpaca_map_fn")
    extra = text_field(example, "input", "alpaca_map_fn", optional=True)
    return {"conversation": [{"input": f"{instruction}\n{extra}", "output": output}]}
