"""Prompt templates (how a conversation turn becomes text) and system prompts.

A prompt template is a dict of six fields; ``template_map_fn`` applies it to
each turn of a standard ``conversation`` row:

    turn input  := [SYSTEM.format(system=...)] + INSTRUCTION.format(input=..., round=i + 1)
    turn output := output + SUFFIX          (SUFFIX is trained; it is the end-of-turn marker)
    need_eos_token := not SUFFIX_AS_EOS     (append the tokenizer's EOS after the output)
    sep := SEP                              (untrained text after each turn)

STOP_WORDS end generation at inference. The names and values are XTuner 0.2's
(a config migrates by renaming the package) plus a few newer models; where a
value differs from XTuner 0.2 the entry says why (see docs/templates.md).

One extension: when SYSTEM itself contains ``{input}``, a turn that has a
system prompt is rendered by SYSTEM alone (``SYSTEM.format(system=, input=,
round=)``), which folds the system prompt into the user message for models
that have no system role (Gemma 2).

``PROMPT_TEMPLATE.hf_chat_template`` is special: it tells the encoder to
render with the tokenizer's own jinja ``chat_template``; its optional fields
``TRAIN_ON_REASONING`` (default True) and ``ENABLE_THINKING`` (default: not
passed) are the reasoning settings (``dict(PROMPT_TEMPLATE.hf_chat_template,
TRAIN_ON_REASONING=False)``).

The chat formats ``qwen3``, ``qwen3_no_think``, ``qwen2_5`` and ``llama3_1`` are entries of
that mode with a ``CHAT_FORMAT`` (fields: ``CHAT_FORMAT_FIELDS``): the model family's official
chat template written as format strings (system, tools, reasoning, tool calls and results),
which the encoder renders in place of the tokenizer's jinja (``sfttool.dataset.chat_format``).
"""
from __future__ import annotations

import difflib
from typing import Any, Mapping

from mmengine.config import ConfigDict

# Values a template may leave out; every built-in is completed with them.
TEMPLATE_DEFAULTS = dict(SYSTEM="{system}\n", INSTRUCTION="{input}", SUFFIX="", SUFFIX_AS_EOS=False,
                         SEP="", STOP_WORDS=[])
TEMPLATE_FIELDS = tuple(TEMPLATE_DEFAULTS)
# The HF chat-template entry's settings (docs/reasoning_and_tools.md): train the reasoning (<think> block) or
# not; Qwen3's enable_thinking for rows without reasoning (None: not passed to the template).
HF_CHAT_TEMPLATE_FIELDS = ("HF_CHAT_TEMPLATE", "STOP_WORDS", "TRAIN_ON_REASONING", "ENABLE_THINKING", "CHAT_FORMAT")

# A CHAT_FORMAT's fields and what each means when left out (rendered by sfttool.dataset.chat_format;
# docs/templates.md describes each). Placeholders: {system} {content} {tools} {tool} {name} {arguments}
# {results} {reasoning} {environment}.
CHAT_FORMAT_FIELDS = dict(
    BOS="",                      # text before everything (Llama: <|begin_of_text|>)
    SYSTEM="{system}\n",         # the system block, {system}: the system prompt (and the tools block)
    SYSTEM_ALWAYS=False,         # write the system block also without a system prompt or tools
    DEFAULT_SYSTEM="",           # the system prompt of a conversation that has none
    ENVIRONMENT="",              # {environment} in SYSTEM when the row has tools
    USER="{content}\n",          # a user message
    ASSISTANT="",                # an answer's header, and the generation prompt
    SUFFIX="", SEP="",           # after an answer: SUFFIX is its end-of-turn (trained), SEP is not
    TRIM=False,                  # strip whitespace around system, user and answer text (Llama 3.1)
    TOOLS="", TOOL="",           # the tools block ({tools}: each schema through TOOL, {tool}: its JSON)
    TOOL_INDENT=None,            # json indent of a schema
    TOOLS_IN="system",           # where the tools block goes: "system" (after the system prompt) or "user"
    TOOL_CALL="", TOOL_CALL_SEP="\n",  # one call ({name}, {arguments} as JSON); between calls and after content
    CALLS_REPLACE_CONTENT=False,  # an answer with tool calls shows only them (Llama 3.1)
    MAX_TOOL_CALLS=0,            # calls allowed per answer (0: any number)
    TOOL_RESULTS="{results}", TOOL_RESULT="",  # a run of tool messages; one of them ({content})
    TOOL_RESULT_JSON=False,      # a tool result is written as a JSON string (Llama 3.1)
    REASONING="",                # an answer's reasoning before its content ({reasoning}; Qwen3's rule)
    NO_THINK="",                 # after the generation prompt when ENABLE_THINKING=False
)

