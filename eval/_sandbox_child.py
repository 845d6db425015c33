"""The runner: what runs inside the sandbox (stdlib only; never import the project from here).

:mod:`eval.execution` starts one fresh interpreter per test, ``python -I -B -X utf8 runner.py``,
through :func:`eval.sandbox.spawn` (inside bubblewrap: its own user, pid and network namespaces,
read-only system files, a private ``/tmp``). The spec (JSON) comes on the descriptor named by the
first argument and is closed before any generated code runs. The runner then

1. sets resource limits the program cannot raise again (hard = soft): address space
   (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``, which also caps stdout and stderr), CPU seconds
   (``RLIMIT_CPU``), processes (``RLIMIT_NPROC``; the sandbox's pids cgroup bounds them too), no
   core files;
2. installs the Python-level guards (:func:`install_guards`) as a second layer: writes outside the
   working directory, process creation, signals, raising limits, sockets and ``ctypes`` raise or
   cannot be imported (accidents stop there; the kernel stops the rest);
3. runs one mode:

   * ``stdin`` -- the program as ``__main__`` with the test's input on stdin and its stdout going
     to the parent, which compares it; the exit status says whether it ended cleanly;
   * ``call`` -- defines the program, calls the function once per argument typing
     (:func:`arg_candidates`) and writes what came back (plain data only: :func:`plain`) as one
     frame (:func:`write_frame`) to the parent, which compares it with :func:`values_match`;
   * ``serve`` -- defines the program (a HumanEval prompt + completion), says ``ready``, then answers
     call requests from the judge with plain values;
   * ``judge`` -- trusted code only: the dataset's prompt (for its helpers) and test, whose
     ``check`` gets a proxy for the entry point that asks the ``serve`` process; generated code
     never runs in this process, and its answers arrive as plain data decoded by
     :class:`PlainUnpickler`. The judge's outcome goes to the parent on a descriptor the generated
     program never had.

Whatever the generated program does to its own process, it can only change its own answers: the
verdict is taken by the parent (stdout comparison, call results) or by the judge.
"""

from __future__ import annotations

import builtins
import errno
import functools
import io
import itertools
import json
import linecache
import math
import os
import pickle
import resource
import struct
import sys
import traceback

MAX_ARG_CANDIDATES = 16
"""At most this many typings are tried for one MapCoder call-based test (see :func:`arg_candidates`)."""

MAX_FRAME_BYTES = 16 << 20
"""The largest message one process accepts from another (a larger one is an error)."""

_DETAIL_CHARS = 600


# ----------------------------------------------------------------------------------------------
# argument typings of call-based tests


def _literal_options(text: str) -> list:
    import ast

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
    import inspect

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
# plain data between processes


_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_PLAIN_CONTAINERS = (list, tuple, dict, set, frozenset)


def to_plain(value, depth: int = 0):
    """``value`` with numpy-like scalars and arrays turned into Python ones (``tolist``); other
    objects are left as they are (and are then not :func:`is_plain`)."""
    if depth > 200:
        return value
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return value
    if kind in (list, tuple):
        return kind(to_plain(v, depth + 1) for v in value)
    if kind is dict:
        return {to_plain(k, depth + 1): to_plain(v, depth + 1) for k, v in value.items()}
    if kind in (set, frozenset):
        return kind(to_plain(v, depth + 1) for v in value)
    if hasattr(value, "tolist") and callable(value.tolist):
        try:
            return to_plain(value.tolist(), depth + 1)
        except Exception:
            return value
    return value


SANDBOX_MODULE = "__sandbox__"
"""The module name the program's and the judge's namespaces are registered under, so that
instances of the dataset's own classes (a test building a ``Node`` for the function) travel by
reference to the class of the same name on the other side."""


def _namespace_module() -> dict:
    """A fresh namespace registered as :data:`SANDBOX_MODULE` (its ``__dict__``)."""
    import types

    module = types.ModuleType(SANDBOX_MODULE)
    module.__builtins__ = builtins
    sys.modules[SANDBOX_MODULE] = module
    return module.__dict__


def _data_of(value, accept, depth: int = 0) -> bool:
    """Whether ``value`` is made of exactly the builtin data types (no subclasses: nothing whose
    comparison a program chose) and of objects whose class ``accept`` takes (their ``__dict__``
    holding such data in turn), at most 200 levels deep."""
    if depth > 200:
        return False
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return True
    if kind in (list, tuple, set, frozenset):
        return all(_data_of(v, accept, depth + 1) for v in value)
    if kind is dict:
        return all(_data_of(k, accept, depth + 1) and _data_of(v, accept, depth + 1) for k, v in value.items())
    state = getattr(value, "__dict__", None)
    return accept(kind) and type(state) is dict and _data_of(state, accept, depth + 1)


