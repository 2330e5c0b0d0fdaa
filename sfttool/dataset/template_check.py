"""Does a configured PROMPT_TEMPLATE fit the tokenizer? One check for
``check-custom-dataset`` and the train entry alike.

    >>> template_mismatch(PROMPT_TEMPLATE.llama3_chat, chatml_tokenizer)    # doctest: +SKIP
    "the configured template renders differently from the tokenizer's chat_template (first difference ..."

The template's text is rendered with the encoder's own pieces and BOS rule
(``encode.pieces_text``), so a BOS the encoder does not emit (SmolLM2's BOS is
``<|im_start|>``, which every ChatML turn starts with) is not reported as a
difference.
"""
from __future__ import annotations

import re
from typing import Any

from sfttool.dataset.conversation import to_messages
from sfttool.dataset.encode import pieces_text, template_pieces

MARKER = re.compile(r"</?\|?[A-Za-z_][\w\-]*\|?>")

PROBE = [{"system": "You are a helpful assistant.", "input": "Hello?", "output": "Hi there."},
         {"input": "How are you?", "output": "Fine, thanks."}]


def template_text(template: Any, tokenizer, conversation: list[dict]) -> str:
    """The text the encoder trains on for ``conversation`` with ``template`` (BOS/EOS as their token text)."""
    from sfttool.dataset.map_fns import template_map_fn_factory
    turns = template_map_fn_factory(template)({"conversation": conversation})["conversation"]
    return pieces_text(template_pieces(turns), tokenizer)


def split_markers(template: Any, tokenizer) -> list[str]:
    """One warning per role marker of ``template`` that is several tokens for ``tokenizer`` (a marker of
    another model family)."""
    chat_format = template.get("CHAT_FORMAT") if template is not None else None
    if template is None or (template.get("HF_CHAT_TEMPLATE") and not chat_format):
        return []
    # A chat format's role markers only: its tool tags may be plain text to the model (Qwen's <tools>).
    source, fields = ((chat_format, ("BOS", "SYSTEM", "USER", "ASSISTANT", "SUFFIX")) if chat_format
                      else (template, ("SYSTEM", "INSTRUCTION", "SUFFIX", "SEP")))
    texts = [str(source.get(f) or "") for f in fields]
    warnings = []
    for marker in sorted({m for t in texts for m in MARKER.findall(t)}):
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(ids) > 1:
            warnings.append(f"template marker {marker!r} is {len(ids)} tokens for this tokenizer "
                            f"({tokenizer.convert_ids_to_tokens(ids)}): it is not a special token of this "
                            "model, so the template probably belongs to another model family")
    return warnings


def template_warnings(template: Any, tokenizer) -> list[str]:
    """Everything ``check-custom-dataset`` and ``train`` say about ``template`` for ``tokenizer``: a render
    that differs from the tokenizer's chat_template first (it names the first differing text), then each
    role marker the tokenizer splits."""
    mismatch = template_mismatch(template, tokenizer)
    return ([mismatch] if mismatch else []) + split_markers(template, tokenizer)


def template_mismatch(template: Any, tokenizer) -> str | None:
    """How ``template`` renders differently from the tokenizer's own ``chat_template`` (the first
    differing text of each), or None when they agree, when there is nothing to compare, or when the
    template is ``hf_chat_template`` (the tokenizer's own)."""
    if template is None or template.get("HF_CHAT_TEMPLATE") or not getattr(tokenizer, "chat_template", None):
        return None
    for probe in (PROBE, [{k: v for k, v in t.items() if k != "system"} for t in PROBE]):
        try:
            theirs = tokenizer.apply_chat_template(to_messages(probe), tokenize=False)
        except Exception:  # some chat templates reject a system role: retry without
            continue
        ours = template_text(template, tokenizer, probe)
        if ours.rstrip() == theirs.rstrip():
            return None
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        return ("the configured template renders differently from the tokenizer's chat_template "
                f"(first difference at character {at}):\n  template:      {ours[max(0, at - 30):at + 40]!r}"
                f"\n  chat_template: {theirs[max(0, at - 30):at + 40]!r}\n  use "
                "PROMPT_TEMPLATE.hf_chat_template to train on exactly the model's own format")
    return None
