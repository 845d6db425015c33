"""Test setup: run Triton kernels through the CPU interpreter when no CUDA device is present.

TRITON_INTERPRET must be set before any kernel module is imported, so this runs first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
