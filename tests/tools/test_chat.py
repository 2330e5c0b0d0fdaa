"""`sfttool chat`: prompts identical to training, stop words honoured and
hidden, history kept as training rows hold it, non-interactive use."""
from __future__ import annotations

import io
import re
import shutil

import pytest
from click.testing import CliRunner

from sfttool.cli.main import cli
from sfttool.tools.chat import (ChatError, ChatSession, GenerationSettings, _held_back, cut_at_stop_words,
                                make_streamer, resolve_system, resolve_template, template_from_saved_config)
from sfttool.utils import PROMPT_TEMPLATE, SYSTEM_TEMPLATE, get_template

GREEDY = GenerationSettings(max_new_tokens=12, temperature=0)


def test_cut_at_the_first_stop_word():
    assert cut_at_stop_words("Hi!<|im_end|>\n<|im_start|>", ["<|endoftext|>", "<|im_end|>"]) == "Hi!"
    assert cut_at_stop_words("no stop here", ["</s>"]) == "no stop here"
    assert cut_at_stop_words("a</s>b<|im_end|>", ["<|im_end|>", "</s>"]) == "a"


def test_held_back_is_the_longest_possible_start_of_a_stop_word():
    assert _held_back("Hello <|im", ["<|im_end|>"]) == 4
    assert _held_back("Hello <", ["<|im_end|>", "</s>"]) == 1
    assert _held_back("Hello", ["<|im_end|>"]) == 0


def test_streamer_never_prints_a_stop_word_split_across_chunks(tiny_tokenizer):
    out = io.StringIO()
    streamer = make_streamer(tiny_tokenizer, ["<|im_end|>"], out)
    for chunk in ["The answer ", "is 42.<|im", "_end|>", "\n<|im_start|>user"]:
        streamer.on_finalized_text(chunk)
    streamer.on_finalized_text("", stream_end=True)
    assert out.getvalue() == "The answer is 42.\n"


def test_streamer_flushes_a_held_back_tail_at_the_end(tiny_tokenizer):
    out = io.StringIO()
    streamer = make_streamer(tiny_tokenizer, ["<|im_end|>"], out)
    streamer.on_finalized_text("less than <")
    assert out.getvalue() == "less than "
    streamer.on_finalized_text("", stream_end=True)
    assert out.getvalue() == "less than <\n"


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()


def test_prompts_are_the_training_encoding(tiny_model, tiny_tokenizer_bos):
    """After a turn, the next prompt is token for token the training encoding of
    the conversation so far, up to where the new answer starts."""
    from sfttool.dataset.encode import encode_batch
    from sfttool.dataset.map_fns import template_map_fn_factory

    template = get_template("qwen_chat")
    session = ChatSession(tiny_model, tiny_tokenizer_bos, template, system="Be brief.", settings=GREEDY)
    first = session.ask("hello world")
    assert session.history == [{"input": "hello world", "output": first, "system": "Be brief."}]
    prompt = session.prompt_ids("the cat")
    row = {"conversation": session.history + [{"input": "the cat", "output": "a dog."}]}
    row = template_map_fn_factory(template)(row)
    encoded = encode_batch({"conversation": [row["conversation"]]}, [0], tiny_tokenizer_bos, 4096)
    train_ids, labels = encoded["input_ids"][0], encoded["labels"][0]
    assert train_ids[:len(prompt)] == prompt
    # ... and the prompt ends exactly where the trained answer "a dog." begins.
    answer = tiny_tokenizer_bos("a dog.<|im_end|>", add_special_tokens=False).input_ids
    assert labels[len(prompt) - 1] == -100 and labels[len(prompt):len(prompt) + len(answer)] == answer


def test_generation_stops_at_a_stop_word_and_hides_it(tiny_model, tiny_tokenizer_bos):
    template = get_template("qwen_chat")
    free = ChatSession(tiny_model, tiny_tokenizer_bos, template, settings=GREEDY).ask("the cat")
    assert len(free) > 6
    stop = free[3:6]  # a piece of what the model says unprompted
    out = io.StringIO()
    stopped = ChatSession(tiny_model, tiny_tokenizer_bos, template, stop_words=[stop], settings=GREEDY)
    answer = stopped.ask("the cat", out)
    assert answer == free[:free.index(stop)]
    assert out.getvalue() == answer + "\n"
    assert stopped.history[0]["output"] == answer


def test_greedy_is_deterministic_and_reset_forgets(tiny_model, tiny_tokenizer_bos):
    session = ChatSession(tiny_model, tiny_tokenizer_bos, get_template("qwen_chat"), settings=GREEDY)
    a = session.ask("hello world")
    session.reset()
    assert session.history == [] and session.ask("hello world") == a


