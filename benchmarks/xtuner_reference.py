"""A faithful per-row re-implementation of XTuner 0.2's ``encode_fn``, for
comparison only (tests check our encoder against it; the benchmark times it).

Kept as XTuner wrote it (one ``tokenizer.encode`` per text, per row), except
that a tokenizer without BOS yields no BOS instead of crashing, so it can run
on the same tokenizers.
"""
from __future__ import annotations

import copy

IGNORE_INDEX = -100


def get_bos_eos_token_ids(tokenizer):
    bos_token_id = tokenizer.bos_token_id
    eos_token_id = tokenizer.eos_token_id
    bos_token_id = [] if bos_token_id is None else bos_token_id  # XTuner: crashes later on None
    if isinstance(bos_token_id, int):
        bos_token_id = [bos_token_id]
    if isinstance(eos_token_id, int):
        eos_token_id = [eos_token_id]
    return bos_token_id, eos_token_id


def xtuner_encode_fn(example, tokenizer, max_length, input_ids_with_output=True):
    bos_token_id, eos_token_id = get_bos_eos_token_ids(tokenizer)
    is_multi_turn_conversation = len(example["conversation"]) > 1
    if is_multi_turn_conversation:
        assert input_ids_with_output

    input_ids, labels = [], []
    next_needs_bos_token = True
    for single_turn_conversation in example["conversation"]:
        input = single_turn_conversation["input"]
        input_encode = tokenizer.encode(input, add_special_tokens=False)
        if next_needs_bos_token:
            input_ids += bos_token_id
            labels += [IGNORE_INDEX] * len(bos_token_id)
        input_ids += input_encode
        labels += [IGNORE_INDEX] * len(input_encode)
        if input_ids_with_output:
            output_with_loss = single_turn_conversation.get("output_with_loss", True)
            output = single_turn_conversation["output"]
            output_encode = tokenizer.encode(output, add_special_tokens=False)
            input_ids += output_encode
            if output_with_loss:
                labels += copy.deepcopy(output_encode)
            else:
                labels += [IGNORE_INDEX] * len(output_encode)
            if single_turn_conversation.get("need_eos_token", True):
                next_needs_bos_token = True
                input_ids += eos_token_id
                if output_with_loss:
                    labels += copy.deepcopy(eos_token_id)
                else:
                    labels += [IGNORE_INDEX] * len(eos_token_id)
            else:
                next_needs_bos_token = False
            sep = single_turn_conversation.get("sep", "")
            if sep != "":
                sep_encode = tokenizer.encode(sep, add_special_tokens=False)
                input_ids += sep_encode
                labels += [IGNORE_INDEX] * len(sep_encode)

    if len(input_ids) > max_length:
        input_ids = input_ids[:max_length]
        labels = labels[:max_length]
    return {"input_ids": input_ids, "labels": labels, "length": len(input_ids)}