_CHATML = dict(
    SYSTEM="<|im_start|>system\n{system}<|im_end|>\n",
    INSTRUCTION="<|im_start|>user\n{input}<|im_end|>\n<|im_start|>assistant\n",
    SUFFIX="<|im_end|>",
    SUFFIX_AS_EOS=True,
    SEP="\n",
    STOP_WORDS=["<|im_end|>", "<|endoftext|>"],
)

_VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant "
                  "gives helpful, detailed, and polite answers to the user's questions. {system}\n ")

_DEEPSEEK_CODER_SYSTEM = (
    "You are an AI programming assistant, utilizing the DeepSeek Coder model, developed by "
    "DeepSeekCompany, and you only answer questions related to computer science. For politically "
    "sensitive questions, security and privacy issues, and other non-computer science questions, "
    "you will refuse to answer. {system}\n")

# Mistral/Mixtral instruct: `<s>[INST] q1 [/INST]a1</s>[INST] q2 [/INST]a2</s>`. There is no
# system role; mistral-common prepends the system prompt to the first user message.
# (XTuner 0.2: SYSTEM='[INST] {system} [/INST]\n', SEP='\n', a turn and a newline the model never saw.)
_MISTRAL = dict(SYSTEM="[INST] {system}\n\n{input} [/INST]", INSTRUCTION="[INST] {input} [/INST]")
# DeepSeek-MoE keeps XTuner 0.2's value.
_XTUNER_INST = dict(SYSTEM="[INST] {system} [/INST]\n", INSTRUCTION="[INST] {input} [/INST]", SEP="\n")

