"""Sample generations during training (XTuner's ``evaluation_inputs``).

Before training, every ``every_n_iters`` iterations and after training, each
input is rendered exactly as ``sfttool chat`` renders it (``encode_prompt``
with the config's template), answered greedily by default, cut at
the stop words ``sfttool chat`` uses (``sfttool.utils.stop_words``), logged, and appended to
``work_dir/eval_outputs/iter_<n>.jsonl``:

    {"iter": 10, "input": "Hi?", "prompt": "<|im_start|>user\\nHi?...", "output": "Hello."}

With ``evaluation_images`` (a vision-language model) each input goes with its image, rendered by the
model's processor as ``sfttool chat --image`` renders it (``sfttool.tools.image_chat``); the record
names the image.

Every rank generates (ZeRO-3 needs all ranks in each forward); rank 0 writes. At the end the
terminal shows each input's answers before and after training and where the files are:

    Sample answers (all of them in work_dirs/demo/eval_outputs/):
      Who are you?
        iter 0:  I'm SmolLM, an AI assistant.
        iter 57: I'm Quill, an assistant made by Larkspur Labs.
"""
from __future__ import annotations

import json
import os
from typing import Any

from mmengine.dist import is_main_process
from mmengine.hooks import Hook

from sfttool import compat
from sfttool.dataset.images_stage import build_processor
from sfttool.engine.runner import DRY_RUN_INFO, unwrap_model
from sfttool.model.hf_folder import config_processor
from sfttool.registry import BUILDER, build_if_config
from sfttool.tools.image_chat import image_messages, prompt_inputs
from sfttool.utils.stop_words import cut_at_stop_words, stop_words_for


@BUILDER.register_module()
class EvaluateChatHook(Hook):
    """XTuner's arguments; ``stop_word`` (one string) is accepted too.

    ``generation_kwargs`` go to ``generate`` over the hook's defaults (greedy,
    ``max_new_tokens``, end at EOS or a stop word that is one token, the KV
    cache, ``synced_gpus`` under ZeRO-3): a key given there wins, so
    ``generation_kwargs=dict(max_new_tokens=5)`` beats ``max_new_tokens=600``.
    """

    priority = "LOW"

    def __init__(self, tokenizer, evaluation_inputs, evaluation_images=None, image_processor=None, system="",
                 prompt_template=None, every_n_iters=None, max_new_tokens=600, stop_word=None, stop_words=[],
                 generation_kwargs={}, processor=None):
        self.tokenizer = build_if_config(tokenizer, "EvaluateChatHook.tokenizer")
        self.evaluation_inputs = [evaluation_inputs] if isinstance(evaluation_inputs, str) else list(evaluation_inputs)
        self.evaluation_images = evaluation_image_list(evaluation_images, len(self.evaluation_inputs))
        # The model's processor renders image prompts: ``processor`` or ``image_processor`` when it is a whole
        # processor (XTuner passes a CLIP image processor there, which cannot render a prompt), else the one the
        # training data was encoded with (found at the first generation).
        self.processor = next((p for p in (build_processor(processor), image_processor)
                               if hasattr(p, "apply_chat_template")), None)
        self.system = system or ""
        self.prompt_template = prompt_template
        self.every_n_iters = every_n_iters
        self._extra_stop_words = list(stop_words) + ([stop_word] if stop_word else [])
        # The same words `sfttool chat` stops on; the model's own end tokens join them at generation.
        self.stop_words = stop_words_for(prompt_template, self.tokenizer, extra=self._extra_stop_words)
        self.generation_kwargs = self._default_generation_kwargs(max_new_tokens)
        self.generation_kwargs.update(generation_kwargs)
        self._generated_at = None  # the iteration generated for last
        self._first: list[dict] = []  # this run's generations before training, shown again at the end
        self._last: list[dict] = []

    def _default_generation_kwargs(self, max_new_tokens: int) -> dict:
        tokenizer = self.tokenizer
        eos = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids(
            [w for w in self.stop_words if w in tokenizer.get_vocab()])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(set(eos)),
                    pad_token_id=pad, use_cache=True)

    def before_train(self, runner) -> None:
        self._first = self._generate(runner, runner.iter)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        if self.every_n_iters and self.every_n_iters > 0 and self.every_n_train_iters(runner, self.every_n_iters):
            self._generate(runner, runner.iter + 1)

    def after_train(self, runner) -> None:
        last = self._last if self._generated_at == runner.iter else self._generate(runner, runner.iter)
        if is_main_process():
            kept = not runner.message_hub.get_info(DRY_RUN_INFO, False)  # a dry run's work dir is removed
            text = answers_text(self._first, last, os.path.join(runner.work_dir, "eval_outputs") if kept else None)
            runner.logger.info(text)
            if not compat.console_is_verbose():  # the quiet terminal shows no INFO line: print it plainly
                print(text, flush=True)

    # -- generation -------------------------------------------------------

    def prompt_ids(self, text: str) -> list[int]:
        from sfttool.dataset.encode import encode_prompt

        turn = {"input": text}
        if self.system:
            turn["system"] = self.system
        return encode_prompt([turn], self.tokenizer, self.prompt_template)

    def _generate(self, runner, iteration: int) -> list[dict]:
        model = unwrap_model(runner.model)
        self.stop_words = stop_words_for(self.prompt_template, self.tokenizer, getattr(model, "llm", None),
                                         self._extra_stop_words)
        was_training = model.training
        model.eval()
        try:
            records = [self._answer(model, runner, text, iteration, image)
                       for text, image in zip(self.evaluation_inputs, self.evaluation_images)]
        finally:
            model.train(was_training)
        self._generated_at, self._last = iteration, records
        if is_main_process():
            self._write(runner, iteration, records)
        return records

    def _answer(self, model, runner, text: str, iteration: int, image: str | None = None) -> dict:
        import torch

        device = next(model.parameters()).device
        if image is not None:  # rendered by the processor, as training encoded image rows
            inputs = prompt_inputs(self._processor(runner), image_messages([], text, [image], self.system), device)
        else:
            input_ids = torch.tensor([self.prompt_ids(text)], device=device)  # [1, prompt_len]
            inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
        ids = inputs["input_ids"][0].tolist()
        kwargs = {"synced_gpus": _zero3(runner.model), **self.generation_kwargs}
        with torch.no_grad():
            out = model.llm.generate(**inputs, **kwargs)
        answer = self.tokenizer.decode(out[0, len(ids):], skip_special_tokens=False)
        record = {"iter": iteration, "input": text, "prompt": self.tokenizer.decode(ids),
                  "output": cut_at_stop_words(answer, self.stop_words)}
        return record if image is None else {**record, "image": image}

    def _processor(self, runner):
        if self.processor is None:
            self.processor = config_processor(runner.cfg)
        if self.processor is None:
            raise ValueError("EvaluateChatHook: evaluation_images need the model's processor: set processor=... "
                             "(AutoProcessor.from_pretrained of the model), or train with a dataset's processor=...")
        return self.processor

    def _write(self, runner, iteration: int, records: list[dict]) -> None:
        from sfttool.engine.tracking import add_text

        folder = os.path.join(runner.work_dir, "eval_outputs")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"iter_{iteration}.jsonl"), "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        for record in records:
            runner.logger.info(f"Sample output (iter {iteration}):\n{record['prompt']}{record['output']}\n")
        samples = "\n\n".join(record["prompt"] + record["output"] for record in records)
        add_text(getattr(runner, "visualizer", None), "samples", samples, iteration)  # to every tracker


