"""The chunked loss (the default) equals the unchunked one, and never holds the
logits of more than one chunk of positions.

Loss and gradients are compared in float32 to 1e-5 relative (largest
difference over the largest value) for full, LoRA and QLoRA fine-tuning, packed
and unpacked rows, both reductions, tied and untied embeddings.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sfttool.errors import SfttoolError
from sfttool.model import loss as L
from sfttool.model.chunked_loss import DEFAULT_CHUNK_SIZE
from sfttool.model.lm_head import split_lm
from sfttool.registry import ConfigBuildError

RTOL = 1e-5
CHUNK = 5  # positions: every batch below spans several chunks, the last one partial


def lora(**kwargs):
    from peft import LoraConfig

    return dict(type=LoraConfig, r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **kwargs)


def build(method, model_dir, make_sft):
    if method == "full":
        return make_sft(model_dir)
    if method == "lora":
        return make_sft(model_dir, lora=lora())
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    quant = dict(type=BitsAndBytesConfig, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                 bnb_4bit_compute_dtype="torch.float32")
    from sfttool.model import SupervisedFinetune

    torch.manual_seed(0)
    llm = dict(type="transformers.AutoModelForCausalLM.from_pretrained", pretrained_model_name_or_path=str(model_dir),
               dtype="float32", quantization_config=quant)
    return SupervisedFinetune(llm=llm, lora=lora(), use_activation_checkpointing=False)


def layouts(rows):
    """Packed (several samples a row, one row padded) and unpacked (one sample a row, padded)."""
    samples = rows.make_samples(6, seed=41, lengths=(4, 15))
    return {"packed": rows.collate([rows.pack(samples[:4]), rows.pack(samples[4:])]),
            "unpacked": rows.collate([rows.as_row(s) for s in samples])}


def loss_and_grads(model, data, implementation):
    model.loss_implementation = implementation
    model.zero_grad()
    loss = model({**data, "loss_normalizer": 7.0}, mode="loss")["loss"]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def relative(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


def assert_same_as_unchunked(model, data):
    want_loss, want_grads = loss_and_grads(model, data, "unchunked")
    loss, grads = loss_and_grads(model, data, "chunked")  # leaves the model on its default
    assert relative(loss, want_loss) <= RTOL
    assert len(grads) == len(want_grads) > 0
    for got, want in zip(grads, want_grads):
        assert want.abs().max() > 0 and relative(got, want) <= RTOL


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunked_equals_unchunked(method, tied, tiny_llama_dir, tiny_tied_qwen2_dir, make_sft, rows):
    model = build(method, tiny_tied_qwen2_dir if tied else tiny_llama_dir, make_sft)
    model.loss_chunk_size = CHUNK
    parts, _ = split_lm(model.llm)
    assert parts.plain_linear  # the fast path: the head's weight applied chunk by chunk
    assert (parts.head.weight is model.llm.get_input_embeddings().weight) == tied
    for layout, data in layouts(rows).items():
        assert L.count_loss_units(data["labels"], data["position_ids"]) > 3 * CHUNK, layout  # trained tokens
        for reduction in ("token", "sample"):
            model.loss_reduction = reduction
            assert_same_as_unchunked(model, data)


@pytest.mark.parametrize("head", [dict(target_modules=["q_proj", "v_proj", "lm_head"]),
                                  dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])],
                         ids=["lora_on_head", "modules_to_save"])
def test_a_wrapped_head_runs_chunk_by_chunk_too(head, tiny_llama_dir, make_sft, rows):
    model = make_sft(tiny_llama_dir, lora=lora(**head))
    model.loss_chunk_size = CHUNK
    assert not split_lm(model.llm)[0].plain_linear  # a peft wrapper: the module runs checkpointed per chunk
    data = layouts(rows)["packed"]
    for reduction in ("token", "sample"):
        model.loss_reduction = reduction
        assert_same_as_unchunked(model, data)
    assert largest_logits_rows(model, data, model.llm.config.vocab_size) == CHUNK


def test_flattened_batch_gives_the_same_chunked_loss(tiny_llama_dir, make_sft, rows):
    """With flash-attention the batch runs as one row; the hidden states come back per row."""
    model = make_sft(tiny_llama_dir, loss_chunk_size=CHUNK)
    data = layouts(rows)["packed"]
    want = model(data, mode="loss")["loss"]
    model.flatten_batch = True
    assert relative(model(data, mode="loss")["loss"], want) <= RTOL


class _LogitsRows(TorchDispatchMode):
    """Records the rows of every tensor an op allocates (views excluded) whose last
    dimension is the vocabulary."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == self.vocab and not func.is_view:
                self.rows.append(t.shape[0])
        return out