# - Turn 0: SYSTEM + INSTRUCTION, [output + SUFFIX], SEP
# - Turn 1: INSTRUCTION, [output + SUFFIX], SEP
# [] marks the trained part.
_TEMPLATES: dict[str, dict[str, Any]] = dict(
    default=dict(SYSTEM="<|System|>:{system}\n", INSTRUCTION="<|User|>:{input}\n<|Bot|>:", SEP="\n"),
    # Zephyr ends every message with </s>: `<|user|>\nq</s>\n<|assistant|>\na</s>\n`.
    # (XTuner 0.2 left </s> out after the system and user messages.)
    zephyr=dict(SYSTEM="<|system|>\n{system}</s>\n", INSTRUCTION="<|user|>\n{input}</s>\n<|assistant|>\n",
                SEP="\n"),
    internlm_chat=dict(SYSTEM="<|System|>:{system}\n", INSTRUCTION="<|User|>:{input}<eoh>\n<|Bot|>:",
                       SUFFIX="<eoa>", SUFFIX_AS_EOS=True, SEP="\n", STOP_WORDS=["<eoa>"]),
    internlm2_chat=dict(_CHATML, STOP_WORDS=["<|im_end|>"]),
    moss_sft=dict(SYSTEM="{system}\n", INSTRUCTION="<|Human|>: {input}<eoh>\n", SEP="\n",
                  STOP_WORDS=["<eoc>", "<eom>"]),
    # Llama 2 chat: `<s>[INST] <<SYS>>\nsys\n<</SYS>>\n\nq1 [/INST] a1 </s><s>[INST] q2 [/INST] a2 </s>`:
    # the system block sits inside the first [INST]. (XTuner 0.2 put Meta's default
    # system prompt in a separate [INST] turn before every custom one, and a newline between turns.)
    llama2_chat=dict(SYSTEM="[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{input} [/INST]",
                     INSTRUCTION="[INST] {input} [/INST]"),
    code_llama_chat=dict(SYSTEM="{system}\n", INSTRUCTION="[INST] {input} [/INST]"),
    chatglm2=dict(SYSTEM="{system}\n", INSTRUCTION="[Round {round}]\n\n问：{input}\n\n答：", SEP="\n\n"),
    chatglm3=dict(SYSTEM="<|system|>\n{system}", INSTRUCTION="<|user|>\n{input}<|assistant|>\n", SEP="\n"),
    qwen_chat=dict(_CHATML),
    # Qwen3 in non-thinking mode: its chat template puts an empty think block
    # before the answer of the current turn. It sits in INSTRUCTION, so it is
    # part of every prompt (never trained) and inference prompts end with it too.
    qwen3_chat=dict(_CHATML,
                    INSTRUCTION=("<|im_start|>user\n{input}<|im_end|>\n"
                                 "<|im_start|>assistant\n<think>\n\n</think>\n\n")),
    baichuan_chat=dict(SYSTEM="{system}\n", INSTRUCTION="<reserved_102>{input}<reserved_103>", SEP="\n"),
    baichuan2_chat=dict(SYSTEM="{system}\n", INSTRUCTION="<reserved_106>{input}<reserved_107>", SEP="\n"),
    wizardlm=dict(SYSTEM=_VICUNA_SYSTEM, INSTRUCTION="USER: {input} ASSISTANT:", SEP="\n"),
    wizardcoder=dict(
        SYSTEM=("Below is an instruction that describes a task. Write a response that appropriately "
                "completes the request.\n\n{system}\n "),
        INSTRUCTION="### Instruction:\n{input}\n\n### Response:", SEP="\n\n"),
    vicuna=dict(SYSTEM=_VICUNA_SYSTEM, INSTRUCTION="USER: {input} ASSISTANT:", SEP="\n"),
    deepseek_coder=dict(SYSTEM=_DEEPSEEK_CODER_SYSTEM, INSTRUCTION="### Instruction:\n{input}\n### Response:\n",
                        SEP="\n"),
    deepseekcoder=dict(SYSTEM=_DEEPSEEK_CODER_SYSTEM, INSTRUCTION="### Instruction:\n{input}\n### Response:\n",
                       SEP="\n"),
    deepseek_moe=dict(_XTUNER_INST),
    deepseek_v2=dict(SYSTEM="{system}\n\n", INSTRUCTION="User: {input}\n\nAssistant: ",
                     SUFFIX="<｜end▁of▁sentence｜>", SUFFIX_AS_EOS=True, STOP_WORDS=["<｜end▁of▁sentence｜>"]),
    mistral=dict(_MISTRAL),
    mixtral=dict(_MISTRAL),
    # Mistral's v3 SentencePiece tokenizer (Mistral-7B-Instruct-v0.3): [INST]/[/INST] are control
    # tokens and no space precedes [/INST]: `<s>[INST] q1[/INST] a1</s>[INST] q2[/INST]`.
    mistral_v3=dict(_MISTRAL, SYSTEM="[INST] {system}\n\n{input}[/INST]", INSTRUCTION="[INST] {input}[/INST]"),
    # Mistral's tekken tokenizer (Mistral-Nemo) has no dummy-prefix space, and its format none either:
    # `<s>[INST]q1[/INST]a1</s>[INST]q2[/INST]`.
    mistral_nemo=dict(_MISTRAL, SYSTEM="[INST]{system}\n\n{input}[/INST]", INSTRUCTION="[INST]{input}[/INST]"),
    minicpm=dict(INSTRUCTION="<用户> {input} <AI>", SEP="\n"),
    minicpm3=dict(_CHATML),
    # Gemma (1) has no system role; XTuner 0.2 invented a `system` turn and kept it.
    gemma=dict(SYSTEM="<start_of_turn>system\n{system}<end_of_turn>\n",
               INSTRUCTION="<start_of_turn>user\n{input}<end_of_turn>\n<start_of_turn>model\n",
               SUFFIX="<end_of_turn>", SUFFIX_AS_EOS=False, SEP="\n", STOP_WORDS=["<end_of_turn>"]),
    # Gemma 2 rejects a system role: the system prompt opens the first user
    # message (as Gemma 3's own template does), and <end_of_turn> ends a turn.
    gemma2=dict(SYSTEM="<start_of_turn>user\n{system}\n\n{input}<end_of_turn>\n<start_of_turn>model\n",
                INSTRUCTION="<start_of_turn>user\n{input}<end_of_turn>\n<start_of_turn>model\n",
                SUFFIX="<end_of_turn>", SUFFIX_AS_EOS=True, SEP="\n", STOP_WORDS=["<end_of_turn>"]),
    cohere_chat=dict(
        SYSTEM="<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{system}<|END_OF_TURN_TOKEN|>",
        INSTRUCTION=("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{input}<|END_OF_TURN_TOKEN|>"
                     "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
        SUFFIX="<|END_OF_TURN_TOKEN|>", SUFFIX_AS_EOS=True, STOP_WORDS=["<|END_OF_TURN_TOKEN|>"]),
    llama3_chat=dict(
        SYSTEM="<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>",
        INSTRUCTION=("<|start_header_id|>user<|end_header_id|>\n\n{input}<|eot_id|>"
                     "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        SUFFIX="<|eot_id|>", SUFFIX_AS_EOS=True, STOP_WORDS=["<|eot_id|>"]),
    phi3_chat=dict(SYSTEM="<|system|>\n{system}<|end|>\n", INSTRUCTION="<|user|>\n{input}<|end|>\n<|assistant|>\n",
                   SUFFIX="<|end|>", SUFFIX_AS_EOS=True, SEP="\n", STOP_WORDS=["<|end|>"]),
)


def complete_template(template: Mapping[str, Any]) -> ConfigDict:
    """Return ``template`` as a ConfigDict with every field present.

    >>> complete_template(dict(INSTRUCTION='Q: {input}\\nA: ')).SUFFIX_AS_EOS
    False
    """
    if template.get("HF_CHAT_TEMPLATE"):
        unknown = sorted(set(template) - set(HF_CHAT_TEMPLATE_FIELDS))
        if unknown:
            raise ValueError(f"hf_chat_template has unknown field(s) {unknown}; valid fields are "
                             f"{list(HF_CHAT_TEMPLATE_FIELDS)}")
        unknown = sorted(set(template.get("CHAT_FORMAT") or {}) - set(CHAT_FORMAT_FIELDS))
        if unknown:
            raise ValueError(f"CHAT_FORMAT has unknown field(s) {unknown}; valid fields are {list(CHAT_FORMAT_FIELDS)}")
        return ConfigDict(dict(template))
    unknown = sorted(set(template) - set(TEMPLATE_FIELDS))
    if unknown:
        raise ValueError(f"prompt template has unknown field(s) {unknown}; "
                         f"valid fields are {list(TEMPLATE_FIELDS)} (or HF_CHAT_TEMPLATE=True)")
    merged = {k: template.get(k, v) for k, v in TEMPLATE_DEFAULTS.items()}
    merged["STOP_WORDS"] = list(merged["STOP_WORDS"] or [])
    return ConfigDict(merged)


PROMPT_TEMPLATE = ConfigDict({name: complete_template(t) for name, t in _TEMPLATES.items()})
# Render with the tokenizer's own jinja chat_template at encode time.
PROMPT_TEMPLATE.hf_chat_template = ConfigDict(HF_CHAT_TEMPLATE=True, STOP_WORDS=[])

# Chat formats: official chat templates written as format strings (docs/templates.md, "Chat formats"),
# rendered in chat-template mode in place of the tokenizer's jinja, text for text.
_QWEN_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_QWEN_FORMAT = dict(
    SYSTEM="<|im_start|>system\n{system}<|im_end|>\n", USER="<|im_start|>user\n{content}<|im_end|>\n",
    ASSISTANT="<|im_start|>assistant\n", SUFFIX="<|im_end|>", SEP="\n",
    TOOLS=_QWEN_TOOLS, TOOL="\n{tool}",
    TOOL_CALL='<tool_call>\n{"name": "{name}", "arguments": {arguments}}\n</tool_call>',
    TOOL_RESULTS="<|im_start|>user{results}<|im_end|>\n", TOOL_RESULT="\n<tool_response>\n{content}\n</tool_response>")
_QWEN_STOP_WORDS = ["<|im_end|>", "<|endoftext|>"]
# Qwen2.5-Instruct: a default system prompt; reasoning is not part of its format.
_QWEN2_5_FORMAT = dict(_QWEN_FORMAT,
                       DEFAULT_SYSTEM="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
# Qwen3: no default system prompt; reasoning in a think block (empty before the last answer that has none).
_QWEN3_FORMAT = dict(_QWEN_FORMAT, REASONING="<think>\n{reasoning}\n</think>\n\n", NO_THINK="<think>\n\n</think>\n\n")
# Llama-3.1-Instruct: the date lines are the official template's defaults (its `date_string`).
_LLAMA3_1_FORMAT = dict(
    BOS="<|begin_of_text|>", SYSTEM_ALWAYS=True, ENVIRONMENT="Environment: ipython\n", TRIM=True,
    SYSTEM=("<|start_header_id|>system<|end_header_id|>\n\n{environment}Cutting Knowledge Date: December 2023\n"
            "Today Date: 26 Jul 2024\n\n{system}<|eot_id|>"),
    USER="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
    ASSISTANT="<|start_header_id|>assistant<|end_header_id|>\n\n", SUFFIX="<|eot_id|>",
    TOOLS_IN="user", TOOL="{tool}\n\n", TOOL_INDENT=4,
    TOOLS=("Given the following functions, please respond with a JSON for a function call with its proper arguments "
           'that best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": '
           'dictionary of argument name and its value}.Do not use variables.\n\n{tools}'),
    TOOL_CALL='{"name": "{name}", "parameters": {arguments}}', CALLS_REPLACE_CONTENT=True, MAX_TOOL_CALLS=1,
    TOOL_RESULT="<|start_header_id|>ipython<|end_header_id|>\n\n{content}<|eot_id|>", TOOL_RESULT_JSON=True)
PROMPT_TEMPLATE.qwen2_5 = ConfigDict(HF_CHAT_TEMPLATE=True, CHAT_FORMAT=_QWEN2_5_FORMAT, STOP_WORDS=_QWEN_STOP_WORDS)
PROMPT_TEMPLATE.qwen3 = ConfigDict(HF_CHAT_TEMPLATE=True, CHAT_FORMAT=_QWEN3_FORMAT, STOP_WORDS=_QWEN_STOP_WORDS)
PROMPT_TEMPLATE.qwen3_no_think = ConfigDict(PROMPT_TEMPLATE.qwen3, ENABLE_THINKING=False)
PROMPT_TEMPLATE.llama3_1 = ConfigDict(HF_CHAT_TEMPLATE=True, CHAT_FORMAT=_LLAMA3_1_FORMAT,
                                      STOP_WORDS=["<|eot_id|>", "<|eom_id|>"])

SYSTEM_TEMPLATE = ConfigDict(
    moss_sft=("You are an AI assistant whose name is {bot_name}.\n"
              "Capabilities and tools that {bot_name} can possess.\n"
              "- Inner thoughts: enabled.\n"
              "- Web search: enabled. API: Search(query)\n"
              "- Calculator: enabled. API: Calculate(expression)\n"
              "- Equation solver: enabled. API: Solve(equation)\n"
              "- Text-to-image: disabled.\n"
              "- Image edition: disabled.\n"
              "- Text-to-speech: disabled.\n"),
    alpaca=("Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n"),
    arxiv_gentile=("If you are an expert in writing papers, please generate "
                   "a good paper title for this paper based on other authors' "
                   "descriptions of their abstracts.\n"),
    colorist=("You are a professional color designer. Please provide the "
              "corresponding colors based on the description of Human.\n"),
    coder=("You are a professional programer. Please provide the "
           "corresponding code based on the description of Human.\n"),
    lawyer="你现在是一名专业的中国律师，请根据用户的问题给出准确、有理有据的回复。\n",
    medical="如果你是一名医生，请根据患者的描述回答医学问题。\n",
    sql=("If you are an expert in SQL, please generate a good SQL Query "
         "for Question based on the CREATE TABLE statement.\n"),
)


def is_hf_chat_template(template: Any) -> bool:
    """True for ``PROMPT_TEMPLATE.hf_chat_template`` (render with the tokenizer's jinja)."""
    return isinstance(template, Mapping) and bool(template.get("HF_CHAT_TEMPLATE"))


def chat_template_options(template: Any) -> dict:
    """The HF chat-template settings the encoder applies, lower-cased (``{}`` for other templates).

    >>> chat_template_options(dict(HF_CHAT_TEMPLATE=True, TRAIN_ON_REASONING=False))
    {'train_on_reasoning': False, 'enable_thinking': None}
    """
    if not is_hf_chat_template(template):
        return {}
    options = {"train_on_reasoning": bool(template.get("TRAIN_ON_REASONING", True)),
               "enable_thinking": template.get("ENABLE_THINKING")}
    if template.get("CHAT_FORMAT"):  # rendered in place of the tokenizer's jinja (plain data: it is hashed)
        chat_format = template["CHAT_FORMAT"]
        options["chat_format"] = dict(chat_format.to_dict() if hasattr(chat_format, "to_dict") else chat_format)
    return options


def get_template(name_or_dict: str | Mapping[str, Any]) -> ConfigDict:
    """Look a template up by name, or complete a template dict.

    >>> get_template('qwen_chat').SUFFIX
    '<|im_end|>'
    >>> get_template('qwen_caht')
    Traceback (most recent call last):
    ...
    ValueError: unknown prompt template 'qwen_caht'; valid names: qwen_chat, qwen3_chat, ...
    """
    if isinstance(name_or_dict, Mapping):
        return complete_template(name_or_dict)
    if not isinstance(name_or_dict, str):
        raise TypeError(f"a prompt template is a name or a dict, got {type(name_or_dict).__name__}")
    name = name_or_dict
    if "PROMPT_TEMPLATE." in name:  # how a dumped config spells it: 'sfttool.utils.PROMPT_TEMPLATE.qwen_chat'
        name = name.rpartition("PROMPT_TEMPLATE.")[2]
    if name in PROMPT_TEMPLATE:
        return PROMPT_TEMPLATE[name]
    names = sorted(PROMPT_TEMPLATE)
    close = difflib.get_close_matches(name, names, n=len(names), cutoff=0.5)
    ordered = close + [n for n in names if n not in close]
    raise ValueError(f"unknown prompt template {name_or_dict!r}; valid names: {', '.join(ordered)}")
