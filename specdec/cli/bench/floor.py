"""What ``specdec bench-engine``'s ``scale`` and ``profile`` sections measure a forward against.

**The weight-streaming floor.** A decode step (and a verify forward of a few nodes) reads every
weight once: ``weight_bytes(model)`` counts the parameter bytes a forward streams (every
parameter, tied ones once, minus the input embedding table of an untied model: a forward reads
only its B x n rows), ``kv_bytes`` the KV cache bytes of a prefix, and ``floor_ms(bytes, gbs)``
the time to move them at a bandwidth. ``measure_copy_bandwidth(device)`` measures that
bandwidth in the run: one large device-to-device copy, bytes read + written per second (the
convention of the H100 figure, 3.0 TB/s, in ``../shared/DEVICE.md``). ``bandwidth_info`` and
``forward_floors`` are what the sections record: both bandwidths, and the floors of one forward
at each.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

from specdec.cli.bench.common import Timer
from specdec.cli.bench.config import BenchConfig

__all__ = ["bandwidth_info", "floor_ms", "forward_floors", "kv_bytes", "measure_copy_bandwidth", "weight_bytes"]


def weight_bytes(model) -> dict[str, int]:
    """Parameter bytes of ``model`` and the part of them one forward streams.

    Returns ``{"params", "param_bytes", "embedding_bytes", "streamed_bytes"}``: parameter count and
    bytes (a tied parameter counted once), the input embedding table's bytes when it is not the
    LM head's weight (a forward reads only the rows of its tokens: not streamed), and
    ``param_bytes - embedding_bytes``. Works on a model on the meta device (sizes only).
    """
    params = nbytes = 0
    for p in model.parameters():  # parameters() yields a shared (tied) parameter once
        params += p.numel()
        nbytes += p.numel() * p.element_size()
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb
    embedding = 0 if tied else emb.numel() * emb.element_size()
    return {"params": params, "param_bytes": nbytes, "embedding_bytes": embedding, "streamed_bytes": nbytes - embedding}


def kv_bytes(model, tokens: int) -> int:
    """Bytes of the KV cache of ``tokens`` tokens (one sequence, every layer, keys and values), in
    the dtype of the model's parameters."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    elem = next(model.parameters()).element_size()
    return cfg.num_hidden_layers * 2 * kv_heads * head_dim * int(tokens) * elem


def floor_ms(nbytes: float, gbs: float) -> float:
    """Milliseconds to move ``nbytes`` at ``gbs`` GB/s (10^9 bytes per second)."""
    if gbs <= 0:
        raise ValueError(f"gbs: expected a bandwidth > 0, got {gbs}")
    return nbytes / (gbs * 1e9) * 1e3


def measure_copy_bandwidth(device, nbytes: int | None = None, reps: int = 10) -> dict[str, float]:
    """Device copy bandwidth: ``dst.copy_(src)`` of ``nbytes`` bytes, median of ``reps`` timed copies
    after two untimed ones; GB/s counts bytes read + written (2 x nbytes per copy).

    ``nbytes`` defaults to 2 GiB on CUDA (4 GiB allocated for the moment) and 64 MiB on CPU.
    Returns ``{"gbs", "bytes", "median_ms", "reps"}``.
    """
    import torch

    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = int(nbytes or (2 << 30 if cuda else 64 << 20))
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timer, copy = Timer(device), functools.partial(dst.copy_, src)
    times = [timer(copy)[0] for _ in range(reps + 2)][2:]  # the first two untimed
    del src, dst, copy
    if cuda:
        torch.cuda.empty_cache()
    med = statistics.median(times)
    return {"gbs": 2 * nbytes / med / 1e9, "bytes": nbytes, "median_ms": med * 1e3, "reps": reps}


def bandwidth_info(cfg: BenchConfig, device) -> dict[str, Any]:
    """The ``--bandwidth-gbs`` flag's bandwidth and the copy bandwidth measured on ``device`` now."""
    got = measure_copy_bandwidth(device)
    return {"flag_gbs": float(cfg.bandwidth_gbs), "measured_gbs": got["gbs"], "measured_bytes": got["bytes"],
            "measured_median_ms": got["median_ms"]}  # fmt: skip


def forward_floors(model, prefix: int, bandwidth: dict[str, Any]) -> dict[str, Any]:
    """The weight-streaming floor of one forward of ``model`` (weights, and weights + ``prefix``
    tokens of KV) at the flag's and at the measured bandwidth."""
    w = weight_bytes(model)
    kv = kv_bytes(model, prefix)
    return {
        **w,
        "kv_tokens": prefix,
        "kv_bytes": kv,
        "floor_ms": floor_ms(w["streamed_bytes"], bandwidth["flag_gbs"]),
        "floor_kv_ms": floor_ms(w["streamed_bytes"] + kv, bandwidth["flag_gbs"]),
        "floor_measured_ms": floor_ms(w["streamed_bytes"], bandwidth["measured_gbs"]),
        "floor_kv_measured_ms": floor_ms(w["streamed_bytes"] + kv, bandwidth["measured_gbs"]),
    }
