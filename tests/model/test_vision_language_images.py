"""Vision-language checkpoints trained on image-text rows: the batch's pixels (and Qwen2-VL's grids) reach
the model, a packed row of samples with images trains like its samples run one by one through the
checkpoint's own forward (its own 3-D rotary positions; Gemma 3's attention within each image, from the
processor's token_type_ids), loss and gradients, on the chunked and the unchunked loss. Samples come from
the tiny processors themselves (``apply_chat_template``)."""
from __future__ import annotations

import pytest
import torch

from sfttool import assets
from sfttool.model.vision import multimodal_position_ids, packed_image_attention_masks, token_types

ATOL = 1e-5
ARCHS = ("qwen2_5_vl", "llava", "gemma3")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, tiny_tokenizer_dir):
    """Per architecture: the checkpoint folder and three processed samples (1 image, none, 2 images)."""
    from transformers import AutoProcessor

    root = tmp_path_factory.mktemp("vlm_images")
    images = [str(assets.write_png(root / f"{i}.png", w, h, seed=i))
              for i, (w, h) in enumerate([(40, 60), (90, 30), (56, 56)])]
    out = {}
    for arch in ARCHS:
        folder = assets.build_tiny_vlm(root / arch, tiny_tokenizer_dir, arch)
        processor = AutoProcessor.from_pretrained(folder)
        out[arch] = (folder, [encode(processor, conversation) for conversation in conversations(images)])
    return out


def conversations(images):
    def user(text, *paths):
        return {"role": "user", "content": [*({"type": "image", "image": p} for p in paths),
                                            {"type": "text", "text": text}]}

    def answer(text):
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}

    return [[user("what is in the picture", images[0]), answer("a small square of noise")],
            [user("say hello"), answer("hello there")],
            [user("compare these two", images[1], images[2]), answer("the first is wider"),
             user("and the colours?"), answer("random")]]


