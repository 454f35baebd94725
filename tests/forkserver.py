"""Fork servers for the tests' Python processes: ``python script.py`` and ``python -m module``
without paying for ``import torch`` each time.

Half the slow tests' time went into starting interpreters: every run of a script, every torchrun
launcher and each of its workers imported torch (about 2 s of CPU here), and ran for less. A
server imports torch and trainer once, then forks a process per request, which sets up the
requested stdio, environment and working directory and runs the script or module as
``__main__``, as the interpreter would. The processes are real and separate: their own pids,
signals, exit statuses, gloo groups, crashes.

What a forked process cannot have of its own is the hash seed: the interpreter fixes it at
start, and every str hash already computed depends on it. So there are :data:`SERVERS` servers,
each a fresh interpreter started with its own random ``PYTHONHASHSEED``, and each request goes
to the next one in turn that no running process came from, never to the last request's: a
process never shares its seed with the one started just before it, nor with those running
beside it while they are ``SERVERS - 1`` or fewer, that one included (a torchrun launcher and
its two workers; two launchers of one worker each). A bug that depends on the order of a set or
a dict of strings differing between ranks or runs can show, as it would for users.
``TRAINER_TEST_HASHSEEDS=s0,s1,...`` gives the servers these seeds instead (a failed test's
report lists its processes' seeds and the value that replays them), and
``TRAINER_TEST_FORKSERVER=0`` runs every process from a fresh interpreter.

``ForkedPopen`` is a ``subprocess.Popen`` whose child comes from a server: ``communicate``,
``poll``, ``wait``, ``send_signal``, ``kill`` and ``returncode`` behave as Popen's. A child of
a server that starts processes (a torchrun launcher starting its workers) has them forked
by the servers too. A command the servers cannot run as asked (not this interpreter, options
other than ``-u``, an environment that differs in what the import already read) starts a
fresh interpreter as Popen does.

Run as ``python forkserver.py FOLDER INDEX``: serves ``FOLDER/INDEX.socket`` until its standard
input closes (the pytest process that started it ended).
"""

import fcntl
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys

ENV_FOLDER = "TRAINER_TEST_FORKSERVERS"  # the servers' folder: sockets, turn, records
# Enough for every process in the tests to differ in seed from all those running beside it: at
# most four run at once (a torchrun launcher and its two workers; two launchers of one each)
SERVERS = 4
# what the interpreter or the import of torch read at start, which a forked child cannot change
_FIXED_AT_START = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONHOME", "MKL_NUM_THREADS", "LD_PRELOAD")


def records_file(folder: str) -> str:
    """The file where the servers record each child they fork, a line each: ``pid requester
    server argv``, the requester being the process that the child stands for the child of
    (``conftest`` reads it), ``argv`` as JSON."""
    return os.path.join(folder, "children")


def socket_path(folder: str, index: int) -> str:
    return os.path.join(folder, f"{index}.socket")


def _running_file(folder: str, index: int) -> str:
    return os.path.join(folder, f"{index}.running")  # how many children of server index run


class ForkedPopen(subprocess.Popen):
    """``subprocess.Popen`` whose child, where it is ``sys.executable`` running a script or a
    module, is forked by a server of ``$TRAINER_TEST_FORKSERVERS``."""

    def _execute_child(self, *popen_args):
        # Popen's private signature, forwarded whole when a fresh interpreter must start
        args, executable, preexec_fn, _, pass_fds, cwd, env, _, _, shell = popen_args[:10]
        p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite = popen_args[10:16]  # the pipes
        # rest: restore_signals, gid, gids, uid, umask, start_new_session[, process_group]
        rest = popen_args[16:]
        request = _request(args, executable, preexec_fn, pass_fds, cwd, env, shell, rest)
        if request is None:
            self._conn = None
            return super()._execute_child(*popen_args)
        self.args = args
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1]
        fds.append(errwrite if errwrite != -1 else 2)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._buffer = b""
        folder = os.environ[ENV_FOLDER]
        try:
            # One request at a time, held until the server has recorded the child: the next
            # request then sees which servers have a process running.
            with open(os.path.join(folder, "turn"), "r+") as turn:
                fcntl.flock(turn, fcntl.LOCK_EX)
                server = _next_server(folder, int(turn.read()))
                turn.seek(0)
                turn.truncate()
                turn.write(str((server + 1) % SERVERS))
                turn.flush()
                self._conn.connect(socket_path(folder, server))
                payload = json.dumps(request).encode() + b"\n"
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _ints(fds))]
                self._conn.sendmsg([payload], ancillary)
                self.pid = int(self._read_line())
            self._child_created = True
        finally:  # the child's ends of the pipes, as Popen closes them
            for fd, other in ((p2cread, p2cwrite), (c2pwrite, c2pread), (errwrite, errread)):
                if fd != -1 and other != -1:
                    os.close(fd)
            devnull = getattr(self, "_devnull", None)
            if devnull is not None:
                os.close(devnull)

    def _read_line(self, timeout=None) -> str:
        while b"\n" not in self._buffer:
            if timeout is not None and not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the fork server dropped {self.args!r}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _set_status(self, line: str) -> None:
        self.returncode = os.waitstatus_to_exitcode(int(line))
        self._conn.close()

    def _internal_poll(self, *args, **kwargs):
        if self._conn is None:
            return super()._internal_poll(*args, **kwargs)
        if self.returncode is None and (
            b"\n" in self._buffer or select.select([self._conn], [], [], 0)[0]
        ):
            self._set_status(self._read_line())
        return self.returncode

    def _wait(self, timeout):
        if self._conn is None:
            return super()._wait(timeout)
        if self.returncode is None:
            self._set_status(self._read_line(timeout))
        return self.returncode