def largest_logits_rows(model, data, vocab: int) -> int:
    """The most positions whose logits (or their gradient) existed at once, forward and backward."""
    model.zero_grad()
    with _LogitsRows(vocab) as seen:
        model(data, mode="loss")["loss"].backward()
    return max(seen.rows)


def test_never_more_than_one_chunk_of_logits(tiny_llama_dir, make_sft, rows):
    model = make_sft(tiny_llama_dir, loss_chunk_size=CHUNK)
    vocab = model.llm.config.vocab_size
    data = layouts(rows)["packed"]
    n = model.count_loss_units(data)
    assert largest_logits_rows(model, data, vocab) == CHUNK
    model.loss_implementation = "unchunked"  # the check sees the full [n, vocab] logits when they exist
    assert largest_logits_rows(model, data, vocab) == n > 3 * CHUNK


def test_default_is_chunked(tiny_llama_dir, make_sft):
    model = make_sft(tiny_llama_dir)
    assert (model.loss_implementation, model.loss_chunk_size) == ("chunked", DEFAULT_CHUNK_SIZE) == ("chunked", 512)


def test_without_grad_the_chunked_loss_is_the_same(tiny_llama_dir, make_sft, rows):
    model = make_sft(tiny_llama_dir, loss_chunk_size=CHUNK)
    data = layouts(rows)["unpacked"]
    with torch.no_grad():
        got = model(data, mode="loss")["loss"]
        model.loss_implementation = "unchunked"
        want = model(data, mode="loss")["loss"]
    assert not got.requires_grad and relative(got, want) <= RTOL


def test_models_that_transform_their_logits_keep_the_full_logits_path(tiny_llama_dir, rows, caplog):
    from transformers import AutoModelForCausalLM

    from sfttool.model import SupervisedFinetune

    llm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    llm.config.final_logit_softcapping = 30.0  # as Gemma 2 sets it (Llama itself ignores it)
    with caplog.at_level("WARNING", logger="sfttool.model.sft"):
        model = SupervisedFinetune(llm=llm, use_activation_checkpointing=False, loss_chunk_size=CHUNK)
    assert caplog.messages == ["model.loss_implementation='chunked': LlamaForCausalLM transforms its logits "
                               "(final_logit_softcapping), so the loss computes all trained positions' logits at once"]
    assert split_lm(model.llm)[0] is None
    data = layouts(rows)["packed"]
    assert largest_logits_rows(model, data, model.llm.config.vocab_size) == model.count_loss_units(data)


@pytest.mark.parametrize("name, extra", [("liger", "liger"), ("cut_cross_entropy", "cce")])
def test_a_missing_fused_kernel_names_its_extra(name, extra, tiny_llama_dir, make_sft):
    import importlib.util

    from sfttool.model.fused_loss import KERNELS, LossKernelMissingError

    if importlib.util.find_spec(KERNELS[name][0]) is not None:
        pytest.skip(f"{KERNELS[name][2]} is installed")
    with pytest.raises(LossKernelMissingError) as info:
        make_sft(tiny_llama_dir, loss_implementation=name)
    message = str(info.value)
    assert isinstance(info.value, SfttoolError) and "\n" not in message
    assert message.startswith(f"model.loss_implementation={name!r} needs the {KERNELS[name][2]} package")
    assert message.endswith(f"pip install 'sfttool[{extra}]', or set model.loss_implementation='chunked'")


@pytest.mark.parametrize("kwargs, message", [
    (dict(loss_implementation="fused"), "model.loss_implementation must be one of ('chunked', 'unchunked', "
                                        "'liger', 'cut_cross_entropy'), got 'fused'"),
    (dict(loss_chunk_size=0), "model.loss_chunk_size must be a positive integer (positions per chunk, "
                              "default 512), got 0"),
    (dict(loss_chunk_size=True), "model.loss_chunk_size must be a positive integer (positions per chunk, "
                                 "default 512), got True"),
    (dict(loss_implementation="liger", loss_reduction="sample"),
     "model.loss_implementation='liger' supports loss_reduction='token' only; "
     "use loss_implementation='chunked' or 'cut_cross_entropy' for 'sample'"),
])
def test_bad_loss_settings_are_one_line_errors(kwargs, message, tiny_llama_dir, make_sft):
    with pytest.raises(ConfigBuildError) as info:
        make_sft(tiny_llama_dir, **kwargs)
    assert str(info.value) == message


def test_the_extras_the_errors_name_exist():
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    from sfttool.model.fused_loss import KERNELS

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for _, extra, package in KERNELS.values():
        assert [req.split(">")[0] for req in extras[extra]] == [package]


