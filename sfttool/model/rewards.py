"""Reward functions for online RL (``GRPO``): the contract, the built-ins, and how a config names them.

A reward function scores a batch of completions at once, as TRL's do::

    def my_reward(prompts, completions, completion_ids, **columns) -> list[float | None]: ...

``prompts[i]`` is the prompt as the data row gives it (a list of messages, or a string);
``completions[i]`` is ``[{"role": "assistant", "content": text}]`` for a conversational prompt and
the text for a string prompt; ``completion_ids[i]`` the generated token ids; every other column of
the row arrives under its own name, one value per completion (``solution=[...]``). ``None`` means
"does not apply here": that completion's weighted sum leaves the function out.

``reward_funcs`` (model setting) lists built-in names (``'accuracy'``, ``'format'``, ``'length'``),
functions (defined in the config or imported), dotted paths (``'my_pkg.rewards.brevity'``) or typed
dicts (``dict(type=RewardModelReward, model_path=...)``: a reward model trained by sfttool).
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from sfttool.errors import SfttoolError
from sfttool.registry import ConfigBuildError, build, resolve_type


class RewardError(SfttoolError):
    """A reward function raised, returned the wrong number of values, or a value that is not a finite number."""


@dataclass
class Reward:
    name: str
    fn: Callable
    weight: float = 1.0


# ---------------------------------------------------------------------------
# Final answers: math-verify when installed, else a plain numeric comparison.

def math_verify_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("math_verify") is not None


def accuracy_backend() -> str:
    """What the ``accuracy`` reward compares answers with, for the log."""
    if math_verify_available():
        return "math-verify"
    return "a plain numeric comparison (pip install 'sfttool[math]' for math-verify)"


_BOXED = "\\boxed{"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"(?:answer is|answer:)\s*(.+)", re.I)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None.

    >>> last_boxed('so \\\\boxed{\\\\frac{1}{2}}.')
    '\\\\frac{1}{2}'
    """
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """The final answer a text gives: the last ``\\boxed{}``, else what follows the last ``####``, else
    what follows the last "answer is" / "Answer:", else the last number; None when there is none.

    >>> final_answer('3 + 4 = 7, so 7 apples.\\n#### 7')
    '7'
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip() or None
    stated = _ANSWER_IS.findall(text)
    if stated:
        return stated[-1].strip().split("\n")[0].strip().rstrip(".") or None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(answer: str) -> float | None:
    text = answer.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    frac = re.fullmatch(r"\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", text)
    if frac:
        text = f"{frac.group(1)}/{frac.group(2)}"
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(given: str, expected: str) -> bool:
    """Numbers compare by value (``'1,000' == '1000.0'``, ``'\\frac{1}{2}' == '0.5'``), anything else as
    text without spaces and ``$``."""
    a, b = _as_number(given), _as_number(expected)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    squeeze = lambda s: s.replace("$", "").replace(" ", "").rstrip(".")  # noqa: E731
    return squeeze(given) == squeeze(expected)


def _fallback_accuracy(text: str, solution: str) -> float | None:
    expected = final_answer(solution)
    if expected is None:
        return None
    given = final_answer(text)
    return float(given is not None and same_answer(given, expected))


def _math_verify_accuracy(text: str, solution: str) -> float | None:
    from math_verify import parse, verify
    gold = parse(solution)
    if not gold:
        return None
    return float(verify(gold, parse(text)))


# ---------------------------------------------------------------------------
# Built-in reward functions.

def completion_text(completion: Any) -> str:
    """A completion's text: the string itself, or the content of its (last) assistant message."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


def accuracy_reward(completions: list, solution: list, **columns: Any) -> list[float | None]:
    """1.0 when the completion's final answer equals the row's ``solution``'s, else 0.0; None when the
    solution holds no answer. With ``math-verify`` installed it parses and compares both (LaTeX,
    expressions, sets); without it, ``final_answer`` of each compared by ``same_answer``."""
    check = _math_verify_accuracy if math_verify_available() else _fallback_accuracy
    return [None if gold is None else check(completion_text(c), str(gold)) for c, gold in zip(completions, solution)]


