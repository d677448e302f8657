"""Helpers for the tests: run a script as a user would (real processes, CPU and gloo; forked from a warm start where
nothing differs) and read back what it wrote: console output, TensorBoard scalars, checkpoints."""

import contextlib
import importlib.util
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["single_gpu.py", "dataparallel.py", "ddp_spawn.py", "ddp_torchrun.py", "ddp_amp.py", "fsdp.py", "pipeline.py",
           "tensor_parallel.py", "context_parallel.py"]
DISTRIBUTED = ["ddp_spawn.py", "ddp_torchrun.py", "ddp_amp.py", "fsdp.py", "pipeline.py", "tensor_parallel.py",
               "context_parallel.py"]
TORCHRUN = ["ddp_torchrun.py", "ddp_amp.py", "fsdp.py", "pipeline.py", "tensor_parallel.py", "context_parallel.py"]  # started by torchrun (or its old launch)
# The scripts that compute in fp32 (fsdp.py by default, pipeline.py always) and so reach single_gpu.py's numbers
# within PARAM_ATOL.
# ddp_amp.py computes in 16 bits: tests/test_amp.py holds it to fp32 within a bound that bf16's precision sets.
FP32 = [script for script in SCRIPTS if script != "ddp_amp.py"]
LAUNCHER = ROOT / "launch_distributed.sh"

# A tiny model and a short run: seconds on two shared cores, with gradient accumulation (so DDP's
# no_sync path runs), a checkpoint half-way, and a validation pass at steps 0, 8 and 16. tiny.txt holds
# 93 sequences of 16 bytes: 84 to train on, epochs of 10 steps, so a run resumes mid-epoch at 8 and
# then crosses an epoch boundary at 10; and 9 to validate on, of which the scripts keep the whole
# batch of 8. A seed other than 0, the default, shows a script that drops --seed somewhere.
STEPS = 16
TINY_BUILT_IN = ["--seq-len", "16", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--batch-size", "8",
                 "--grad-accum", "2", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "2", "--eval-every", "8",
                 "--ckpt-every", "8"]
TINY = [*TINY_BUILT_IN, "--data", str(ROOT / "tests" / "tiny.txt"), "--seed", "7"]

# Python warnings ("UserWarning: ..."), and log lines at warning or error level: c10's ("[W1121 ..." from a
# worker, "W1121 ..." from torchrun's agent) and torch's Python loggers' in a worker ("[rank0]:W1121 ..."); but two
# of torch's that no script can act on: Inductor's word on the machine where a CUDA build of torch (pip's default)
# runs without a GPU beside a CUDA toolkit ("No CUDA runtime is found, using CUDA_HOME=..."), and torch 2.14's
# compiler calling a function of its own that it deprecated ("is_opaque_value is deprecated", in partitioners.py).
WARNING = re.compile(r"Warning|^(?:\[rank\d+\]:)?\[?[WE]\d{4} (?!.*(?:No CUDA runtime is found|is_opaque_value is "
                     r"deprecated))", re.MULTILINE)

# Two tiers. `python -m pytest tests` runs the smoke tier, the tests marked `smoke`: every script trains, its loss
# falls, it checkpoints and resumes exactly, and the distributed ones reach single_gpu.py's weights, in a few
# minutes. `--full` runs every test, as CI does. A test file or test named on the command line runs whatever its tier.
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="run every test, not only the smoke tier")


def pytest_configure(config):
    config.addinivalue_line("markers", "smoke: in the smoke tier, which runs without --full")


def pytest_collection_modifyitems(config, items):
    named = any(Path(arg.split("::")[0]).is_file() for arg in config.args)
    if config.getoption("--full") or named:
        return
    config.hook.pytest_deselected(items=[item for item in items if not item.get_closest_marker("smoke")])
    items[:] = [item for item in items if item.get_closest_marker("smoke")]


def pytest_report_header(config):
    if config.getoption("--full"):
        return "tier: every test (--full)"
    return "tier: smoke, or every test of the files named (--full runs every test)"


@dataclass
class Run:
    returncode: int | None  # None: killed when it ran past its timeout
    output: str  # stdout and stderr, interleaved as a user sees them
    seconds: float


