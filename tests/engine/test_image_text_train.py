"""Image-text fine-tuning end to end on a tiny Qwen2.5-VL, on CPU: `check-custom-dataset`, `train` (LoRA,
the projector trained whole beside it, sample generations with an image), `convert pth_to_hf`, `convert
merge` (its logits on an image+text input equal base + adapter) and `chat --image`; two processes train
like one with the global batch; a resumed run ends bit-identical to an uninterrupted one. A tiny Gemma 3
through `check-custom-dataset`, `train`, `convert` and `chat --image`; the shipped image-text configs on
tiny models."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from engine_helpers import RUNTIME, two_ranks

from sfttool import assets

pytestmark = pytest.mark.timeout(900)

IMAGE_CONFIG = '''
from datasets import load_dataset
from mmengine.dataset import DefaultSampler
from mmengine.hooks import CheckpointHook, IterTimerHook, LoggerHook, ParamSchedulerHook, DistSamplerSeedHook
from peft import LoraConfig
from torch.optim import AdamW
from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from sfttool.dataset import process_hf_dataset
from sfttool.dataset.collate_fns import default_collate_fn
from sfttool.dataset.map_fns import llava_map_fn
from sfttool.engine.hooks import EvaluateChatHook
from sfttool.engine.runner import TrainLoop
from sfttool.model import SupervisedFinetune

model_dir = {model_dir!r}
data_file = {data_file!r}
image_folder = {image_folder!r}
max_length = {max_length}
batch_size = {batch_size}
accumulative_counts = 2
max_epochs = 1
seed = 7

processor = dict(type=AutoProcessor.from_pretrained, pretrained_model_name_or_path=model_dir)
tokenizer = dict(type=AutoTokenizer.from_pretrained, pretrained_model_name_or_path=model_dir)
model = dict(
    type=SupervisedFinetune,
    use_activation_checkpointing=False,
    llm=dict(type=AutoModelForImageTextToText.from_pretrained, pretrained_model_name_or_path=model_dir,
             dtype='float32'),
    lora=dict(type=LoraConfig, r=8, lora_alpha=16, lora_dropout={dropout}, bias='none', task_type='CAUSAL_LM'),
    freeze_projector=False, lora_vision_tower={lora_vision_tower})

train_dataset = dict(
    type=process_hf_dataset,
    dataset=dict(type=load_dataset, path='json', data_files=data_file),
    processor=processor, image_folder=image_folder, dataset_map_fn=llava_map_fn, template_map_fn=None,
    max_length=max_length, pack_to_max_length=True, shuffle_before_pack=True, map_num_proc=1, seed=seed)

train_dataloader = dict(
    batch_size=batch_size, num_workers=0, dataset=train_dataset,
    sampler=dict(type=DefaultSampler, shuffle=True, seed=seed),
    collate_fn=dict(type=default_collate_fn))

optim_wrapper = dict(
    optimizer=dict(type=AdamW, lr=5e-3, betas=(0.9, 0.999), weight_decay=0),
    clip_grad=dict(max_norm=1, error_if_nonfinite=False), accumulative_counts=accumulative_counts)
param_scheduler = []
train_cfg = dict(type=TrainLoop, max_epochs=max_epochs)

'''
IMAGE_CONFIG += RUNTIME


@pytest.fixture(scope="module")
def image_data(tmp_path_factory, tiny_tokenizer_dir):
    """The tiny Qwen2.5-VL, 16 LLaVA-format rows (12 with one of three images, 4 text-only) and the images."""
    root = tmp_path_factory.mktemp("image_text")
    model_dir = assets.build_tiny_vlm(root / "qwen2_5_vl", tiny_tokenizer_dir, "qwen2_5_vl")
    sizes = [(56, 84), (112, 56), (28, 28)]
    names = [assets.write_png(root / "images" / f"{i}.png", w, h, seed=i).name for i, (w, h) in enumerate(sizes)]
    rows = []
    for i in range(16):
        question, answer = f"what is in picture {i}?", f"colour {i} and noise {i % 5}"
        if i % 4 == 3:
            rows.append({"id": str(i), "conversations": [{"from": "human", "value": question},
                                                         {"from": "gpt", "value": answer}]})
        else:
            rows.append({"id": str(i), "image": names[i % 3], "conversations": [
                {"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]})
    data_file = assets.write_jsonl(root / "llava.jsonl", rows)
    return dict(model_dir=model_dir, data_file=data_file, image_folder=root / "images", image=root / "images" / names[0])


def image_config(path, data, batch_size=1, dropout=0.0, custom_hooks="[]", lora_vision_tower=False,
                 max_length=160):
    path.write_text(IMAGE_CONFIG.format(model_dir=str(data["model_dir"]), data_file=str(data["data_file"]),
                                        image_folder=str(data["image_folder"]), batch_size=batch_size,
                                        dropout=dropout, custom_hooks=custom_hooks, save_steps=4, keep=2,
                                        lora_vision_tower=lora_vision_tower, max_length=max_length))
    return path


def image_input(processor, image):
    messages = [{"role": "user", "content": [{"type": "image", "image": str(image)},
                                             {"type": "text", "text": "what is it?"}]}]
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")


@pytest.mark.slow
def test_check_train_convert_merge_and_chat_with_images(tmp_path, image_data, capsys):
    from transformers import AutoProcessor

    from sfttool.cli.main import cli
    from sfttool.engine.train import train

    hooks = (f"[dict(type=EvaluateChatHook, tokenizer=tokenizer, evaluation_inputs=['what is it?'], "
             f"evaluation_images={str(image_data['image'])!r}, max_new_tokens=3)]")
    config = image_config(tmp_path / "vl.py", image_data, custom_hooks=hooks)
    checked = CliRunner().invoke(cli, ["check-custom-dataset", str(config)])
    assert checked.exit_code == 0, checked.output
    assert "<image 1: " in checked.output and " tokens>" in checked.output  # each image in its place

    out = train(str(config), work_dir=str(tmp_path / "work"), max_steps=2)
    summary = capsys.readouterr().out
    assert "Vision tower (" in summary and "): frozen; projector (" in summary and "): full; language model (" \
        in summary and "): LoRA." in summary
    records = (out / "eval_outputs" / "iter_4.jsonl").read_text()
    assert f'"image": "{image_data["image"]}"' in records

    converted = merged_answers_as_base_and_adapter(tmp_path, config, image_data, out)
    processor = AutoProcessor.from_pretrained(converted)  # the processor travels with the adapter
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"


@pytest.mark.slow
def test_check_and_train_gemma3_with_images(tmp_path, image_data, tiny_tokenizer_dir, capsys):
    """Gemma 3, whose image tokens attend to each other: `check-custom-dataset` shows each image in its place
    (its 4 tokens between <start_of_image> and <end_of_image>), and LoRA with the projector trained whole
    runs on packed rows with images, with sample answers about an image (generate with its token_type_ids)."""
    from safetensors.torch import load_file

    from sfttool.cli.main import cli
    from sfttool.engine.train import train

    data = dict(image_data, model_dir=assets.build_tiny_vlm(tmp_path / "gemma3", tiny_tokenizer_dir, "gemma3"))
    hooks = (f"[dict(type=EvaluateChatHook, tokenizer=tokenizer, evaluation_inputs=['what is it?'], "
             f"evaluation_images={str(image_data['image'])!r}, max_new_tokens=3)]")
    config = image_config(tmp_path / "gemma3.py", data, custom_hooks=hooks)
    checked = CliRunner().invoke(cli, ["check-custom-dataset", str(config)])
    assert checked.exit_code == 0, checked.output
    assert "<start_of_image><image 1: " in checked.output and ", 4 tokens><end_of_image>" in checked.output

    out = train(str(config), work_dir=str(tmp_path / "work"), max_steps=2)
    summary = capsys.readouterr().out
    assert "): frozen; projector (" in summary and "): full; language model (" in summary
    assert f'"image": "{image_data["image"]}"' in (out / "eval_outputs" / "iter_4.jsonl").read_text()
    adapter = load_file(out / "hf_adapter" / "adapter_model.safetensors")
    assert any("multi_modal_projector" in k for k in adapter) and any("lora_B" in k for k in adapter)
    merged_answers_as_base_and_adapter(tmp_path, config, data, out)


def merged_answers_as_base_and_adapter(tmp_path, config, data, out):
    """`convert pth_to_hf` then `convert merge`: the merged model's logits on an image+text input equal the
    base model's with the adapter (and the projector trained beside it); `chat --image` answers with it."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from sfttool.cli.main import cli
    from sfttool.config import load_config
    from sfttool.tools.convert import pth_to_hf
    from sfttool.tools.merge import merge_adapter

    converted = pth_to_hf(load_config(str(config)), out / "iter_4.pth", tmp_path / "converted")
    merged = merge_adapter(data["model_dir"], converted, tmp_path / "merged")
    inputs = image_input(AutoProcessor.from_pretrained(merged), data["image"])
    with torch.no_grad():
        base = AutoModelForImageTextToText.from_pretrained(data["model_dir"])
        base_logits = base(**inputs).logits
        want = PeftModel.from_pretrained(base, str(out / "hf_adapter"))(**inputs).logits
        got = AutoModelForImageTextToText.from_pretrained(merged)(**inputs).logits
    assert not torch.allclose(want, base_logits, atol=1e-4)  # the adapter (and the projector) changed something
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    chatted = CliRunner().invoke(cli, ["chat", str(merged), "--image", str(data["image"]), "--prompt",
                                       "what is it?", "--max-new-tokens", "3", "--temperature", "0"])
    assert chatted.exit_code == 0, chatted.output
    assert "the processor's chat template (--image)" in chatted.output
    return converted