THINK_FORMAT = re.compile(r"^\s*<think>(?!.*<think>).*?</think>\s*\S", re.S)


def format_reward(completions: list, **columns: Any) -> list[float]:
    """1.0 when the completion is laid out as reasoning models answer: one ``<think>...</think>`` block
    first, then a non-empty answer (Qwen3 and DeepSeek-R1's layout); else 0.0."""
    return [float(THINK_FORMAT.match(completion_text(c)) is not None) for c in completions]


class pattern_reward:  # noqa: N801 (used like a function in configs)
    """1.0 when the completion matches the regular expression ``pattern`` (``re.search``, DOTALL), else
    0.0: a format constraint of your own, e.g. ``dict(type=pattern_reward, pattern=r'Answer: \\d+$')``."""

    def __init__(self, pattern: str, name: str = "pattern"):
        self.regex, self.__name__ = re.compile(pattern, re.S), name

    def __call__(self, completions: list, **columns: Any) -> list[float]:
        return [float(self.regex.search(completion_text(c)) is not None) for c in completions]


class length_reward:  # noqa: N801 (used like a function in configs)
    """DAPO's soft over-long penalty on the completion's token count L: 0 up to
    ``max_completion_length - soft_punish_cache``, then falling linearly to -1 at
    ``max_completion_length``, -1 beyond. The built-in name ``'length'`` uses the model's
    ``max_completion_length`` and a cache of a fifth of it."""

    __name__ = "length"

    def __init__(self, max_completion_length: int, soft_punish_cache: int | None = None):
        self.max_length = int(max_completion_length)
        self.cache = max(1, self.max_length // 5) if soft_punish_cache is None else int(soft_punish_cache)
        if not 0 < self.cache <= self.max_length:
            raise ConfigBuildError(f"length reward: soft_punish_cache must be in (0, max_completion_length="
                                   f"{self.max_length}], got {soft_punish_cache!r}")

    def __call__(self, completion_ids: list, **columns: Any) -> list[float]:
        expected = self.max_length - self.cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= expected else ((expected - n) / self.cache if n <= self.max_length else -1.0))
        return out


BUILTIN_REWARDS = ("accuracy", "format", "length")


# ---------------------------------------------------------------------------
# From the config to a list of Reward.

def reward_name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _builtin(name: str, max_completion_length: int | None) -> Callable:
    if name == "accuracy":
        return accuracy_reward
    if name == "format":
        return format_reward
    if max_completion_length is None:
        raise ConfigBuildError("model.reward_funcs: 'length' needs max_completion_length")
    return length_reward(max_completion_length)


def resolve_reward(spec: Any, key: str, max_completion_length: int | None = None) -> Reward:
    """One entry of ``reward_funcs``: a built-in name, a dotted path, a typed dict or a callable."""
    if isinstance(spec, str):
        if spec in BUILTIN_REWARDS:
            return Reward(spec, _builtin(spec, max_completion_length))
        if " (defined in " in spec:  # how a dumped config writes a function the config defined
            raise ConfigBuildError(f"{key}: {spec!r} is a function the config defined, which a dumped config "
                                   "cannot hold: use the original config file")
        if "." not in spec:
            close = difflib.get_close_matches(spec, BUILTIN_REWARDS, n=1)
            raise ConfigBuildError(f"{key}: unknown reward {spec!r}; built-ins: {', '.join(BUILTIN_REWARDS)}"
                                   f"{f' (did you mean {close[0]!r}?)' if close else ''}, or give a function, "
                                   "a dotted path 'pkg.module.fn' or a typed dict")
        fn = resolve_type(spec, key)
    elif isinstance(spec, dict) and "type" in spec:
        fn = build(spec, key)
    else:
        fn = spec
    if not callable(fn):
        raise ConfigBuildError(f"{key}: a reward function must be callable "
                               f"(prompts, completions, **columns) -> list of floats, got {fn!r:.80}")
    return Reward(reward_name(fn), fn)


