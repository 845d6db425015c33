"""Shared by the training tests: ``specdec train-eagle`` arguments on a tiny saved target."""

from __future__ import annotations

import json
from pathlib import Path

from tests.drafters.helpers import save_tiny_pair


def cli_argv(tmp_path, problems: int, heldout: int, new_tokens: int, *extra: str) -> tuple[list[str], Path]:
    """train-eagle arguments on a tiny saved target and ``problems`` MBPP-like rows; (argv, out dir)."""
    target_dir, _ = save_tiny_pair(tmp_path)
    data = tmp_path / "mbpp.jsonl"
    rows = [{"text": f"Write a function number {i}.", "test_list": [f"assert f({i}) == {i}"]} for i in range(problems)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eagle"
    argv = ["--target", str(target_dir), "--data", str(data), "--out", str(out), "--steps", "2", "--batch-size", "2",
            "--heldout", str(heldout), "--max-new-tokens", str(new_tokens), "--unroll", "2", "--device", "cpu",
            "--no-progress", *extra]  # fmt: skip
    return argv, out
