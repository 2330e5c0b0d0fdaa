"""Hook helpers and hook behaviour on a built dataset, on a tiny model behind a
stand-in runner, and in short training runs."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine_helpers import logged, write_config
from sfttool.engine.hooks import DatasetInfoHook, EvaluateChatHook, ThroughputHook
from sfttool.engine.hooks.dataset_info_hook import configured_max_length, trained_spans
from sfttool.utils.stop_words import cut_at_stop_words
from sfttool.engine.hooks.throughput_hook import logical_numel, peak_tflops_of


def test_trained_spans():
    assert trained_spans([5, 6, 7, 8, 9], [-100, 6, 7, -100, 9]) == [[6, 7], [9]]
    assert trained_spans([1, 2], [-100, -100]) == []


def test_cut_at_stop_words():
    assert cut_at_stop_words("Hi.<|im_end|>junk<|endoftext|>", ["<|endoftext|>", "<|im_end|>"]) == "Hi."
    assert cut_at_stop_words("no stop", ["<|im_end|>"]) == "no stop"


def test_peak_lookup():
    assert peak_tflops_of("NVIDIA H200") == 989.0
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops_of("Mystery GPU") is None


def test_configured_max_length():
    assert configured_max_length({"train_dataloader": {"dataset": {"max_length": 8}}}) == 8
    assert configured_max_length({"train_dataloader": {"dataset": {"type": "load_processed_dataset"}}}) is None


def test_evaluate_chat_prompt_is_the_chat_prompt(tiny_tokenizer):
    """The hook renders exactly what `encode_prompt` (training / chat) renders, and
    takes its stop words from the template."""
    from sfttool.dataset.encode import encode_prompt
    from sfttool.utils import PROMPT_TEMPLATE

    hook = EvaluateChatHook(tiny_tokenizer, ["hello?"], system="Be brief.",
                            prompt_template=PROMPT_TEMPLATE.qwen_chat, stop_words=["###"])
    expected = encode_prompt([{"system": "Be brief.", "input": "hello?"}], tiny_tokenizer,
                             PROMPT_TEMPLATE.qwen_chat)
    assert hook.prompt_ids("hello?") == expected
    assert hook.stop_words == list(PROMPT_TEMPLATE.qwen_chat.STOP_WORDS) + ["###"]
    assert hook.generation_kwargs["do_sample"] is False


def test_hooks_accept_tokenizer_configs(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    cfg = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=str(tiny_tokenizer_dir))
    assert DatasetInfoHook(cfg).tokenizer.eos_token == "<|im_end|>"
    assert EvaluateChatHook(cfg, "one input").evaluation_inputs == ["one input"]
    assert ThroughputHook().peak_tflops is None


def test_evaluation_images_are_checked(tiny_tokenizer, tmp_path):
    from sfttool import assets
    with pytest.raises(ValueError, match=f"EvaluateChatHook: evaluation_images: {tmp_path}/a.png does not exist"):
        EvaluateChatHook(tiny_tokenizer, ["x"], evaluation_images=[str(tmp_path / "a.png")])
    image = str(assets.write_png(tmp_path / "b.png", 28, 28))
    with pytest.raises(ValueError, match="EvaluateChatHook: 2 evaluation_images for 3 evaluation_inputs; give one "
                                         "image for all of them or one per input"):
        EvaluateChatHook(tiny_tokenizer, ["x", "y", "z"], evaluation_images=[image, image])
    assert EvaluateChatHook(tiny_tokenizer, ["x", "y"], evaluation_images=image).evaluation_images == [image, image]


# -- EvaluateChatHook: generation_kwargs and when it generates --------------------


def fake_runner(model, work_dir, iteration=0, hooks=()):
    """What the hooks read from an mmengine runner."""
    from mmengine.logging import MessageHub

    return SimpleNamespace(model=model, work_dir=str(work_dir), iter=iteration, hooks=list(hooks),
                           logger=logging.getLogger("test_hooks"),
                           message_hub=MessageHub.get_instance("test_hooks"))


def tiny_sft(model_dir, **llm):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from sfttool.model import SupervisedFinetune

    torch.manual_seed(0)
    return SupervisedFinetune(
        llm=dict(type=AutoModelForCausalLM.from_pretrained, pretrained_model_name_or_path=str(model_dir),
                 dtype="float32", **llm),
        lora=dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout=0.0), use_activation_checkpointing=False)


def test_generation_kwargs_win_over_the_defaults(tiny_tokenizer):
    hook = EvaluateChatHook(tiny_tokenizer, ["hi"], max_new_tokens=600,
                            generation_kwargs=dict(do_sample=True, temperature=0.7, max_new_tokens=5,
                                                   eos_token_id=7, pad_token_id=8, use_cache=False))
    assert hook.generation_kwargs == dict(do_sample=True, temperature=0.7, max_new_tokens=5, eos_token_id=7,
                                          pad_token_id=8, use_cache=False)
    defaults = EvaluateChatHook(tiny_tokenizer, ["hi"], prompt_template="qwen_chat", max_new_tokens=9)
    stops = tiny_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])  # qwen_chat's STOP_WORDS
    assert defaults.generation_kwargs == dict(max_new_tokens=9, do_sample=False, eos_token_id=sorted(stops),
                                              pad_token_id=tiny_tokenizer.pad_token_id, use_cache=True)


@pytest.mark.parametrize("generation_kwargs", [
    dict(max_new_tokens=3, min_new_tokens=3),  # exactly 3 new tokens, whatever the random model says
    dict(do_sample=True, temperature=0.7),
    dict(eos_token_id=5),
    dict(pad_token_id=5),
    dict(use_cache=False),
], ids=lambda kwargs: ",".join(kwargs))
def test_generation_kwargs_reach_generate(tmp_path, tiny_qwen2_dir, tiny_tokenizer, monkeypatch,
                                          generation_kwargs):
    model = tiny_sft(tiny_qwen2_dir)
    hook = EvaluateChatHook(tiny_tokenizer, ["hello?"], prompt_template="qwen_chat", max_new_tokens=8,
                            generation_kwargs=generation_kwargs)
    seen = []
    generate = model.llm.generate

    def spy(**kwargs):
        out = generate(**kwargs)  # [1, prompt + new]
        seen.append((kwargs, out.shape[1] - kwargs["input_ids"].shape[1]))
        return out

    monkeypatch.setattr(model.llm, "generate", spy)
    hook.before_train(fake_runner(model, tmp_path))
    (kwargs, new_tokens), = seen
    assert kwargs.items() >= generation_kwargs.items()
    assert new_tokens == 3 if "max_new_tokens" in generation_kwargs else new_tokens <= 8
    assert (tmp_path / "eval_outputs" / "iter_0.jsonl").is_file()


def test_sample_generations_stop_on_the_words_chat_stops_on(tmp_path, tiny_qwen2_dir, tiny_tokenizer, monkeypatch):
    """The template's STOP_WORDS, the user's, the tokenizer's EOS and the model's generation-config end
    tokens: the hook used to miss the last, and chat the hook's `stop_word`."""
    from sfttool.tools.chat import ChatSession
    from sfttool.utils import get_template

    model = tiny_sft(tiny_qwen2_dir)
    model.llm.generation_config.eos_token_id = [tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")]
    hook = EvaluateChatHook(tiny_tokenizer, ["hi"], prompt_template="llama2_chat", stop_word="###",
                            max_new_tokens=2)
    monkeypatch.setattr(model.llm, "generate", lambda **kw: torch.cat(
        [kw["input_ids"], torch.tensor([tiny_tokenizer.encode("ok<|im_start|>x")])], dim=1))
    hook.before_train(fake_runner(model, tmp_path))
    chat = ChatSession(model.llm, tiny_tokenizer, get_template("llama2_chat"), stop_words=["###"])
    assert hook.stop_words == chat.stop_words == ["###", "<|im_end|>", "<|im_start|>"]
    record = json.loads((tmp_path / "eval_outputs" / "iter_0.jsonl").read_text())
    assert record["output"] == "ok"


@pytest.mark.parametrize("max_iters, expected", [(8, [0, 4, 8]), (10, [0, 4, 8, 10])])
def test_generates_once_per_iteration(tmp_path, tiny_tokenizer, monkeypatch, max_iters, expected):
    """When every_n_iters divides max_iters, the last iteration's generation is the final one."""
    hook = EvaluateChatHook(tiny_tokenizer, ["hi"], every_n_iters=4)
    generated = []

    def answer(model, runner, text, iteration, image=None):
        generated.append(iteration)
        return {"iter": iteration, "input": text, "prompt": text, "output": ""}

    monkeypatch.setattr(hook, "_answer", answer)
    runner = fake_runner(torch.nn.Linear(2, 2), tmp_path)
    hook.before_train(runner)
    for runner.iter in range(max_iters):
        hook.after_train_iter(runner, runner.iter)
    runner.iter = max_iters
    hook.after_train(runner)
    assert generated == expected


def test_the_terminal_shows_the_answers_before_and_after_training_and_where_they_are(tmp_path, tiny_tokenizer,
                                                                                       monkeypatch, capsys):
    """The README promises generations before and after training; the terminal (INFO hidden) showed none."""
    from sfttool import compat

    monkeypatch.setattr(compat, "console_is_verbose", lambda: False)
    hook = EvaluateChatHook(tiny_tokenizer, ["Who are you?", "2+2?"])
    answers = iter(["I am a model.", "5", "I'm Quill,\n made by\tLarkspur Labs.", "4"])
    monkeypatch.setattr(hook, "_answer", lambda model, runner, text, iteration, image=None: {
        "iter": iteration, "input": text, "prompt": text, "output": next(answers)})
    runner = fake_runner(torch.nn.Linear(2, 2), tmp_path)
    hook.before_train(runner)
    runner.iter = 12
    capsys.readouterr()
    hook.after_train(runner)
    assert capsys.readouterr().out == (
        f"Sample answers (all of them in {tmp_path}/eval_outputs/):\n"
        "  Who are you?\n    iter 0:  I am a model.\n    iter 12: I'm Quill, made by Larkspur Labs.\n"
        "  2+2?\n    iter 0:  5\n    iter 12: 4\n")
    assert sorted(p.name for p in (tmp_path / "eval_outputs").iterdir()) == ["iter_0.jsonl", "iter_12.jsonl"]
    from sfttool.engine.hooks.evaluate_chat_hook import answers_text

    long = answers_text([], [{"iter": 3, "input": "Q", "output": "word " * 60}], "w")
    assert long.splitlines()[-1] == "    iter 3: " + ("word " * 40).rstrip() + " [...]"  # 200 characters shown
    # A dry run's work dir is a scratch folder, removed when it ends: the terminal points nowhere
    from sfttool.engine.runner import DRY_RUN_INFO
    runner.message_hub.update_info(DRY_RUN_INFO, True)
    try:
        hook.after_train(runner)
    finally:
        runner.message_hub.update_info(DRY_RUN_INFO, False)
    assert capsys.readouterr().out.splitlines()[0] == "Sample answers (a dry run keeps no files):"


# -- ThroughputHook: parameters counted, values logged -----------------------------


def test_logical_numel_of_a_zero3_partitioned_parameter():
    partitioned = torch.nn.Parameter(torch.empty(0))  # what ZeRO-3 leaves on a rank
    partitioned.ds_numel = 64 * 64
    assert logical_numel(partitioned) == 4096
    assert logical_numel(torch.nn.Parameter(torch.empty(3, 5))) == 15


def test_qlora_counts_the_parameters_of_the_unquantized_model(tmp_path, tiny_qwen2_dir):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    quant = dict(type=BitsAndBytesConfig, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                 bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype="torch.float32")
    counts = []
    for model in (tiny_sft(tiny_qwen2_dir), tiny_sft(tiny_qwen2_dir, quantization_config=quant)):
        hook = ThroughputHook()
        hook.before_train(fake_runner(model, tmp_path))
        counts.append(hook.params)
    assert sum(p.numel() for p in model.parameters()) < counts[0]  # 4-bit storage: 2 values per byte
    assert counts[1] == counts[0]


def test_throughput_covers_the_logger_interval(tmp_path, monkeypatch):
    """Tokens over summed time of the last `interval` iterations."""
    from mmengine.hooks import LoggerHook

    from sfttool.engine.hooks import throughput_hook

    hook = ThroughputHook()
    runner = fake_runner(torch.nn.Linear(2, 2), tmp_path, hooks=[LoggerHook(interval=2)])
    hook.before_train(runner)
    clock = iter([0.0, 1.0, 1.0, 4.0, 4.0, 5.0])  # iterations of 1 s, 3 s, 1 s
    monkeypatch.setattr(throughput_hook.time, "perf_counter", lambda: next(clock))
    tokens_per_sec = []
    for tokens in (10, 50, 30):
        batch = {"data": {"input_ids": torch.ones(1, tokens), "labels": torch.full((1, tokens), -100)}}
        hook.before_train_iter(runner, 0, batch)
        hook.after_train_iter(runner, 0, batch)
        tokens_per_sec.append(runner.message_hub.get_scalar("train/tokens_per_sec").current())
    assert tokens_per_sec == [10 / 1, (10 + 50) / (1 + 3), (50 + 30) / (3 + 1)]


THROUGHPUT_HOOKS = "[dict(type=ThroughputHook), dict(type='engine_helpers.ThroughputProbe')]"


def throughput_run(work: Path, model_dir, data_file, deepspeed=None):
    """5 iterations of 8 packed rows, logged every iteration -> (work_dir, ThroughputProbe's record)."""
    from sfttool.engine.train import train

    work.mkdir()
    cfg = write_config(work / f"throughput_{deepspeed}.py", model_dir, data_file, batch_size=8, max_epochs=1,
                       accumulative_counts=1, save_steps=100, custom_hooks=THROUGHPUT_HOOKS)
    work_dir = train(str(cfg), work_dir=str(work / "work"), deepspeed=deepspeed)
    return work_dir, json.loads((work_dir / "throughput_probe.json").read_text())


@pytest.fixture(scope="module")
def plain_throughput(tmp_path_factory, tiny_qwen2_dir, tiny_sft_jsonl):
    """The throughput run without DeepSpeed, shared by the tests below."""
    return throughput_run(tmp_path_factory.mktemp("throughput") / "plain", tiny_qwen2_dir, tiny_sft_jsonl)


@pytest.mark.slow
def test_each_log_line_has_its_own_iterations_throughput(plain_throughput):
    """The logger (BELOW_NORMAL) reads the message hub after ThroughputHook wrote this
    iteration's values: trained / processed tokens per second on line i is batch i's
    trained fraction (the seconds cancel), from the first line to the last."""
    work_dir, probe = plain_throughput
    tokens, trained = logged(work_dir, "tokens_per_sec"), logged(work_dir, "trained_tokens_per_sec")
    assert len(tokens) == len(trained) == len(logged(work_dir)) == 5
    fractions = [probe["trained_fraction"][str(i)] for i in range(1, 6)]
    assert len(set(fractions)) == 5  # a value from another iteration would not match
    assert [t / p for p, t in zip(tokens, trained)] == pytest.approx(fractions)


@pytest.mark.slow
def test_zero3_counts_the_whole_model(tmp_path, tiny_qwen2_dir, tiny_sft_jsonl, plain_throughput):
    """ZeRO-3 has partitioned the parameters by before_train; they count at full size."""
    pytest.importorskip("deepspeed")
    _, plain = plain_throughput
    _, zero3 = throughput_run(tmp_path / "zero3", tiny_qwen2_dir, tiny_sft_jsonl, deepspeed="zero3")
    assert zero3["params"] == plain["params"] > 0


def test_hooks_are_built_through_sfttools_build_with_mmengines_priority_key():
    from mmengine.hooks import LoggerHook

    from sfttool.engine.assemble import _build_hook
    from sfttool.registry import ConfigBuildError

    hook = _build_hook(dict(type=ThroughputHook, priority="LOW"), "custom_hooks[0]")
    assert isinstance(hook, ThroughputHook) and hook.priority == 70
    with pytest.raises(ConfigBuildError, match=r"^default_hooks\.logger: building LoggerHook failed: .*'intervl'"):
        _build_hook(dict(type=LoggerHook, intervl=3), "default_hooks.logger")
    assert _build_hook(dict(type="IterTimerHook"), "default_hooks.timer") == dict(type="IterTimerHook")
