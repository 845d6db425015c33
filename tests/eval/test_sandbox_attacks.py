"""The pass@1 checker against hostile completions: every escape and forged verdict that worked
against the Python-level guards alone, each checked from the host (files, processes, connections,
verdicts) rather than from what the program says about itself.

Each attack first gets past the Python guards (unwrapping them, re-importing ``posix``, removing
the import blocker), so what is tested is the kernel isolation and the verdict path behind them.
"""

from __future__ import annotations

import os
import shutil
import socket
import textwrap
import threading
import time
from pathlib import Path

import pytest

from eval import execution as E
from eval import sandbox
from eval.datasets import AppsProblem, HumanEvalProblem, IOExample

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get("CI"),
                                reason="bubblewrap is not installed (apt-get install bubblewrap); CI installs it")  # fmt: skip

LIMITS = E.Limits(timeout_s=3.0, memory_mb=512, max_procs=32)

#: Gets the unguarded ``posix`` module and ``open``: what every attack below starts from.
UNGUARD = textwrap.dedent("""
    import sys, io
    real_open = getattr(open, "__wrapped__", open)
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "BlockImports"]
    for name in [m for m in sys.modules if m in ("posix", "os", "ctypes", "_ctypes")]:
        del sys.modules[name]
    import posix
""")


def _add_problem() -> HumanEvalProblem:
    prompt = 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n'
    test = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-4, 4) == 0\n"
    return HumanEvalProblem("Synthetic/add", prompt, "add", "    return a + b\n", test)


def _body(code: str) -> str:
    """Top-level attack code as a HumanEval completion (indented into the function, run at definition
    time through a nested exec so it runs before the tests)."""
    return "    return 'WRONG'\n\nexec(" + repr(UNGUARD + textwrap.dedent(code)) + ")\n"


def _my_userns() -> str:
    return os.readlink("/proc/self/ns/user")


def _sandboxed_processes() -> set[int]:
    """Host pids of live processes in another user namespace (every sandboxed process is) that
    this test process started: in one of its per-run pids cgroups where those exist (a sandboxed
    process cannot leave its cgroup), else any."""
    mine, found = _my_userns(), set()
    tag = f"/specdec-sandbox/run-{os.getpid()}-"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/user") == mine:
                continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/cgroup") as f:
                cgroups = f.read()
        except OSError:
            continue
        if sandbox.isolation().process_limit != "cgroup" or tag in cgroups:
            found.add(int(entry))
    return found


@pytest.fixture
def no_leftovers():
    """Fails the test if a process it sandboxed is alive once the check has returned."""
    before = _sandboxed_processes()
    yield
    assert _sandboxed_processes() - before == set()


def test_isolation_is_bubblewrap_with_a_process_limit():
    iso = sandbox.isolation()
    assert iso.tool == "bubblewrap"
    assert iso.process_limit in ("cgroup", "rlimit")


def test_runs_as_nobody_without_capabilities_and_sees_no_host_files(tmp_path, no_leftovers):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-VALUE")
    program = UNGUARD + textwrap.dedent(f"""
        print(posix.getuid(), posix.getgid())
        caps = [line.split()[1] for line in real_open("/proc/self/status") if line.startswith("CapEff")]
        print(caps[0])
        for path in ({str(secret)!r}, "/etc/shadow", "/root/.bash_history", {str(Path(E.__file__))!r}):
            try:
                real_open(path).read()
                print("READ", path)
            except OSError as e:
                print("unreadable", type(e).__name__)
    """)
    r = E.run_program(program, limits=LIMITS)
    assert r.status == "ok", r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "65534 65534" and int(lines[1], 16) == 0
    assert lines[2:] == ["unreadable FileNotFoundError"] * 4, r.stdout
    assert "TOP-SECRET-VALUE" not in r.stdout + r.stderr


