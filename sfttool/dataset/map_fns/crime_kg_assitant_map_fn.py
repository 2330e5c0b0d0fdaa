"""CrimeKgAssitant (Chinese legal Q&A): ``input``, ``output``. The misspelt name is XTuner's."""
from sfttool.registry import MAP_FUNC
from sfttool.utils.templates import SYSTEM_TEMPLATE

from ._fields import text_field


@MAP_FUNC.register_module()
def crime_kg_assitant_map_fn(example: dict) -> dict:
    """One legal Q&A turn with the ``lawyer`` system prompt.

    >>> crime_kg_assitant_map_fn({'input': '问', 'output': '答'})['conversation'][0]['output']
    '答'
    """
    return {"conversation": [{
        "system": SYSTEM_TEMPLATE.lawyer,
        "input": text_field(example, "input", "crime_kg_assitant_map_fn"),
        "output": text_field(example, "output", "crime_kg_assitant_map_fn"),
    }]}