def evaluation_image_list(images: Any, n_inputs: int) -> list[str | None]:
    """XTuner's ``evaluation_images``: one image for every input, or one per input -> a list of
    ``n_inputs`` (None: no image)."""
    if images is None:
        return [None] * n_inputs
    images = [images] if isinstance(images, (str, os.PathLike)) else list(images)
    if len(images) == 1:
        images = images * n_inputs
    if len(images) != n_inputs:
        raise ValueError(f"EvaluateChatHook: {len(images)} evaluation_images for {n_inputs} evaluation_inputs; "
                         "give one image for all of them or one per input")
    missing = [str(image) for image in images
               if not str(image).startswith(("http://", "https://")) and not os.path.isfile(image)]
    if missing:
        raise ValueError(f"EvaluateChatHook: evaluation_images: {missing[0]} does not exist")
    return [str(image) for image in images]


SHOWN_CHARACTERS = 200  # of each answer on the terminal; the files hold all of it


def answers_text(first: list[dict], last: list[dict], folder: str | None) -> str:
    """What the terminal shows at the end: each input, its answer before and after training
    (whitespace collapsed, at most ``SHOWN_CHARACTERS``), and where all of them are (None: nowhere, a
    dry run keeps no files).

    >>> print(answers_text([{"iter": 0, "input": "Hi?", "output": "Hello."}],
    ...                    [{"iter": 8, "input": "Hi?", "output": "Hi there!\\n"}], "w/eval_outputs"))
    Sample answers (all of them in w/eval_outputs/):
      Hi?
        iter 0: Hello.
        iter 8: Hi there!
    """
    lines = [f"Sample answers (all of them in {folder}/):" if folder else "Sample answers (a dry run keeps no files):"]
    for index, record in enumerate(last):
        lines.append(f"  {_shown(record['input'])}")
        before = first[index] if index < len(first) and first[index]["iter"] != record["iter"] else None
        width = len(f"iter {record['iter']}:")
        for shown in ([before] if before else []) + [record]:
            lines.append(f"    {'iter ' + str(shown['iter']) + ':':<{width}} {_shown(shown['output'])}")
    return "\n".join(lines)


def _shown(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS].rstrip() + " [...]"


def _zero3(wrapped: Any) -> bool:
    engine = getattr(wrapped, "model", None)
    partitioned = getattr(engine, "zero_optimization_partition_weights", None)
    return bool(callable(partitioned) and partitioned())
