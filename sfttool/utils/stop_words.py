"""Where generated text ends: one list of stop words for ``sfttool chat`` and the
training's sample generations (``EvaluateChatHook``), so both stop on the same words.

    >>> stop_words_for('qwen_chat', tokenizer, extra=['###'])  # doctest: +SKIP
    ['<|im_end|>', '<|endoftext|>', '###']
    >>> cut_at_stop_words('Hello!<|im_end|>\\n<|im_start|>', ['<|im_end|>'])  # doctest: +SKIP
    'Hello!'
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from sfttool.utils.templates import get_template


def stop_words_for(template: Mapping | str | None, tokenizer, model=None, extra: Iterable[str] = ()) -> list[str]:
    """The template's STOP_WORDS, ``extra`` (the user's), and the texts of the tokenizer's and the
    model's generation config's end tokens, without duplicates, in that order. ``template`` is a
    template dict, a built-in's name, or None."""
    if isinstance(template, str):
        template = get_template(template)
    words = list((template or {}).get("STOP_WORDS") or []) + [w for w in extra if w]
    end_ids: list[Any] = [tokenizer.eos_token_id]
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    end_ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
    words += [tokenizer.convert_ids_to_tokens(i) for i in end_ids if i is not None]
    return list(dict.fromkeys(w for w in words if w))


def cut_at_stop_words(text: str, stop_words: Iterable[str]) -> str:
    """Text before the first stop word.

    >>> cut_at_stop_words('a</s>b<|im_end|>', ['<|im_end|>', '</s>'])
    'a'
    """
    cut = len(text)
    for word in stop_words:
        pos = text.find(word) if word else -1
        if pos >= 0:
            cut = min(cut, pos)
    return text[:cut]