def is_plain(value, classes: frozenset = frozenset()) -> bool:
    """Whether ``value`` is plain data: builtin types only, or instances of ``classes`` (the
    dataset's own, trusted) holding plain data."""
    return _data_of(value, lambda kind: kind in classes)


def _own_classes(value) -> bool:
    """Whether every object in ``value`` that is not builtin data is an instance of a class defined
    in the program's namespace (sent by reference; the judge accepts only the dataset's ones)."""
    return _data_of(value, lambda kind: getattr(kind, "__module__", None) == SANDBOX_MODULE)


class PlainUnpickler(pickle.Unpickler):
    """Decodes only builtin data, plus instances of ``classes`` (the judge's own namespace's, which
    the dataset defined): no other class or function can be named (``find_class`` refuses all but
    ``complex``, ``set``, ``frozenset`` and those), so a message from a generated program cannot run
    the program's code."""

    _ALLOWED = {("builtins", "complex"), ("builtins", "set"), ("builtins", "frozenset")}

    def __init__(self, file, classes: dict | None = None) -> None:
        super().__init__(file)
        self.classes = classes or {}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return getattr(builtins, name)
        if module == SANDBOX_MODULE and name in self.classes:
            return self.classes[name]
        raise pickle.UnpicklingError(f"not plain data: {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("not plain data: a persistent id")


def loads_plain(data: bytes, classes: dict | None = None):
    """:class:`PlainUnpickler` on ``data``, then :func:`is_plain` on the result (ValueError if not)."""
    try:
        value = PlainUnpickler(io.BytesIO(data), classes).load()
    except Exception as e:
        raise ValueError(f"not a plain-data message ({type(e).__name__}: {e})") from None
    if not is_plain(value, frozenset((classes or {}).values())):
        raise ValueError(f"not a plain-data message (a {type(value).__name__})")
    return value


def write_frame(fd: int, value) -> None:
    """Send ``value`` (pickled) as one length-prefixed frame."""
    data = pickle.dumps(value, protocol=5)
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, plain: bool = True, classes: dict | None = None):
    """The next frame's value (None at end of stream); ``plain`` decodes with :func:`loads_plain`
    (which also accepts instances of ``classes``).

    Raises:
        ValueError: a frame over :data:`MAX_FRAME_BYTES`, cut short, or (``plain``) not plain data.
    """
    head = _read_exact(fd, 8)
    if head is None:
        return None
    (size,) = struct.unpack("<Q", head)
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a message of {size} bytes (the limit is {MAX_FRAME_BYTES})")
    data = _read_exact(fd, size)
    if data is None:
        raise ValueError("a message cut short")
    return loads_plain(data, classes) if plain else pickle.loads(data)


# ----------------------------------------------------------------------------------------------
# guards


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


# ----------------------------------------------------------------------------------------------
# limits


def _set_limits(spec: dict) -> None:
    def limit(which, value):
        if value is None:
            return
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))

    limit(resource.RLIMIT_AS, spec.get("memory_bytes"))
    limit(resource.RLIMIT_FSIZE, spec.get("fsize_bytes"))
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NPROC, spec.get("max_procs"))
    if spec.get("cpu_s"):
        cpu = int(math.ceil(spec["cpu_s"]))
        soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1 if hard == resource.RLIM_INFINITY else min(cpu + 1, hard)))


# ----------------------------------------------------------------------------------------------
# running generated code


def _short(value, limit: int = 120) -> str:
    try:
        text = repr(value)
    except BaseException:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _exc_detail(exc: BaseException) -> str:
    try:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except BaseException:
        text = type(exc).__name__
    return text[:_DETAIL_CHARS]


_FILENAME = "solution.py"


def _format_traceback(files: tuple[str, ...] = (_FILENAME,)) -> str:
    """The current exception's traceback from the first frame of ``files`` on (not the runner's)."""
    try:
        etype, exc, tb = sys.exc_info()
        first = tb
        while first is not None and first.tb_frame.f_code.co_filename not in files:
            first = first.tb_next
        return "".join(traceback.format_exception(etype, exc, first or tb))
    except BaseException:
        return ""


def _print_traceback(files: tuple[str, ...] = (_FILENAME,)) -> None:
    try:
        sys.stderr.write(_format_traceback(files))
    except BaseException:
        pass


