"""``VLLMRollout`` (``rollout_engine='vllm'``, the ``sfttool[vllm]`` extra): sampling with vLLM colocated on
the training GPUs.

Each training process holds its own vLLM engine on its own GPU (vLLM's ``external_launcher`` executor:
torchrun started the processes, vLLM starts none), built from the checkpoint the policy was loaded
from, sharing the GPU with training (``vllm_gpu_memory_utilization``, TRL's setting and default). Before
every generation round the policy's current weights are loaded into it through a vLLM worker extension
(``WeightLoader``, called with ``LLM.collective_rpc``): with LoRA the adapter is merged into the base
weights for the copy and unmerged afterwards; under ZeRO-3 the parameters are gathered first. Each
completion is sampled with its own seed (``SamplingParams.seed``, from the run's seed and the completion's
prompt row, epoch and index), so runs repeat; vLLM's sampler draws other tokens than the ``hf`` engine's.

Written against vLLM's documented API (``LLM``, ``SamplingParams``, ``TokensPrompt``, ``LLM.collective_rpc``,
``worker_extension_cls``); it needs a CUDA GPU and was not run on this project's CPU-only machines:
``benchmarks/gpu_check.sh`` runs it where a GPU is present.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from sfttool.model.rollout import Completions, SamplingSettings, cut_completions
from sfttool.registry import ConfigBuildError


class WeightLoader:
    """vLLM worker extension (``worker_extension_cls``): load named tensors into the served model."""

    def load_named_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)


def completion_seed(seed: int, key: Sequence[int]) -> int:
    """A 31-bit seed per completion from the run's seed and the completion's key (epoch, row, index)."""
    return int(np.random.SeedSequence([seed % 2 ** 64, *key]).generate_state(1)[0] & 0x7FFFFFFF)


def merged_weights(llm: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights as the base checkpoint names them: LoRA merged in, adapter tensors left out."""
    for name, param in llm.named_parameters():
        if "lora_" in name or "modules_to_save" in name or "original_module" in name:
            continue
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        yield name, param.data


@contextlib.contextmanager
def whole_parameters(llm: Any, zero3: bool) -> Iterator[None]:
    """Under ZeRO-3, every parameter gathered for the block (the merge and the copy need them whole)."""
    if not zero3:
        yield
        return
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(llm.parameters()), modifier_rank=None):
        yield


def check_vllm_model(llm: Any) -> None:
    """vLLM serves 16-bit weights: a 4-bit (QLoRA) policy cannot be copied into it."""
    if any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in llm.modules()):
        raise ConfigBuildError("model.rollout_engine='vllm' with a quantized (QLoRA) model: vLLM needs the merged "
                               "weights in 16 bits; use rollout_engine='hf', or LoRA on bf16 weights")


def single_process_env() -> dict[str, str]:
    """torchrun's variables for a process it did not start (one process, this machine)."""
    if "RANK" in os.environ:
        return {}
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


class VLLMRollout:
    """vLLM colocated with training (see the module docstring)."""

    name = "vllm"

    def __init__(self, model: Any, stop_ids: Sequence[int], gpu_memory_utilization: float = 0.3,
                 max_model_len: int | None = None, enable_sleep_mode: bool = False):
        check_vllm_model(model.llm)
        self.model, self.stop_ids = model, list(stop_ids)
        self.options = dict(gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                            enable_sleep_mode=enable_sleep_mode)
        self.synced_gpus = False
        self._llm = None

    def engine(self):
        if self._llm is None:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine runs in this process
            for name, value in single_process_env().items():  # external_launcher reads torchrun's variables
                os.environ.setdefault(name, value)
            from vllm import LLM
            llm = self.model.llm
            base = llm.get_base_model() if hasattr(llm, "get_base_model") else llm
            dtype = next(p.dtype for p in base.parameters() if p.is_floating_point())
            options = {k: v for k, v in self.options.items() if v is not None}
            self._llm = LLM(model=base.config._name_or_path, dtype=str(dtype).replace("torch.", ""),
                            distributed_executor_backend="external_launcher",
                            seed=int(os.environ.get("RANK", 0)), enable_prefix_caching=True,
                            worker_extension_cls="sfttool.model.rollout_vllm.WeightLoader", **options)
        return self._llm

    @torch.no_grad()
    def sync_weights(self, llm: Any) -> None:
        """Load the policy's current weights into the vLLM engine."""
        lora = hasattr(llm, "merge_adapter")
        with whole_parameters(llm, self.synced_gpus):
            if lora:
                llm.merge_adapter()
            try:
                self.engine().collective_rpc("load_named_weights", args=(list(merged_weights(llm)),))
            finally:
                if lora:
                    llm.unmerge_adapter()
        self.engine().reset_prefix_cache()  # cached prompts hold the old weights' keys and values

    def generate(self, llm: Any, prompts: Sequence[Sequence[int]], keys: Sequence[Sequence[int]],
                 settings: SamplingSettings, with_logits: bool = False) -> Completions:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        if with_logits:
            raise NotImplementedError("the vllm engine does not return logits; use rollout_engine='hf'")
        engine = self.engine()
        if self.options["enable_sleep_mode"]:
            engine.wake_up()
        self.sync_weights(llm)
        params = [SamplingParams(n=1, temperature=settings.temperature, top_p=settings.top_p,
                                 max_tokens=settings.max_completion_length, seed=completion_seed(settings.seed, key),
                                 stop_token_ids=self.stop_ids, detokenize=False) for key in keys]
        outputs = engine.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        if self.options["enable_sleep_mode"]:
            engine.sleep(level=1)
        return self._completions(outputs, settings.max_completion_length)

    def _completions(self, outputs: Any, max_new_tokens: int) -> Completions:
        """vLLM's outputs as the hf engine gives them: through the first stop token, included."""
        rows = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            if sample.finish_reason == "stop" and not set(ids) & set(self.stop_ids):  # the stop token was left out
                reason = sample.stop_reason
                ids.append(reason if isinstance(reason, int) else self.stop_ids[0])
            rows.append(ids + [-1] * (max_new_tokens + 1 - len(ids)))  # -1: padding no stop id matches
        ids, truncated = cut_completions(torch.tensor(rows), self.stop_ids, max_new_tokens)
        return Completions([[t for t in row if t >= 0] for row in ids], truncated)
