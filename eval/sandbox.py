"""Kernel isolation for running generated programs: bubblewrap, a process cgroup, clean teardown.

:mod:`eval.execution` runs every test of a completion as a fresh interpreter started through
:func:`spawn`. With bubblewrap (``bwrap``, Debian package ``bubblewrap``) each process gets

* new user, pid, network, ipc, uts and cgroup namespaces: uid / gid 65534 (``nobody``) with no
  capabilities, no network but a loopback that nothing listens on, no view of the host's
  processes (``--die-with-parent``; when the sandbox's first process ends, the kernel kills every
  process left in its pid namespace), no further user namespaces (``--disable-userns``), a new
  session (no terminal to inject input into);
* a filesystem of read-only binds of only what the interpreter needs (the Python installation
  and ``/usr``), a fresh ``/proc`` and minimal ``/dev``, and a size-limited private ``/sandbox`` as its
  working directory, home and temp dir (gone with the process; there is no ``/tmp``);
* a process budget: a pids cgroup (``pids.max``, cgroup v1's pids hierarchy where it is writable,
  as for root here) and ``RLIMIT_NPROC`` (set inside by the runner; the kernel ignores it for uid 0
  outside the namespace, hence the cgroup).

Without bubblewrap, :func:`isolation` raises :class:`IsolationUnavailable` with one line saying how
to install it, unless the caller asked for ``unsafe=True`` (``specdec check --unsafe-no-isolation``):
then programs run as plain child processes in a new session, with only the resource limits and
Python-level guards of the runner, and every verdict records ``isolation = "none"``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["INSTALL_HINT", "Isolation", "IsolationUnavailable", "Spawned", "isolation", "memfd", "read_fd", "spawn", "workdir"]

INSTALL_HINT = ("the pass@1 checker runs generated code inside bubblewrap, which is not installed: "
                "'apt-get install bubblewrap' (Debian/Ubuntu) or 'dnf install bubblewrap'; "
                "or pass --unsafe-no-isolation to run it without kernel isolation")  # fmt: skip
"""The one line :class:`IsolationUnavailable` carries when ``bwrap`` is missing."""

SANDBOX_UID = 65534
"""The uid and gid programs run as inside the user namespace (``nobody``)."""

RUNNER_PATH = "/specdec/runner.py"
SANDBOX_DIR = "/sandbox"
"""The program's working directory, home and temp dir inside the sandbox: the one writable place
(a private tmpfs). There is no ``/tmp``: a host path under ``/tmp`` names nothing in the sandbox."""

"""Where the runner (``eval/_sandbox_child.py``) appears inside the sandbox."""

_CGROUP_V1_PIDS = Path("/sys/fs/cgroup/pids")


class IsolationUnavailable(OSError):
    """No kernel isolation tool can run here (and the caller did not accept running without one):
    an error of the environment, reported by the command line as one line."""


@dataclass(frozen=True)
class Isolation:
    """How programs are isolated.

    Attributes:
        tool: ``"bubblewrap"`` or ``"none"`` (``unsafe=True`` without a working ``bwrap``, or asked).
        bwrap: the ``bwrap`` executable, or None.
        process_limit: what bounds the number of processes: ``"cgroup"`` (a pids cgroup per run),
            ``"rlimit"`` (``RLIMIT_NPROC`` in the user namespace: the caller is not root) or
            ``"none"``.
    """

    tool: str
    bwrap: str | None
    process_limit: str


_PROBED: dict[str, str | None] = {}
_PROBE_LOCK = threading.Lock()


@functools.cache
def _python_roots() -> tuple[str, ...]:
    """The directories the interpreter needs (installation, venv), outermost first, no nesting."""
    roots = set()
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.realpath(sys.executable)), os.path.dirname(sys.executable)):  # fmt: skip
        if p and os.path.isdir(p):
            roots.add(os.path.realpath(p) if os.path.islink(p) else os.path.abspath(p))
            roots.add(os.path.realpath(p))
    roots = sorted(roots, key=len)
    kept: list[str] = []
    for r in roots:
        if r == "/" or any(r == k or r.startswith(k.rstrip("/") + "/") for k in kept):
            continue
        kept.append(r)
    return tuple(kept)


def _system_binds() -> list[str]:
    """``/usr`` read-only and the merged-usr links (or binds) of ``/bin``, ``/lib``, ``/lib64``, ``/sbin``."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def bwrap_args(*, tmp_bytes: int, runner: str) -> list[str]:
    """The bubblewrap options of one sandbox (the command follows them)."""
    args = ["--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--disable-userns", "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--proc", "/proc", "--dev", "/dev", "--size", str(tmp_bytes), "--tmpfs", SANDBOX_DIR]  # fmt: skip
    args += _system_binds()
    for root in _python_roots():
        if not root.startswith("/usr/"):
            args += ["--ro-bind", root, root]
    args += ["--ro-bind", runner, RUNNER_PATH, "--ro-bind", "/proc/sys", "/proc/sys", "--remount-ro", "/",
             "--chdir", SANDBOX_DIR]  # fmt: skip
    return args