def encode(processor, conversation) -> dict:
    """The processor's own encoding; the last 6 tokens trained (image tokens never are). Gemma 3's
    token_type_ids are kept for the checkpoint's own forward only: sfttool's batches do not carry them."""
    batch = processor.apply_chat_template(conversation, tokenize=True, return_dict=True, return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    sample = {"input_ids": ids, "labels": [-100] * (len(ids) - 6) + ids[-6:]}
    sample.update({k: batch[k] for k in ("pixel_values", "image_grid_thw", "token_type_ids") if k in batch})
    return sample


def collate(samples: list[dict]) -> dict:
    """Samples -> one packed row: positions restart at each sample, image tensors in sample order."""
    batch = {"input_ids": [], "labels": [], "position_ids": []}
    for s in samples:
        batch["input_ids"] += s["input_ids"]
        batch["labels"] += s["labels"]
        batch["position_ids"] += list(range(len(s["input_ids"])))
    batch = {k: torch.tensor([v]) for k, v in batch.items()}
    for key in ("pixel_values", "image_grid_thw"):
        parts = [s[key] for s in samples if key in s]
        if parts:
            batch[key] = torch.cat(parts)
    return batch


def make_vlm(folder, **kwargs):
    from transformers import AutoModelForImageTextToText

    from sfttool.model import SupervisedFinetune
    torch.manual_seed(0)
    llm = dict(type=AutoModelForImageTextToText.from_pretrained, pretrained_model_name_or_path=str(folder),
               dtype="float32", attn_implementation="sdpa")
    model = SupervisedFinetune(llm=llm, use_activation_checkpointing=False, **kwargs)
    with torch.no_grad():  # sharper attention than the random init's near-uniform one: positions matter
        for name, param in model.llm.named_parameters():
            if ".language_model." in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(10)
    return model


def own_loss(model, samples) -> torch.Tensor:
    """The checkpoint's own forward on each sample alone (it computes its own positions), token-weighted."""
    total, count = 0.0, 0
    for s in samples:
        data = collate([s])
        images = {k: v for k, v in data.items() if k in ("pixel_values", "image_grid_thw")}
        if "image_grid_thw" in images:  # Qwen2-VL computes 3-D positions from the token types
            images["mm_token_type_ids"] = (data["input_ids"] == model.llm.config.image_token_id).long()
        if "token_type_ids" in s:  # Gemma 3 lets each image's tokens attend to each other from them
            images["token_type_ids"] = s["token_type_ids"]
        units = int((data["labels"][:, 1:] != -100).sum())
        with torch.no_grad():
            total += model.llm(input_ids=data["input_ids"], labels=data["labels"], **images).loss * units
        count += units
    return total / count


def sfttool_grads(model, batches) -> tuple[torch.Tensor, dict]:
    """sfttool's loss over ``batches`` (token-weighted) and the gradients it gives."""
    model.zero_grad()
    total, count = 0.0, 0
    for data in batches:
        units = model.count_loss_units(data)
        total = total + model(data, mode="loss")["loss"] * units
        count += units
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("loss_implementation", ["chunked", "unchunked"])
def test_a_packed_row_with_images_trains_like_its_samples(vlm, arch, loss_implementation):
    """The vision tower trains too here, so its gradients show each sample's pixels stayed with it."""
    folder, samples = vlm[arch]
    model = make_vlm(folder, freeze_vision_tower=False, loss_implementation=loss_implementation)
    want = own_loss(model, samples)
    one_by_one, want_grads = sfttool_grads(model, [collate([s]) for s in samples])
    packed, grads = sfttool_grads(model, [collate(samples)])
    assert torch.allclose(one_by_one, want, atol=ATOL) and torch.allclose(packed, want, atol=ATOL)
    # (a batch without images gives the trained vision parameters zero gradients, where a packed one may have
    # none for those its images do not use, such as LLaVA's last vision layer)
    assert want_grads.keys() >= grads.keys() and all(not want_grads[n].any() for n in want_grads.keys() - grads.keys())
    assert any((".visual." in n or ".vision_tower." in n) and grads[n].any() for n in grads)  # the tower learns
    assert all(torch.allclose(grads[n], want_grads[n], atol=ATOL) for n in grads)


@pytest.mark.parametrize("arch", ARCHS)
def test_validation_sums_the_losses_of_packed_rows_with_images(vlm, arch):
    """What validation adds up per row (``summed_row_losses``): the token mean of the checkpoint's own loss."""
    folder, samples = vlm[arch]
    model = make_vlm(folder)
    with torch.no_grad():
        sums, counts = model.summed_row_losses(collate(samples))
    assert torch.allclose((sums.sum() / counts.sum()).float(), own_loss(model, samples), atol=ATOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_pixels_reach_the_model(vlm, arch):
    folder, samples = vlm[arch]
    model = make_vlm(folder)
    data = collate(samples)
    with torch.no_grad():
        loss = model(data, mode="loss")["loss"]
        other = model(dict(data, pixel_values=data["pixel_values"].flip(0)), mode="loss")["loss"]
    assert not torch.allclose(loss, other)


def test_packed_3d_positions_are_each_samples_own(vlm):
    """Row 0 keeps the text positions (they mark the samples); rows 1-3 are get_rope_index of each sample."""
    folder, samples = vlm["qwen2_5_vl"]
    model = make_vlm(folder)
    data = collate(samples)
    got = multimodal_position_ids(model.llm, data["input_ids"], data["position_ids"], data["image_grid_thw"])
    assert torch.equal(got[0], data["position_ids"])
    want = []
    for s in samples:
        ids = torch.tensor([s["input_ids"]])
        if "image_grid_thw" in s:
            types = (ids == model.llm.config.image_token_id).long()
            want.append(model.llm.model.get_rope_index(ids, mm_token_type_ids=types,
                                                       image_grid_thw=s["image_grid_thw"])[0])
        else:
            want.append(torch.arange(ids.shape[1]).expand(3, 1, -1))
    assert torch.equal(got[1:], torch.cat(want, dim=2))
    assert not torch.equal(got[1], got[2])  # height and width differ around the images
    with pytest.raises(ValueError, match="image_grid_thw does not match the image tokens"):
        multimodal_position_ids(model.llm, data["input_ids"], data["position_ids"], data["image_grid_thw"][[1, 0, 2]])


def test_packed_gemma3_masks_are_each_samples_own(vlm):
    """Per layer type, the masks of a packed row hold each sample's own (the checkpoint's
    create_masks_for_generate, given the processor's token_type_ids) on the diagonal, nothing across samples."""
    folder, samples = vlm["gemma3"]
    model = make_vlm(folder)
    config = model.llm.config
    data = collate(samples)
    got = packed_image_attention_masks(model.llm, data["input_ids"], data["position_ids"])
    own = []
    for s in samples:
        ids = torch.tensor([s["input_ids"]])
        assert torch.equal(token_types(config, ids), s["token_type_ids"])  # the image tokens the processor marks
        own.append(model.llm.create_masks_for_generate(config, torch.empty(1, ids.shape[1], 0), None, None,
                                                       torch.arange(ids.shape[1])[None],
                                                       token_type_ids=s["token_type_ids"]))
    assert set(got) == {"full_attention", "sliding_attention"}
    for kind, mask in got.items():
        assert torch.equal(mask[0, 0].long(), torch.block_diag(*(m[kind][0, 0].long() for m in own)))
    assert got["sliding_attention"][0, 0].triu(1).any()  # an image's tokens see the ones after them
    # transformers 5.25's own masks for the packed row: right on the global layers, but on the sliding-window
    # ones each token's image is read at its position within its sample (why sfttool builds the masks)
    theirs = model.llm.create_masks_for_generate(config, torch.empty(*data["input_ids"].shape, 0), None, None,
                                                 data["position_ids"],
                                                 token_type_ids=token_types(config, data["input_ids"]))
    assert torch.equal(theirs["full_attention"], got["full_attention"])
    assert not torch.equal(theirs["sliding_attention"], got["sliding_attention"])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_a_batch_without_images_reaches_the_projector_where_images_would(vlm, arch, autocast):
    """LoRA with the projector trained whole: a batch without images reaches the projector (zero gradients) at
    the point of the backward where an image's gradients arrive, so every parameter's gradient arrives in the
    same order either way (ZeRO-1/2 lay a process's gradient buckets out in arrival order). Under bf16
    autocast a linear layer's weight gradient arrives before its bias's, in float32 after it."""
    from peft import LoraConfig

    folder, samples = vlm[arch]
    model = make_vlm(folder, lora=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"), freeze_projector=False)
    names = {p: n for n, p in model.named_parameters() if p.requires_grad}

    def arrival_order(sample) -> list[str]:
        order = []
        handles = [p.register_post_accumulate_grad_hook(lambda p: order.append(names[p])) for p in names]
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(collate([sample]), mode="loss")["loss"]
        loss.backward()
        for handle in handles:
            handle.remove()
        return order

    with_image, without = arrival_order(samples[0]), arrival_order(samples[1])
    assert "pixel_values" not in collate([samples[1]]) and len(without) == len(names)
    assert without == with_image and any(".merger." in n or ".multi_modal_projector." in n for n in without)
    assert all(p.grad is not None and not p.grad.any() for n, p in model.named_parameters()
               if p.requires_grad and (".merger." in n or ".multi_modal_projector." in n))
