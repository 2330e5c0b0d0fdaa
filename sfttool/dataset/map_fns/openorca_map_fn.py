"""OpenOrca (Open-Orca/OpenOrca): ``system_prompt``, ``question``, ``response``."""
from sfttool.registry import MAP_FUNC

from ._fields import text_field


@MAP_FUNC.register_module()
def openorca_map_fn(example: dict) -> dict:
    """One turn with the row's own system prompt (empty prompts render no system part).

    >>> openorca_map_fn({'system_prompt': 'Be brief.', 'question': '2+2?', 'response': '4'})
    {'conversation': [{'system': 'Be brief.', 'input': '2+2?', 'output': '4'}]}
    """
    return {"conversation": [{
        "system": text_field(example, "system_prompt", "openorca_map_fn", optional=True),
        "input": text_field(example, "question", "openorca_map_fn"),
        "output": text_field(example, "response", "openorca_map_fn"),
    }]}
