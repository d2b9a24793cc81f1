"""Verifiable rewards (`training.rewards`): the built-in verifiers, a user's function, weights, bad answers."""

import sys
import types

import numpy as np
import pytest

from transformer.training import rewards

EXAMPLES = [{"answer": "42"}, {"answer": "1,000"}, {"answer": "7"}]
COMPLETIONS = ["6 * 7 is 42", "so it is 999 ... #### 1,000", "  7 "]


def test_built_in_verifiers():
    assert rewards.extract_number("a 3 then #### -12.5 and 9") == -12.5
    assert rewards.extract_number("first 3, then 4") == 4 and rewards.extract_number("none") is None
    assert rewards.numeric(COMPLETIONS, EXAMPLES) == [1.0, 1.0, 1.0]
    assert rewards.exact_match(COMPLETIONS, EXAMPLES) == [0.0, 0.0, 1.0]
    assert rewards.format_check(COMPLETIONS, EXAMPLES) == [0.0, 1.0, 0.0]
    with pytest.raises(rewards.RewardError, match="reward 'numeric' raised KeyError: .*'answer' field"):
        rewards.score(rewards.parse("numeric"), ["1"], [{}])


@pytest.fixture
def user_module(monkeypatch):
    module = types.ModuleType("user_rewards")
    module.length = lambda completions, examples: [len(c) for c in completions]
    module.raises = lambda completions, examples: 1 / 0
    module.short = lambda completions, examples: [1.0]
    module.text = lambda completions, examples: ["1"] * len(completions)
    module.nan = lambda completions, examples: [float("nan")] * len(completions)
    monkeypatch.setitem(sys.modules, "user_rewards", module)


def test_weighted_combination_with_a_user_function(user_module):
    total, each = rewards.score(rewards.parse("numeric=2, format=0.5,user_rewards:length=0.1"), COMPLETIONS, EXAMPLES)
    np.testing.assert_allclose(total, [2 + 1.1, 2 + 0.5 + 2.7, 2 + 0.4], rtol=1e-6)
    assert list(each) == ["numeric", "format", "user_rewards:length"]


@pytest.mark.parametrize("name, message", [
    ("user_rewards:raises", "reward 'user_rewards:raises' raised ZeroDivisionError: division by zero"),
    ("user_rewards:short", "reward 'user_rewards:short' returned 1 values for 3 completions"),
    ("user_rewards:text", "reward 'user_rewards:text' returned '1' for completion 0: not a finite number"),
    ("user_rewards:nan", "reward 'user_rewards:nan' returned nan for completion 0: not a finite number"),
])
def test_a_bad_reward_stops_in_one_line_naming_it(user_module, name, message):
    with pytest.raises(rewards.RewardError) as error:
        rewards.score(rewards.parse(name), COMPLETIONS, EXAMPLES)
    assert str(error.value) == message


def test_bad_specs():
    with pytest.raises(ValueError, match="reward 'exact': choose one of exact_match, numeric, format"):
        rewards.parse("exact")
    with pytest.raises(ValueError, match="reward 'no_such_module_x:f': cannot import it"):
        rewards.parse("no_such_module_x:f")
    with pytest.raises(ValueError, match="the weight after '=' must be a number"):
        rewards.parse("numeric=high")
    with pytest.raises(ValueError, match="no reward given"):
        rewards.parse(" , ")


def test_each_reward_is_called_at_launch_and_user_code_is_named(user_module):
    rewards.at_launch(rewards.parse("numeric,user_rewards:length"), EXAMPLES[:1])  # answers rightly: passes
    with pytest.raises(rewards.RewardError) as error:
        rewards.at_launch(rewards.parse("numeric,user_rewards:short"), EXAMPLES)
    assert str(error.value) == ("reward 'user_rewards:short' returned 1 values for 2 completions (called at launch "
                                "on 2 sample completions)")
    lines = rewards.user_code("numeric,user_rewards:length=0.5")
    assert len(lines) == 1 and lines[0].startswith("grpo.rewards: user_rewards:length is code of yours, imported "
                                                   "from a module without a file; it runs in this process")
    assert "a relaunch of this workdir imports it again" in lines[0]
