"""Plain text for continued pre-training: ``text``."""
from sfttool.registry import MAP_FUNC

from ._fields import text_field


@MAP_FUNC.register_module()
def pretrain_map_fn(example: dict) -> dict:
    """The whole (stripped) text is the trained output; no prompt and no EOS.

    >>> pretrain_map_fn({'text': '  Once upon a time.\\n'})
    {'conversation': [{'input': '', 'output': 'Once upon a time.', 'need_eos_token': False}]}
    """
    text = text_field(example, "text", "pretrain_map_fn")
    return {"conversation": [{"input": "", "output": text.strip(), "need_eos_token": False}]}
