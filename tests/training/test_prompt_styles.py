"""Training prompts in the evaluation harness's instruction styles (``training.distill.PROMPT_STYLES``):
the same text as ``eval.datasets`` writes for a problem of that kind, and the CLI option."""

from __future__ import annotations

import pytest

from eval.datasets import AppsProblem, HumanEvalProblem, mbpp_signature
from training.distill import PROMPT_STYLES, mbpp_prompt, styled_prompts

ROW = {
    "text": "Write a function to find the shared elements from the given two lists.",
    "code": "def helper(x):\r\n    return set(x)\r\ndef similar_elements(test_tup1, test_tup2):\r\n"
            "  res = tuple(helper(test_tup1) & helper(test_tup2))\r\n  return (res) ",
    "test_list": ["assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
                  "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)"],
}  # fmt: skip


def test_signature_is_the_function_the_tests_call():
    assert mbpp_signature(ROW) == "def similar_elements(test_tup1, test_tup2):"
    assert mbpp_signature({**ROW, "code": "def  f (a, b) -> int:\n  return a"}) == "def f(a, b):"
    assert mbpp_signature({**ROW, "code": "x = 1"}) is None


def test_styles_use_the_evaluation_harness_text():
    sig = "def similar_elements(test_tup1, test_tup2):"
    stdin = AppsProblem("0", "introductory", ROW["text"]).messages()[0]["content"]
    starter = AppsProblem("0", "introductory", ROW["text"], starter_code=sig).messages()[0]["content"]
    doc = ('    """Write a function to find the shared elements from the given two lists.\n'
           "    >>> similar_elements((3, 4, 5, 6),(5, 7, 4, 10))\n    (4, 5)\n"
           "    >>> similar_elements((1, 2, 3, 4),(5, 4, 3, 7))\n    (3, 4)\n"
           '    """')  # fmt: skip
    function = HumanEvalProblem("x", f"{sig}\n{doc}\n", "similar_elements", "", "").messages()[0]["content"]
    assert mbpp_prompt(ROW, "stdin") == stdin
    assert mbpp_prompt(ROW, "starter") == starter
    assert mbpp_prompt(ROW, "function") == function
    assert mbpp_prompt(ROW) == mbpp_prompt(ROW, "mbpp") and "Your code should pass these tests" in mbpp_prompt(ROW)
    with pytest.raises(ValueError, match="style: expected one of"):
        mbpp_prompt(ROW, "apps")


def test_styled_prompts_group_by_style_and_skip_rows_without_a_function():
    rows = [ROW, {**ROW, "code": "x = 1"}]
    got = styled_prompts(rows, PROMPT_STYLES)
    assert [i for i, _ in got] == [0, 1, 0, 0, 1, 0]  # mbpp: both, function: 0, stdin: both, starter: 0
    assert [t for _, t in got][:2] == [mbpp_prompt(ROW), mbpp_prompt(rows[1])]
