"""``specdec.dtypes.parse_dtype``: the one name -> ``torch.dtype`` map."""

import pytest
import torch

from specdec.dtypes import DTYPE_NAMES, parse_dtype


def test_names_and_aliases():
    assert DTYPE_NAMES == ("fp32", "bf16", "fp16")
    assert [parse_dtype(n) for n in DTYPE_NAMES] == [torch.float32, torch.bfloat16, torch.float16]
    for name, want in (("float32", torch.float32), ("float", torch.float32), ("bfloat16", torch.bfloat16),
                       ("BF16", torch.bfloat16), ("torch.float16", torch.float16), ("half", torch.float16),
                       (torch.bfloat16, torch.bfloat16)):  # fmt: skip
        assert parse_dtype(name) == want


def test_auto_follows_the_device():
    assert parse_dtype(None) == torch.float32 and parse_dtype("auto", "cpu") == torch.float32
    assert parse_dtype("auto", "cuda:0") == torch.bfloat16 and parse_dtype(None, torch.device("cuda")) == torch.bfloat16


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"dtype: expected one of fp32, bf16, fp16 \(or float32, bfloat16, float16, "
                                         r"auto\), got 'int8'"):  # fmt: skip
        parse_dtype("int8")
    with pytest.raises(ValueError, match=r"--dtype: expected one of .*, got 3"):
        parse_dtype(3, arg="--dtype")
    with pytest.raises(ValueError, match=r"dtype: expected float32, bfloat16 or float16, got torch.int64"):
        parse_dtype(torch.int64)
