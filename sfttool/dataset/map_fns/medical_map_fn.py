"""Medical dialogue (shibing624/medical): ``instruction``, ``input``, ``output``."""
from sfttool.registry import MAP_FUNC
from sfttool.utils.templates import SYSTEM_TEMPLATE

from ._fields import text_field


@MAP_FUNC.register_module()
def medical_map_fn(example: dict) -> dict:
    """Instruction and input on two lines, with the ``medical`` system prompt.

    >>> medical_map_fn({'instruction': '头痛', 'input': '', 'output': '休息'})['conversation'][0]['input']
    '头痛\\n'
    """
    instruction = text_field(example, "instruction", "medical_map_fn")
    extra = text_field(example, "input", "medical_map_fn", optional=True)
    return {"conversation": [{
        "system": SYSTEM_TEMPLATE.medical,
        "input": f"{instruction}\n{extra}",
        "output": text_field(example, "output", "medical_map_fn"),
    }]}
