"""Apply a prompt template to standard ``conversation`` rows.

This is the one place turn text is rendered from a template: training
(``process_hf_dataset``), evaluation hooks and ``chat`` all go through it, so
the text a model is trained on is the text it is prompted with.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping

from sfttool.registry import MAP_FUNC
from sfttool.utils.templates import get_template, is_hf_chat_template


def render_input(template: Mapping[str, Any], input: str | None, system: str | None = None, round: int = 1) -> str:
    """The prompt text of one turn: optional system prompt, then the instruction.

    >>> render_input(dict(SYSTEM='S:{system}\\n', INSTRUCTION='U:{input}\\nA:'), 'hi', 'be kind')
    'S:be kind\\nU:hi\\nA:'

    A SYSTEM containing ``{input}`` renders the whole turn (system folded into
    the user message, for models without a system role).
    """
    return _render_input(*_input_formats(template), input, system, round)


def _input_formats(template: Mapping[str, Any]) -> tuple[str, str]:
    """``(SYSTEM, INSTRUCTION)``, read once per conversation or batch (``conversation_renderer``)."""
    return template.get("SYSTEM", "{system}\n"), template.get("INSTRUCTION", "{input}")


def _render_input(system_format: str, instruction: str, input: str | None, system: str | None, round: int) -> str:
    input = input or ""
    if system:
        if "{input}" in system_format:
            return system_format.format(system=system, input=input, round=round)
        return system_format.format(system=system) + instruction.format(input=input, round=round)
    return instruction.format(input=input, round=round)


def template_map_fn(example: Mapping[str, Any], template: Mapping[str, Any]) -> dict[str, list[dict]]:
    """Render each turn's prompt and answer text with ``template``.

    >>> tpl = dict(SYSTEM='S:{system}\\n', INSTRUCTION='U:{input}\\nA:', SUFFIX='</a>',
    ...            SUFFIX_AS_EOS=True, SEP='\\n')
    >>> template_map_fn({'conversation': [{'system': 'sys', 'input': 'hi', 'output': 'yo'}]}, tpl)
    {'conversation': [{'system': 'sys', 'input': 'S:sys\\nU:hi\\nA:', 'output': 'yo</a>', 'need_eos_token': False, 'sep': '\\n'}]}

    Each turn gets ``need_eos_token`` (append the tokenizer's EOS after the
    output: ``not SUFFIX_AS_EOS``) and ``sep`` (untrained text after the turn).
    A turn without an ``output`` (the prompt turn at inference) keeps none.
    Other keys (``system``, ``output_with_loss``) are kept. The input row is
    not modified. With the hf_chat_template the row is returned unchanged:
    the encoder renders it with the tokenizer's own chat template.
    """
    return {"conversation": conversation_renderer(template)(example.get("conversation"))}


def conversation_renderer(template: Mapping[str, Any]) -> Callable[[list[dict] | None], list[dict]]:
    """``template_map_fn``'s work on one conversation, with the template read once: a config's template is
    an mmengine ``ConfigDict``, whose ``get`` costs microseconds, and the encode stage renders a batch of
    conversations with one template (``stages.templated``)."""
    if is_hf_chat_template(template):
        return lambda conversation: list(conversation or [])
    suffix = template.get("SUFFIX") or ""
    need_eos_token = not template.get("SUFFIX_AS_EOS", False)
    sep = template.get("SEP") or ""
    system_format, instruction = _input_formats(template)

    def render(conversation: list[dict] | None) -> list[dict]:
        rendered = []
        for i, turn in enumerate(conversation or []):
            new_turn = dict(turn)
            new_turn["input"] = _render_input(system_format, instruction, turn.get("input"), turn.get("system"),
                                              i + 1)
            if turn.get("output") is not None:
                new_turn["output"] = turn["output"] + suffix
            new_turn["need_eos_token"] = need_eos_token
            new_turn["sep"] = sep
            rendered.append(new_turn)
        return rendered
    return render


@MAP_FUNC.register_module()
def template_map_fn_factory(template: str | Mapping[str, Any]) -> partial:
    """A picklable ``row -> row`` function for ``datasets.map`` (stable cache fingerprint).

    ``template`` is a template dict or a name in ``PROMPT_TEMPLATE``.
    """
    template = get_template(template)
    return partial(template_map_fn, template=template)
