"""Test setup shared by the whole suite.

- Triton kernels run through the CPU interpreter when no CUDA device is present: TRITON_INTERPRET
  must be set before any kernel module is imported, so this runs first.
- ``@pytest.mark.cuda``: skipped without a CUDA device.
- ``@pytest.mark.slow`` (minutes of CPU: many-sample chi-square checks, training runs, real models):
  left out of a plain ``pytest -q``; ``pytest -q -m slow`` runs exactly them (CI runs both). Any
  ``-m`` expression replaces that default (``-m "slow or not slow"``: everything), and a test named
  by its node id always runs.
- ``one_thread``: the fixture most modules use (``pytestmark = pytest.mark.usefixtures("one_thread")``).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


_SLOW_LEFT_OUT = pytest.StashKey[int]()  # how many slow tests a plain run deselected


def _named(item: pytest.Item, config: pytest.Config) -> bool:
    """True if the command line names this test (or its parametrized family) by node id."""
    for arg in config.args:
        if "::" not in arg:
            continue
        path, _, rest = arg.partition("::")
        nodeid = f"{os.path.relpath(os.path.abspath(path), config.rootpath)}::{rest}".replace(os.sep, "/")
        if item.nodeid == nodeid or item.nodeid.startswith(nodeid + "[") or item.nodeid.startswith(nodeid + "::"):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    default_run = not config.getoption("markexpr")
    keep, slow = [], []
    for item in items:
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if default_run and item.get_closest_marker("slow") is not None and not _named(item, config):
            slow.append(item)
        else:
            keep.append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep
        config.stash[_SLOW_LEFT_OUT] = len(slow)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    left_out = config.stash.get(_SLOW_LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} slow tests left out; run them with: pytest -q -m slow")


@pytest.fixture
def one_thread():
    """Run a test on one torch thread: tiny models are much slower when threads contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
