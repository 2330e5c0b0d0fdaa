"""LM head + cross-entropy over chunks of trained positions (see docs/model.md).

With a 150k-token vocabulary the logits of a 4k-token row take 2.3 GiB in
float32, and autograd keeps three such buffers alive at the start of backward
(the saved log-softmax, the gradient from the loss, the gradient of the
logits). Here the ``[n, vocab]`` logits exist for one chunk of positions at a
time: forward computes each chunk's loss *and* its gradients (softmax minus
one-hot, times the token's weight), accumulates ``d loss / d hidden`` and
``d loss / d weight``, and frees the chunk. Backward only scales those by the
incoming gradient. The matmul count equals the unchunked loss (three per
position: logits, grad of hidden, grad of weight), so time does not grow.

Float32 exists only inside a chunk: the head runs in the model's dtype, its
output is upcast, exactly as ``summed_loss`` upcasts the full logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_SIZE = 512  # positions: 512 x 151,936 x 4 B = 297 MiB of float32 logits per chunk


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 targets: torch.Tensor, token_weights: torch.Tensor | None,
                                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """``sum_i w_i * CE(hidden_i @ weight.T + bias, targets_i)`` in float32.

    ``hidden`` [n, d] (trained positions only), ``weight`` [vocab, d], ``bias``
    [vocab] or None, ``targets`` [n], ``token_weights`` [n] float32 or None (all 1).
    """
    weights = _weights_or_ones(token_weights, hidden)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not grads:
        return (_chunk_losses(hidden, weight, bias, targets, weights, chunk_size, None)[0] * weights).sum()
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, weights, chunk_size)


def chunked_token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            targets: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """``log p(targets_i | hidden_i)`` for every position, [n] float32, for
    losses that are not a weighted sum of token losses (preference losses
    take per-sequence sums of these). One chunk of logits at a time; backward
    recomputes each chunk's logits, since each token's incoming gradient is
    only known then. The head's weight must stay whole until backward (not
    for ZeRO-3 partitioned heads).
    """
    return _ChunkedTokenLogProbs.apply(hidden, weight, bias, targets, chunk_size)


def _weights_or_ones(token_weights: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor:
    return token_weights if token_weights is not None else hidden.new_ones(hidden.shape[0], dtype=torch.float32)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Gradients are computed in forward, chunk by chunk; backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, weights, chunk_size):
        want = ctx.needs_input_grad[:3]  # hidden, weight, bias
        token_ce, (grad_h, grad_w, grad_b) = _chunk_losses(hidden, weight, bias, targets, weights, chunk_size, want)
        # Kept on ctx, not saved for backward: backward scales them in place and hands
        # them over, so no second weight-sized buffer exists. d/d(weight) waits in the
        # weight's dtype (half the memory in bf16).
        ctx.grads = (grad_h, None if grad_w is None else grad_w.to(weight.dtype), grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return (token_ce * weights).sum()

    @staticmethod
    def backward(ctx, grad_total):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("the chunked loss hands its gradients over once: backward(retain_graph=True) "
                               "twice through it is not supported")
        out = [None if g is None else g.mul_(grad_total.to(g.dtype)).to(dtype) for g, dtype in zip(grads, ctx.dtypes)]
        return (*out, None, None, None)


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """Forward keeps no logits; backward recomputes them chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size):
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk_size = chunk_size
        return -_chunk_losses(hidden, weight, bias, targets, None, chunk_size, None)[0]

    @staticmethod
    def backward(ctx, grad_log_probs):
        hidden, weight, bias, targets = ctx.saved_tensors
        want = ctx.needs_input_grad[:3]
        # d(sum_i g_i log p_i) = d(sum_i (-g_i) CE_i): the weighted-CE gradients with weights -g.
        _, grads = _chunk_losses(hidden, weight, bias, targets, -grad_log_probs.float(), ctx.chunk_size, want)
        dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return (*[None if g is None else g.to(dt) for g, dt in zip(grads, dtypes)], None, None)


def _chunk_losses(hidden, weight, bias, targets, weights, chunk_size, want):
    """Per-token CE [n] float32, and (when ``want`` names any) the float32
    gradients of ``sum_i weights_i * CE_i`` with respect to hidden, weight and bias."""
    want_h, want_w, want_b = want if want is not None else (False, False, False)
    grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b else None
    token_ce = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [n]
    grad_weights = weights if want_h or want_w or want_b else None
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        h, t = hidden[start:end], targets[start:end]  # [c, d], [c]
        w = grad_weights[start:end] if grad_weights is not None else None
        token_ce[start:end], probs = _chunk_loss(h, weight, bias, t, w)
        if probs is None:
            continue
        g = probs.to(weight.dtype)  # [c, vocab] d(sum)/d(logits), in the head's dtype as autograd would have it
        if want_h:
            grad_h[start:end] = g.mm(weight).float()
        if want_w and g.dtype == h.dtype == torch.float32:
            grad_w.addmm_(g.t(), h)  # no weight-sized temporary
        elif want_w:  # bf16 head, or bf16 hidden states into a float32 head under autocast
            grad_w += g.t().mm(h.to(g.dtype)).float()
        if want_b:
            grad_b += probs.sum(0)
    return token_ce, (grad_h, grad_w, grad_b)


def _chunk_loss(h, weight, bias, t, grad_weights):
    """Per-token CE [c] of one chunk; given ``grad_weights`` [c], also the
    gradient of ``sum_i grad_weights_i * CE_i`` with respect to the logits,
    (softmax - one-hot) * w, built in place in the logits buffer."""
    logits = F.linear(h, weight, bias).float()  # [c, vocab]: the one logits-sized buffer
    picked = logits.gather(1, t[:, None]).squeeze(1)  # [c]
    peak = logits.amax(1, keepdim=True)
    probs = logits.sub_(peak).exp_()  # unnormalised, in place
    norm = probs.sum(1, keepdim=True)
    ce = norm.log().add_(peak).squeeze(1) - picked  # [c] log-sum-exp minus the target's logit
    if grad_weights is None:
        return ce, None
    probs.div_(norm)
    probs[torch.arange(t.shape[0], device=t.device), t] -= 1
    return ce, probs.mul_(grad_weights[:, None])


def checkpointed_head_cross_entropy(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                                    token_weights: torch.Tensor | None,
                                    chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """The same sum for any head module (a LoRA-wrapped or ``modules_to_save``
    head): each chunk runs the module under activation checkpointing, so its
    logits are recomputed in backward instead of kept."""
    weights = _weights_or_ones(token_weights, hidden)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        end = start + chunk_size
        total = total + checkpoint(_module_chunk_loss, head, hidden[start:end], targets[start:end],
                                   weights[start:end], use_reentrant=False)
    return total


def _module_chunk_loss(head, h, t, w):
    return (F.cross_entropy(head(h).float(), t, reduction="none") * w).sum()
