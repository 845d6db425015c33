"""Test setup: run Triton kernels through the CPU interpreter when no CUDA device is present.

TRITON_INTERPRET must be set before any kernel module is imported, so this runs first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def one_thread():
    """Run a test on one torch thread: tiny models are much slower when threads contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