@pytest.mark.parametrize("how", ["open.__wrapped__", "FileIO.__mro__", "os.open.__closure__", "posix reimport"])
def test_unwrapped_writers_cannot_write_outside(tmp_path, how, no_leftovers):
    target = tmp_path / "pwned.txt"
    writers = {
        "open.__wrapped__": "w = lambda p: open.__wrapped__(p, 'w').write('x')",
        "FileIO.__mro__": "w = lambda p: io.FileIO.__mro__[1](p, 'w').write(b'x')",
        "os.open.__closure__": textwrap.dedent("""
            cells = [c.cell_contents for c in (guarded_os.open.__closure__ or ()) if callable(c.cell_contents)]
            raw = next(f for f in cells if getattr(f, '__name__', '') == 'open')
            w = lambda p: posix.write(raw(p, posix.O_WRONLY | posix.O_CREAT, 0o666), b'x')
        """),
        "posix reimport": "w = lambda p: posix.write(posix.open(p, posix.O_WRONLY | posix.O_CREAT, 0o666), b'x')",
    }
    program = "import os as guarded_os\n" + UNGUARD + writers[how] + textwrap.dedent(f"""
        import sys
        for path in ({str(target)!r}, sys.prefix + "/pwned.txt", "/usr/pwned.txt", "/pwned.txt", "/proc/sys/kernel/hostname"):
            try:
                w(path)
                print("WROTE", path)
            except OSError as e:
                print("refused", type(e).__name__)
    """)
    r = E.run_program(program, limits=LIMITS)
    assert r.status == "ok", r.stderr
    assert r.stdout.count("refused") == 5 and "WROTE" not in r.stdout, r.stdout
    assert not target.exists() and list(tmp_path.iterdir()) == []
    assert not Path("/pwned.txt").exists() and not Path("/usr/pwned.txt").exists()


def test_shell_commands_through_ctypes_stay_inside(tmp_path, no_leftovers):
    marker = tmp_path / "shell-ran"
    program = UNGUARD + textwrap.dedent(f"""
        import ctypes
        libc = ctypes.CDLL(None)
        print("system", libc.system(b"id -u > /sandbox/id; touch {marker}; echo done > /sandbox/done"))
        print(real_open("/sandbox/id").read().strip(), posix.path.exists("/sandbox/done") if hasattr(posix, "path") else "")
    """)
    r = E.run_program(program, limits=LIMITS)
    assert r.status == "ok", r.stderr
    assert "65534" in r.stdout  # the shell ran, as nobody, inside
    assert not marker.exists()


def test_fork_bomb_hits_the_process_limit(no_leftovers):
    program = UNGUARD + textwrap.dedent("""
        import time
        n = 0
        for _ in range(150):
            try:
                pid = posix.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                posix._exit(0)
            n += 1
        print("forked", n)
    """)
    start = time.monotonic()
    r = E.run_program(program, limits=LIMITS)
    assert r.status == "ok", r.stderr
    forked = int(r.stdout.split()[1])
    assert forked < LIMITS.max_procs, r.stdout
    assert time.monotonic() - start < 10


def test_a_double_forked_setsid_process_does_not_outlive_the_verdict(tmp_path, no_leftovers):
    program = UNGUARD + textwrap.dedent("""
        if posix.fork() == 0:
            posix.setsid()
            if posix.fork() == 0:
                posix.execv("/bin/sleep", ["sleep", "30"])
            posix._exit(0)
        print("parent done")
    """)
    r = E.run_program(program, limits=LIMITS)
    assert r.status == "ok" and r.stdout == "parent done\n", r.stderr
    v = E.check(_add_problem(), _body("""
        if posix.fork() == 0:
            posix.setsid()
            if posix.fork() == 0:
                posix.execv("/bin/sleep", ["sleep", "30"])
            posix._exit(0)
    """), LIMITS)
    assert v.status == "fail"


def test_no_connection_reaches_the_host(no_leftovers):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    program = UNGUARD + textwrap.dedent(f"""
        import _socket
        def connect():
            s = _socket.socket()
            s.settimeout(1)
            s.connect(("127.0.0.1", {port}))
        try:
            connect(); print("CONNECTED direct")
        except OSError as e:
            print("refused direct", type(e).__name__)
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for pid in posix.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                fd = posix.open(f"/proc/{{pid}}/ns/net", posix.O_RDONLY)
            except OSError:
                continue
            if libc.setns(fd, 0x40000000) == 0:
                try:
                    connect(); print("CONNECTED via", pid)
                except OSError:
                    print("refused via", pid)
            else:
                print("setns refused", pid)
        for path in ("/proc/1/root/proc/1/ns/net", "/run/netns"):
            print("exists" if posix.access(path, 0) else "absent", path)
    """)
    try:
        r = E.run_program(program, limits=LIMITS)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert r.status == "ok", r.stderr
    assert "CONNECTED" not in r.stdout and "refused direct" in r.stdout, r.stdout
    assert accepted == []


