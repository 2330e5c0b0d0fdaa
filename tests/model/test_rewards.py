"""Reward functions: how a config names them, the built-ins, and the errors that name the function and row."""
from __future__ import annotations

import math

import pytest
import torch

from sfttool.model import rewards as R
from sfttool.registry import ConfigBuildError

LABELS = [f"row 7 (completion {k} of 3)" for k in (1, 2, 3)]


def brevity(completions, **columns):
    return [-len(R.completion_text(c)) / 10 for c in completions]


def test_names_functions_dotted_paths_and_typed_dicts_resolve():
    rewards = R.resolve_reward_funcs(['accuracy', 'format', 'length', brevity, 'sfttool.model.rewards.format_reward',
                                      dict(type=R.pattern_reward, pattern=r"\d$", name="ends_with_digit"), brevity],
                                     [1.0, 0.5, 1, 2, 1, 1, -1], max_completion_length=20)
    # the log names each function's mean: a function listed twice gets two names
    assert [r.name for r in rewards] == ["accuracy", "format", "length", "brevity_1", "format_reward",
                                         "ends_with_digit", "brevity_2"]
    assert [r.weight for r in rewards] == [1.0, 0.5, 1.0, 2.0, 1.0, 1.0, -1.0]
    assert rewards[0].fn is R.accuracy_reward and rewards[1].fn is rewards[4].fn is R.format_reward
    assert (rewards[2].fn.max_length, rewards[2].fn.cache) == (20, 4)
    assert [r.name for r in R.resolve_reward_funcs(brevity)] == ["brevity"]  # one function, not in a list


@pytest.mark.parametrize("funcs,weights,message", [
    (["acuracy"], None, "model.reward_funcs[0]: unknown reward 'acuracy'; built-ins: accuracy, format, length "
                        "(did you mean 'accuracy'?), or give a function, a dotted path 'pkg.module.fn' or a typed "
                        "dict"),
    ([3], None, "model.reward_funcs[0]: a reward function must be callable (prompts, completions, **columns) -> list "
                "of floats, got 3"),
    (["no_such_pkg.fn"], None, "model.reward_funcs[0]: cannot import 'no_such_pkg.fn'"),
    (["accuracy", "format"], [1.0], "model.reward_weights: expected 2 numbers, one per reward function, got [1.0]"),
    (["accuracy"], [float("nan")], "model.reward_weights: expected 1 numbers"),
    ([], None, "model.reward_funcs: give at least one reward function"),
    (["my_reward (defined in /x/cfg.py)"], None, "model.reward_funcs[0]: 'my_reward (defined in /x/cfg.py)' is a "
                                                 "function the config defined, which a dumped config cannot hold"),
])
def test_bad_reward_settings_are_one_line_naming_the_key(funcs, weights, message):
    with pytest.raises(ConfigBuildError) as err:
        R.resolve_reward_funcs(funcs, weights, max_completion_length=16)
    assert str(err.value).startswith(message)