def _probe(bwrap: str) -> str | None:
    """None if a trivial sandbox runs, else why not (one line)."""
    cmd = [bwrap, *bwrap_args(tmp_bytes=1 << 20, runner=os.path.abspath(__file__)), sys.executable, "-I", "-S", "-c", "pass"]
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{bwrap} did not run: {e}"
    if r.returncode != 0:
        tail = r.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"{bwrap} could not start a sandbox here: {tail[-1] if tail else f'exit status {r.returncode}'}"
    return None


@functools.cache
def _cgroup_root() -> Path | None:
    """A writable pids cgroup directory for per-run cgroups (cgroup v1's pids hierarchy), or None
    (probed once per process)."""
    base = _CGROUP_V1_PIDS / "specdec-sandbox"
    try:
        if not (_CGROUP_V1_PIDS / "cgroup.procs").exists():
            return None
        base.mkdir(exist_ok=True)
        probe = base / f"probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        ok = (probe / "pids.max").exists()
        probe.rmdir()
        return base if ok else None
    except OSError:
        return None


def isolation(unsafe: bool = False) -> Isolation:
    """The isolation this machine gives, checked once per process.

    Raises:
        IsolationUnavailable: no working ``bwrap`` and not ``unsafe`` (the message says how to
            install it, or why the installed one cannot start a sandbox).
    """
    if unsafe:
        return Isolation("none", None, "none")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise IsolationUnavailable(INSTALL_HINT)
    with _PROBE_LOCK:
        if bwrap not in _PROBED:
            _PROBED[bwrap] = _probe(bwrap)
    problem = _PROBED[bwrap]
    if problem is not None:
        raise IsolationUnavailable(f"{problem}; or pass --unsafe-no-isolation to run without kernel isolation")
    if _cgroup_root() is not None:
        limit = "cgroup"
    else:
        limit = "rlimit" if os.geteuid() != 0 else "none"
    return Isolation("bubblewrap", bwrap, limit)


def _env() -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SANDBOX_DIR, "TMPDIR": SANDBOX_DIR, "TMP": SANDBOX_DIR,
        "TEMP": SANDBOX_DIR,
        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1",
    }  # fmt: skip


@dataclass
class Spawned:
    """One sandboxed process (:func:`spawn`); :meth:`finish` waits, kills what is left and cleans up."""

    proc: subprocess.Popen
    cgroup: Path | None
    workdir: str | None = None

    def wait(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the process: True if it ended in time (woken by
        a pidfd the moment it ends, not by polling)."""
        try:
            pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel), or already reaped
            try:
                self.proc.wait(max(0.0, timeout))
                return True
            except subprocess.TimeoutExpired:
                return False
        try:
            ready = select.select([pidfd], [], [], max(0.0, timeout))[0]
        finally:
            os.close(pidfd)
        if ready:
            self.proc.wait()
        return bool(ready)

    def finish(self) -> int:
        """Kill the sandbox and everything in it, reap it, remove its cgroup: its exit status."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.cgroup is not None:
            _empty_cgroup(self.cgroup)
        if self.workdir is not None:
            _rmtree(self.workdir)
        return self.proc.returncode


def workdir(iso: Isolation) -> str:
    """The program's working directory as the runner sees it: :data:`SANDBOX_DIR` in the sandbox,
    else a fresh temporary directory (removed by :meth:`Spawned.finish`)."""
    if iso.tool == "bubblewrap":
        return SANDBOX_DIR
    import tempfile

    return tempfile.mkdtemp(prefix="specdec-exec-")


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):  # a program made a directory unwritable: open it up (not through links), retry
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                full = os.path.join(root, d)
                if not os.path.islink(full):
                    with contextlib.suppress(OSError):
                        os.chmod(full, 0o700)
        shutil.rmtree(path, ignore_errors=True)