def command(script, nproc=2, python=sys.executable):
    """How a user starts each script (a file here, or a changed copy elsewhere): torchrun for those in
    TORCHRUN, plain python for the rest."""
    path, name = str(ROOT / script), Path(script).name
    if name in TORCHRUN:
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", path]
    if name == "ddp_spawn.py":
        return [python, path, "--nproc", str(nproc)]
    return [python, path]


def run(script, *args, nproc=2, timeout=180, cwd=None, env=None):
    """Run a script to completion. A hang fails the test after `timeout` seconds, and the whole
    process group is killed so that no worker outlives it. From a warm start (`warm`) where nothing in `env`
    acts before Python runs its first line."""
    if any(name.startswith(COLD) and name != "PYTHONPATH" for name in env or {}):
        return run_command(command(script, nproc) + [str(a) for a in args], env=env, timeout=timeout, cwd=cwd)
    return warm(script, *args, nproc=nproc, timeout=timeout, cwd=cwd, env=env)


# What a process reads before its first line of Python or while torch is imported (an allocator's settings, torch's
# logs, threads): a run with these in its environment starts cold, as the user's does. PYTHONPATH's sitecustomize
# runs in a warm start too.
COLD = ("MALLOC_", "LD_", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "NCCL", "GLOO", "PYTHON")


class WarmStart:
    """tests/warm_start.py, a process that has imported what every script imports and forks one process a run.
    Started at the first run that asks for it; ends with the tests."""
    started = None

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "warm_start.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=environment(), cwd=ROOT)
        self.pending, self.ended = b"", {}

    @classmethod
    def get(cls):
        if cls.started is None or cls.started.proc.poll() is not None:
            cls.started = cls()
        return cls.started

    def message(self, timeout):
        """The next line it writes, as a dict; None after `timeout` seconds without one."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            assert chunk, f"tests/warm_start.py ended: {self.proc.wait()}"
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def start(self, argv, env, cwd, output):
        """Fork a process that runs `python -u argv[0] argv[1:]` in `env`, writing to the file `output`: its pid."""
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(cwd), "output": str(output)}).encode()
                              + b"\n")
        self.proc.stdin.flush()
        while "returncode" in (reply := self.message(60) or {"pid": None}):
            self.ended[reply["pid"]] = reply["returncode"]
        assert reply["pid"], "tests/warm_start.py forked nothing in 60 s"
        self.ended.pop(reply["pid"], None)  # an earlier process's, that had the same pid
        return reply["pid"]

    def wait(self, pids, timeout):
        """(pid, return code) of the first of `pids` to end, or None if all still run after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not (ended := [pid for pid in pids if pid in self.ended]):
            reply = self.message(max(0.0, deadline - time.monotonic()))
            if reply is None:
                return None
            self.ended[reply["pid"]] = reply["returncode"]
        return ended[0], self.ended.pop(ended[0])


