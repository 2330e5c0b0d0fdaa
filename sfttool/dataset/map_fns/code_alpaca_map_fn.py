"""Code Alpaca (HuggingFaceH4/CodeAlpaca_20K): ``prompt``, ``completion``."""
from sfttool.registry import MAP_FUNC
from sfttool.utils.templates import SYSTEM_TEMPLATE

from ._fields import text_field


@MAP_FUNC.register_module()
def code_alpaca_map_fn(example: dict) -> dict:
    """One coding turn with the ``coder`` system prompt.

    >>> code_alpaca_map_fn({'prompt': 'Print 1.', 'completion': 'print(1)'})['conversation'][0]['input']
    'Print 1.'
    """
    return {"conversation": [{
        "system": SYSTEM_TEMPLATE.coder,
        "input": text_field(example, "prompt", "code_alpaca_map_fn"),
        "output": text_field(example, "completion", "code_alpaca_map_fn"),
    }]}