def _empty_cgroup(path: Path, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)
    with contextlib.suppress(OSError):
        path.rmdir()


def spawn(iso: Isolation, argv: Sequence[str], *, fds: Sequence[int] = (), stdin: int | None = None,
          stdout: int | None = None, stderr: int | None = None, max_procs: int = 64,
          tmp_bytes: int = 64 << 20, runner: str, workdir: str | None = None) -> Spawned:  # fmt: skip
    """Start ``argv`` (an interpreter command; the runner is at :data:`RUNNER_PATH` in the sandbox,
    at ``runner`` without isolation) in a sandbox.

    Args:
        iso: :func:`isolation`'s answer.
        argv: the command; ``"{runner}"`` in it becomes the runner's path.
        fds: descriptors the process inherits under the same numbers (pipes, memfds).
        stdin, stdout, stderr: descriptors for 0 / 1 / 2 (None: ``/dev/null``).
        max_procs: processes (threads included) the sandbox may hold at once (``pids.max``).
        tmp_bytes: size of the private ``/tmp``.
        runner: the runner's path on this machine.
        workdir: without isolation, the working directory, home and temp dir (:func:`workdir`);
            removed by :meth:`Spawned.finish`.
    """
    inside = RUNNER_PATH if iso.tool == "bubblewrap" else runner
    argv = [a.replace("{runner}", inside) for a in argv]
    cgroup = None
    if iso.tool == "bubblewrap":
        cmd = [iso.bwrap, *bwrap_args(tmp_bytes=tmp_bytes, runner=runner), *argv]
        if iso.process_limit == "cgroup":
            root = _cgroup_root()
            if root is not None:
                cgroup = root / f"run-{os.getpid()}-{uuid.uuid4().hex[:12]}"
                cgroup.mkdir()
                (cgroup / "pids.max").write_text(f"{max_procs + 2}\n")  # + bwrap's own two processes
                cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *cmd]
    else:
        cmd = list(argv)
    env = _env()
    if iso.tool != "bubblewrap":
        if workdir is None:
            raise ValueError("workdir: expected a directory for a run without isolation, got None")
        env.update(HOME=workdir, TMPDIR=workdir, TMP=workdir, TEMP=workdir)
    devnull = subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdin=devnull if stdin is None else stdin, stdout=devnull if stdout is None else stdout,
                                stderr=devnull if stderr is None else stderr, pass_fds=tuple(fds), env=env,
                                cwd="/" if iso.tool == "bubblewrap" else workdir, start_new_session=True)  # fmt: skip
    except BaseException:
        if cgroup is not None:
            _empty_cgroup(cgroup)
        raise
    return Spawned(proc, cgroup, workdir if iso.tool != "bubblewrap" else None)


@contextlib.contextmanager
def memfd(name: str, data: bytes = b"") -> Iterator[int]:
    """An anonymous in-memory file holding ``data`` (offset 0), closed on exit."""
    fd = os.memfd_create(name, 0)
    try:
        if data:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


def read_fd(fd: int, limit: int) -> bytes:
    """The first ``limit`` bytes of a memfd / file descriptor's content (from offset 0)."""
    size = os.fstat(fd).st_size
    return os.pread(fd, min(size, limit), 0) if size else b""
