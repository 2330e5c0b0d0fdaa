"""Dataset map fns: one module per raw format, each ``row -> {"conversation": [...]}``.

Every fn is registered in ``sfttool.registry.MAP_FUNC`` under its name, so a
config may say ``dataset_map_fn='alpaca_map_fn'`` or import the function.
``template_map_fn_factory`` then renders the standard rows with a template.
"""
from .alpaca_map_fn import alpaca_map_fn
from .alpaca_zh_map_fn import alpaca_zh_map_fn
from .arxiv_map_fn import arxiv_map_fn
from .code_alpaca_map_fn import code_alpaca_map_fn
from .colors_map_fn import colors_map_fn
from .crime_kg_assitant_map_fn import crime_kg_assitant_map_fn
from .default_map_fn import default_map_fn
from .errors import MapFnError
from .law_reference_map_fn import law_reference_map_fn
from .llava_map_fn import llava_map_fn
from .medical_map_fn import medical_map_fn
from .msagent_map_fn import msagent_map_fn
from .oasst1_map_fn import oasst1_map_fn
from .openai_map_fn import openai_map_fn
from .openorca_map_fn import openorca_map_fn
from .pretrain_map_fn import pretrain_map_fn
from .reasoning_prompt_map_fns import gsm8k_map_fn, math_map_fn
from .preference_map_fns import (intel_orca_dpo_map_fn, orpo_dpo_mix_40k_map_fn, preference_strings_map_fn,
                                 ultrafeedback_binarized_map_fn)
from .sharegpt_map_fn import sharegpt_map_fn
from .sql_map_fn import sql_map_fn
from .stack_exchange_map_fn import stack_exchange_map_fn
from .template_map_fn import render_input, template_map_fn, template_map_fn_factory
from .tiny_codes_map_fn import tiny_codes_map_fn
from .wizardlm_map_fn import wizardlm_map_fn

__all__ = [
    "MapFnError", "render_input", "template_map_fn", "template_map_fn_factory",
    "alpaca_map_fn", "alpaca_zh_map_fn", "arxiv_map_fn", "code_alpaca_map_fn", "colors_map_fn",
    "crime_kg_assitant_map_fn", "default_map_fn", "law_reference_map_fn", "llava_map_fn", "medical_map_fn",
    "msagent_map_fn",
    "oasst1_map_fn", "openai_map_fn", "openorca_map_fn", "pretrain_map_fn", "sharegpt_map_fn", "sql_map_fn",
    "stack_exchange_map_fn", "tiny_codes_map_fn", "wizardlm_map_fn",
    "intel_orca_dpo_map_fn", "orpo_dpo_mix_40k_map_fn", "preference_strings_map_fn", "ultrafeedback_binarized_map_fn",
    "gsm8k_map_fn", "math_map_fn",
]
