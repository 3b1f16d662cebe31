"""A warm launcher for the tests' multi-rank runs: ranks forked from one process that has
already imported torch, transformers, vLLM and the trainers.

Why: on the 2-core CI machines most of a short end-to-end case is process start-up, not its
work. A 2-rank ``torchrun`` of ``fsdp-rlhf ppo`` pays for the agent's torch import and, in each
rank, torch, DTensor, transformers and vLLM (about 26 CPU-seconds before the first step;
benchmarks/2026-11-27-make-test-startup.md). Here one server imports all of that once per test
session; each case's ranks are ``fork()``\\ ed from it, so they start with the imports done and
pay only for their own work.

What a case gets is what ``torchrun --nproc_per_node N -m fsdp_rlhf.cli ...`` gives its ranks:

- the environment torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK``, ``ROLE_*``, ``MASTER_ADDR``/``MASTER_PORT`` on a fresh port, the
  ``TORCHELASTIC_*`` variables, ``OMP_NUM_THREADS=1`` for several ranks), over the caller's;
- the agent's store: a ``TCPStore`` served by the case's agent process on ``MASTER_PORT``, with
  ``TORCHELASTIC_USE_AGENT_STORE=True``, so ``init_process_group`` and the exit report
  (fsdp_rlhf/distributed/exit_report.py) find it as under torchrun;
- torchrun's ending: the first rank to fail (a non-zero code or a signal) has the others sent
  SIGTERM, then SIGKILL after 30 s; the case's code is 0, or 1 when any rank failed, and
  torchrun's own report of the failed ranks (its ChildFailedError message) goes to stderr;
- the real code path: ``fsdp_rlhf.cli`` run as ``__main__`` (runpy), real gloo, in-process vLLM.

What each forked rank resets from the server's state (nothing carries from one case to the
next: every case forks from the server, which only ever imported modules): the environment
(replaced by the case's), the working directory, ``sys.argv`` / ``sys.orig_argv``, stdin /
stdout / stderr (the caller's files), the signal handlers Python installs (SIGINT, SIGTERM,
SIGCHLD, SIGPIPE back to a fresh interpreter's), the random generators (Python's ``random`` is
reseeded by CPython at fork, numpy's and torch's default generator from the OS here, as at
start-up) and the intra-op thread count from ``OMP_NUM_THREADS`` (libgomp read the
variable when torch loaded, in the server). Forking after these imports is safe here: the
server runs no torch op (no OpenMP pool exists), and its only other threads are OpenBLAS's
idle servers (numpy, OpenCV), which OpenBLAS stops and restarts around ``fork``.

What cannot be reset is what a library computed from the environment while the server
imported it. So a case whose environment differs from the server's in a variable read at
import (``LD_PRELOAD``, ``PYTHONPATH``, ``VLLM_*``, ``TORCH*``, ``OMP_*``, ``HF_*``...: the
prefixes in :data:`IMPORT_TIME`) is run by real ``torchrun`` instead, and says so on stderr.
The server starts with tcmalloc preloaded and the CLI's quiet-library settings applied, as
every CLI process re-executes itself with them before its heavy imports
(fsdp_rlhf.allocator, fsdp_rlhf.cli.quiet_libraries).

``FSDP_RLHF_TEST_LAUNCHER=torchrun`` runs every case under real torchrun (and gloo-rank
functions spawned as before): a case that fails one way must fail the other
(docs/testing.md shows one).

Protocol: the client (the test process) connects to the server's Unix socket and sends a
length-prefixed JSON request with its stdin/stdout/stderr descriptors (SCM_RIGHTS); the server
forks an agent for it and goes back to listening. The agent forks the ranks, watches them and
the connection (a closed connection, as on a test's timeout, kills the case), and answers with
the exit code.
"""

from __future__ import annotations

