"""Stop training on NaNs instead of silently learning from them.

An optimizer step is *non-finite* when the loss of any micro-batch in its
accumulation window is NaN or inf on any rank, or (plain fp32/bf16 path) when
any gradient is. Such a step is skipped: no parameter update, gradients
zeroed, the skip counted and logged. After ``max_consecutive_nonfinite``
non-finite steps in a row the run stops with ``NonFiniteLossError``; one
finite step resets the streak.

Turn it on from the config; it is on by default with a limit of 5::

    optim_wrapper = dict(type=OptimWrapper, optimizer=dict(type=AdamW, lr=2e-4),
                         max_consecutive_nonfinite=5)     # None or 0: no check

``guard_optim_wrapper_cfg(cfg.optim_wrapper)`` swaps ``type`` for a guarded
subclass of the same wrapper class, so the rest of the config is unchanged:

    >>> guard_optim_wrapper_cfg(dict(type='OptimWrapper', optimizer=opt))['type']  # doctest: +SKIP
    <class 'sfttool.engine.nonfinite.NonFiniteGuardOptimWrapper'>

Paths:
- ``OptimWrapper`` (fp32 / bf16 weights): loss and gradients are checked.
- ``AmpOptimWrapper`` (fp16 / bf16 autocast): gradients are scaled, and an
  overflowing fp16 step is the GradScaler's business (it skips the step and
  lowers the scale, which is normal early in fp16 training); only a
  non-finite *loss* counts here.
- DeepSpeed: the engine owns the gradients (partitioned under ZeRO) and
  decides itself whether to apply a step: it skips steps whose gradients
  overflow in fp16 (loss scaling), in bf16 when ``bf16.check_grad_overflow``
  is true (the default in deepspeed 0.19) and, for ZeRO-1/2, when the global
  gradient norm is not finite. Our guard cannot skip there; it counts steps
  with a non-finite loss and stops the run after N in a row.
"""
from __future__ import annotations

import torch
from mmengine.logging import MessageHub, print_log
from mmengine.optim import OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS

from sfttool import compat
from sfttool.engine.collective import any_rank
from sfttool.errors import SfttoolError
from sfttool.registry import resolve_type

DEFAULT_MAX_CONSECUTIVE_NONFINITE = 5


class NonFiniteLossError(SfttoolError, RuntimeError):
    """Too many optimizer steps in a row had a NaN/inf loss or gradient."""



def _check_limit(value) -> int | None:
    if value in (None, 0):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"optim_wrapper.max_consecutive_nonfinite must be a positive integer, or None/0 to turn the "
            f"check off; got {value!r}")
    return value


def grads_are_finite(optimizer: torch.optim.Optimizer) -> bool:
    """True when every gradient the optimizer would apply is finite.

    The inf-norm (largest magnitude) is NaN or inf exactly when some entry
    is, and unlike the 2-norm it cannot overflow on large finite gradients.
    """
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return True
    norm = torch.nn.utils.get_total_norm(grads, norm_type=float("inf"), error_if_nonfinite=False)
    return bool(torch.isfinite(norm))


