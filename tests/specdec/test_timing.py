"""``specdec.timing.PhaseTimer`` and the engine's step timing: a device synchronize per phase only
when profiling is asked for (``SpecDecoder(profile=True)``)."""

import time
from pathlib import Path

import pytest
import torch

from specdec import SpecDecoder
from specdec.timing import PhaseTimer, device_sync
from tests.specdec.helpers import RandomTreeDrafter, prepared_tiny_model, random_prompt

pytestmark = pytest.mark.usefixtures("one_thread")


def test_phase_timer_without_sync_is_host_time_and_marks_add_up():
    timer = PhaseTimer()
    with timer("verify"):
        time.sleep(0.01)
    timer.mark("draft")
    time.sleep(0.01)
    timer.mark("draft")
    assert timer.seconds["verify"] >= 0.01 and timer.seconds["draft"] >= 0.02 and timer.seconds["commit"] == 0.0
    syncs = []
    clock = PhaseTimer(lambda: syncs.append(1), start=time.perf_counter() - 1.0)
    clock.mark("catch_up")
    assert syncs == [1] and clock.seconds["catch_up"] >= 1.0
    assert device_sync(torch.device("cpu")) is None  # nothing to wait for on the CPU


@pytest.mark.parametrize("static", [False, True])
def test_generate_syncs_the_device_for_timing_only_when_profiling(monkeypatch, static):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: calls.append("cuda"))
    monkeypatch.setattr(SpecDecoder, "_sync", lambda self: calls.append("sync"))
    dec = SpecDecoder(prepared_tiny_model(), RandomTreeDrafter(seed=1), tree_size=4, static_shapes=static,
                      attn_impl="torch")  # fmt: skip
    assert dec.profile is False
    out = dec.generate(random_prompt(9, 0), 6)
    assert calls == [] and len(out.steps) > 0
    assert all(s.verify_s >= s.forward_s > 0 and s.draft_s > 0 and s.commit_s > 0 for s in out.steps)
    assert out.prefill_s > 0  # host wall time: timed, without a synchronize

    profiled = SpecDecoder(prepared_tiny_model(), RandomTreeDrafter(seed=1), tree_size=4, static_shapes=static,
                           attn_impl="torch", profile=True)  # fmt: skip
    out2 = profiled.generate(random_prompt(9, 0), 6)
    assert out2.sequences.tolist() == out.sequences.tolist()
    # one before the prefill, its end, then per step: draft, forward, verify, commit, the drafter's update
    assert calls == ["sync"] * (2 + 5 * len(out2.steps))


def test_profile_is_checked():
    with pytest.raises(ValueError, match=r"profile: expected True or False, got 1"):
        SpecDecoder(prepared_tiny_model(), None, profile=1)


def test_since_process_start_counts_from_the_process_start_not_the_import():
    """A child process that sleeps before importing: the seconds since its start include the sleep."""
    import subprocess
    import sys

    from specdec.timing import since_process_start

    a, b = since_process_start(), since_process_start()
    assert 0 < a <= b
    code = "import time; time.sleep(0.6); from specdec.timing import since_process_start as s; print(s())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 cwd=str(Path(__file__).resolve().parents[2])).stdout)  # fmt: skip
    assert 0.6 <= child < 120
