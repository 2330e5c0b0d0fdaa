"""The LoRA adapter and the 4-bit quantisation that LoRA and QLoRA configs share.

A config uses them as `lora=lora_config` and
`quantization_config=qlora_4bit` inside its `model` dict; to change the rank
for one run, pass `--cfg-options model.lora.r=16` (or edit the copy made by
`sfttool copy-cfg`).
"""
from peft import LoraConfig
from transformers import BitsAndBytesConfig

# target_modules is left unset: SupervisedFinetune then adapts every linear layer
# of the LLM (4-bit ones included) except the output head. Name modules to
# narrow it, e.g. target_modules=['q_proj', 'v_proj'].
# The update is scaled by lora_alpha / r = 16 / 64 = 0.25, as in XTuner's configs.
lora_config = dict(
    type=LoraConfig,
    r=64,
    lora_alpha=16,
    lora_dropout=0.1,
    bias='none',
    task_type='CAUSAL_LM',
)

# NF4 weights with double quantisation (~0.52 bytes per parameter: a 7B model
# needs ~4 GB), matmuls computed in bfloat16. Needs a CUDA GPU and bitsandbytes.
qlora_4bit = dict(
    type=BitsAndBytesConfig,
    load_in_4bit=True,
    load_in_8bit=False,
    llm_int8_threshold=6.0,
    llm_int8_has_fp16_weight=False,
    bnb_4bit_compute_dtype='bfloat16',
    bnb_4bit_use_double_quant=True,
    bnb_4bit_quant_type='nf4',
)