@pytest.mark.slow
@pytest.mark.parametrize("arch, projector", [("qwen2_5_vl", "merger"), ("gemma3", "multi_modal_projector")])
def test_a_resumed_image_text_run_ends_bit_identical(tmp_path, image_data, tiny_tokenizer_dir, arch, projector):
    """--max-steps 2 (a checkpoint after iteration 4), then --resume: the adapter and the projector trained
    beside it end as the uninterrupted run's, bit for bit (dropout on); Gemma 3's packed rows with images
    carry its own attention masks."""
    from safetensors.torch import load_file

    from sfttool.engine.train import train

    data = image_data if arch == "qwen2_5_vl" else dict(
        image_data, model_dir=assets.build_tiny_vlm(tmp_path / arch, tiny_tokenizer_dir, arch))
    config = image_config(tmp_path / "vl.py", data, dropout=0.1)
    full = train(str(config), work_dir=str(tmp_path / "full"))
    part = train(str(config), work_dir=str(tmp_path / "part"), max_steps=2)
    assert sorted(p.name for p in part.glob("iter_*")) == ["iter_4.pth"]
    resumed = train(str(config), work_dir=str(part), resume="auto")
    a = load_file(full / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(resumed / "hf_adapter" / "adapter_model.safetensors")
    assert any(projector in k for k in a)  # the projector, trained whole, is saved with the adapter
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("deepspeed, arch, tower", [(None, "gemma3", "lora"), ("zero2", "qwen2_5_vl", "frozen"),
                                                    ("zero3", "qwen2_5_vl", "frozen")])
def test_two_ranks_train_image_text_like_one_rank_with_the_global_batch(tmp_path, image_data, tiny_tokenizer_dir,
                                                                        deepspeed, arch, tower):
    """2 processes (DDP, or DeepSpeed ZeRO-2/3) x micro-batch 1 = 1 process x micro-batch 2 (the same rows per
    step, dropout off): the pixels of each rank's rows go with them, the loss normaliser spans the ranks, and a
    rank whose batch has no image still runs the vision modules and reduces the projector's gradients, at the
    point of its backward where the images' gradients arrive (else the ranks' gradient buckets disagree: under
    ZeRO-2, whose buckets are laid out in arrival order, one rank's projector gradients would be summed with the
    other's LoRA ones; under ZeRO-3 the ranks' parameter gathers would not match). DDP runs on Gemma 3 (its
    packed rows' own attention masks) with LoRA on the vision tower too, beside the projector trained whole: DDP
    stops on a trained parameter that took no part in the loss (the tower's pooling head, left out)."""
    from safetensors.torch import load_file
    from test_distributed import run_sfttool

    from sfttool.engine.train import train

    data = image_data if arch == "qwen2_5_vl" else dict(
        image_data, model_dir=assets.build_tiny_vlm(tmp_path / arch, tiny_tokenizer_dir, arch))
    # Gemma 3 at 120 tokens packs its rows into 8, as Qwen2.5-VL at 160: whole steps of 4 rows (at 160, 5 rows,
    # which two ranks' sampler would round up to 6 with a repeated row, training other rows than one rank)
    settings = dict(lora_vision_tower=tower == "lora", max_length=160 if arch == "qwen2_5_vl" else 120)
    two = image_config(tmp_path / "two.py", data, batch_size=1, **settings)
    one = image_config(tmp_path / "one.py", data, batch_size=2, **settings)
    result = run_sfttool([str(two), "--work-dir", str(tmp_path / "two"), *two_ranks(deepspeed)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    single = train(str(one), work_dir=str(tmp_path / "one"), deepspeed=deepspeed)  # the same engine as two
    a = load_file(tmp_path / "two" / "hf_adapter" / "adapter_model.safetensors")
    b = load_file(single / "hf_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and max(v.abs().max().item() for k, v in a.items() if "lora_B" in k) > 0
    assert any("vision_tower" in k and "lora_B" in k for k in a) == (tower == "lora")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name, arch", [("qwen2_5_vl_7b_instruct_qlora_llava_instruct_e1", "qwen2_5_vl"),
                                        ("llava_1_5_7b_hf_qlora_llava_instruct_e1", "llava"),
                                        ("gemma3_4b_it_qlora_llava_instruct_e1", "gemma3")])
def test_the_shipped_image_text_configs_train_a_tiny_model(tmp_path, image_data, tiny_tokenizer_dir, name, arch):
    """The built-in configs with their model, data and images swapped for tiny local ones (QLoRA on CPU):
    one optimizer step, sample answers about the image before and after."""
    from sfttool.engine.train import train

    model_dir = image_data["model_dir"] if arch == "qwen2_5_vl" else \
        assets.build_tiny_vlm(tmp_path / arch, tiny_tokenizer_dir, arch)
    options = [f"pretrained_model_name_or_path={model_dir}", f"data_path={image_data['data_file']}",
               "data_files=None", f"image_folder={image_data['image_folder']}",
               f"evaluation_images={image_data['image']}", "evaluation_max_new_tokens=2", "max_length=256",
               "dataloader_num_workers=0", "accumulative_counts=1"]
    out = train(name, work_dir=str(tmp_path / "work"), cfg_options=options, max_steps=1)
    assert (out / "hf_adapter" / "adapter_model.safetensors").is_file()
    assert (out / "hf_adapter" / "processor_config.json").is_file()
    assert sorted(p.name for p in (out / "eval_outputs").iterdir()) == ["iter_0.jsonl", "iter_1.jsonl"]


def test_chat_with_an_image_needs_a_model_with_a_processor_and_a_readable_image(tmp_path, tiny_qwen2_dir,
                                                                                image_data):
    from sfttool.cli.main import cli

    image = assets.write_png(tmp_path / "a.png", 28, 28)
    result = CliRunner().invoke(cli, ["chat", str(tiny_qwen2_dir), "--image", str(image), "--prompt", "hi"])
    assert result.exit_code != 0
    assert (f"--image: {tiny_qwen2_dir} has no processor (processor_config.json / preprocessor_config.json): chat "
            "with images needs an image-text model and its processor files") in result.output
    broken = tmp_path / "b.png"
    broken.write_bytes(b"not an image")
    result = CliRunner().invoke(cli, ["chat", str(image_data["model_dir"]), "--image", str(broken), "--prompt", "hi"])
    assert result.exit_code != 0 and f"--image {broken}: not a readable image (" in result.output