@pytest.fixture(params=["fallback", "math-verify"])
def verifier(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(R, "math_verify_available", lambda: False)
    elif not R.math_verify_available():
        pytest.skip("math-verify is not installed (pip install 'sfttool[math]')")
    return request.param


@pytest.mark.parametrize("completion,solution,expected", [
    ("3 + 4 = 7 apples.\n#### 7", "7", 1.0),
    ("First 3 + 4 = 7, then doubled: 14", "7", 0.0),        # the final answer counts, not any number
    ("The answer is \\boxed{1000}.", "1,000", 1.0),
    ("so \\boxed{\\frac{1}{2}}", "$\\frac12 = \\boxed{0.5}$", 1.0),
    ("I do not know.", "7", 0.0),
    ("Answer: 42", "42", 1.0),
])
def test_accuracy_compares_final_answers(verifier, completion, solution, expected):
    assert R.accuracy_reward([completion], [solution]) == [expected]
    # conversational completions (a conversational prompt's) are read the same way
    assert R.accuracy_reward([[{"role": "assistant", "content": completion}]], [solution]) == [expected]


def test_accuracy_without_a_solution_does_not_apply(verifier):
    assert R.accuracy_reward(["7"], [None]) == [None]


def test_fallback_answer_extraction():
    assert R.final_answer("x \\boxed{a{b}c} y \\boxed{2}") == "2"
    assert R.final_answer("steps\n#### 1,234\nbye") == "1,234"
    assert R.final_answer("so the answer is 12.") == "12"
    assert R.final_answer("no digits here") is None
    assert R.same_answer("1,000", "1000.0") and R.same_answer("\\frac{3}{4}", "0.75")
    assert R.same_answer("$x+1$", "x + 1")
    assert not R.same_answer("0.5", "0.51")


def test_format_reward_wants_one_think_block_then_an_answer():
    completions = ["<think>\n3 + 4 = 7\n</think>\n\nThe answer is 7.", "The answer is 7.",
                   "<think>a</think><think>b</think> 7", "<think>only thoughts</think>  ", "  <think>x</think>7"]
    assert R.format_reward(completions) == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_length_reward_is_dapos_soft_overlong_penalty():
    length = R.length_reward(max_completion_length=20, soft_punish_cache=5)
    ids = [[0] * n for n in (0, 15, 16, 18, 20, 21)]
    assert length(completion_ids=ids) == [0.0, 0.0, -0.2, -0.6, -1.0, -1.0]
    with pytest.raises(ConfigBuildError, match="soft_punish_cache must be in"):
        R.length_reward(20, 0)


def score(*functions, weights=None, columns=None, completions=("a", "bb", "ccc")):
    rewards = R.resolve_reward_funcs(list(functions), weights)
    return R.score_completions(rewards, ["Q"] * 3, list(completions), [[1], [1, 2], [1, 2, 3]],
                               columns or {"solution": ["1", "2", "3"]}, LABELS), rewards


def test_columns_reach_the_functions_by_name_and_none_leaves_a_function_out():
    seen = {}

    def by_solution(prompts, completions, completion_ids, solution, **columns):
        seen.update(prompts=prompts, ids=completion_ids, solution=solution)
        return [None if s == "2" else float(s) for s in solution]

    table, rewards = score(by_solution, brevity, weights=[1.0, 2.0])
    assert seen == {"prompts": ["Q"] * 3, "ids": [[1], [1, 2], [1, 2, 3]], "solution": ["1", "2", "3"]}
    assert math.isnan(table[1, 0]) and table[:, 1].tolist() == [-0.1, -0.2, -0.3]
    # the weighted sum leaves a None out (TRL's nansum): 1 - 0.2, 0 - 0.4, 3 - 0.6
    torch.testing.assert_close(R.total_rewards(table, rewards), torch.tensor([0.8, -0.4, 2.4], dtype=torch.float64))


def fails_on_bb(completions, **columns):
    return [1.0 / (len(c) - 2) for c in completions]  # ZeroDivisionError for 'bb'


@pytest.mark.parametrize("fn,message", [
    (fails_on_bb, "reward function fails_on_bb failed on row 7 (completion 2 of 3): ZeroDivisionError: "
                  "float division by zero"),
    (lambda completions, **c: [1.0, 2.0], "reward function <lambda> returned 2 values for 3 completions; it must "
                                          "return one per completion (None where it does not apply)"),
    (lambda completions, **c: [1.0, float("nan"), 0.0], "reward function <lambda> returned nan for row 7 "
                                                        "(completion 2 of 3); return a finite number, or None where "
                                                        "it does not apply"),
    (lambda completions, **c: [1.0, 0.0, "good"], "reward function <lambda> returned 'good' for row 7 (completion "
                                                  "3 of 3): not a number"),
    (lambda completions, **c: 1.0, "reward function <lambda> returned float, not a list of 3 floats"),
])
def test_a_bad_reward_function_is_named_with_the_row(fn, message):
    with pytest.raises(R.RewardError) as err:
        score(fn)
    assert str(err.value).startswith(message)


def test_a_function_failing_only_on_the_whole_batch_says_so():
    def batch_only(completions, **columns):
        if len(completions) > 1:
            raise RuntimeError("out of memory")
        return [0.0]

    with pytest.raises(R.RewardError, match="failed on a batch of 3 completions \\(each alone passes\\): "
                                            "RuntimeError: out of memory"):
        score(batch_only)


def test_a_reward_model_trained_by_sfttool_scores_completions_as_sfttool_score_does(tiny_llama_dir, tiny_tokenizer,
                                                                                   tmp_path):
    """RewardModelReward renders each prompt + completion as `sfttool score` renders a prompt + answer (the
    training config's template and reward token, saved beside the adapter), for both prompt forms."""
    from test_preference import perturb
    from test_preference_reward import make_reward

    from sfttool.tools.score import RewardModelReward, score_pair
    model = make_reward(tiny_llama_dir, lora=True, reward_token_id=2)
    perturb(model.llm, seed=10, scale=0.2)
    adapter = tmp_path / "adapter"
    model.llm.save_pretrained(adapter)
    tiny_tokenizer.save_pretrained(adapter)
    (adapter / "sfttool_config.py").write_text(
        "prompt_template = dict(HF_CHAT_TEMPLATE=True, STOP_WORDS=[])\nmodel = dict(reward_token_id=2)\n")
    (reward,) = R.resolve_reward_funcs([dict(type=RewardModelReward, model_path=str(tiny_llama_dir),
                                             adapter=str(adapter))])
    assert reward.name == "reward_model"
    got = reward.fn(prompts=[[{"role": "user", "content": "Is the sky blue?"}], "Is the sky blue?"],
                    completions=[[{"role": "assistant", "content": "Yes, on a clear day."}], "No."], solution=[1, 2])
    chosen, rejected = score_pair(str(tiny_llama_dir), "Is the sky blue?", "Yes, on a clear day.", "No.",
                                  adapter=str(adapter))
    assert got == pytest.approx([chosen, rejected], abs=1e-6) and chosen != rejected
