"""Tiny codes (nampdn-ai/tiny-codes): ``prompt``, ``response``."""
from sfttool.registry import MAP_FUNC
from sfttool.utils.templates import SYSTEM_TEMPLATE

from ._fields import text_field


@MAP_FUNC.register_module()
def tiny_codes_map_fn(example: dict) -> dict:
    """One coding turn with the ``coder`` system prompt.

    >>> tiny_codes_map_fn({'prompt': 'Write hi.', 'response': 'print("hi")'})['conversation'][0]['output']
    'print("hi")'
    """
    return {"conversation": [{
        "system": SYSTEM_TEMPLATE.coder,
        "input": text_field(example, "prompt", "tiny_codes_map_fn"),
        "output": text_field(example, "response", "tiny_codes_map_fn"),
    }]}