import array
import contextlib
import gc
import importlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MODE_VAR = "FSDP_RLHF_TEST_LAUNCHER"  # "warm" (default) or "torchrun"
# What the server imports: everything a rank of any command needs before its first step.
PRELOAD = (
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "datasets",
    "peft",
    "safetensors.torch",
    "fsdp_rlhf.cli",
    "fsdp_rlhf.trainers.ppo",
    "fsdp_rlhf.trainers.offline.sft",
    "fsdp_rlhf.trainers.offline.dpo",
    "fsdp_rlhf.trainers.offline.rm",
    "fsdp_rlhf.doctor",
    "fsdp_rlhf.rollout.vllm.engine",
    "tests.dist_utils",
)
# Variables some library reads while it is imported (in the server, once): a case that sets
# one of these differently runs under real torchrun. Names are matched by prefix.
IMPORT_TIME = (
    "LD_",
    "PYTHON",
    "VLLM_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "TRANSFORMERS_",
    "HF_",
    "OMP_",
    "KMP_",
    "MKL_",
    "GOMP_",
    "OPENBLAS_",
    "CUDA_",
    "TCMALLOC_",
    "FSDP_RLHF_TCMALLOC",
    "TOKENIZERS_",
    "WANDB_",
)
# ...but these are torchrun's own or read when used, never at import.
RUN_TIME = (
    "OMP_NUM_THREADS",  # applied per rank with torch.set_num_threads
    "TORCHELASTIC_",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_CACHE",
    "PYTHONUNBUFFERED",
)
STOP_GRACE_S = 30.0  # torchrun: SIGTERM, then SIGKILL after 30 s
POLL_S = 0.1  # torchrun's default --monitor-interval


def mode() -> str:
    return os.environ.get(MODE_VAR, "warm")


# --------------------------------------------------------------------------- the environment


def cli_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a ``python -m fsdp_rlhf.cli`` process has when its heavy imports start:
    the quiet-library defaults set, tcmalloc preloaded by the re-exec where it would be."""
    from fsdp_rlhf.allocator import find_tcmalloc, gpu_visible, reexec_env

    env = dict(environ)
    for key, value in _QUIET.items():
        env.setdefault(key, value)
    return reexec_env(env, find_tcmalloc(), gpu_visible()) or env


_QUIET = {  # fsdp_rlhf.cli.quiet_libraries (kept equal by tests/unit/test_warm_launch.py)
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
}


def _import_time(key: str) -> bool:
    return key.startswith(IMPORT_TIME) and not key.startswith(RUN_TIME)


def import_time_differences(
    server: Mapping[str, str], case: Mapping[str, str], added: Mapping[str, str] | None = None
) -> list[str]:
    """The variables read at import whose values differ between the server's environment
    (before its imports) and a case's (sorted names; empty when the case can fork from the
    server). A value the server's imports set themselves (``added``) is no difference: a
    process that has imported those libraries, as the test process often has (vLLM sets
    TORCHINDUCTOR_CACHE_DIR), passes it on, and a fresh rank importing them would set it."""
    added = added or {}
    keys = {k for k in (*server, *case) if _import_time(k)}
    return sorted(
        k for k in keys if case.get(k) != server.get(k) and (k not in added or case[k] != added[k])
    )


def torchrun_env(
    base: Mapping[str, str], nproc: int, port: int, run_dir: str
) -> list[dict[str, str]]:
    """Each local rank's environment as ``torchrun --nproc_per_node nproc --master_addr
    127.0.0.1 --master_port port`` (static rendezvous, one node) sets it over ``base``."""
    shared = {
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": str(nproc),
        "WORLD_SIZE": str(nproc),
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    out = []
    for rank in range(nproc):
        env = {**base, **shared, "RANK": str(rank), "ROLE_RANK": str(rank)}
        env["LOCAL_RANK"] = str(rank)
        env["TORCHELASTIC_ERROR_FILE"] = os.path.join(run_dir, str(rank), "error.json")
        if nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        out.append(env)
    return out


# ------------------------------------------------------------------------------- the wire


def _send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(frame)


def _recv(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the descriptors sent with it; (None, []) when the peer closed."""
    fds: list[int] = []
    buf = b""
    while len(buf) < 4:
        if max_fds and not fds:
            chunk, fds = _recv_fds(sock, 4 - len(buf), max_fds)
        else:
            chunk = sock.recv(4 - len(buf))
        if not chunk:
            return None, fds
        buf += chunk
    (size,) = struct.unpack("!I", buf)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