def kill(pids, signum):
    """Send `signum` to each process of `pids` and to the processes it started (its session's group)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)  # forked, but not yet in a session of its own


def warm(script, *args, nproc=2, timeout=180, cwd=None, env=None):
    """Run a script as `run` does, each process forked from a warm start: torchrun's scripts as torchrun starts them
    (its variables, each rank's output to one place, the others stopped with SIGTERM, then SIGKILL 30 s later, once
    one fails, and 1 for any failure), saving torchrun's agent and 6 s of imports a process. The tests of what
    torchrun itself does (restarts, signals to the job, several nodes) run it."""
    starter, env = WarmStart.get(), environment(env)
    path, name = str(ROOT / script), Path(script).name
    ranks = [{}]
    if name in TORCHRUN:
        port = free_ports()[0]
        ranks = [{"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                  "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
                  "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                  "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                  "TORCHELASTIC_RUN_ID": "none"} for rank in range(nproc)]
    argv = [path, *map(str, args)] + (["--nproc", str(nproc)] if name == "ddp_spawn.py" else [])
    start = time.monotonic()
    with tempfile.NamedTemporaryFile("r") as output:
        pids = [starter.start(argv, {**env, **rank}, cwd or ROOT, output.name) for rank in ranks]
        returncodes, hang_at, kill_at = {}, start + timeout, float("inf")
        while running := [pid for pid in pids if pid not in returncodes]:
            ended = starter.wait(running, max(0.0, min(hang_at, kill_at) - time.monotonic()))
            if ended is None and time.monotonic() >= hang_at:
                kill(running, signal.SIGKILL)
                pytest.fail(f"{' '.join(argv)} ran past {timeout}s:\n{output.read()}")
            if ended is None:  # still running 30 s after the SIGTERM
                kill(running, signal.SIGKILL)
                kill_at = float("inf")
                continue
            returncodes[ended[0]] = ended[1]
            if ended[1] != 0 and kill_at == float("inf") and len(running) > 1:
                kill([pid for pid in running if pid != ended[0]], signal.SIGTERM)
                kill_at = time.monotonic() + 30
        result = list(returncodes.values())
        returncode = result[0] if len(result) == 1 else int(any(result))
        return Run(returncode, output.read(), time.monotonic() - start)


def free_ports(count=1):
    """Ports nobody listens on, all different: each socket stays bound until every port is picked."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def injected(directory, code):
    """An environment whose Python processes run `code` at start-up (a sitecustomize module in `directory`):
    how the tests break or slow one process without a test hook in the scripts."""
    (Path(directory) / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": str(directory)}


def launch(*args, env=None, timeout=180, cwd=None):
    """Run launch_distributed.sh with `args`, and `env` added to this environment."""
    return run_command([str(LAUNCHER)] + [str(a) for a in args], env=env, timeout=timeout, cwd=cwd)


# What would change what the launcher does: the tests set these themselves, or run outside any allocation.
LAUNCH_SETTINGS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "RDZV_ID", "JOIN_TIMEOUT",
                   "MAX_RESTARTS", "SHUTDOWN_TIMEOUT", "PYTHON")


def environment(env=None):
    """This environment without a SLURM allocation's or the launcher's settings, plus `env`. Two cores are
    shared by every rank, the interpreter running the tests is the one the launcher finds, and no GPU is used:
    the tests check CPU and gloo."""
    own = {name: value for name, value in os.environ.items()
           if not name.startswith(("SLURM_", "SBATCH_", "SRUN_")) and name not in LAUNCH_SETTINGS}
    env = {**own, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def run_command(argv, env=None, timeout=180, cwd=None, fail_on_hang=True):
    """Run a command to completion. One that runs past `timeout` seconds is killed, with every process it started,
    and fails the test; or, without fail_on_hang, returns with returncode None."""
    env = environment(env)
    env.setdefault("LAUNCH_TEST_TAG", f"{os.getpid()}-{time.monotonic_ns()}")
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd or ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc, env["LAUNCH_TEST_TAG"])
        output, _ = proc.communicate()
        if fail_on_hang:
            pytest.fail(f"{' '.join(map(str, argv))} ran past {timeout}s:\n{output}")
        return Run(None, output, time.monotonic() - start)
    return Run(proc.returncode, output, time.monotonic() - start)


def tagged_processes(tag):
    """{pid: environment} of the processes started with LAUNCH_TEST_TAG=tag, which every descendant
    inherits: torchrun starts its workers in sessions of their own, where a process group would miss them."""
    def environ(pid):
        try:
            items = (Path("/proc") / pid / "environ").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return {}  # exited while we looked, or not ours to read
        return dict(item.split("=", 1) for item in items if "=" in item)

    found = {int(p.name): environ(p.name) for p in Path("/proc").glob("[0-9]*")}
    return {pid: env for pid, env in found.items() if env.get("LAUNCH_TEST_TAG") == tag}