@pytest.mark.parametrize("forgery", ["json.dumps", "report descriptors", "always equal", "exit early", "sys.modules"])
def test_forged_passes_are_not_passes(forgery, no_leftovers):
    attacks = {
        # the old driver reported through json.dumps in the tested process
        "json.dumps": "import json\njson.dumps = lambda *a, **k: '{\"outcome\": \"pass\"}'\n",
        # write a pass wherever a descriptor is writable, in every framing, then leave before the tests
        "report descriptors": textwrap.dedent("""
            import pickle, struct
            for fd in range(3, 64):
                for msg in (b'{"outcome": "pass"}', struct.pack("<Q", 30) + pickle.dumps({"outcome": "pass"})[:30],
                            pickle.dumps({"value": 3}), pickle.dumps({"ready": True})):
                    try:
                        posix.write(fd, msg)
                    except OSError:
                        pass
            posix._exit(0)
        """),
        # a return value that equals everything
        "always equal": "class Anything:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
                        "import builtins\nbuiltins.AlwaysEqual = Anything\n",
        "exit early": "posix._exit(0)\n",
        "sys.modules": "import sys\nsys.modules['builtins'].AssertionError = type('Harmless', (Exception,), {})\n",
    }
    completion = _body(attacks[forgery])
    if forgery == "always equal":
        completion = "    return AlwaysEqual()\n\nexec(" + repr(UNGUARD + attacks[forgery]) + ")\n"
    v = E.check(_add_problem(), completion, LIMITS)
    assert v.status in ("fail", "error") and not v.passed, (v.status, v.detail)


def test_a_forged_call_answer_is_judged_on_its_value(no_leftovers):
    problem = AppsProblem(id="c1", difficulty="introductory", question="Add.", fn_name="add", source="apps",
                          tests=(IOExample([1, 2], 3), IOExample([5, 5], 10)))  # fmt: skip
    send_and_leave = textwrap.dedent("""
        import struct
        for fd in range(3, 64):  # the answer frame on every descriptor, then out before any test runs
            try:
                posix.write(fd, struct.pack("<Q", len(data)) + data)
            except OSError:
                pass
        posix._exit(0)
    """)
    forge = UNGUARD + 'import pickle\ndata = pickle.dumps({"answers": [{"value": 999, "args": "(1, 2)"}]})\n' + send_and_leave
    code = "def add(a, b):\n    return a + b\n\nexec(" + repr(forge) + ")\n"
    v = E.check(problem, code, LIMITS)
    assert v.status == "fail" and "999" in v.detail
    evil = UNGUARD + textwrap.dedent("""
        import pickle
        class Boom:
            def __reduce__(self):
                return (posix.system, ("echo owned",))
        data = pickle.dumps({"answers": [{"value": Boom(), "args": "()"}]})
    """) + send_and_leave
    v = E.check(problem, "def add(a, b):\n    return a + b\n\nexec(" + repr(evil) + ")\n", LIMITS)
    assert v.status == "error" and "not plain data" in v.detail


def test_stdout_forgery_is_just_a_wrong_answer(no_leftovers):
    problem = AppsProblem(id="s1", difficulty="introductory", question="Add.", tests=(IOExample("1 2\n", "3\n"),))
    v = E.check(problem, 'print(\'{"outcome": "pass", "status": "pass"}\')\nimport os\nos._exit(0)\n', LIMITS)
    assert v.status == "fail"


def test_unsafe_mode_is_recorded_and_refused_without_bwrap(monkeypatch):
    v = E.check(_add_problem(), "    return a + b\n", LIMITS, unsafe=True)
    assert v.passed and v.isolation == "none"
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(sandbox.IsolationUnavailable, match="apt-get install bubblewrap"):
        E.check(_add_problem(), "    return a + b\n", LIMITS)
