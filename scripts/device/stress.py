"""Randomized stress test of the engine in one process: ``specdec.cli.stress.cli`` (its docstring
has the device commands). Exits 0 when every call passed, 1 on a crash or mismatch, 2 on a bad
argument."""

from __future__ import annotations

import sys
from pathlib import Path

# `python3 scripts/device/stress.py` puts this folder first on sys.path, not the repository root.
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from specdec.cli.stress.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