def resolve_reward_funcs(reward_funcs: Any, reward_weights: Any = None,
                         max_completion_length: int | None = None) -> list[Reward]:
    """``reward_funcs`` and ``reward_weights`` of a config -> ``[Reward]``, every problem named by key."""
    specs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not specs or reward_funcs is None:
        raise ConfigBuildError("model.reward_funcs: give at least one reward function, e.g. ['accuracy']")
    rewards = [resolve_reward(s, f"model.reward_funcs[{i}]", max_completion_length) for i, s in enumerate(specs)]
    if reward_weights is not None:
        weights = list(reward_weights) if isinstance(reward_weights, (list, tuple)) else None
        if weights is None or len(weights) != len(rewards) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights):
            raise ConfigBuildError(f"model.reward_weights: expected {len(rewards)} numbers, one per reward function, "
                                   f"got {reward_weights!r}")
        for reward, weight in zip(rewards, weights):
            reward.weight = float(weight)
    names = [r.name for r in rewards]
    for i, name in enumerate(names):  # the log names each function's mean: make repeated names unique
        if names.count(name) > 1:
            rewards[i].name = f"{name}_{names[:i + 1].count(name)}"
    return rewards


# ---------------------------------------------------------------------------
# Scoring.

def _checked(values: Any, reward: Reward, count: int, labels: Sequence[str]) -> list[float]:
    """The function's values as floats (NaN for None), or a RewardError naming the function and the row."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) and type(values).__name__ != "ndarray":
        raise RewardError(f"reward function {reward.name} returned {type(values).__name__}, not a list of "
                          f"{count} floats (None where it does not apply)")
    values = list(values)
    if len(values) != count:
        raise RewardError(f"reward function {reward.name} returned {len(values)} values for {count} completions; "
                          "it must return one per completion (None where it does not apply)")
    out = []
    for value, label in zip(values, labels):
        if value is None:
            out.append(math.nan)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise RewardError(f"reward function {reward.name} returned {value!r:.40} for {label}: not a number")
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(f"reward function {reward.name} returned {value} for {label}; return a finite "
                              "number, or None where it does not apply")
        out.append(value)
    return out


def _call(reward: Reward, kwargs: dict, labels: Sequence[str]) -> Any:
    """``reward.fn(**kwargs)``; when it raises, find the first completion it fails on alone and name it."""
    try:
        return reward.fn(**kwargs)
    except Exception as batch_exc:  # a user function may raise anything: say which one and where
        for i, label in enumerate(labels):
            try:
                reward.fn(**{k: v[i:i + 1] for k, v in kwargs.items()})
            except Exception as exc:
                raise RewardError(f"reward function {reward.name} failed on {label}: "
                                  f"{type(exc).__name__}: {exc}") from exc
        raise RewardError(f"reward function {reward.name} failed on a batch of {len(labels)} completions (each "
                          f"alone passes): {type(batch_exc).__name__}: {batch_exc}") from batch_exc


def score_completions(rewards: Sequence[Reward], prompts: list, completions: list, completion_ids: list,
                      columns: dict[str, list], labels: Sequence[str]) -> torch.Tensor:
    """Each function's value for each completion: [N, functions] float64, NaN where it returned None.
    ``labels[i]`` names completion i in errors (``'data.jsonl, row 12, completion 3 of 8'``)."""
    kwargs = dict(columns, prompts=prompts, completions=completions, completion_ids=completion_ids)
    table = [_checked(_call(r, kwargs, labels), r, len(completions), labels) for r in rewards]
    return torch.tensor(table, dtype=torch.float64).reshape(len(rewards), len(completions)).T


def total_rewards(per_function: torch.Tensor, rewards: Sequence[Reward]) -> torch.Tensor:
    """The weighted sum per completion [N], each function left out where it returned None (TRL's nansum)."""
    weights = torch.tensor([r.weight for r in rewards], dtype=torch.float64)
    return (per_function * weights).nansum(dim=1)
