"""What every ``specdec`` subcommand shares: one-line errors, argument types that check ranges and
the environment (devices, files) before any model is loaded.

A bad argument or an environment problem ends a command with exactly one line on stderr,
``specdec <cmd>: error: <what, naming the argument>``, and exit status 2 -- no traceback (``specdec
--debug <cmd> ...`` shows it). ``run`` is the wrapper ``specdec.cli`` puts around each handler.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "ArgumentParser",
    "device",
    "device_name",
    "existing_path",
    "float_in",
    "int_at_least",
    "output_dir",
    "output_file",
    "run",
]

#: Exceptions that are the user's input or environment, answered with one line.
_USER_ERRORS = (ValueError, OSError, ImportError)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line: ``<prog>: error: <message>`` (exit 2)."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message}\n")


def run(prog: str, handler: Callable[[list[str]], int | None], argv: Sequence[str], debug: bool = False) -> int:
    """Call ``handler(argv)``; turn user / environment errors into one line and exit status 2.

    ``ValueError`` (bad input, raised by the library with the argument's name), ``OSError``
    (missing / unwritable files), ``ImportError`` (a missing optional package) and CUDA
    out-of-memory errors are reported as ``<prog>: error: <message>``; anything else is a bug and
    keeps its traceback. ``debug`` re-raises everything.
    """
    try:
        return int(handler(list(argv)) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - filtered just below
        if debug or not (isinstance(e, _USER_ERRORS) or type(e).__name__ == "OutOfMemoryError"):
            raise
        msg = " ".join(str(e).split()) or type(e).__name__  # one line
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- argument types


def tree_size(low: int) -> Callable[[str], int | str]:
    """argparse type: ``auto`` (the per-step budget, ``SpecDecoder(tree_size="auto")``) or an int >= ``low``."""

    ints = int_at_least(low)

    def parse(text: str) -> int | str:
        if text == "auto":
            return text
        try:
            return ints(text)
        except argparse.ArgumentTypeError as e:  # the int's message, naming the other choice
            raise argparse.ArgumentTypeError(str(e).replace("expected ", "expected 'auto' or ", 1)) from None

    parse.__name__ = f"'auto' or int >= {low}"
    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """argparse type: an int >= ``low``."""

    def parse(text: str) -> int:
        try:
            val = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None
        if val < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {val}")
        return val

    parse.__name__ = f"int >= {low}"
    return parse


def float_in(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False
             ) -> Callable[[str], float]:
    """argparse type: a finite float in the interval (``low_open`` / ``high_open`` exclude ends)."""
    lo = "(" if low_open else "["
    hi = ")" if high_open or high == math.inf else "]"
    span = f"{lo}{low:g}, {high:g}{hi}"

    def parse(text: str) -> float:
        try:
            val = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {span}, got {text!r}") from None
        ok = math.isfinite(val) and (val > low if low_open else val >= low)
        ok = ok and (high == math.inf or (val < high if high_open else val <= high))
        if not ok:
            raise argparse.ArgumentTypeError(f"expected a number in {span}, got {text}")
        return val

    parse.__name__ = f"number in {span}"
    return parse


def device_name(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N`` by name only, not checked against this
    machine (e.g. to name the device a results file was made on)."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def device(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N`` that exists on this machine."""
    import torch

    dev = torch.device(device_name(text))
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r} requested but no CUDA device is available "
                                             f"(torch {torch.__version__}); use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise argparse.ArgumentTypeError(f"expected a CUDA index < {count}, got {text!r}")
    return text


def nonempty_text(text: str) -> str:
    """argparse type: a string with something besides whitespace in it."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty text, got {text!r}")
    return text


def existing_path(text: str) -> str:
    """argparse type: a file or directory that exists."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text!r}")
    return text


def output_file(text: str) -> str:
    """argparse type: a file path that can be written.

    An existing file is left untouched; a new one is created and removed again to prove it can be,
    and folders created for that probe are removed again (whoever writes the file creates them):
    a command that stops at a later argument leaves nothing behind.
    """
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got the directory {text!r}")
    created = [p for p in [path.parent, *path.parent.parents] if not p.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            if not os.access(path, os.W_OK):
                raise PermissionError(f"not writable: {text!r}")
        else:
            path.open("a").close()
            path.unlink()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {e.strerror or e}") from None
    finally:
        for folder in created:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                break
    return text


def output_dir(text: str) -> str:
    """argparse type: a directory that exists or can be created, and is writable."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a directory, got the file {text!r}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"not writable: {text!r}")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write to {text!r}: {e.strerror or e}") from None
    return text