class NonFiniteGuardMixin:
    """Skip-and-count logic shared by every guarded optimizer wrapper.

    Placed before an mmengine optimizer wrapper in the MRO; it wraps
    ``backward`` (to see each micro-batch's loss) and ``step``.
    """

    def __init__(self, *args, max_consecutive_nonfinite: int | None = DEFAULT_MAX_CONSECUTIVE_NONFINITE,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.max_consecutive_nonfinite = _check_limit(max_consecutive_nonfinite)
        self.nonfinite_streak = 0       # non-finite steps in a row
        self.nonfinite_skipped = 0      # non-finite steps since this process started
        self._window_finite = None      # bool tensor: every loss of this window finite so far

    @property
    def _checks_grads(self) -> bool:
        # Scaled fp16 gradients overflow routinely; the GradScaler handles that.
        return not hasattr(self, "loss_scaler")

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        finite = torch.isfinite(loss.detach()).all()  # stays on device: no sync per micro-batch
        self._window_finite = finite if self._window_finite is None else self._window_finite & finite
        super().backward(loss, **kwargs)

    def _window_is_nonfinite(self, check_grads: bool) -> tuple[bool, str]:
        loss_bad = self._window_finite is not None and not bool(self._window_finite)
        self._window_finite = None
        grads_bad = check_grads and not loss_bad and not grads_are_finite(self.optimizer)
        bad = any_rank(loss_bad or grads_bad)
        what = "loss" if loss_bad else "gradients" if grads_bad else "loss or gradients on another rank"
        return bad, what

    def step(self, **kwargs) -> None:
        if self.max_consecutive_nonfinite is None:
            return super().step(**kwargs)
        bad, what = self._window_is_nonfinite(self._checks_grads)
        if not bad:
            self.nonfinite_streak = 0
            return super().step(**kwargs)
        self.optimizer.zero_grad(set_to_none=True)
        self._count_nonfinite(what, action="skipped the optimizer step")

    def _count_nonfinite(self, what: str, action: str) -> None:
        self.nonfinite_streak += 1
        self.nonfinite_skipped += 1
        hub = MessageHub.get_current_instance()  # DeepSpeed's wrapper has no `message_hub` attribute
        hub.update_scalar("train/nonfinite_steps", self.nonfinite_skipped)
        step = hub.get_info("iter")
        where = f"iteration {step + 1}" if isinstance(step, int) else "this step"
        print_log(f"non-finite {what} at {where}: {action} ({self.nonfinite_streak} in a row, "
                  f"{self.nonfinite_skipped} in total, limit {self.max_consecutive_nonfinite} in a row)",
                  logger="current", level=30)
        if self.nonfinite_streak >= self.max_consecutive_nonfinite:
            raise NonFiniteLossError(
                f"training stopped at {where}: {self.nonfinite_streak} optimizer steps in a row had a "
                f"non-finite (NaN/inf) {what}. Common causes: a learning rate too high, fp16 overflow "
                f"(use bf16), or data rows with extreme values. Skipped steps left the weights unchanged, so "
                f"the last checkpoint is usable: lower the learning rate or fix the data, then resume. "
                f"The limit is optim_wrapper.max_consecutive_nonfinite "
                f"(now {self.max_consecutive_nonfinite}; None turns the check off).")


class DeepSpeedNonFiniteGuardMixin(NonFiniteGuardMixin):
    """For wrappers whose ``step`` hands over to a DeepSpeed engine.

    The engine applies or skips the step itself (see the module docstring);
    skipping its ``step()`` call would desynchronise its micro-step count, so
    this mixin only counts steps with a non-finite loss and stops the run.
    """

    def step(self, **kwargs) -> None:
        boundary = self.model.is_gradient_accumulation_boundary()
        super(NonFiniteGuardMixin, self).step(**kwargs)
        if self.max_consecutive_nonfinite is None or not boundary:
            return
        bad, what = self._window_is_nonfinite(check_grads=False)
        if not bad:
            self.nonfinite_streak = 0
            return
        applied = getattr(self.model, "was_step_applied", lambda: True)()
        self._count_nonfinite(what, action="DeepSpeed skipped the step" if not applied
                              else "DeepSpeed applied the step")


@OPTIM_WRAPPERS.register_module()
class NonFiniteGuardOptimWrapper(NonFiniteGuardMixin, OptimWrapper):
    """mmengine's ``OptimWrapper`` that skips non-finite steps (see module docstring)."""


_GUARDED: dict[type, type] = {OptimWrapper: NonFiniteGuardOptimWrapper}


def guarded_class(base: type) -> type:
    """The guarded subclass of an mmengine optimizer wrapper class (made once per class)."""
    if issubclass(base, NonFiniteGuardMixin):
        return base
    if base not in _GUARDED:
        # Wrappers that own their gradients derive from OptimWrapper (AmpOptimWrapper too);
        # DeepSpeed's wrapper delegates backward/step to the engine instead.
        mixin = NonFiniteGuardMixin if issubclass(base, OptimWrapper) else DeepSpeedNonFiniteGuardMixin
        _GUARDED[base] = type(f"NonFiniteGuard{base.__name__}", (mixin, base),
                              {"__module__": __name__, "__doc__": f"{base.__name__} + {mixin.__name__}"})
    return _GUARDED[base]


def _resolve_wrapper_type(type_) -> type | None:
    if isinstance(type_, type):
        return type_
    if isinstance(type_, str):
        found = OPTIM_WRAPPERS.get(type_)
        if found is None and "." not in type_:
            compat.register_mmengine_deepspeed_wrapper()
            found = OPTIM_WRAPPERS.get(type_)
        if found is None and "." in type_:
            found = resolve_type(type_, "optim_wrapper.type")
        return found if isinstance(found, type) else None
    return None


def guard_optim_wrapper_cfg(optim_cfg: dict) -> dict:
    """Return a copy of an ``optim_wrapper`` config whose wrapper skips non-finite steps.

    ``max_consecutive_nonfinite`` (default 5; None or 0: off) is read from the
    config. A wrapper type that cannot be resolved here is left unguarded with
    a warning rather than failing the run.
    """
    cfg = dict(optim_cfg)
    limit = _check_limit(cfg.pop("max_consecutive_nonfinite", DEFAULT_MAX_CONSECUTIVE_NONFINITE))
    if limit is None:
        return cfg
    base = _resolve_wrapper_type(cfg.get("type", "OptimWrapper"))
    if base is None:
        print_log(f"optim_wrapper.type {cfg.get('type')!r} is not a known optimizer wrapper class: the "
                  f"non-finite loss check is off for this run", logger="current", level=30)
        return cfg
    cfg["type"] = guarded_class(base)
    cfg["max_consecutive_nonfinite"] = limit
    return cfg