def test_template_resolution_order(tiny_tokenizer, tmp_path):
    assert resolve_template(tiny_tokenizer, "qwen_chat")[0] == PROMPT_TEMPLATE.qwen_chat
    assert resolve_template(tiny_tokenizer, hf_template=True)[0] == PROMPT_TEMPLATE.hf_chat_template
    (tmp_path / "sfttool_config.py").write_text("prompt_template = 'sfttool.utils.PROMPT_TEMPLATE.llama3_chat'\n")
    assert template_from_saved_config(tmp_path) == "llama3_chat"
    template, source = resolve_template(tiny_tokenizer, folders=[tmp_path])
    assert template == PROMPT_TEMPLATE.llama3_chat and source.endswith("sfttool_config.py")
    assert resolve_template(tiny_tokenizer)[1] == "the tokenizer's chat_template"
    with pytest.raises(ChatError, match="unknown prompt template 'qwen_caht'; valid names: qwen_chat"):
        resolve_template(tiny_tokenizer, "qwen_caht")
    with pytest.raises(ChatError, match="not both"):
        resolve_template(tiny_tokenizer, "qwen_chat", hf_template=True)


def test_system_from_text_or_template():
    assert resolve_system("You are Pico.") == "You are Pico."
    assert resolve_system(system_template="alpaca") == SYSTEM_TEMPLATE.alpaca
    with pytest.raises(ChatError, match="unknown system template 'alpacca'"):
        resolve_system(system_template="alpacca")


# ---------------------------------------------------------------------------
# The command, non-interactive: base + the run's adapter, template from the saved config.