def _exec(code: str, namespace: dict, filename: str = _FILENAME) -> None:
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # source lines in tracebacks
    exec(compile(code, filename, "exec"), namespace)


def _finish() -> None:
    """End the way ``python solution.py`` would: wait for non-daemon threads (the
    ``threading.Thread(target=main).start()`` idiom for deep recursion), then run ``atexit``
    functions (fast-output templates print the buffered answer there), then flush."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.__stdout__, sys.stderr, sys.__stderr__):
        if stream is not None:
            stream.flush()


def _run_stdin(spec: dict) -> int:
    """The program as ``__main__``: its exit status (0: ended cleanly)."""
    ns = {"__name__": "__main__", "__builtins__": builtins}
    exec(spec.get("header") or "", ns)
    code = 0
    try:
        _exec(spec["code"], ns)
    except SystemExit as e:
        if e.code is None or e.code == 0:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF or 1
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        _print_traceback()
        print(f"specdec-sandbox: {_exc_detail(e)}", file=sys.stderr)
        code = 1
    try:
        _finish()
    except BaseException as e:  # e.g. EFBIG once the output reaches RLIMIT_FSIZE
        print(f"specdec-sandbox: writing the output failed: {_exc_detail(e)}", file=sys.stderr)
        code = code or 1
    return code


def _find_function(ns: dict, name: str):
    obj = ns.get(name)
    if callable(obj) and not isinstance(obj, type):
        return obj
    solution = ns.get("Solution")
    if isinstance(solution, type) and hasattr(solution, name):
        return getattr(solution(), name)
    return obj if callable(obj) else None


def _define(spec: dict, name: str) -> dict:
    """Run the program's definitions (``__name__ == "__sandbox__"``): ``{"fn": callable}`` or
    ``{"outcome": "fail" | "error", "detail": ...}``."""
    ns = _namespace_module()
    exec(spec.get("header") or "", ns)
    try:
        _exec(spec["code"], ns)
    except SystemExit as e:
        return {"outcome": "error", "detail": f"the program exited (SystemExit {e.code!r}) while defining the solution"}
    except EOFError as e:  # top-level code reading stdin (a main the task did not ask for): stdin is empty
        if _find_function(ns, name) is None:
            _print_traceback()
            return {"outcome": "error", "detail": "while defining the solution: " + _exc_detail(e)}
    except AssertionError as e:
        _print_traceback()
        return {"outcome": "fail", "detail": "a test assertion failed" + (f": {e}" if str(e) else "")}
    except BaseException as e:
        _print_traceback()
        return {"outcome": "error", "detail": "while defining the solution: " + _exc_detail(e)}
    fn = _find_function(ns, name)
    if fn is None:
        return {"outcome": "error", "detail": f"no function {name!r} (nor Solution().{name}) defined"}
    return {"fn": fn}


def _answer(fn, args: list, kwargs: dict) -> dict:
    """One call: ``{"value": plain}``, ``{"opaque": type name, "repr": ...}`` (not plain data) or
    ``{"raised": exception type name, "detail": ...}``."""
    try:
        got = fn(*args, **kwargs)
    except SystemExit as e:
        return {"raised": "SystemExit", "detail": f"the function exited (SystemExit {_short(e.code)})"}
    except BaseException as e:
        sys.stderr.write(_format_traceback())
        return {"raised": type(e).__name__, "detail": _exc_detail(e)}
    got = to_plain(got)
    if is_plain(got) or _own_classes(got):
        return {"value": got}
    return {"opaque": type(got).__name__, "repr": _short(got)}


def _send(fd: int, message: dict) -> None:
    try:
        write_frame(fd, message)
    except (ValueError, TypeError, pickle.PicklingError, RecursionError, OverflowError) as e:
        write_frame(fd, {"raised": "TypeError", "detail": f"the answer could not be sent: {_exc_detail(e)}"})


def _run_call(spec: dict) -> int:
    """Define the solution, call it once per argument typing, send the answers as one frame."""
    defined = _define(spec, spec["fn_name"])
    out = spec["reply_fd"]
    if "fn" not in defined:
        _send(out, defined)
        return 0
    fn, test = defined["fn"], spec["test"]
    if "args" in test:
        candidates = [list(test["args"]) if isinstance(test["args"], (list, tuple)) else [test["args"]]]
    else:
        candidates = arg_candidates(test["text"], *_arity(fn))
    answers = []
    for args in candidates:
        answer = _answer(fn, args, {})
        answer["args"] = _short(args)
        answers.append(answer)
    _send(out, {"answers": answers})
    _finish()
    return 0


def _run_serve(spec: dict) -> int:
    """Define the program, then answer the judge's calls until it hangs up."""
    requests, replies = spec["request_fd"], spec["reply_fd"]
    defined = _define(spec, spec["fn_name"])
    if "fn" not in defined:
        _send(replies, defined)
        return 0
    _send(replies, {"ready": True})
    fn = defined["fn"]
    while True:
        request = read_frame(requests, plain=False)
        if request is None:
            return 0
        args, kwargs = request
        _send(replies, _answer(fn, list(args), dict(kwargs)))