@pytest.mark.slow
def test_zero3_chunked_equals_unchunked_and_gathers_the_head_once(tmp_path, tiny_llama_dir):
    """Two CPU ranks over gloo, every parameter partitioned (zero3_loss_worker.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("deepspeed")
    worker = Path(__file__).with_name("zero3_loss_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(worker),
                           str(tiny_llama_dir), str(tmp_path)], env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for steps in ranks:
        assert [s["implementation"] for s in steps.values()] == ["chunked", "chunked", "unchunked"]
        # The head's weight: gathered once per chunked step (not once per chunk of the
        # 5-position chunks), where the head module gathers it for forward and again for backward.
        assert [s["head_gathers"] for s in steps.values()] == [1, 1, 2]
        chunked, unchunked = steps[1], steps[2]
        assert relative(chunked["loss"], unchunked["loss"]) <= RTOL
        for name, want in unchunked["grads"].items():
            assert want.abs().max() > 0 and relative(chunked["grads"][name], want) <= RTOL, name
    for name, grad in ranks[0][1]["grads"].items():  # reduced over both ranks' rows
        assert torch.equal(grad, ranks[1][1]["grads"][name]), name
    assert ranks[0][1]["loss"] != ranks[1][1]["loss"]  # each rank had its own rows


def test_the_function_with_a_bias_and_token_weights_matches_autograd():
    from sfttool.model.chunked_loss import chunked_linear_cross_entropy

    torch.manual_seed(0)
    hidden, weight, bias = (torch.randn(37, 16, requires_grad=True), torch.randn(101, 16, requires_grad=True),
                            torch.randn(101, requires_grad=True))
    targets, token_weights = torch.randint(0, 101, (37,)), torch.rand(37)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    want = (torch.nn.functional.cross_entropy(logits, targets, reduction="none") * token_weights).sum()
    want_grads = torch.autograd.grad(want * 0.3, [hidden, weight, bias])
    got = chunked_linear_cross_entropy(hidden, weight, bias, targets, token_weights, chunk_size=8)
    got_grads = torch.autograd.grad(got * 0.3, [hidden, weight, bias])
    assert relative(got, want) <= RTOL
    assert all(relative(g, w) <= RTOL for g, w in zip(got_grads, want_grads))


def test_a_second_backward_through_the_chunked_loss_is_refused():
    from sfttool.model.chunked_loss import chunked_linear_cross_entropy

    hidden, weight = torch.randn(6, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    loss = chunked_linear_cross_entropy(hidden, weight, None, torch.arange(1, 7), None, chunk_size=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        loss.backward()


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_under_bf16_autocast_it_follows_autograd(hidden_dtype):
    """As on a GPU under AmpOptimWrapper: the head runs in bf16 (a QLoRA head kept in
    float32 receives bf16 hidden states). bf16 matmuls: compared to 1e-2."""
    from sfttool.model.chunked_loss import chunked_linear_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(40, 32).to(hidden_dtype).requires_grad_(True)
    weight = (torch.randn(300, 32) * 0.3).requires_grad_(True)
    targets = torch.randint(0, 300, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight).float(), targets,
                                                 reduction="sum")
        got = chunked_linear_cross_entropy(hidden, weight, None, targets, None, chunk_size=16)
    want_grads = torch.autograd.grad(want, [hidden, weight])
    got_grads = torch.autograd.grad(got, [hidden, weight])
    assert got.dtype == torch.float32 and relative(got, want) <= 1e-2
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype and relative(g.float(), w.float()) <= 1e-2


def test_per_token_log_probs_match_autograd_for_any_upstream_gradient():
    """What a preference loss needs: log p per token, then a non-linear function of their sums."""
    from sfttool.model.chunked_loss import chunked_token_log_probs

    torch.manual_seed(0)
    hidden, weight, bias = (torch.randn(37, 16, requires_grad=True), torch.randn(101, 16, requires_grad=True),
                            torch.randn(101, requires_grad=True))
    targets, seq = torch.randint(0, 101, (37,)), torch.arange(37) % 3  # three "sequences"

    def dpo_like(log_probs):
        sums = torch.zeros(3).index_add(0, seq, log_probs)
        return torch.nn.functional.logsigmoid(sums[0] - 0.5 * sums[1] + 0.25 * sums[2])

    want_lp = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias), -1).gather(1, targets[:, None])[:, 0]
    want_grads = torch.autograd.grad(dpo_like(want_lp), [hidden, weight, bias])
    got_lp = chunked_token_log_probs(hidden, weight, bias, targets, chunk_size=8)
    got_grads = torch.autograd.grad(dpo_like(got_lp), [hidden, weight, bias])
    assert got_lp.shape == (37,) and relative(got_lp, want_lp) <= RTOL
    assert all(relative(g, w) <= RTOL for g, w in zip(got_grads, want_grads))
    with _LogitsRows(101) as seen:
        chunked_token_log_probs(hidden, weight, bias, targets, chunk_size=8).sum().backward()
    assert max(seen.rows) == 8