def kill_all(proc, tag):
    """Kill a job that hangs: its process group, and the torchrun workers that live in sessions of their own."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in tagged_processes(tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Killed:
    run: Run
    resumed_after: float | None  # seconds from the kill to the restarted run's "resumed from" line


def kill_a_worker(argv, checkpoint, env=None, timeout=240):
    """Start a torchrun job, SIGKILL its local rank 1 as soon as `checkpoint` exists, and let it finish."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    with tempfile.TemporaryFile("w+") as log:
        start = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, env=environment({**(env or {}), "LAUNCH_TEST_TAG": tag}), stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        killed_at = resumed_at = None
        try:
            while proc.poll() is None and time.monotonic() < start + timeout:
                if killed_at is None and Path(checkpoint).exists():
                    workers = [pid for pid, e in tagged_processes(tag).items() if e.get("LOCAL_RANK") == "1"]
                    assert len(workers) == 1, workers
                    os.kill(workers[0], signal.SIGKILL)
                    killed_at = time.monotonic()
                log.seek(0)
                if killed_at and resumed_at is None and "resumed from" in log.read():
                    resumed_at = time.monotonic()
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                kill_all(proc, tag)  # ran past the timeout: a hang
            proc.wait()
        log.seek(0)
        output = log.read()
    assert killed_at is not None, f"{checkpoint} never appeared:\n{output}"
    return Killed(Run(proc.returncode, output, time.monotonic() - start), resumed_at and resumed_at - killed_at)


