"""Colour descriptions (burkelibbey/colors): ``description`` ('Medium blue: a calm ...'), ``color``."""
from sfttool.registry import MAP_FUNC
from sfttool.utils.templates import SYSTEM_TEMPLATE

from ._fields import text_field


@MAP_FUNC.register_module()
def colors_map_fn(example: dict) -> dict:
    """Describe -> hex colour; the colour name before the first ':' is dropped from the input.

    >>> colors_map_fn({'description': 'Sky: a pale blue', 'color': '#87ceeb'})['conversation'][0]['input']
    'a pale blue'
    """
    description = text_field(example, "description", "colors_map_fn")
    return {"conversation": [{
        "system": SYSTEM_TEMPLATE.colorist,
        "input": ":".join(description.split(":")[1:]).strip(),
        "output": text_field(example, "color", "colors_map_fn"),
    }]}