def _next_server(folder: str, turn: int) -> int:
    """The server whose turn it is, or the next after it with no process running, never the
    one before it (the last request's); ``turn``'s where all the others have one."""
    for index in [(turn + i) % SERVERS for i in range(SERVERS - 1)]:
        with open(_running_file(folder, index)) as f:
            if f.read() == "0":
                return index
    return turn


def _ints(values) -> bytes:
    return struct.pack(f"{len(values)}i", *values)


def _request(args, executable, preexec_fn, pass_fds, cwd, env, shell, rest):
    """What the server is asked to run, or None where only a fresh interpreter does as asked."""
    if not os.environ.get(ENV_FOLDER) or shell or executable or preexec_fn or pass_fds:
        return None
    restore_signals, gid, gids, uid, umask, start_new_session = rest[:6]
    if any(x is not None for x in (gid, gids, uid)) or umask != -1 or rest[6:7] not in ((), (-1,)):
        return None
    argv = [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes)) else args)]
    if argv[0] != sys.executable:
        return None
    options = argv[1:]
    unbuffered = options[:1] == ["-u"]
    options = options[1:] if unbuffered else options
    if not options or (options[0].startswith("-") and options[0] != "-m") or options == ["-m"]:
        return None
    env = dict(
        os.environ if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
    )
    if any(env.get(name) != os.environ.get(name) for name in _FIXED_AT_START):
        return None
    env[ENV_FOLDER] = os.environ[ENV_FOLDER]  # for the processes it starts
    return {
        "argv": options,
        "unbuffered": unbuffered,
        "env": env,
        "cwd": os.fsdecode(cwd) if cwd is not None else os.getcwd(),
        "new_session": bool(start_new_session),
    }


# ---- the server --------------------------------------------------------------------------------


def _serve(folder: str, index: int):
    """Forks a child per request; returns the request in each child, and never in the server."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path(folder, index))
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    waiting = {}  # pid -> the requester's connection, told the exit status
    _set_running(folder, index, 0)
    # one write a line, appended: the servers share the file
    record = os.open(records_file(folder), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    print("ready", flush=True)
    while True:
        try:
            ready = select.select([listener, sys.stdin, wake_r], [], [])[0]
        except InterruptedError:
            continue
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            return None  # pytest ended
        if wake_r in ready:
            os.read(wake_r, 4096)
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{status}\n".encode())
                except OSError:
                    pass  # the requester is gone
                conn.close()
            _set_running(folder, index, len(waiting))
        if listener in ready:
            conn, _ = listener.accept()
            request, fds = _receive(conn)
            credentials = conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
            )
            requester = struct.unpack("3i", credentials)[0]
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for held in (listener, conn, *waiting.values()):
                    held.close()  # this process's copies; the server keeps its own
                for fd in (record, wake_r, wake_w):
                    os.close(fd)
                return request, fds
            for fd in fds:
                os.close(fd)
            os.write(record, f"{pid} {requester} {index} {json.dumps(request['argv'])}\n".encode())
            waiting[pid] = conn
            _set_running(folder, index, len(waiting))
            conn.sendall(f"{pid}\n".encode())


def _set_running(folder: str, index: int, count: int) -> None:
    """Publish how many of this server's children run (read by :func:`_next_server`)."""
    path = _running_file(folder, index)
    with open(path + ".tmp", "w") as f:
        f.write(str(count))
    os.replace(path + ".tmp", path)  # whole: a reader never sees it half written


def _receive(conn):
    data, fds = b"", []
    while not data.endswith(b"\n"):
        msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4))
        if not msg:
            raise RuntimeError("a client hung up in mid-request")
        data += msg
        for level, kind, raw in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += struct.unpack(f"{len(raw) // 4}i", raw[: len(raw) // 4 * 4])
    return json.loads(data), fds


def _become(request, fds, default_threads):
    """In the forked child: the process the request asks for, up to running its code."""
    import torch

    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # stdio as a fresh interpreter sets it up (-u: unbuffered stdout and stderr)
    unbuffered = request["unbuffered"]
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), errors="strict")
    sys.stdout = _stream(1, unbuffered, "strict")
    sys.stderr = _stream(2, True, "backslashreplace", unbuffered)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    # the import read OMP_NUM_THREADS; torchrun sets it to 1 for its workers
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or default_threads))
    # a torchrun launcher's workers come from this server too
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    subprocess_handler.Popen = ForkedPopen
    return request["argv"]


def _stream(fd, line_buffered, errors, unbuffered=False):
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(
        io.BufferedWriter(raw),
        errors=errors,
        line_buffering=line_buffered or raw.isatty(),
        write_through=unbuffered,
    )


def _run(argv):
    import runpy

    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    # What the children import, each costing them from half a second to two: torch, trainer,
    # torch._dynamo (a torch optimizer's constructor imports it), FSDP2 and DCP (the sharded
    # tests), the torchrun launcher's modules (not torch.distributed.run itself, which runs as
    # __main__), scikit-learn (the examples).
    import torch
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401

    import trainer  # noqa: F401

    try:
        import sklearn.datasets  # noqa: F401
        import sklearn.model_selection  # noqa: F401
    except ImportError:  # the examples extra is not installed: their tests skip
        pass

    threads = torch.get_num_threads()
    job = _serve(sys.argv[1], int(sys.argv[2]))
    if job is not None:
        _run(_become(*job, threads))