def _recv_fds(sock: socket.socket, size: int, max_fds: int) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    msg, ancdata, _, _ = sock.recvmsg(size, socket.CMSG_LEN(max_fds * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return msg, list(fds)


# ----------------------------------------------------------------------------- the server


def serve(path: str, parent: int) -> None:
    """Import everything (:data:`PRELOAD`), then fork an agent for every connection on the Unix
    socket ``path`` until the process ``parent`` (the test session) is gone."""
    base_env = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    for name in _model_modules():
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # what the imports set in the environment (vLLM's inductor settings, for one): a fresh
    # process that imports them has these too
    added = {k: v for k, v in os.environ.items() if base_env.get(k) != v}
    # the imported modules' objects live as long as a rank: out of the collector's sight, a
    # rank's collections scan only its own objects (as a fresh process's would) and do not
    # touch, so copy, the server's pages
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # connectable only once everything is imported
    listener.listen(16)
    listener.settimeout(1.0)
    while os.getppid() == parent:
        _reap()  # finished agents (waited for: their CPU time counts as the session's)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            try:
                code = _agent(conn, base_env, added)
            except BaseException:  # noqa: BLE001 - the agent must never return into the loop
                import traceback

                traceback.print_exc()
                code = 70
            os._exit(code)
        conn.close()


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _model_modules() -> list[str]:
    """The transformers model code the tests' tiny families load (imported lazily otherwise)."""
    families = (
        "qwen2",
        "qwen3",
        "llama",
        "qwen3_moe",
        "qwen2_moe",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
    )
    return [f"transformers.models.{f}.modeling_{f}" for f in families]


def _agent(conn: socket.socket, base_env: dict[str, str], added: dict[str, str]) -> int:
    """One case: read the request, fork its ranks, watch them and the connection, answer."""
    os.setpgid(0, 0)  # the case's processes form one group, killed together
    conn.settimeout(None)
    request, fds = _recv(conn, max_fds=3)
    if request is None:
        return 0
    stdin, stdout, stderr = fds
    if request["kind"] == "info":
        _send(conn, {"added": added})
        return 0
    env = dict(request["env"])
    differ = import_time_differences(base_env, env, added)
    if differ:
        _send(conn, {"fallback": f"the case sets {', '.join(differ)} differently"})
        return 0
    env.update(added)
    nproc = int(request["nproc"])
    run_dir = tempfile.mkdtemp(prefix="warm_case_")
    store = None
    if request["kind"] == "torchrun":
        from torch.distributed import TCPStore

        port = int(request["port"])
        # the agent's store, as torchrun's static rendezvous serves it to its workers
        store = TCPStore("127.0.0.1", port, nproc, is_master=True, wait_for_workers=False)
        envs = torchrun_env(env, nproc, port, run_dir)
    else:
        envs = [dict(env) for _ in range(nproc)]
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _rank(request, rank, envs[rank], (stdin, stdout, stderr))
        pids[pid] = rank
    # torchrun reports failed ranks and exits 1; one plain process exits with its own code
    report = request.get("name", "fsdp_rlhf.cli") if request["kind"] == "torchrun" else None
    codes = _watch(pids, conn, stderr, report, run_dir)
    del store
    shutil.rmtree(run_dir, ignore_errors=True)  # the ranks' error files, read by the report
    ranks = [codes[r] for r in range(nproc)]
    if request["kind"] == "single":
        returncode = ranks[0]
    else:
        returncode = 1 if any(ranks) else 0
    _send(conn, {"returncode": returncode, "ranks": ranks})
    return 0


def _watch(
    pids: dict[int, int], conn: socket.socket, stderr: int, name: str | None, run_dir: str
) -> dict[int, int]:
    """torchrun's monitor: poll the ranks; the first failure stops the others (SIGTERM, then
    SIGKILL after :data:`STOP_GRACE_S`) and, with a ``name``, is reported as torchrun reports it
    (its ChildFailedError message: the ranks found failed at that poll); a closed connection
    kills them all at once."""
    codes: dict[int, int] = {}
    failed: dict[int, tuple[int, int]] = {}  # rank -> (pid, code), as torchrun saw them
    stop_at = None
    conn.setblocking(False)
    while len(codes) < len(pids):
        for pid, rank in pids.items():
            if rank in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)
                if codes[rank] != 0 and stop_at is None:
                    failed[rank] = (pid, codes[rank])
        if stop_at is None and failed:
            _signal_all(pids, codes, signal.SIGTERM)
            stop_at = time.monotonic() + STOP_GRACE_S
        if stop_at is not None and time.monotonic() > stop_at:
            _signal_all(pids, codes, signal.SIGKILL)
        try:
            if conn.recv(1) == b"":  # the caller is gone (a timeout): end the case now
                _signal_all(pids, codes, signal.SIGKILL)
        except BlockingIOError:
            pass
        time.sleep(POLL_S)
    conn.setblocking(True)
    if failed and name is not None:
        os.write(stderr, _failure_report(name, failed, run_dir).encode())
    return codes


def _failure_report(name: str, failed: dict[int, tuple[int, int]], run_dir: str) -> str:
    """What torchrun prints when ranks fail: its own ChildFailedError message."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    failures = {
        rank: ProcessFailure(rank, pid, code, os.path.join(run_dir, str(rank), "error.json"))
        for rank, (pid, code) in failed.items()
    }
    message = ChildFailedError(name, failures).format_msg()
    return f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: {message}\n"


def _signal_all(pids: dict[int, int], codes: dict[int, int], sig: int) -> None:
    for pid, rank in pids.items():
        if rank not in codes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def _rank(request: dict, rank: int, env: dict[str, str], fds: tuple[int, int, int]) -> None:
    """A forked rank: become a fresh process of the case (see the module docstring), run it,
    and leave with its code (never returns)."""
    code = 1
    try:
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        _fresh_process(env, request["cwd"], request["argv"])
        code = _run(request, rank)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # noqa: BLE001 - as an uncaught exception ends a fresh process
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        _finish(code)


def _fresh_process(env: dict[str, str], cwd: str, argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = list(argv)
    sys.orig_argv = [sys.executable, *argv]
    import numpy as np
    import torch

    np.random.seed()
    torch.seed()  # a fresh process's default generator starts from a random seed
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _run(request: dict, rank: int) -> int:
    import runpy

    if request["kind"] == "call":  # a function of the tests on gloo ranks (tests.dist_utils)
        module, _, name = request["call"].partition(":")
        getattr(importlib.import_module(module), name)(rank)
        return 0
    argv = request["argv"]
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv[0] == "-m":
        sys.argv = ["-m", *argv[2:]]
        _unimport(argv[1])
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")
    return 0


def _unimport(module: str) -> None:
    """A fresh ``python -m package.module`` has not imported the module itself (it runs as
    ``__main__`` only); the server imported it for its dependencies."""
    sys.modules.pop(module, None)
    parent, _, child = module.rpartition(".")
    if parent and parent in sys.modules and hasattr(sys.modules[parent], child):
        delattr(sys.modules[parent], child)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """Python's own ending of a process: wait for non-daemon threads, run atexit, flush."""
    import atexit
    import threading

    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- the client


@dataclass
class Server:
    """The test session's server: its process and socket."""

    proc: subprocess.Popen
    path: str
    log: str

    def ready(self, timeout: float = 600.0) -> bool:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def stop(self) -> None:
        """End the server; its folder goes with it unless it had ended by itself (its log then
        says why, and the fallback lines name it)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


_server: Server | None = None


def start_server(repo: Path) -> Server:
    """Start the session's server in the background (its imports take a while: a case that
    needs it waits in :func:`launch`). Idempotent."""
    global _server
    if _server is not None:
        return _server
    import atexit

    folder = tempfile.mkdtemp(prefix="fsdp_rlhf_warm_")
    path = os.path.join(folder, "server.sock")
    log = os.path.join(folder, "server.log")
    env = cli_env(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(repo), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsdp_rlhf.testing.warm_launch", path, str(os.getpid())],
            cwd=repo,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    _server = Server(proc, path, log)
    atexit.register(_server.stop)
    return _server


def imports_added() -> dict[str, str]:
    """The variables the server's imports set in its environment (every case gets them)."""
    server = start_server(Path.cwd())
    if not server.ready():
        raise Fallback(f"its server did not start: {server.log}")
    with open(os.devnull, "rb") as devnull, socket.socket(socket.AF_UNIX) as sock:
        sock.connect(server.path)
        _send(sock, {"kind": "info"}, [devnull.fileno()] * 3)
        answer, _ = _recv(sock)
    return dict(answer["added"])


