"""Chinese Alpaca (silk-road/alpaca-data-gpt4-chinese): ``instruction_zh``, ``input_zh``, ``output_zh``."""
from sfttool.registry import MAP_FUNC

from ._fields import text_field


@MAP_FUNC.register_module()
def alpaca_zh_map_fn(example: dict) -> dict:
    """One turn from the ``*_zh`` columns.

    >>> alpaca_zh_map_fn({'instruction_zh': '翻译。', 'input_zh': 'cat', 'output_zh': '猫'})
    {'conversation': [{'input': '翻译。\\ncat', 'output': '猫'}]}
    """
    instruction = text_field(example, "instruction_zh", "alpaca_zh_map_fn")
    extra = text_field(example, "input_zh", "alpaca_zh_map_fn", optional=True)
    output = text_field(example, "output_zh", "alpaca_zh_map_fn")
    return {"conversation": [{"input": f"{instruction}\n{extra}", "output": output}]}
