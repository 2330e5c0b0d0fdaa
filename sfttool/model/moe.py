"""Mixture-of-experts models: find their routers, expert blocks and fused expert weights, and
compute the router's load-balancing loss the way the model itself defines it.

Found by capability, not class name: a transformers 5 MoE model records its routers' logits
(``_can_record_outputs['router_logits']`` names the router class); an MoE block is a module with
a router among its children; fused experts are the block's 3-D parameters ``[experts, out, in]``
(Qwen3-MoE, Mixtral and DeepSeek-V3 store them so, not as one Linear per expert).

    >>> moe_blocks(llm)                    # tiny Qwen3-MoE  # doctest: +SKIP
    ['model.layers.0.mlp', 'model.layers.1.mlp']
    >>> fused_expert_parameters(llm)  # doctest: +SKIP
    ['experts.down_proj', 'experts.gate_up_proj']
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch

from sfttool.model.vision import base_model
from sfttool.registry import ConfigBuildError


def router_class(llm: Any) -> type | None:
    """The class whose first output is a layer's router logits, as the model records them; None for a
    dense model."""
    for module in base_model(llm).modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return getattr(recorder, "target_class", recorder)
    return None


def routers(llm: Any) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every router, in forward order."""
    kind = router_class(llm)
    return [] if kind is None else [(n, m) for n, m in base_model(llm).named_modules() if isinstance(m, kind)]


def moe_blocks(llm: Any) -> list[str]:
    """Names of the modules holding a router and its experts (what ZeRO-3 must keep whole)."""
    router_names = {name for name, _ in routers(llm)}
    return sorted({name.rpartition(".")[0] for name in router_names})


def is_moe(llm: Any) -> bool:
    return router_class(llm) is not None


def moe_block_classes(llm: Any) -> list[type]:
    modules = dict(base_model(llm).named_modules())
    return sorted({type(modules[name]) for name in moe_blocks(llm)}, key=lambda c: c.__name__)


def fused_expert_parameters(llm: Any) -> list[str]:
    """``owner.parameter`` suffixes of the 3-D expert weights inside MoE blocks (peft's
    ``target_parameters`` matches them), e.g. ``['experts.down_proj', 'experts.gate_up_proj']``."""
    modules = dict(base_model(llm).named_modules())
    found = set()
    for block in moe_blocks(llm):
        for name, param in modules[block].named_parameters():
            if param.dim() == 3:
                owner, _, leaf = name.rpartition(".")
                found.add(f"{owner.rpartition('.')[2]}.{leaf}" if owner else leaf)
    return sorted(found)


# ---------------------------------------------------------------------------
# The router's load-balancing loss.

def aux_loss_function(llm: Any) -> Callable | None:
    """The model's own load-balancing loss, ``f(router_logits, num_experts, top_k, mask)``, when the
    model has one with a coefficient (``router_aux_loss_coef``); None otherwise (dense models, and
    MoE models balanced another way, such as DeepSeek-V3's bias correction)."""
    base = base_model(llm)
    if getattr(base.config, "router_aux_loss_coef", None) is None or not is_moe(base):
        return None
    return getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)


def aux_loss_coefficient(llm: Any, override: float | None) -> float:
    """The weight of the load-balancing loss: ``override`` (``router_aux_loss_coef``), else the
    model's own; 0 for a model without one (``engine.checks`` refuses an override there)."""
    if aux_loss_function(llm) is None:
        if override:
            raise ConfigBuildError(f"router_aux_loss_coef={override}: {type(base_model(llm)).__name__} has no router "
                             "load-balancing loss; remove the setting")
        return 0.0
    return float(base_model(llm).config.router_aux_loss_coef if override is None else override)


def experts_and_top_k(llm: Any) -> tuple[int, int]:
    """(routed experts, experts per token) of an MoE model."""
    config = base_model(llm).config
    experts = next(getattr(config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")
                   if getattr(config, key, None))
    return int(experts), int(config.num_experts_per_tok)


@contextlib.contextmanager
def recorded_router_logits(llm: Any, enabled: bool = True) -> Iterator[list[torch.Tensor]]:
    """The router logits ``[tokens, experts]`` of every routed layer of the forwards run inside the
    block, in order. Hooks, not ``output_router_logits``, so the chunked loss's decoder-only forward
    records them too; they are removed on exit, so activation checkpointing's recompute in backward
    adds nothing."""
    logits: list[torch.Tensor] = []
    if not enabled:
        yield logits
        return
    handles = [module.register_forward_hook(lambda _m, _i, out: logits.append(out[0]))
               for _, module in routers(llm)]
    try:
        yield logits
    finally:
        for handle in handles:
            handle.remove()


def load_balancing_loss(llm: Any, router_logits: list[torch.Tensor], token_mask: torch.Tensor) -> torch.Tensor:
    """The model's load-balancing loss over the tokens ``token_mask`` [batch, seq] marks, from the
    ``router_logits`` of one forward (each ``[batch * seq, experts]``)."""
    experts, top_k = experts_and_top_k(llm)
    loss = aux_loss_function(llm)(tuple(router_logits), experts, top_k, token_mask.reshape(-1))
    return loss if isinstance(loss, torch.Tensor) else torch.zeros((), device=token_mask.device)
