"""One map from dtype names (what command lines and config files say) to ``torch.dtype``."""

from __future__ import annotations

import torch

__all__ = ["DTYPE_NAMES", "cpu_bf16_native", "parse_dtype"]

#: The short names the command lines offer (``--dtype``), in the order they list them.
DTYPE_NAMES = ("fp32", "bf16", "fp16")

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype | None, device: torch.device | str | None = None,
                arg: str = "dtype") -> torch.dtype:  # fmt: skip
    """The ``torch.dtype`` a name stands for.

    Args:
        name: ``"fp32"`` / ``"float32"`` / ``"float"``, ``"bf16"`` / ``"bfloat16"``, ``"fp16"`` /
            ``"float16"`` / ``"half"`` (case-insensitive, an optional ``"torch."`` prefix), a
            ``torch.dtype`` of these (returned as is), or None / ``"auto"``: bfloat16 when ``device``
            is a CUDA device, else float32.
        device: where the model runs; only read for None / ``"auto"``.
        arg: the argument's name in the ``ValueError`` (e.g. ``"--dtype"``).

    Raises:
        ValueError: naming ``arg`` for any other value.
    """
    if isinstance(name, torch.dtype):
        if name not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{arg}: expected float32, bfloat16 or float16, got {name}")
        return name
    if name is None or (isinstance(name, str) and name.strip().lower() == "auto"):
        return torch.bfloat16 if torch.device(device or "cpu").type == "cuda" else torch.float32
    key = name.strip().lower().removeprefix("torch.") if isinstance(name, str) else None
    if key not in _DTYPES:
        raise ValueError(f"{arg}: expected one of {', '.join(DTYPE_NAMES)} (or float32, bfloat16, float16, auto), "
                         f"got {name!r}")
    return _DTYPES[key]


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX, as oneDNN reports it): there a
    bf16 model decodes about twice as fast as in float32 (half the bytes a token); elsewhere bf16
    matrix products are emulated, slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False
