"""The sandboxed side of :mod:`eval.execution` (stdlib only; never import the project from here).

:mod:`eval.execution` starts this file as ``python -I -B -X utf8 _sandbox_child.py SPEC`` in a new
session, with a fresh temporary directory as cwd, HOME and TMPDIR and a minimal environment.
This process is the *driver*: it runs no generated code itself. It

1. reads the pickled spec (written by the parent) and opens the files it reports through;
2. sets resource limits that every process it forks inherits: address space (``RLIMIT_AS``),
   file size (``RLIMIT_FSIZE``, which also caps the program's stdout and stderr: both are
   files), no core files;
3. tries to move into a private network namespace (``unshare(CLONE_NEWNET)``, inside a new user
   namespace when not root): then the kernel has no route anywhere. Where that is refused the
   Python-level socket guard below is all there is;
4. installs Python-level guards (:func:`install_guards`): writes outside the temporary directory,
   process creation, signals to other processes, raising limits and ``socket.socket`` /
   ``create_connection`` / DNS raise ``PermissionError``; ``ctypes``, ``sqlite3``, ``dbm`` and
   POSIX shared memory cannot be imported (the C-level ``_socket.socket`` is left alone:
   ``socket.socket`` calls it by name; the network namespace is what stops it);
5. runs each test in a forked process (stdin from the test's input file, stdout to a file), kills
   it with SIGKILL when it passes the per-test wall-clock limit (also ``RLIMIT_CPU`` as a
   backstop), compares the output here, outside the tested process, and writes one JSON result.

The guards are best effort, in the spirit of HumanEval's ``reliability_guard``: they stop accidents
by generated code (``os.remove``, ``shutil.rmtree('/')``, ``subprocess.run``, writing
``../x.txt``), not a determined attacker, who can reach the original functions (closures,
``gc``) or C code. The kernel-enforced parts are the resource limits, the process group the
parent kills, and the network namespace when it is granted.
"""

from __future__ import annotations

import ast
import builtins
import errno
import functools
import inspect
import io
import itertools
import json
import linecache
import math
import os
import pickle
import re
import resource
import select
import signal
import sys
import time
import traceback

FLOAT_TOLERANCE = 1e-6
"""Two numbers (at least one not an integer) match when within this absolute or relative error."""

MAX_ARG_CANDIDATES = 16
"""At most this many typings are tried for one MapCoder call-based test (see :func:`arg_candidates`)."""

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_DETAIL_CHARS = 600
_INT_TOKEN = re.compile(r"[+-]?\d+")


# ----------------------------------------------------------------------------------------------
# comparisons (pure functions; eval.execution re-exports them)


def _tokens_close(got: str, expected: str) -> bool:
    if _INT_TOKEN.fullmatch(got) and _INT_TOKEN.fullmatch(expected):
        return int(got) == int(expected)
    try:
        g, e = float(got), float(expected)
    except ValueError:
        return False
    if math.isnan(g) or math.isnan(e):
        return math.isnan(g) and math.isnan(e)
    return math.isclose(g, e, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)


def outputs_match(got: str, expected: str) -> bool:
    """Whether a standard-input program's output ``got`` matches ``expected``.

    Compared as whitespace-separated tokens, so line breaks, trailing spaces and blank lines do
    not matter (APPS's whitespace-split comparison; Codeforces' default token checker). Two tokens
    match when equal as strings, when both are integers of equal value, or when both parse as
    floats (at least one not an integer) within :data:`FLOAT_TOLERANCE` absolute or relative
    error. Case matters ("YES" is not "Yes"); order matters (APPS's last, order-free set
    comparison is not used).
    """
    if got == expected:
        return True
    g, e = got.split(), expected.split()
    return len(g) == len(e) and all(a == b or _tokens_close(a, b) for a, b in zip(g, e))


def _plain(value):
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes, list, dict)):
        try:  # numpy scalars and arrays
            return value.tolist()
        except Exception:
            return value
    return value


