"""Chinese law references (law_reference_data): ``question``, ``answer``."""
from sfttool.registry import MAP_FUNC
from sfttool.utils.templates import SYSTEM_TEMPLATE

from ._fields import text_field


@MAP_FUNC.register_module()
def law_reference_map_fn(example: dict) -> dict:
    """One legal Q&A turn with the ``lawyer`` system prompt.

    >>> law_reference_map_fn({'question': '问', 'answer': '答'})['conversation'][0]['input']
    '问'
    """
    return {"conversation": [{
        "system": SYSTEM_TEMPLATE.lawyer,
        "input": text_field(example, "question", "law_reference_map_fn"),
        "output": text_field(example, "answer", "law_reference_map_fn"),
    }]}
