"""Verifiable rewards for GRPO: built-in verifiers, a user's `module:function`, combined with weights.

A reward function takes (completions: list[str], examples: list[dict]) -- the decoded completions and, row
for row, the prompt's JSON-lines record (with what the verifier needs, e.g. "answer") -- and returns one
number per completion. A spec names them with weights, e.g. "numeric=1.0,format=0.1,my_pkg.rewards:score=0.5"
(a weight left out is 1). A function that raises, returns something else than one finite number per
completion, stops the run with a `RewardError` of one line naming it.
"""

import importlib
import math
import numbers
import re
import sys
from collections.abc import Callable

import numpy as np

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
MARKED = re.compile(r"####\s*(-?\d[\d,]*(?:\.\d+)?)")

RewardFn = Callable[[list[str], list[dict]], list[float]]


class RewardError(ValueError):
    """A reward function failed or answered badly; the message is one line naming it."""


def extract_number(text: str) -> float | None:
    """The answer after a GSM8K-style '####' marker, else the last number in the text, else None."""
    marked = MARKED.search(text)
    found = marked.group(1) if marked else (NUMBER.findall(text) or [None])[-1]
    return None if found is None else float(found.replace(",", ""))


def answer_of(example: dict, name: str):
    if "answer" not in example:
        raise KeyError(f"the {name} reward needs an 'answer' field in each prompt's record")
    return example["answer"]


def exact_match(completions: list[str], examples: list[dict]) -> list[float]:
    """1 where the completion, stripped, equals the record's answer (as text), else 0."""
    return [float(c.strip() == str(answer_of(e, "exact_match")).strip()) for c, e in zip(completions, examples)]


def numeric(completions: list[str], examples: list[dict]) -> list[float]:
    """1 where the number extracted from the completion (`extract_number`) equals the record's answer."""
    rewards = []
    for completion, example in zip(completions, examples):
        got, want = extract_number(completion), float(str(answer_of(example, "numeric")).replace(",", ""))
        rewards.append(float(got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)))
    return rewards


def format_check(completions: list[str], examples: list[dict]) -> list[float]:
    """1 where the completion ends its reasoning with a '#### <number>' answer line, else 0."""
    return [float(MARKED.search(c) is not None) for c in completions]


BUILT_IN: dict[str, RewardFn] = {"exact_match": exact_match, "numeric": numeric, "format": format_check}


def resolve(name: str) -> RewardFn:
    """A built-in verifier by name, or a user's function named `package.module:function`."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    if ":" not in name:
        raise ValueError(f"reward {name!r}: choose one of {', '.join(BUILT_IN)} or name a module:function")
    module_name, function_name = name.split(":", 1)
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"reward {name!r}: cannot import it ({error})") from None
    if not callable(function):
        raise ValueError(f"reward {name!r} is not a function")
    return function


def user_code(spec: str) -> list[str]:
    """One line for each reward of `spec` that is a user's `module:function`: the file it is imported from,
    which runs in the training process, and again on every relaunch of the run (its config names it)."""
    lines = []
    for name, _, _ in parse(spec):
        if name not in BUILT_IN:
            where = getattr(sys.modules.get(name.split(":", 1)[0]), "__file__", None) or "a module without a file"
            lines.append(f"grpo.rewards: {name} is code of yours, imported from {where}; it runs in this process "
                         "on every rollout, and a relaunch of this workdir imports it again from wherever Python "
                         "finds it then")
    return lines


def at_launch(rewards: list[tuple[str, float, RewardFn]], examples: list[dict]) -> None:
    """Calls each reward on two sample completions (the first record's answer, and empty text) of the first
    records, so that a reward that answers badly stops the launch in one line, not the first rollout."""
    sample = (examples * 2)[:2]
    try:
        score(rewards, [str(sample[0].get("answer", "")), ""], sample)
    except RewardError as error:
        raise RewardError(f"{error} (called at launch on 2 sample completions)") from None


def parse(spec: str) -> list[tuple[str, float, RewardFn]]:
    """[(name, weight, function)] from 'name=weight,name,...' (see the module docstring)."""
    parsed = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition("=")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"reward {part!r}: the weight after '=' must be a number") from None
        parsed.append((name.strip(), value, resolve(name.strip())))
    if not parsed:
        raise ValueError("no reward given: name at least one, e.g. 'numeric' or 'my_module:my_reward'")
    return parsed


def checked(name: str, function: RewardFn, completions: list[str], examples: list[dict]) -> np.ndarray:
    """The function's rewards as float32 [N], or a one-line RewardError naming it."""
    try:
        values = function(completions, examples)
    except Exception as error:  # noqa: BLE001 -- any failure of user code stops the run, named
        message = str(error).splitlines()[0] if str(error) else ""
        raise RewardError(f"reward {name!r} raised {type(error).__name__}: {message}") from error
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"reward {name!r} returned {type(values).__name__}, not a list of numbers") from None
    if len(values) != len(completions):
        raise RewardError(f"reward {name!r} returned {len(values)} values for {len(completions)} completions")
    for i, value in enumerate(values):
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value!r} for completion {i}: not a finite number")
    return np.asarray(values, np.float32)


def score(rewards: list[tuple[str, float, RewardFn]], completions: list[str],
          examples: list[dict]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(the weighted sum [N], each function's own rewards by name) for N completions."""
    each = {name: checked(name, function, completions, examples) for name, _, function in rewards}
    total = sum(weight * each[name] for name, weight, _ in rewards)
    return np.asarray(total, np.float32), each
