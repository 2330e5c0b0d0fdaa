"""``SupervisedFinetune``: the mmengine model wrapping a HF causal LM.

Build order matters: load the LLM, grow its embeddings for the tokenizer,
switch on activation checkpointing (before peft wraps it, so the base model's
layers are the ones checkpointed), then add LoRA adapters.

Forward never passes an attention mask and always ``use_cache=False``: with
``position_ids`` restarting at 0 at every sample start, transformers 5 then
keeps packed samples (and the padding pseudo-sample) from attending to each
other on every backend. A padding mask or a KV cache would silently undo that.
(Flash-attention reads the boundaries from one row only, so with it the batch
runs as a single row.) Under sequence parallelism (``sfttool.parallel``) each
rank runs its slice of every row, and attention reads the whole rows' positions.
An image-text batch's pixels (and grids) go to the model with the ids, and each
packed sample gets its own multimodal positions (``sfttool.model.vision``). A model
whose images attend within themselves (Gemma 3) takes such a batch with its attention
masks, built there: the one exception to passing none.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections import OrderedDict
from typing import Any

import torch
from mmengine.model import BaseModel

from sfttool import compat
from sfttool.model import loss as L
from sfttool.model import moe
from sfttool.model.build import build_llm, resize_embeddings
from sfttool.model.chunked_loss import (DEFAULT_CHUNK_SIZE, checkpointed_head_cross_entropy,
                                        chunked_linear_cross_entropy, chunked_token_log_probs)
from sfttool.model.fused_loss import IMPLEMENTATIONS, fused_linear_cross_entropy, require_kernel
from sfttool.model.lm_head import gathered, is_partitioned, split_lm
from sfttool.model.lora import apply_lora, build_lora_config, load_adapter_folder, vision_language_targets
from sfttool.model.vision import (attends_within_images, check_vision_settings, freeze_parts, image_inputs,
                                  is_vision_language, multimodal_position_ids, packed_image_attention_masks,
                                  placeholder_image_zero, uses_multimodal_rope, vision_parameters)
from sfttool.model.step_metrics import STEP_METRICS, split_step_metrics, step_metrics
from sfttool.parallel import sequence as sequence_parallel
from sfttool.parallel.split import RowSplit
from sfttool.registry import BUILDER, ConfigBuildError, build_if_config
from sfttool.utils.checkpoint_file import load_checkpoint

logger = logging.getLogger(__name__)


@BUILDER.register_module()
class SupervisedFinetune(BaseModel):
    """Supervised fine-tuning of a causal LM: full, LoRA or QLoRA.

    Args:
        llm: the HF model, or its config (see ``sfttool.model.build``).
        lora: a peft ``LoraConfig`` or its config; None for full fine-tuning.
        peft_model: adapter weights to start from (a peft adapter folder or a
            checkpoint file of this model).
        use_activation_checkpointing: recompute activations in backward.
        use_varlen_attn: use flash-attention 2 varlen kernels when available.
        tokenizer: tokenizer or its config; embeddings grow to fit it.
        max_position_embeddings: stretch the context with linear RoPE scaling.
        loss_reduction: 'token' (mean over trained tokens) or 'sample' (mean of
            per-sample means).
        loss_implementation: 'chunked' (default: the LM head and cross-entropy
            run over ``loss_chunk_size`` trained positions at a time, so the
            logits of a whole row never exist), 'unchunked' (all trained
            positions' logits at once), or a fused GPU kernel: 'liger' or
            'cut_cross_entropy' (pip extras ``liger`` / ``cce``).
        loss_chunk_size: trained positions per chunk of the loss.
        lora_targets: where LoRA goes when ``lora`` names no targets: 'all', 'attention' or
            'experts' (mixture-of-experts models; see ``sfttool.model.lora``).
        router_aux_loss_coef: the weight of the router's load-balancing loss in the training loss
            (mixture-of-experts models that define one); None: the model's own
            ``config.router_aux_loss_coef``; 0: left out. See docs/moe.md.
        freeze_vision_tower: a vision-language checkpoint's vision tower stays frozen
            (``sfttool.model.vision``); False trains it (full fine-tuning; with LoRA see
            ``lora_vision_tower``).
        freeze_projector: the projector (image features -> the language model's embeddings) stays
            frozen; None (default): as ``freeze_vision_tower``. False with LoRA trains it whole beside
            the adapters (saved with them).
        freeze_llm: the language model stays frozen (e.g. LLaVA's pretraining stage: the projector alone).
        lora_vision_tower: LoRA adapters on the vision tower's linear layers too (with ``lora``).
    """

    # sfttool.registry.build hands `llm` over as a config: build_llm fixes
    # dtype strings and quantization settings before loading.
    build_args_lazily = ("llm",)

    def __init__(self, llm, lora=None, peft_model=None, use_activation_checkpointing=True,
                 use_varlen_attn=False, tokenizer=None, max_position_embeddings=None,
                 loss_reduction="token", loss_implementation="chunked", loss_chunk_size=DEFAULT_CHUNK_SIZE,
                 lora_targets="all", router_aux_loss_coef=None, freeze_vision_tower=True, freeze_projector=None,
                 freeze_llm=False, lora_vision_tower=False, data_preprocessor=None):
        super().__init__(data_preprocessor=data_preprocessor)
        check_loss_settings(loss_reduction, loss_implementation, loss_chunk_size)
        self.loss_reduction = loss_reduction
        self.loss_implementation = loss_implementation
        self.loss_chunk_size = loss_chunk_size
        self.use_varlen_attn = use_varlen_attn
        llm = build_llm(llm, use_varlen_attn, max_position_embeddings)
        if tokenizer is not None:
            resize_embeddings(llm, build_if_config(tokenizer, "model.tokenizer"))
        llm.config.use_cache = False
        compat.disable_bnb_cpu_weight_repacking(llm)
        self.lora = build_lora_config(lora) if lora is not None else None
        self.use_lora = self.lora is not None
        if not self.use_lora and lora_targets != "all":
            raise ConfigBuildError(f"model.lora_targets={lora_targets!r} chooses where LoRA goes, but model.lora is "
                                   "None (full fine-tuning trains everything): set model.lora or remove lora_targets")
        # on a text model any of these switches is an error; on a vision-language model they must agree
        freeze_parts(llm, freeze_vision_tower, freeze_projector, freeze_llm, lora_vision_tower)
        check_vision_settings(self.use_lora, freeze_vision_tower, freeze_projector, freeze_llm, lora_vision_tower)
        self.frozen_vision_parameters = sum(p.numel() for p in vision_parameters(llm).values() if not p.requires_grad)
        self.multimodal_rope = uses_multimodal_rope(llm)  # packed positions go in as four rows
        self.image_attention = attends_within_images(llm)  # batches with images go in with their masks
        self.llm = llm
        self.router_aux_loss_coef = moe.aux_loss_coefficient(llm, router_aux_loss_coef)
        # Flash-attention derives varlen boundaries from position_ids only for a
        # single row (transformers 5): give it the batch as one row.
        self.flatten_batch = "flash" in str(getattr(llm.config, "_attn_implementation", ""))
        if use_activation_checkpointing:
            self.gradient_checkpointing_enable()
        if self.use_lora and is_vision_language(llm):
            train_projector = freeze_projector is False
            vision_language_targets(llm, self.lora, lora_targets, freeze_llm, lora_vision_tower, train_projector)
            lora_targets = "all"  # chosen above
        if self.use_lora:
            self.llm = apply_lora(llm, self.lora, use_activation_checkpointing, lora_targets)
        if peft_model is not None:
            self.load_peft_model(peft_model)
        # trained vision tower or projector parameters (each batch without images must still reach them)
        self._trains_vision = any(p.requires_grad for p in vision_parameters(self.llm).values())
        parts, why = split_lm(self.llm)
        if parts is None and loss_implementation != "unchunked":
            logger.warning("model.loss_implementation=%r: %s, so the loss computes all trained positions' "
                           "logits at once", loss_implementation, why)
        self._is_init = True

    # -- set-up helpers ---------------------------------------------------

    def gradient_checkpointing_enable(self) -> None:
        """Non-reentrant checkpointing; input grads on so frozen embeddings
        (LoRA) still let gradients reach the checkpointed layers."""
        llm = self.llm
        if hasattr(llm, "activation_checkpointing_enable"):  # transformers >= 5.x name
            llm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        llm.enable_input_require_grads()

    def gradient_checkpointing_disable(self) -> None:
        llm = self.llm
        if hasattr(llm, "activation_checkpointing_disable"):
            llm.activation_checkpointing_disable()
        else:
            llm.gradient_checkpointing_disable()

    def load_peft_model(self, path: str | os.PathLike) -> None:
        if not self.use_lora:
            raise ConfigBuildError("model.peft_model is set but model.lora is None: adapters need a LoRA config")
        if not os.path.exists(path):
            raise FileNotFoundError(f"model.peft_model: {path} does not exist "
                                    "(expected a peft adapter folder or a checkpoint of this model)")
        if os.path.isdir(path):
            load_adapter_folder(self.llm, path)
            return
        # A checkpoint written by the runner: mmengine pickles its own objects beside the weights,
        # loaded through the explicit allow-list, never with arbitrary unpickling.
        ckpt = load_checkpoint(path)
        state = ckpt.get("state_dict", ckpt)
        missing = set(self.state_dict()) - set(state)
        if missing:
            raise ConfigBuildError(f"model.peft_model: {path} lacks adapter weights such as {sorted(missing)[:3]}")
        self.load_state_dict(state, strict=False)

    def init_weights(self) -> None:
        """No-op: the weights come from the pretrained checkpoint. (mmengine's
        default initialisers would also touch bnb's uint8 4-bit weights and fail.)"""

    # -- forward ----------------------------------------------------------

    def forward(self, data: dict, data_samples: Any = None, mode: str = "loss"):
        if mode == "loss":
            return self.compute_loss(data)
        if mode == "predict":
            return [{"logits": logits} for logits in self._logits(data)]
        if mode == "tensor":
            return self._logits(data)
        raise NotImplementedError(f"mode must be 'loss', 'predict' or 'tensor', got {mode!r}")

    def _inputs(self, data: dict) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``input_ids``, ``position_ids`` as the LLM takes them, and whether the
        batch was flattened into one row (flash-attention)."""
        input_ids = data["input_ids"]  # [batch, seq]
        position_ids = data.get("position_ids")
        if position_ids is None:
            position_ids = L.default_position_ids(input_ids)
        flat = self.flatten_batch and input_ids.shape[0] > 1
        if flat:  # rows start at position 0, so one long row keeps them apart
            input_ids, position_ids = input_ids.reshape(1, -1), position_ids.reshape(1, -1)
        return input_ids, position_ids, flat

    def _row_split(self, position_ids: torch.Tensor):
        """This rank's share of the rows (``position_ids`` as the LLM takes them) under sequence
        parallelism; None without it."""
        size = sequence_parallel.get_sequence_parallel_world_size()
        if size == 1:
            return None
        return RowSplit.of(position_ids, size, sequence_parallel.get_sequence_parallel_rank(),
                           sequence_parallel.get_sequence_parallel_group())

    def _forward_kwargs(self, data: dict, split: Any = None) -> tuple[dict, bool, Any]:
        """The LLM's keyword arguments, whether the batch was flattened, and the row split (or None;
        ``split``: the one the caller already made for this batch). Under sequence parallelism the LLM
        gets this rank's slice, and attention the whole rows' split."""
        input_ids, position_ids, flat = self._inputs(data)
        kwargs = dict(attention_mask=None, use_cache=False)
        if split is None:
            split = self._row_split(position_ids)
        images = image_inputs(data)  # the batch's pixels (and grids), as the processor gave them
        if split is not None:
            input_ids, position_ids = split.local(input_ids, 0), split.local_positions()
            kwargs["sequence_parallel"] = split
        elif self.multimodal_rope:  # each packed sample's own 3-D positions around its images
            position_ids = multimodal_position_ids(self.llm, input_ids, position_ids, images.get("image_grid_thw"))
        elif self.image_attention and images:  # each image's tokens see each other, within their sample
            kwargs["attention_mask"] = packed_image_attention_masks(self.llm, input_ids, position_ids)
        return dict(kwargs, input_ids=input_ids, position_ids=position_ids, **images), flat, split

    def _run_llm(self, data: dict, logits_to_keep: Any = 0, llm: Any = None, split: Any = None) -> torch.Tensor:
        """The logits of ``self.llm`` (or of another ``llm``, e.g. a frozen reference copy, run
        through the same packed forward). Under sequence parallelism: this rank's slice, with
        ``logits_to_keep`` already laid out as the slice."""
        llm = self.llm if llm is None else llm
        kwargs, flat, split = self._forward_kwargs(data, split)
        if flat and split is None and isinstance(logits_to_keep, torch.Tensor):
            logits_to_keep = logits_to_keep.reshape(1, -1)  # same row-major order of kept positions
        use_keep = not _is_zero(logits_to_keep) and _accepts_logits_to_keep(llm)
        if use_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        logits = llm(**kwargs).logits
        if flat and split is None and logits.dim() == 3:
            logits = logits.view(*data["input_ids"].shape, -1)
        return logits

    def _hidden_states(self, decoder: torch.nn.Module, data: dict, split: Any = None) -> torch.Tensor:
        """The decoder's last hidden states [batch, seq, hidden]: the LLM without its head (under
        sequence parallelism this rank's slice, laid out as ``RowSplit.local``)."""
        kwargs, _, split = self._forward_kwargs(data, split)
        hidden = decoder(**kwargs).last_hidden_state
        return hidden if split is not None else hidden.view(*data["input_ids"].shape, -1)

    def _logits(self, data: dict) -> torch.Tensor:
        return self._run_llm(data)  # [batch, seq, vocab]

    def count_loss_units(self, data: dict) -> int:
        """Local count the loss is divided by when no ``loss_normalizer`` is given.

        Takes the collated batch, or the dataloader's ``{'data': batch, ...}``.
        """
        if "labels" not in data and isinstance(data.get("data"), dict):
            data = data["data"]
        return L.count_loss_units(data["labels"], data.get("position_ids"), self.loss_reduction)

    def normalize(self, total: torch.Tensor, data: dict, ranks_sharing_rows: int = 1) -> torch.Tensor:
        """``total`` (a summed loss) over the step's loss units: the train loop's ``loss_normalizer``,
        else this batch's own ``count_loss_units``, counted once over the ``ranks_sharing_rows``
        sequence-parallel ranks that each hold a slice of the same rows (as the train loop counts)."""
        normalizer = data.get("loss_normalizer")
        if normalizer is None:
            normalizer = self.count_loss_units(data) / ranks_sharing_rows
        return total / max(float(normalizer), 1e-12)

    def _trained_positions(self, data: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(targets [batch, seq], keep [batch, seq], position_ids)``: each position's next-token
        target and whether it predicts a trained token."""
        labels = data["labels"]
        position_ids = data.get("position_ids")
        if position_ids is None:
            position_ids = L.default_position_ids(labels)
        targets = L.shift_targets(labels, position_ids)  # [batch, seq]
        keep = targets != L.IGNORE_INDEX  # [batch, seq] positions that predict a trained token
        return targets, keep, position_ids

    def trained_token_log_probs(self, data: dict, keep: torch.Tensor, targets: torch.Tensor,
                                llm: Any = None, temperature: float = 1.0) -> torch.Tensor:
        """``log p(target)`` of each trained position, [n] float32 in row-major order, for ``self.llm``
        or another ``llm`` (a frozen reference copy) run through the same packed forward. ``keep``
        [batch, seq] marks the positions, ``targets`` [n] holds their targets. Like the training loss
        the head runs over ``loss_chunk_size`` positions at a time where the model allows it, so a
        row's [n, vocab] logits never exist. ``temperature`` divides the logits first (the sampling
        distribution of online RL); 1 leaves them untouched."""
        llm = self.llm if llm is None else llm
        parts = self._lm_parts(llm)
        # chunked_token_log_probs keeps the head's weight until backward: a ZeRO-3 partitioned head
        # can be used whole only where no backward follows.
        if parts is not None and parts.plain_linear and not (torch.is_grad_enabled()
                                                            and is_partitioned(parts.head.weight)):
            hidden = self._hidden_states(parts.decoder, data)[keep]  # [n, hidden]
            with gathered(parts.head.weight, parts.head.bias):
                bias = parts.head.bias
                if temperature != 1:  # (h W^T + b) / T = (h / T) W^T + b / T
                    hidden, bias = hidden / temperature, None if bias is None else bias / temperature
                return chunked_token_log_probs(hidden, parts.head.weight, bias, targets, self.loss_chunk_size)
        logits = self._run_llm(data, logits_to_keep=keep, llm=llm)
        if logits.dim() == 3:  # the model ignored logits_to_keep: select here
            logits = logits[keep]
        logits = logits.float() if temperature == 1 else logits.float() / temperature
        return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")

    def summed_row_losses(self, data: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of the batch: the summed token cross-entropy (float64) and the trained-token
        count, ``([batch], [batch])``. Validation adds these up over the whole set, so its loss is
        the token mean whatever the packing, batch size or process count."""
        targets, keep, _ = self._trained_positions(data)
        per_token = -self.trained_token_log_probs(data, keep, targets[keep])  # [n]
        row_of = keep.nonzero()[:, 0]  # [n] the row of each trained position (row-major, as the hidden states)
        sums = per_token.new_zeros(keep.shape[0], dtype=torch.float64).index_add(0, row_of, per_token.double())
        return sums, keep.sum(dim=1)

    def _lm_parts(self, llm: Any = None):
        """The decoder and head to run the loss in chunks, or None: the model's logits are not
        head(hidden states), or ``loss_implementation='unchunked'``."""
        return split_lm(self.llm if llm is None else llm)[0] if self.loss_implementation != "unchunked" else None

    def compute_loss(self, data: dict) -> dict:
        targets, keep, position_ids = self._trained_positions(data)
        split = self._row_split(self._inputs(data)[1])
        if split is not None:
            return self._sequence_parallel_loss(data, targets, keep, position_ids, split)
        parts = self._lm_parts()
        with self._untouched_vision_zero(data), \
                moe.recorded_router_logits(self.llm, enabled=bool(self.router_aux_loss_coef)) as router_logits:
            if parts is None:
                total = self._unchunked_loss(data, targets, keep, position_ids)
            else:
                hidden = self._hidden_states(parts.decoder, data)[keep]  # [n, hidden]
                weights = L.token_weights(position_ids, keep, self.loss_reduction)  # [n] or None
                total = self._head_loss(parts, hidden, targets[keep], weights)
        units = self._loss_units(keep, position_ids)
        if not router_logits:
            return {"loss": self.normalize(total, data), **step_metrics(loss=(total, units))}
        # The forward's load-balancing loss counts once per loss unit, like each unit's LM loss: the
        # step's objective is its units' mean of (LM loss + coef * aux loss of their forward).
        aux = moe.load_balancing_loss(self.llm, router_logits, L.trained_sample_tokens(data["labels"], position_ids))
        objective = total + self.router_aux_loss_coef * aux * units
        return {"loss": self.normalize(objective, data),
                **step_metrics(loss=(total, units), aux_loss=(aux * units, units))}

    @contextlib.contextmanager
    def _untouched_vision_zero(self, data: dict):
        """Nothing for a batch with images; for one without, the forward runs the vision tower and projector
        on a placeholder image and adds 0 times its features to the input embeddings, where image features
        would go in. Every process's forward and backward then run the same modules and reach the same
        parameters, in the same order: DDP and ZeRO reduce gradients in buckets, and a process whose batch
        had no image would leave its buckets waiting (the others' hold the images' gradients); ZeRO-1/2 also
        lay a bucket out in the order its gradients arrive, so a zero reaching the projector first (added to
        the loss) instead of last (where the images' gradients arrive), or its bias before its weight, would
        sum one process's projector gradients with another's LoRA ones; ZeRO-3 gathers each module's
        parameters as its forward starts, on every process. Their gradient from this batch stays 0."""
        if not self._trains_vision or image_inputs(data):
            yield
            return

        def add_zero(module, args, output):
            # Computed here, after the embeddings' own forward, as a real image's features are: ZeRO-3
            # gathers each module's parameters as its forward starts, in the same order on every process.
            return output + placeholder_image_zero(self.llm).to(output.dtype)

        handle = self.llm.get_input_embeddings().register_forward_hook(add_zero)
        try:
            yield
        finally:
            handle.remove()

    def _sequence_parallel_loss(self, data, targets, keep, position_ids, split) -> dict:
        """The loss of this rank's slice. Targets and sample weights come from the whole rows (a slice's
        last position predicts the next slice's first token); the returned value is the whole rows'
        loss on every rank, while each rank's gradient is its own slice's (see ``sfttool.parallel.comm``)."""
        # `total` below is the group's mean of its ranks' slice losses, the rows' summed loss / sp: a
        # rank's share of it, shown beside the same share of the rows' loss units.
        units = self._loss_units(keep, position_ids) / split.size
        weights = L.token_weights(position_ids, keep, self.loss_reduction)  # [n] over the whole rows
        targets = split.local(targets, L.IGNORE_INDEX)  # [batch, seq/sp]
        weights = None if weights is None else split.local(keep.float().masked_scatter(keep, weights), 0.0)
        keep = targets != L.IGNORE_INDEX
        weights = None if weights is None else weights[keep]
        parts = self._lm_parts()
        if parts is None:
            logits = self._run_llm(data, logits_to_keep=keep, split=split)
            token_loss = torch.nn.functional.cross_entropy(
                (logits[keep] if logits.dim() == 3 else logits).float(), targets[keep], reduction="none")
            total = token_loss.sum() if weights is None else (token_loss * weights).sum()
        else:
            total = self._head_loss(parts, self._hidden_states(parts.decoder, data, split)[keep], targets[keep],
                                    weights)
        total = sequence_parallel.reduce_sequence_parallel_loss(total, split.group)
        return {"loss": self.normalize(total, data, ranks_sharing_rows=split.size), **step_metrics(loss=(total, units))}

    def _loss_units(self, keep: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | int:
        """The micro-batch's loss units (``count_loss_units``) from its trained positions ``keep``
        [batch, seq]: a tensor for tokens (no synchronisation with the device)."""
        if self.loss_reduction == "token":
            return keep.sum()
        return int(L.sample_ids(position_ids)[keep].unique().numel())

    def parse_losses(self, losses: dict) -> tuple[torch.Tensor, dict]:
        """mmengine's, with the step metrics (``sfttool.model.step_metrics``) handed through to the
        train loop beside the logged values."""
        losses, metrics = split_step_metrics(losses)
        loss, log_vars = super().parse_losses(losses)
        if metrics is not None:
            log_vars[STEP_METRICS] = metrics
        return loss, log_vars

    def _unchunked_loss(self, data, targets, keep, position_ids) -> torch.Tensor:
        """The logits of every trained position at once: for models whose logits
        are not head(hidden), and as the reference the chunked loss is tested against."""
        logits = self._run_llm(data, logits_to_keep=keep)
        if logits.dim() == 3:  # the model ignored logits_to_keep: select here
            logits = logits[keep]
        sample_of = L.sample_ids(position_ids)[keep] if self.loss_reduction == "sample" else None
        return L.summed_loss(logits, targets[keep], sample_of)  # [n, vocab] -> scalar

    def _head_loss(self, parts, hidden, targets, weights) -> torch.Tensor:
        """Head + CE summed over trained positions, never all their logits at once."""
        if not parts.plain_linear:  # e.g. a LoRA-wrapped head: run the module itself per chunk
            return checkpointed_head_cross_entropy(parts.head, hidden, targets, weights, self.loss_chunk_size)
        weight, bias = parts.head.weight, parts.head.bias
        with gathered(weight, bias):  # ZeRO-3: gather the head once per step, not once per chunk
            if self.loss_implementation == "chunked":
                return chunked_linear_cross_entropy(hidden, weight, bias, targets, weights, self.loss_chunk_size)
            return fused_linear_cross_entropy(self.loss_implementation, hidden, weight, bias, targets, weights)

    # -- checkpoints ------------------------------------------------------

    # Submodules a subclass rebuilds from their source at start and never saves (a frozen reference model).
    unsaved_modules: tuple[str, ...] = ()

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """Full fine-tune: the LLM's weights. LoRA: only the trainable
        (adapter) weights, under the keys ``load_state_dict`` expects back.
        Neither holds the ``unsaved_modules``."""
        state = super().state_dict(prefix=prefix, keep_vars=keep_vars)
        if self.use_lora:
            trained = {prefix + name for name, p in self.named_parameters() if p.requires_grad}
            state = OrderedDict((k, v) for k, v in state.items() if k in trained)
        unsaved = tuple(f"{prefix}{name}." for name in self.unsaved_modules)
        if unsaved:
            state = OrderedDict((k, v) for k, v in state.items() if not k.startswith(unsaved))
        if destination is not None:
            destination.update(state)
            return destination
        return state


def check_loss_settings(reduction: str, implementation: str, chunk_size: Any) -> None:
    if reduction not in L.REDUCTIONS:
        raise ConfigBuildError(f"model.loss_reduction must be one of {L.REDUCTIONS}, got {reduction!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ConfigBuildError(f"model.loss_implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigBuildError(f"model.loss_chunk_size must be a positive integer (positions per chunk, "
                               f"default {DEFAULT_CHUNK_SIZE}), got {chunk_size!r}")
    if implementation == "liger" and reduction != "token":
        raise ConfigBuildError("model.loss_implementation='liger' supports loss_reduction='token' only; "
                               "use loss_implementation='chunked' or 'cut_cross_entropy' for 'sample'")
    if implementation in ("liger", "cut_cross_entropy"):
        require_kernel(implementation)


def _is_zero(value: Any) -> bool:
    return isinstance(value, int) and value == 0


def _accepts_logits_to_keep(llm: Any) -> bool:
    """Whether the causal LM can project only selected positions onto the
    vocabulary (transformers 5 models take a boolean ``logits_to_keep`` mask)."""
    base = llm.get_base_model() if hasattr(llm, "get_base_model") else llm
    return "logits_to_keep" in inspect.signature(base.forward).parameters