class Fallback(Exception):
    """The case cannot fork from the server (the reason is the message): run it for real."""


# this test process's cases that ran without the server, and why (the session's summary)
FALLBACKS: list[str] = []


def note_fallback(what: str, why: Fallback) -> str:
    """Remember a case that runs without the server (listed at the session's end; the case's
    own output stays as the process writes it: tests read its lines); the line to log."""
    FALLBACKS.append(f"{what}: {why}")
    return f"warm launcher: this case runs without it ({why})"


def launch(
    kind: str,
    argv: list[str],
    env: Mapping[str, str],
    cwd: str,
    nproc: int,
    timeout: float | None,
    stdout: int,
    stderr: int,
    call: str = "",
    port: int | None = None,
) -> int:
    """Run one case on the session's server; returns its exit code (torchrun's, 0 or 1, or a
    single process's own).

    ``kind``: ``"torchrun"`` (``argv`` after ``python``, ranks as torchrun starts them),
    ``"single"`` (one process, the environment as given) or ``"call"`` (``call`` names a
    ``module:function`` taking the rank; the environment as given, per rank). Every kind's
    environment gets what a CLI process sets before its heavy imports (:func:`cli_env`).
    Raises :class:`Fallback` when the case must run without the server, and
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds (the case is killed).
    """
    server = start_server(Path(cwd))
    if not server.ready():
        raise Fallback(f"its server did not start: {server.log}")
    from fsdp_rlhf.distributed.env import free_port

    request = {
        "kind": kind,
        "argv": list(argv),
        "env": cli_env(env),
        "cwd": str(cwd),
        "nproc": nproc,
        "call": call,
        "port": port if port is not None else free_port(),
        "name": argv[1] if argv[:1] == ["-m"] else (argv[0] if argv else call),
    }
    with open(os.devnull, "rb") as devnull, socket.socket(socket.AF_UNIX) as sock:
        sock.connect(server.path)
        _send(sock, request, [devnull.fileno(), stdout, stderr])
        sock.settimeout(timeout)
        try:
            answer, _ = _recv(sock)
        except TimeoutError:
            raise subprocess.TimeoutExpired(argv, timeout) from None
    if answer is None:
        raise RuntimeError(f"the warm launcher's agent ended without an answer ({server.log})")
    if "fallback" in answer:
        raise Fallback(answer["fallback"])
    return int(answer["returncode"])


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