def _same(got, expected) -> bool:
    got, expected = _plain(got), _plain(expected)
    if isinstance(expected, bool) or isinstance(got, bool):
        return isinstance(expected, bool) and isinstance(got, bool) and got == expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        if math.isnan(got) or math.isnan(expected):
            return math.isnan(got) and math.isnan(expected)
        return math.isclose(got, expected, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(_same(g, e) for g, e in zip(got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        if len(got) != len(expected):
            return False
        by_str = {str(k): v for k, v in got.items()}  # JSON turned the reference's keys into strings
        for key, value in expected.items():
            if key in got:
                if not _same(got[key], value):
                    return False
            elif not (isinstance(key, str) and key in by_str and _same(by_str[key], value)):
                return False
        return True
    try:
        return bool(got == expected)
    except Exception:
        return False


def values_match(got, expected, wrapped: bool) -> bool:
    """Whether a call-based solution's return value ``got`` matches the test's ``expected``.

    ``wrapped=True`` (MapCoder rows): ``expected`` is ``[value]``; compare with ``value`` only.
    ``wrapped=False`` (original APPS rows): APPS's rule, ``got == expected`` or, when ``expected``
    is a non-empty list, ``got == expected[0]``. Tuples compare as lists (the reference went
    through JSON), dict keys may have become strings, bools only equal bools, and numbers (at
    least one a float) compare within :data:`FLOAT_TOLERANCE`.
    """
    if wrapped:
        if isinstance(expected, (list, tuple)) and len(expected) == 1:
            return _same(got, expected[0])
        return _same(got, expected)
    return _same(got, expected) or (isinstance(expected, list) and len(expected) > 0 and _same(got, expected[0]))


def _literal_options(text: str) -> list:
    try:
        value = ast.literal_eval(text)
    except Exception:  # ValueError, SyntaxError, MemoryError, RecursionError, ...
        return [text]
    return [value, text]


def arg_candidates(text: str, n_required: int, n_max: int | None) -> list[list]:
    """Argument lists to try for a MapCoder call-based test.

    MapCoder's conversion wrote a call's arguments as ``"\\n".join(str(arg) for arg in args)``,
    which loses their types (``"1234"`` may have been the int or the string). So: split ``text``
    into one argument per line when the function takes that many (``n_required`` required
    parameters, at most ``n_max``, None for ``*args``), else pass the whole text as one argument;
    read each argument as a Python literal where it parses, else as the raw string. Candidates
    come all-literal first, then with more and more arguments kept as raw strings (at most
    :data:`MAX_ARG_CANDIDATES`); a test passes if any candidate gives the expected value. When
    none does, a wrong value is reported rather than an exception (which may only mean a wrong
    guess at the types).
    """
    if n_max == 0:
        return [[]]
    lines = text.split("\n")
    if len(lines) >= n_required and (n_max is None or len(lines) <= n_max):
        parts = lines
    else:
        parts = [text]
    options = [_literal_options(p) for p in parts]
    return [list(c) for c in itertools.islice(itertools.product(*options), MAX_ARG_CANDIDATES)]


def _arity(fn) -> tuple[int, int | None]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0, None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        n_max = None
    else:
        n_max = len(positional)
    return sum(p.default is p.empty for p in positional), n_max


# ----------------------------------------------------------------------------------------------
# guards


class _Originals:
    """The real functions the driver keeps for itself before the guards replace them."""

    def __init__(self) -> None:
        self.fork = os.fork
        self.kill = os.kill
        self.setrlimit = resource.setrlimit


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise PermissionError(errno.EPERM, f"sandbox: {what} is not allowed")

    return refused


_BLOCKED_MODULES = ("ctypes", "_ctypes", "cffi", "_cffi_backend", "sqlite3", "_sqlite3", "dbm", "_dbm", "_gdbm",
                    "_posixshmem", "readline")  # fmt: skip
"""Not importable in the sandbox: foreign-function access, and C code that creates files itself."""
_DEVICES = frozenset(["/dev/null", "/dev/stdout", "/dev/stderr", "/dev/fd/1", "/dev/fd/2", "/proc/self/fd/1", "/proc/self/fd/2"])
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def install_guards(root: str) -> None:
    """Replace what lets Python code write outside ``root``, start processes, signal other
    processes, raise resource limits, open sockets or import :data:`_BLOCKED_MODULES` (``ctypes``,
    ``sqlite3``, ...; see the module docstring
    for what this does not stop). Reading files anywhere stays allowed (imports need it)."""
    root = os.path.realpath(root)

    def resolve(path, dir_fd=None, follow=True) -> str | None:
        if isinstance(path, int):
            return None  # an already open descriptor
        p = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        if follow:
            return os.path.realpath(p)
        # the last component itself (unlink removes a symlink, not its target)
        head, tail = os.path.split(p)
        return os.path.normpath(os.path.join(os.path.realpath(head or "."), tail))

    def check(path, dir_fd=None, follow=True) -> None:
        if not isinstance(path, int) and os.fsdecode(path) in _DEVICES and dir_fd is None:
            return
        real = resolve(path, dir_fd, follow)
        if real is not None and real != root and not real.startswith(root + os.sep):
            raise PermissionError(errno.EPERM, "sandbox: writing outside the temporary directory is not allowed", os.fsdecode(path))

    def writing(mode) -> bool:
        return isinstance(mode, str) and any(c in mode for c in "wax+")

    real_open = io.open

    @functools.wraps(real_open)
    def guarded_open(file, mode="r", *args, **kwargs):
        if writing(mode):
            check(file)
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = guarded_open
    import _io

    _io.open = guarded_open

    class GuardedFileIO(_io.FileIO):
        def __init__(self, file, mode="r", *args, **kwargs):
            if writing(mode):
                check(file)
            super().__init__(file, mode, *args, **kwargs)

    io.FileIO = _io.FileIO = GuardedFileIO

    import posix

    def patch(name, replacement):
        for module in (os, posix):
            if hasattr(module, name):
                setattr(module, name, replacement)

    real_os_open = os.open

    def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & _WRITE_FLAGS:
            check(path, dir_fd)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    patch("open", guarded_os_open)

    def one_path(name, follow):
        real = getattr(os, name)

        @functools.wraps(real)
        def guarded(path, *args, **kwargs):
            check(path, kwargs.get("dir_fd"), follow and kwargs.get("follow_symlinks", True))
            return real(path, *args, **kwargs)

        patch(name, guarded)

    for name in ("chmod", "chown", "truncate", "utime", "setxattr", "removexattr", "chflags"):
        if hasattr(os, name):
            one_path(name, True)
    for name in ("remove", "unlink", "rmdir", "mkdir", "mkfifo", "mknod", "lchmod", "lchown", "lchflags"):
        if hasattr(os, name):
            one_path(name, False)

    def two_paths(name, src_follow):
        real = getattr(os, name)

        @functools.wraps(real)
        def guarded(src, dst, *args, **kwargs):
            if src_follow is not None:
                check(src, kwargs.get("src_dir_fd"), src_follow)
            check(dst, kwargs.get("dst_dir_fd", kwargs.get("dir_fd")), False)
            return real(src, dst, *args, **kwargs)

        patch(name, guarded)

    two_paths("rename", False)
    two_paths("replace", False)
    two_paths("link", True)  # a hard link to an outside file would let writes through
    two_paths("symlink", None)  # the target may be anywhere: writes through the link are checked on its resolved path

    for name in ("system", "popen", "fork", "forkpty", "vfork", "execv", "execve", "execl", "execle", "execlp",
                 "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                 "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp"):  # fmt: skip
        if hasattr(os, name):
            patch(name, _refuse(f"creating processes (os.{name})"))
    for name in ("killpg", "setsid", "setpgid", "setpgrp", "chroot", "setuid", "seteuid", "setgid", "setegid", "setreuid",
                 "setregid", "setresuid", "setresgid", "setgroups", "unshare", "setns", "plock"):  # fmt: skip
        if hasattr(os, name):
            patch(name, _refuse(f"os.{name}"))

    real_kill = os.kill

    def guarded_kill(pid, sig):
        if pid != os.getpid():
            raise PermissionError(errno.EPERM, "sandbox: signalling other processes is not allowed")
        return real_kill(pid, sig)

    patch("kill", guarded_kill)

    import _posixsubprocess

    _posixsubprocess.fork_exec = _refuse("creating processes (subprocess)")
    resource.setrlimit = _refuse("changing resource limits")
    if hasattr(resource, "prlimit"):
        resource.prlimit = _refuse("changing resource limits")

    import _socket
    import socket

    class NoSocket(socket.socket):
        """Only wraps descriptors that already exist (``socketpair``, which asyncio needs)."""

        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None:
                raise PermissionError(errno.EPERM, "sandbox: network access is not allowed")
            super().__init__(family, type, proto, fileno)

    socket.socket = socket.SocketType = NoSocket  # not _socket.socket: socket.socket's methods call it by name
    for name in ("create_connection", "create_server", "fromfd", "getaddrinfo", "gethostbyname", "gethostbyname_ex",
                 "gethostbyaddr", "getnameinfo"):  # fmt: skip
        for module in (socket, _socket):
            if hasattr(module, name):
                setattr(module, name, _refuse("network access"))

    blocked = _BLOCKED_MODULES
    for name in [m for m in sys.modules if m.split(".")[0] in blocked]:
        del sys.modules[name]

    class BlockImports:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ImportError(f"sandbox: importing {name} is not allowed", name=name)
            return None

    sys.meta_path.insert(0, BlockImports())


def _set_limits(spec: dict, originals: _Originals) -> None:
    def limit(which, value):
        if value is None:
            return
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        originals.setrlimit(which, (value, value))

    limit(resource.RLIMIT_AS, spec["memory_bytes"])
    limit(resource.RLIMIT_FSIZE, spec["fsize_bytes"])
    limit(resource.RLIMIT_CORE, 0)


def _isolate_network() -> bool:
    """Move into a private network namespace (only loopback, down); False where refused."""
    flags = _CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET
    try:
        if hasattr(os, "unshare"):  # Python 3.12+
            os.unshare(flags)
            return True
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.unshare(flags) == 0
    except Exception:
        return False


# ----------------------------------------------------------------------------------------------
# one test, in the forked process


def _short(value, limit: int = 120) -> str:
    try:
        text = repr(value)
    except BaseException:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _exc_detail(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:_DETAIL_CHARS]


_FILENAME = "solution.py"


def _format_traceback() -> str:
    """The current exception's traceback from the program's first frame on (not the driver's)."""
    try:
        etype, exc, tb = sys.exc_info()
        first = tb
        while first is not None and first.tb_frame.f_code.co_filename != _FILENAME:
            first = first.tb_next
        return "".join(traceback.format_exception(etype, exc, first or tb))
    except BaseException:
        return ""


def _print_traceback() -> None:
    try:
        sys.stderr.write(_format_traceback())
    except BaseException:
        pass


def _exec(code: str, namespace: dict) -> None:
    linecache.cache[_FILENAME] = (len(code), None, code.splitlines(True), _FILENAME)  # source lines in tracebacks
    exec(compile(code, _FILENAME, "exec"), namespace)


def _body_humaneval(spec: dict, test: dict) -> dict:
    ns = {"__name__": "__sandbox__", "__builtins__": builtins}
    try:
        _exec(spec["code"], ns)
    except AssertionError as e:
        _print_traceback()
        return {"outcome": "fail", "detail": "a test assertion failed" + (f": {e}" if str(e) else "")}
    except SystemExit as e:
        return {"outcome": "error", "detail": f"the program exited (SystemExit {e.code!r}) before the tests finished"}
    except BaseException as e:
        _print_traceback()
        return {"outcome": "error", "detail": _exc_detail(e)}
    return {"outcome": "pass"}


def _body_stdin(spec: dict, test: dict) -> dict:
    ns = {"__name__": "__main__", "__builtins__": builtins}
    exec(spec["header"], ns)
    try:
        _exec(spec["code"], ns)
    except SystemExit as e:
        if e.code is None or e.code == 0:
            return {"outcome": "exited", "code": 0}
        if isinstance(e.code, int):
            return {"outcome": "exited", "code": e.code, "detail": f"exit status {e.code}"}
        print(e.code, file=sys.stderr)
        return {"outcome": "exited", "code": 1, "detail": f"exit({_short(e.code)})"}
    except BaseException as e:
        _print_traceback()
        return {"outcome": "exited", "code": 1, "detail": _exc_detail(e)}
    return {"outcome": "exited", "code": 0}


def _find_function(ns: dict, name: str):
    obj = ns.get(name)
    if callable(obj) and not isinstance(obj, type):
        return obj
    solution = ns.get("Solution")
    if isinstance(solution, type) and hasattr(solution, name):
        return getattr(solution(), name)
    return obj if callable(obj) else None


def _body_call(spec: dict, test: dict) -> dict:
    ns = {"__name__": "__sandbox__", "__builtins__": builtins}
    exec(spec["header"], ns)
    try:
        _exec(spec["code"], ns)
    except SystemExit as e:
        return {"outcome": "error", "detail": f"the program exited (SystemExit {e.code!r}) while defining the solution"}
    except EOFError as e:  # top-level code reading stdin (a main the task did not ask for): stdin is empty
        if _find_function(ns, spec["fn_name"]) is None:
            _print_traceback()
            return {"outcome": "error", "detail": "while defining the solution: " + _exc_detail(e)}
    except BaseException as e:
        _print_traceback()
        return {"outcome": "error", "detail": "while defining the solution: " + _exc_detail(e)}
    fn = _find_function(ns, spec["fn_name"])
    if fn is None:
        return {"outcome": "error", "detail": f"no function {spec['fn_name']!r} (nor Solution().{spec['fn_name']}) defined"}
    if "args" in test:
        candidates = [list(test["args"]) if isinstance(test["args"], (list, tuple)) else [test["args"]]]
    else:
        candidates = arg_candidates(test["text"], *_arity(fn))
    outcomes = []
    for args in candidates:
        try:
            got = fn(*args)
        except SystemExit as e:
            outcomes.append({"outcome": "error", "detail": f"args {_short(args)}: the function exited (SystemExit {e.code!r})"})
        except BaseException as e:
            outcomes.append({"outcome": "error", "detail": f"args {_short(args)}: {_exc_detail(e)}", "tb": _format_traceback()})
        else:
            if values_match(got, test["expected"], test["wrapped"]):
                return {"outcome": "pass"}
            expected = test["expected"]
            if test["wrapped"] and isinstance(expected, list) and len(expected) == 1:
                expected = expected[0]
            outcomes.append({"outcome": "fail", "detail": f"args {_short(args)}: expected {_short(expected)}, got {_short(got)}"})
    # a wrong value outranks an exception: the exception may only mean a wrong guess at the types
    chosen = next((o for o in outcomes if o["outcome"] == "fail"), outcomes[0])
    if chosen.get("tb"):
        sys.stderr.write(chosen.pop("tb"))
    chosen.pop("tb", None)
    return chosen


_BODIES = {"humaneval": _body_humaneval, "stdin": _body_stdin, "call": _body_call}


def _finish() -> None:
    """End the way ``python solution.py`` would: wait for non-daemon threads (the
    ``threading.Thread(target=main).start()`` idiom for deep recursion), then run ``atexit``
    functions (fast-output templates print the buffered answer there)."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()


def _in_fork(spec: dict, test: dict, in_fd: int, out_fd: int, report_fd: int, originals: _Originals) -> None:
    """The forked test process: never returns."""
    try:
        os.dup2(in_fd, 0)
        os.dup2(out_fd, 1)
        cpu = math.ceil(spec["timeout_s"]) + 1
        originals.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        sys.argv = [_FILENAME]
        message = _BODIES[spec["mode"]](spec, test)
        _finish()
    except BaseException as e:
        message = {"outcome": "error", "detail": "sandbox: " + _exc_detail(e)}
    for stream in (sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except BaseException as e:  # e.g. EFBIG once the output reaches RLIMIT_FSIZE
            if stream in (sys.stdout, sys.__stdout__) and message.get("outcome") in ("pass", "exited"):
                message = {"outcome": "error", "detail": f"writing the output failed: {_exc_detail(e)}"}
    try:
        os.write(report_fd, json.dumps(message).encode()[:60000])
    finally:
        os._exit(0)


# ----------------------------------------------------------------------------------------------
# the driver


def _wait(pid: int, timeout: float, originals: _Originals) -> tuple[int, bool]:
    """Wait for ``pid`` at most ``timeout`` seconds, then SIGKILL it: (wait status, timed out)."""
    deadline = time.monotonic() + timeout
    pidfd = None
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pass
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status, False
            left = deadline - time.monotonic()
            if left <= 0:
                originals.kill(pid, signal.SIGKILL)
                return os.waitpid(pid, 0)[1], True
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.005))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _read_all(fd: int) -> bytes:
    chunks = []
    os.set_blocking(fd, False)
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _read_output(out_fd: int) -> str:
    size = os.fstat(out_fd).st_size
    data = os.pread(out_fd, size, 0) if size else b""
    return data.decode("utf-8", errors="replace")


def _run_test(spec: dict, test: dict, out_fd: int, originals: _Originals) -> tuple[str, str, str | None]:
    """One test: (outcome in pass/fail/error/timeout, detail, the program's stdout or None)."""
    in_fd = os.open(test.get("input_path") or os.devnull, os.O_RDONLY)
    os.ftruncate(out_fd, 0)
    os.lseek(out_fd, 0, os.SEEK_SET)
    read_fd, write_fd = os.pipe()
    pid = originals.fork()
    if pid == 0:
        os.close(read_fd)
        _in_fork(spec, test, in_fd, out_fd, write_fd, originals)
    os.close(write_fd)
    os.close(in_fd)
    try:
        status, timed_out = _wait(pid, spec["timeout_s"], originals)
        raw = _read_all(read_fd)
    finally:
        os.close(read_fd)
    stdout = _read_output(out_fd) if spec["mode"] == "stdin" else None
    if timed_out:
        return "timeout", f"no answer within {spec['timeout_s']:g} s (killed)", stdout
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return "timeout", "CPU time limit exceeded", stdout
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        hint = " (out of memory?)" if sig == signal.SIGKILL else ""
        return "error", f"killed by {name}{hint}", stdout
    try:
        message = json.loads(raw.decode()) if raw else None
    except ValueError:
        message = None
    if message is None:
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
        if spec["mode"] == "stdin":
            message = {"outcome": "exited", "code": code, "detail": f"exit status {code}"}
        else:
            return "error", f"the program exited (status {code}) before the tests finished", stdout
    if message["outcome"] != "exited":
        return message["outcome"], message.get("detail", ""), stdout
    if message["code"] != 0:
        return "error", message.get("detail") or f"exit status {message['code']}", stdout
    if test.get("expected") is None:
        return "pass", "", stdout
    if outputs_match(stdout, test["expected"]):
        return "pass", "", stdout
    return "fail", f"wrong answer: expected {_short(test['expected'], 80)}, got {_short(stdout, 80)}", stdout


def run(spec: dict, out_fd: int, originals: _Originals) -> dict:
    """Run the spec's tests in order (stopping at the first failure when asked)."""
    status, detail, passed, ran, stdout = "pass", "", 0, 0, None
    for i, test in enumerate(spec["tests"]):
        outcome, what, stdout = _run_test(spec, test, out_fd, originals)
        ran += 1
        if outcome == "pass":
            passed += 1
            continue
        if status == "pass":
            status = outcome
            detail = f"test {i}: {what}" if len(spec["tests"]) > 1 else what
        if spec["stop_on_failure"]:
            break
    result = {"status": status, "detail": detail, "tests_run": ran, "tests_passed": passed}
    if spec.get("capture_stdout"):
        result["stdout"] = (stdout or "")[: spec["capture_stdout"]]
    return result


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    with open(argv[1], "rb") as f:
        spec = pickle.load(f)
    os.unlink(argv[1])  # the expected outputs need not stay readable
    result_fd = os.open(spec["result_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    out_fd = os.open(spec["stdout_path"], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    originals = _Originals()
    _set_limits(spec, originals)
    network_namespace = _isolate_network() if spec["isolate_network"] else False
    install_guards(spec["sandbox"])
    result = run(spec, out_fd, originals)
    result["network_namespace"] = network_namespace
    os.write(result_fd, json.dumps(result).encode())
    os.close(result_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
