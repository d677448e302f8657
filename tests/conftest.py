"""Helpers for the tests: run a script as a user would (a real subprocess, CPU and gloo) and read
back what it wrote: console output, TensorBoard scalars, checkpoints."""

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["single_gpu.py", "dataparallel.py", "ddp_spawn.py", "ddp_torchrun.py"]
DISTRIBUTED = ["ddp_spawn.py", "ddp_torchrun.py"]
LAUNCHER = ROOT / "launch_distributed.sh"

# A tiny model and a short run: seconds on two shared cores, with gradient accumulation (so DDP's
# no_sync path runs), a checkpoint half-way, and a validation pass at steps 0, 8 and 16.
STEPS = 16
TINY = ["--seq-len", "16", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--batch-size", "8",
        "--grad-accum", "2", "--lr", "1e-2", "--warmup-steps", "2", "--log-every", "2", "--eval-every", "8",
        "--ckpt-every", "8"]

# Python warnings ("UserWarning: ..."), and c10's C++ log lines at warning or error level ("[W1121 ..."
# from a worker, "W1121 ..." from torchrun's agent).
WARNING = re.compile(r"Warning|^\[?[WE]\d{4} ", re.MULTILINE)


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr, interleaved as a user sees them
    seconds: float


def command(script, nproc=2):
    """How a user starts each script: torchrun for ddp_torchrun.py, plain python for the rest."""
    path = str(ROOT / script)
    if script == "ddp_torchrun.py":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", path]
    if script == "ddp_spawn.py":
        return [sys.executable, path, "--nproc", str(nproc)]
    return [sys.executable, path]


def run(script, *args, nproc=2, timeout=180, cwd=None):
    """Run a script to completion. A hang fails the test after `timeout` seconds, and the whole
    process group is killed so that no worker outlives it."""
    return run_command(command(script, nproc) + [str(a) for a in args], timeout=timeout, cwd=cwd)


def launch(*args, env=None, timeout=180, cwd=None):
    """Run launch_distributed.sh with `args`, and `env` added to this environment."""
    return run_command([str(LAUNCHER)] + [str(a) for a in args], env=env, timeout=timeout, cwd=cwd)


def run_command(argv, env=None, timeout=180, cwd=None):
    # Two cores are shared by every rank; the interpreter running the tests is the one the launcher finds.
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd or ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, argv))} ran past {timeout}s:\n{output}")
    return Run(proc.returncode, output, time.monotonic() - start)


def scalars(log_dir):
    """Every TensorBoard scalar under log_dir, as {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def load(ckpt_dir):
    return torch.load(Path(ckpt_dir) / "checkpoint.pt", weights_only=True)


# Where the scripts may differ at all, they differ only in the order of fp32 additions: a
# gradient summed as two per-rank halves, then averaged, rounds differently from one sum over
# the batch (about 1e-7 relative). Sixteen AdamW steps, whose update m / sqrt(v) normalises
# gradients, keep that far below 1e-5 on weights of size ~0.02-1 (the largest seen: see README).
PARAM_ATOL = 1e-5


def max_param_diff(a, b):
    """Largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


@dataclass
class Trained:
    run: Run
    ckpt_dir: Path
    log_dir: Path


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """Each script trained once for STEPS steps on the same config; shared by the tests that read it."""
    results = {}
    for script in SCRIPTS:
        out = tmp_path_factory.mktemp(script[:-3])
        result = run(script, *TINY, "--max-steps", STEPS, "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb")
        results[script] = Trained(result, out / "ckpt", out / "tb")
    return results
