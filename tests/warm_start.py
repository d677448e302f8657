"""A warm start for the tests' runs: one process that has imported torch, DCP and TensorBoard (about 6 s of CPU
in every process, most of a tiny run's cost on two cores) and forks a process for each run asked of it, which
then runs a script as `python -u script args` would, from a clean state: its own session, environment, working
directory, arguments, signal handlers and output, and a sitecustomize module from its PYTHONPATH run first.

conftest.py starts it and talks to it over its stdin and stdout, a JSON object a line each way: a request
{"argv", "env", "cwd", "output"} is answered with {"pid"} once forked, and each such process's end with
{"pid", "returncode"} (negative: killed by that signal, as subprocess says). It ends when its stdin closes."""

import atexit
import gc
import io
import json
import os
import random
import runpy
import select
import signal
import sys
import traceback

# What the scripts import that costs time, directly or on first use (the optimizer imports the compiler), imported
# once here. Nothing runs: no thread, no computation, so a fork starts as a fresh process would, and a script's own
# imports find these already done. What they register to run at exit is noted: each fork runs it at its end.
at_exit, register = [], atexit.register
atexit.register = lambda function, *args, **kwargs: at_exit.append((function, args, kwargs)) or register(
    function, *args, **kwargs)
import torch
import torch._dynamo
import torch.distributed.checkpoint.state_dict
import torch.distributed.fsdp
import torch.distributed.pipelining
import torch.distributed.tensor.parallel
import torch.nn.attention.bias
import torch.utils.flop_counter
import torch.utils.tensorboard  # noqa: F401

atexit.register = register
# Out of the collector's sight: a fork that collects garbage would otherwise touch, and so copy, every page of these
# objects (2 s of a fork's end, against 0.6 s).
gc.freeze()


def end(status):
    """A fork's end once its own atexit functions ran: the imports' (noted above), as a fresh process runs them after
    its own, then its output flushed, and the exit. Python's own end, which would come next, tears down every module
    and destroys torch's C++ objects: 0.6 s a process, a third of a tiny run."""
    for function, args, kwargs in reversed(at_exit):
        try:
            function(*args, **kwargs)
        except Exception:  # noqa: BLE001 (as atexit does: printed, and the next one runs)
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status[0])


def run_script(argv, env, cwd, output):
    """In the forked process: become what `python -u argv[0] argv[1:]` would be, run the script, and exit as
    Python would (SystemExit's code, 1 after an uncaught exception's traceback)."""
    os.setsid()  # as subprocess's start_new_session, so that a test can kill it and its own processes at once
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # appends: each rank's lines land whole
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)  # as -u
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    for signum in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE}:
        try:
            signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    random.seed()  # a fork shares its parent's state: each run draws its own, as a fresh process does
    sys.argv = list(argv)
    paths = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    sys.path[:1] = [os.path.dirname(os.path.abspath(argv[0])), *paths]
    status = [1]
    atexit.register(end, status)  # before the script's own, so after them
    if any(os.path.exists(os.path.join(path, "sitecustomize.py")) for path in paths):
        import sitecustomize  # noqa: F401
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:  # Python's exit status for it: None 0, a number itself, else 1 (the message printed)
        status[0] = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        raise
    except BaseException:  # noqa: BLE001 (as Python does: the traceback, and exit 1)
        traceback.print_exc()
        sys.exit(1)
    status[0] = 0
    sys.exit(0)


def serve():
    """Fork a process for each request on stdin; report each one's end on stdout."""
    requests, replies = sys.stdin.buffer, sys.stdout
    children = set()
    while True:
        ready, _, _ = select.select([requests], [], [], 0.01)
        if ready:
            line = requests.readline()
            if not line:
                return
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os.close(requests.fileno())
                os.close(replies.fileno())
                run_script(**request)  # never returns: SystemExit ends this process
            children.add(pid)
            print(json.dumps({"pid": pid}), file=replies, flush=True)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                print(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}), file=replies,
                      flush=True)


if __name__ == "__main__":
    serve()