@pytest.fixture(scope="module")
def converted_adapter(lora_run, lora_cfg_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("chat_adapter") / "adapter"
    result = CliRunner().invoke(cli, ["convert", "pth_to_hf", str(lora_cfg_path), str(lora_run / "iter_4.pth"),
                                      str(out)])
    assert result.exit_code == 0, result.output
    return out


def run_chat(*args, input=None):
    return CliRunner().invoke(cli, ["chat", *map(str, args)], input=input)


@pytest.mark.slow
def test_chat_command_answers_prompts_with_the_training_template(tiny_llama_dir, converted_adapter):
    result = run_chat(tiny_llama_dir, "--adapter", converted_adapter, "--temperature", "0",
                      "--max-new-tokens", "8", "--prompt", "hello world", "--prompt", "the cat")
    assert result.exit_code == 0, result.output
    assert f"Prompt template: {converted_adapter / 'sfttool_config.py'}" in result.stderr
    answers = result.stdout.split("\n")
    assert len(answers) == 3 and answers[2] == "" and answers[0] and answers[1]
    assert "<|im_end|>" not in result.stdout


@pytest.mark.slow
def test_chat_reads_stdin_when_it_is_not_a_terminal(tiny_llama_dir, converted_adapter):
    args = (tiny_llama_dir, "--adapter", converted_adapter, "--temperature", "0", "--max-new-tokens", "8",
            "--no-streamer")
    both = run_chat(*args, "--prompt", "hello world", "--prompt", "the cat")
    piped = run_chat(*args, input="hello world\n\nthe cat\nEXIT\nnever asked\n")
    assert piped.exit_code == 0, piped.output
    assert piped.stdout == both.stdout
    reset = run_chat(*args, input="hello world\nRESET\nthe cat\n")
    alone = run_chat(*args, "--prompt", "the cat")
    assert reset.stdout.split("\n")[1] == alone.stdout.split("\n")[0]


@pytest.mark.slow
def test_chat_user_errors_are_one_line(tiny_llama_dir, tmp_path):
    result = run_chat(tiny_llama_dir, "--adapter", tmp_path, "--prompt", "hi")
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == f"Error: {tmp_path}: not a peft adapter folder (no adapter_config.json)"
    result = run_chat(tiny_llama_dir, "--prompt-template", "nope", "--prompt", "hi")
    assert result.exit_code == 1 and "Error: unknown prompt template 'nope'" in result.output


# ---------------------------------------------------------------------------
# The real SmolLM2: its own end-of-turn token ends the answer, with either template spelling.

@pytest.mark.real_asset
@pytest.mark.parametrize("template", ["--hf-template", "qwen_chat"])
def test_real_model_stops_at_its_end_of_turn(smollm2_dir, template):
    args = ["--hf-template"] if template == "--hf-template" else ["--prompt-template", template]
    result = run_chat(smollm2_dir, *args, "--temperature", "0", "--max-new-tokens", "40", "--prompt",
                      "What is the capital of France?")
    assert result.exit_code == 0, result.output
    assert result.stdout == "The capital of France is Paris.\n"


def test_the_runs_own_adapter_folder_names_the_training_template(lora_run, tiny_tokenizer):
    template, source = resolve_template(tiny_tokenizer, folders=[lora_run / "hf_adapter"])
    assert template == PROMPT_TEMPLATE.qwen_chat and source.endswith("hf_adapter/sfttool_config.py")


@pytest.mark.parametrize("bits, layer", [(4, "Linear4bit"), (8, "Linear8bitLt")])
def test_bits_loads_the_model_quantised_and_it_answers(tiny_llama_dir, bits, layer):
    from sfttool.tools.chat import load_chat_model

    model, tokenizer = load_chat_model(tiny_llama_dir, bits=bits)
    assert any(type(m).__name__ == layer for m in model.modules())
    answer = ChatSession(model, tokenizer, get_template("qwen_chat"), settings=GREEDY).ask("hello world")
    assert isinstance(answer, str) and "<|im_end|>" not in answer


@pytest.mark.slow
def test_training_outputs_given_as_model_are_one_line(lora_run, tmp_path):
    def error(model):
        result = run_chat(model, "--prompt", "hi")
        assert result.exit_code == 1
        return result.output.splitlines()[-1]

    ckpt, config = lora_run / "iter_4.pth", lora_run / "tiny_lora.py"
    assert error(ckpt) == (f"Error: {ckpt}: a training checkpoint, not an HF model folder; convert it first: "
                           f"sfttool convert pth_to_hf {config} {ckpt} OUT")
    assert error(lora_run) == (f"Error: {lora_run}: a training work dir, not an HF model folder; "
                               f"pass {lora_run / 'hf_adapter'}")
    unexported = tmp_path / "run"
    unexported.mkdir()
    shutil.copy(ckpt, unexported)
    shutil.copy(config, unexported)
    assert error(unexported) == (
        f"Error: {unexported}: a training work dir, not an HF model folder; convert a checkpoint first: "
        f"sfttool convert pth_to_hf {unexported / 'tiny_lora.py'} {unexported / 'iter_4.pth'} OUT")
    assert error(tmp_path / "nowhere") == f"Error: {tmp_path / 'nowhere'}: no such folder"
    assert error(tmp_path) == f"Error: {tmp_path}: not an HF model folder (no config.json)"
    # The tests run with HF_HUB_OFFLINE=1: the hub cannot provide it.
    assert re.fullmatch(r"Error: nonexistent-model: no such folder, and the model hub did not provide it \(.+\); "
                        r"without access to the model hub, give a local folder", error("nonexistent-model"))


@pytest.mark.slow
def test_the_runs_adapter_folder_works_as_model(lora_run):
    result = run_chat(lora_run / "hf_adapter", "--temperature", "0", "--max-new-tokens", "4", "--prompt", "hi")
    assert result.exit_code == 0, result.output
    assert f"Prompt template: {lora_run / 'hf_adapter' / 'sfttool_config.py'}" in result.stderr


# ---------------------------------------------------------------------------
# Tools and reasoning, rendered as in training.

def test_tools_reach_the_prompt_as_the_chat_template_renders_them(tmp_path):
    import json as json_
    from pathlib import Path

    from transformers import AutoTokenizer

    from sfttool import assets
    from sfttool.tools.chat import load_tools
    jinja = (Path(__file__).resolve().parents[1] / "assets" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja")
    tok = AutoTokenizer.from_pretrained(assets.build_chat_tokenizer(tmp_path / "tok", "qwen", jinja.read_text()))
    schema = {"name": "get_weather", "description": "Weather of a city.", "parameters": {"type": "object"}}
    (tmp_path / "tools.json").write_text(json_.dumps([schema]))
    template = get_template("hf_chat_template")
    tools = load_tools(tmp_path / "tools.json", template)
    assert tools == [{"type": "function", "function": schema}]
    session = ChatSession(None, tok, template, system="Be brief.", tools=tools)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"}]
    expected = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    assert session.prompt_ids("Oslo?") == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    with pytest.raises(ChatError, match="--tools needs the model's own chat template"):
        load_tools(tmp_path / "tools.json", get_template("qwen_chat"))
    (tmp_path / "bad.json").write_text('{"name": "f"}')
    with pytest.raises(ChatError, match="bad.json: expected a JSON list of tool schemas, got dict"):
        load_tools(tmp_path / "bad.json", template)


def test_reasoning_is_shown_apart_from_the_answer():
    from sfttool.tools.chat import shown, split_reasoning
    assert split_reasoning("<think>\nOne and one.\n</think>\n\n2.") == ("One and one.", "2.")
    assert split_reasoning("2.") == ("", "2.")
    assert shown("<think>\nOne and one.\n</think>\n\n2.") == "[reasoning]\nOne and one.\n[answer]\n2."
    assert shown("2.") == "2."
