"""Templates and constants that configs import: ``from sfttool.utils import PROMPT_TEMPLATE``."""
from .constants import DEFAULT_PAD_TOKEN_INDEX, IGNORE_INDEX
from .templates import (PROMPT_TEMPLATE, SYSTEM_TEMPLATE, TEMPLATE_FIELDS, complete_template, get_template,
                        is_hf_chat_template)

__all__ = ["PROMPT_TEMPLATE", "SYSTEM_TEMPLATE", "IGNORE_INDEX", "DEFAULT_PAD_TOKEN_INDEX", "TEMPLATE_FIELDS",
           "complete_template", "get_template", "is_hf_chat_template"]