# ----------------------------------------------------------------------------------------------
# the judge (trusted code only)


class ProgramGone(Exception):
    """The generated program stopped answering (it exited, crashed or sent something invalid)."""


class Opaque:
    """An answer that was not plain data: equal to nothing, so a test comparing it fails."""

    def __init__(self, kind: str, text: str) -> None:
        self.kind, self.text = kind, text

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<{self.kind} from the program: {self.text}>"


def _raise_answer(answer: dict):
    name, detail = answer.get("raised"), str(answer.get("detail", ""))
    if name == "SystemExit":
        raise ProgramGone(detail)
    cls = getattr(builtins, str(name), None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            exc = cls(detail)
        except Exception:
            exc = RuntimeError(f"{name}: {detail}")
        raise exc
    raise RuntimeError(f"{name}: {detail}")


def _proxy(spec: dict, ns: dict):
    """The entry point as the test sees it: each call goes to the program's process and comes back
    as plain data (or as instances of the dataset's own classes, those of ``ns``)."""
    requests, replies = spec["request_fd"], spec["reply_fd"]

    def candidate(*args, **kwargs):
        classes = {k: v for k, v in ns.items() if isinstance(v, type) and v.__module__ == SANDBOX_MODULE}
        try:
            write_frame(requests, (args, kwargs))
        except BrokenPipeError:
            raise ProgramGone("the program exited before the tests finished") from None
        try:
            answer = read_frame(replies, classes=classes)
        except ValueError as e:
            raise ProgramGone(f"the program sent {e}") from None
        if not isinstance(answer, dict):
            raise ProgramGone("the program exited before the tests finished")
        if "value" in answer:
            return answer["value"]
        if "opaque" in answer:
            return Opaque(str(answer["opaque"]), str(answer.get("repr", "")))
        _raise_answer(answer)

    candidate.__name__ = spec["fn_name"]
    return candidate


def _run_judge(spec: dict) -> int:
    """``check(candidate)`` of the dataset's test, the candidate answering from the other process."""
    result_fd = spec["result_fd"]

    def report(outcome: str, detail: str = "") -> int:
        os.write(result_fd, json.dumps({"outcome": outcome, "detail": detail[:_DETAIL_CHARS]}).encode())
        return 0

    try:
        ready = read_frame(spec["reply_fd"])
    except ValueError as e:
        return report("error", f"the program sent {e}")
    if not isinstance(ready, dict):
        return report("error", "the program exited before the tests finished")
    if not ready.get("ready"):
        return report(str(ready.get("outcome", "error")) if ready.get("outcome") in ("fail", "error") else "error",
                      str(ready.get("detail", "the program did not start")))
    ns = _namespace_module()
    try:
        _exec(spec["prompt"], ns, "prompt.py")
        _exec(spec["test"], ns, "test.py")
        candidate = _proxy(spec, ns)
        ns[spec["fn_name"]] = candidate
        ns["check"](candidate)
    except AssertionError as e:
        _print_traceback(("test.py", "prompt.py"))
        return report("fail", "a test assertion failed" + (f": {e}" if str(e) else ""))
    except ProgramGone as e:
        return report("error", str(e))
    except BaseException as e:
        _print_traceback(("test.py", "prompt.py"))
        return report("error", _exc_detail(e))
    return report("pass")


_MODES = {"stdin": _run_stdin, "call": _run_call, "serve": _run_serve, "judge": _run_judge}


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec_fd = int(argv[1])
    with os.fdopen(spec_fd, "rb") as f:
        spec = json.loads(f.read().decode("utf-8"))
    sys.path.extend(spec.get("site_dirs") or ())  # the interpreter runs with -S: packages without .pth hooks
    _set_limits(spec)
    if spec["mode"] != "judge" and spec.get("guards", True):
        install_guards(spec["root"])
    sys.argv = [_FILENAME]
    return _MODES[spec["mode"]](spec)


if __name__ == "__main__":
    code = main(sys.argv)
    os._exit(code)  # no interpreter teardown: nothing of the program's runs after its verdict