def import_script(script):
    """A script as a module, to call its functions: its main() runs only as a program."""
    spec = importlib.util.spec_from_file_location(script[:-3], ROOT / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scalars(log_dir):
    """Every TensorBoard scalar under log_dir, as {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def checkpoints(ckpt_dir):
    """The complete checkpoints in ckpt_dir (those with DCP's .metadata, written last), oldest first."""
    return sorted(path.parent for path in Path(ckpt_dir).glob("step-*/.metadata"))


def load(ckpt_dir):
    """The newest complete checkpoint in ckpt_dir (or a checkpoint directory itself) as one state dict, converted
    by torch's own dcp_to_torch_save, which the README shows (in this process: the command costs seconds)."""
    path = Path(ckpt_dir) if (Path(ckpt_dir) / ".metadata").exists() else checkpoints(ckpt_dir)[-1]
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "checkpoint.pt")
        return torch.load(Path(tmp) / "checkpoint.pt", weights_only=True)


def adam_state(state):
    """{name: tensor} of the AdamW moments and steps in a loaded checkpoint (its optimizer state, flattened)."""
    return {key: value for key, value in state["optimizer"].items() if key.startswith("state.")}


# Where the scripts may differ at all, they differ only in the order of fp32 additions: a gradient summed as two
# per-rank halves, then averaged, rounds differently from one sum over the batch (about 1e-7 relative), and
# tensor_parallel.py sums each matrix product in parts, one a rank. Why 16 steps of the GPT keep that small on any
# CPU: no decision in it can flip (GELU, softmax and LayerNorm are smooth; no ReLU, max or argmax in training), so
# nothing takes another path; and AdamW grows a rounding difference most in its first steps, where it divides a
# gradient by its own size, g / (|g| + 1e-8): a gradient that sums to near zero from terms of 1e-4 keeps their
# rounding, 1e-11, and the learning rate, 1e-2, times 1e-11 / 1e-8 moves a weight by 1e-5, in steps 1 and 2 (then
# flat). Seen at step 16: 1.3e-5 in tensor_parallel.py with torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2), 7.8e-6
# with its AVX-512 ones, 3.0e-6 unvectorised; the other scripts 3.4e-6 at most. A real error moves weights by a step's
# update, about the learning rate: a step, a sample or a rate lost or taken twice lands at 1e-3 or more. A model with
# ReLU or max pooling needs a bound of its own (tests/test_your_model.py).
PARAM_ATOL = 5e-5


def assert_identical(got, expected, where="checkpoint"):
    """Two loaded checkpoints (or parts of one) hold the same keys and the same values, bit for bit."""
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_identical(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), where
    else:
        assert got == expected, where


def max_param_diff(a, b):
    """Largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


@dataclass
class Trained:
    run: Run
    ckpt_dir: Path
    log_dir: Path


class Runs(dict):
    """{script: Trained}, each script run once, when a test first asks for it: one training run per script and
    configuration, shared by every test that reads it."""

    def __init__(self, tmp_path_factory, *flags):
        super().__init__()
        self.tmp_path_factory, self.flags = tmp_path_factory, flags

    def __missing__(self, script):
        out = self.tmp_path_factory.mktemp(script[:-3])
        result = run(script, *TINY, *self.flags, "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb")
        self[script] = Trained(result, out / "ckpt", out / "tb")
        return self[script]


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Each script trained for STEPS steps on the same config, with a checkpoint at the end."""
    return Runs(tmp_path_factory, "--max-steps", STEPS)


HALF = STEPS // 2


@pytest.fixture(scope="session")
def halfway(tmp_path_factory):
    """The first HALF steps of `trained`'s run (the schedule still set for STEPS), with a checkpoint at HALF: where
    the tests that resume start. Copy the checkpoint directory (`resume_in`) before training on from it."""
    return Runs(tmp_path_factory, "--max-steps", HALF, "--lr-decay-steps", STEPS)


@pytest.fixture(scope="session")
def llamas(tmp_path_factory):
    """The Llama-shaped model of tests/test_your_model.py, trained once in each script a test asks for."""
    from test_your_model import LlamaRuns

    return LlamaRuns(tmp_path_factory)


def resume_in(run, directory):
    """A copy of `run`'s checkpoint directory at `directory`, to resume in: the shared run stays as it was."""
    assert run.run.returncode == 0, run.run.output
    shutil.copytree(run.ckpt_dir, directory)
    return directory


def error_lines(script, output):
    """Each `script: error: ...` line in `output`, also where two processes' lines met on one: Python writes a
    SystemExit's message and its newline apart, so another process's message can land between the two."""
    return [part.split("\n", 1)[0] for part in re.split(rf"(?={re.escape(script)}: error: )", output)[1:]]


def fails_cleanly(script, args, message, timeout=180, flags=TINY, nproc=2, env=None):
    """Run `script` with `args`, which it must refuse: a non-zero exit, a line `script: error: ...` (or argparse's
    `script: error: argument ...`) that holds `message`, and no traceback of the script's own code (torchrun's agent
    reports a failed worker with its own traceback, which names the script's file only as a path). A refusal takes
    a start-up, 7 to 20 s under torchrun on 2 busy cores: `timeout` leaves room for a machine several times slower."""
    with tempfile.TemporaryDirectory() as tmp:  # not runs/ in the repository; a test's own --log-dir comes later
        result = run(script, *flags, "--log-dir", tmp, *args, timeout=timeout, nproc=nproc, env=env)
    assert result.returncode != 0, result.output
    assert any(message in line for line in error_lines(script, result.output)), result.output
    assert f'{script}", line' not in result.output, result.output
    if script not in TORCHRUN:
        assert "Traceback" not in result.output, result.output
    return result


def trains_compiled_like_eager(script, eager, tmp_path):
    """Train `script` with --compile as `eager` trained without, and check what every --compile claims: the weights
    within PARAM_ATOL of the eager run's (Inductor's fused kernels add in another order), and the same checkpoint
    keys (no "_orig_mod." prefix), so that either mode's checkpoint loads into the other: DCP loads by key, in the
    checkpointing section every script shares. Returns each rank's number of recompiles."""
    ckpt_dir, site = tmp_path / "ckpt", tmp_path / "site"
    site.mkdir()  # a module there logs each recompile, as TORCH_LOGS=recompiles would
    result = run(script, *TINY, "--max-steps", STEPS, "--compile", "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb",
                 env=injected(site, "import torch\ntorch._logging.set_logs(recompiles=True)\n"), timeout=600)
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    compiled, reference = load(ckpt_dir)["model"], load(eager.ckpt_dir)["model"]
    assert compiled.keys() == reference.keys()  # no "_orig_mod." prefix
    difference = max_param_diff(compiled, reference)
    print(f"{script} --compile: largest difference from the eager run's weights {difference:.2g}")
    assert difference <= PARAM_ATOL
    recompiles = [len(re.findall(rf"^\[rank{rank}\]:.*Recompiling function", result.output, re.MULTILINE))
                  for rank in range(2)]
    print(f"{script} --compile: recompiles per rank {recompiles}")
    return recompiles
