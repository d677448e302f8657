"""A job told to stop saves a checkpoint at the step the scripts document and exits 75, however the signal arrives,
and the run started again ends on an uninterrupted run's weights, bit for bit; a job killed (SIGKILL) while a
checkpoint is written in the background keeps the one before, which resumes bit for bit; ddp_spawn.py's parent
names the signal that killed one of its processes."""

import os
import re
import signal
import subprocess
import time

import pytest
import torch

from conftest import (ROOT, STEPS, TINY, Run, adam_state, checkpoints, command, environment, injected, kill_all, load,
                      run, tagged_processes)

STOPPED = 75  # the scripts' status after a stop (EX_TEMPFAIL): saved, to be run again
HOLD_STEP = 5  # mid-epoch (10 steps an epoch), before the first checkpoint at step 8, and not a logging step

# Injected (hold()): process HOLD_RANK holds its optimizer step HOLD_STEP until a stop signal has reached it, so that
# the signal lands in that step whatever the timing, once (a run started again, by a requeue, holds nothing); with
# HOLD_RANK "every", every rank holds until the signal has reached one of them, whose vote then stops all at the step
# after. A process still alive 25 s after its stop signal prints every thread's stack (torchrun kills at 30 s). Each
# rank of a distributed job says with which status it exits, which torchrun, stopped itself, does not report.
HOLD = """\
import faulthandler, os, signal, sys, threading, time
import torch

received, install = threading.Event(), signal.signal
every, came = os.environ["HOLD_RANK"] == "every", os.environ["HELD"] + "-signal"

def noting(signum, frame, handler):
    faulthandler.dump_traceback_later(25)
    handler(signum, frame)  # the script's handler (torchrun's raises), and then: a signal came
    received.set()
    if every:
        open(came, "w").close()

def noting_install(signum, handler):
    if callable(handler):
        handler = lambda signum, frame, handler=handler: noting(signum, frame, handler)
    return install(signum, handler)

step, steps = torch.optim.AdamW.step, []

def holding_step(self, *args, **kwargs):
    steps.append(None)
    rank = os.environ.get("RANK", "0")
    held = f"{os.environ['HELD']}-{rank}"
    if (len(steps) == int(os.environ["HOLD_STEP"]) and os.environ["HOLD_RANK"] in (rank, "every")
            and not os.path.exists(held)):
        open(held, "w").close()
        print(f"holding step {len(steps)} until a stop signal", flush=True)
        deadline = time.monotonic() + 120
        while not (received.is_set() or every and os.path.exists(came)):
            assert time.monotonic() < deadline, "no stop signal came"
            time.sleep(0.01)
    return step(self, *args, **kwargs)

system_exit = sys.exit

def saying_exit(status=None):
    if "RANK" in os.environ:
        print(f"rank {os.environ['RANK']} exits with {status}", flush=True)
    system_exit(status)

signal.signal, torch.optim.AdamW.step, sys.exit = noting_install, holding_step, saying_exit
"""

# Injected: rank 1 holds its part of the background write of checkpoint HOLD_WRITE (a directory's name) until it is
# killed, while training goes on.
HOLD_WRITE = """\
import os, time
from torch.distributed.checkpoint import filesystem

write = filesystem._FileSystemWriter.write_data

def held_write(self, *args, **kwargs):
    if os.path.basename(self.path) == os.environ["HOLD_WRITE"] and os.environ.get("RANK") == "1":
        print(f"rank 1 holds its write of {self.path}", flush=True)
        time.sleep(3600)
    return write(self, *args, **kwargs)

filesystem._FileSystemWriter.write_data = held_write
"""

# Injected: rank 1 kills itself (SIGKILL) in its third optimizer step, as the kernel's out-of-memory killer would.
KILL_RANK_1 = """\
import os, signal
import torch

step, steps = torch.optim.AdamW.step, []

def dying_step(self, *args, **kwargs):
    steps.append(None)
    if len(steps) == 3 and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self, *args, **kwargs)

torch.optim.AdamW.step = dying_step
"""

# Injected with --workers: Python 3.14's default start method on Linux, which the scripts' "spawn" overrides; and
# each loader worker says so at its first fetch.
FORKSERVER = "import multiprocessing\nmultiprocessing.set_start_method('forkserver')\n"
LOADER_WORKER = """\
import os
import torch.utils.data

getitems, said = torch.utils.data.Subset.__getitems__, []

def saying_getitems(self, indices):
    if torch.utils.data.get_worker_info() and not said:
        print(f"a loader worker of rank {os.environ.get('RANK')} fetches", flush=True)
        said.append(True)
    return getitems(self, indices)

torch.utils.data.Subset.__getitems__ = saying_getitems
"""


def hold(directory, step, rank, also=""):
    """The environment in which rank `rank` (or "every" rank) holds step `step` (see HOLD), and runs the code `also`
    at start-up."""
    return {**injected(directory, HOLD + also), "HOLD_STEP": str(step), "HOLD_RANK": str(rank),
            "HELD": str(directory / "held")}


def flags(out, *more):
    return [*TINY, "--max-steps", STEPS, "--log-dir", out / "tb", *more]


class Job:
    """A script started in the background, its output in a file in `directory`, every process it starts tagged; as
    a context, killed at the end with every process it started, if any is left."""

    def __init__(self, script, args, env, directory):
        self.tag, self.log, self.start = f"{os.getpid()}-{time.monotonic_ns()}", directory / "job.log", time.monotonic()
        with open(self.log, "w") as log:  # a file, not a pipe: nothing blocks on output nobody reads yet
            self.proc = subprocess.Popen(command(script) + [str(a) for a in args], cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env=environment({**env, "LAUNCH_TEST_TAG": self.tag}))

    def output(self):
        return self.log.read_text()

    def wait_for(self, *lines):
        """Wait until the output holds every one of `lines`."""
        deadline = time.monotonic() + 180
        while not all(line in self.output() for line in lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, f"never printed {lines}:\n{self.output()}"
            time.sleep(0.02)

    def finish(self, timeout=180):
        """Wait for the job to end; past `timeout`, a hang, kill it and fail."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"ran past {timeout}s after the signal:\n{self.output()}")
        return Run(self.proc.returncode, self.output(), time.monotonic() - self.start)

    def kill(self):
        kill_all(self.proc, self.tag)
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def assert_ends_like(trained, ckpt_dir):
    """The newest checkpoint in ckpt_dir holds `trained`'s weights and moments, bit for bit."""
    got, expected = load(ckpt_dir), load(trained.ckpt_dir)
    assert got["step"] == expected["step"] == STEPS
    for name, tensors in [("model", lambda state: state["model"]), ("Adam's moments", adam_state)]:
        assert tensors(got).keys() == tensors(expected).keys(), name
        assert all(torch.equal(tensors(got)[key], value) for key, value in tensors(expected).items()), name


# One way each that a signal arrives: to a single process; to ddp_spawn.py's parent, which forwards it; to torchrun,
# which forwards it to each worker's process group, so with --workers 1 to its data loader's process too (spawned: it
# does not inherit the training process's handler), which leaves it to the training process; and to one worker of a
# torchrun job alone (SIGUSR1, as SLURM's --signal sends). The held process is the last rank; the others run into the
# next step's collective and wait there. The distributed scripts vote at logging steps: every LOG_EVERY here, so that
# the stop's step tells a vote at logging steps from one at every step.
LOG_EVERY = 4
@pytest.mark.parametrize("script, target, signum", [
    ("single_gpu.py", "the process", signal.SIGTERM), ("ddp_spawn.py", "the parent", signal.SIGTERM),
    ("ddp_torchrun.py", "torchrun", signal.SIGTERM), ("fsdp.py", "rank 1 alone", signal.SIGUSR1)],
    ids=["single_gpu", "ddp_spawn-parent", "torchrun", "fsdp-rank-1-alone"])
def test_stop_signal_saves_at_the_documented_step_and_the_rerun_ends_bit_for_bit(trained, script, target, signum,
                                                                                tmp_path):
    distributed = script != "single_gpu.py"
    loader = ["--workers", 1] if target == "torchrun" else []
    with Job(script, flags(tmp_path, "--ckpt-dir", tmp_path / "ckpt", "--log-every", LOG_EVERY, *loader),
             hold(tmp_path, HOLD_STEP, int(distributed), (FORKSERVER + LOADER_WORKER) * bool(loader)), tmp_path) as job:
        job.wait_for(f"holding step {HOLD_STEP}")
        if target == "rank 1 alone":
            [pid] = [pid for pid, env in tagged_processes(job.tag).items() if env.get("RANK") == "1"]
        else:
            pid = job.proc.pid  # the one started: the script, ddp_spawn.py's parent, or torchrun
        os.kill(pid, signum)
        result = job.finish()
    # One process stops after the step under way; distributed ranks at the vote of the next logging step.
    step = -(-HOLD_STEP // LOG_EVERY) * LOG_EVERY if distributed else HOLD_STEP
    print(f"\n{script}: {signum.name} to {target} in step {HOLD_STEP}: exit {result.returncode}")
    # Not anchored: the ranks share a pipe, and another's print can write its newline after this line began.
    stops = re.findall(r"step +\d+ \| stopped by [^\n]*", result.output)
    assert stops == [f"step {step:>5} | stopped by {signum.name}: run again to resume"], result.output
    if script in ("single_gpu.py", "ddp_spawn.py"):
        assert result.returncode == STOPPED, result.output
    else:  # torchrun reports a stopped worker, or its own stop, as a failure (exit 1)
        assert result.returncode != 0, result.output
    if distributed:
        assert all(f"rank {rank} exits with {STOPPED}" in result.output for rank in range(2)), result.output
    if loader:  # the signal reached a loader worker that was there
        assert all(f"a loader worker of rank {rank} fetches" in result.output for rank in range(2)), result.output
    assert checkpoints(tmp_path / "ckpt") == [tmp_path / "ckpt" / f"step-{step:06d}"]

    rerun = run(script, *flags(tmp_path, "--ckpt-dir", tmp_path / "ckpt"))
    assert rerun.returncode == 0, rerun.output
    assert f"resumed from {tmp_path / 'ckpt' / f'step-{step:06d}'} at step {step}\n" in rerun.output, rerun.output
    assert_ends_like(trained[script], tmp_path / "ckpt")


def test_without_ckpt_dir_the_stop_says_nothing_was_saved(tmp_path):
    with Job("single_gpu.py", flags(tmp_path), hold(tmp_path, 2, 0), tmp_path) as job:
        job.wait_for("holding step 2")
        os.kill(job.proc.pid, signal.SIGTERM)
        result = job.finish()
    assert result.returncode == STOPPED, result.output
    assert result.output.rstrip().endswith("step     2 | stopped by SIGTERM: no --ckpt-dir, not saved"), result.output


def test_a_kill_during_a_background_write_leaves_the_checkpoint_before_which_resumes_bit_for_bit(trained, tmp_path):
    """Checkpoints every 4 steps. Rank 1 holds its write of step 8's while training goes on to step 10, and there
    every process of the job is killed (SIGKILL): step 4's checkpoint is complete, and the run started again from it
    ends on the uninterrupted run's state, bit for bit."""
    ckpt_dir = tmp_path / "ckpt"
    every_4 = flags(tmp_path, "--ckpt-dir", ckpt_dir, "--ckpt-every", 4)  # the last --ckpt-every wins
    with Job("ddp_torchrun.py", every_4, {**injected(tmp_path, HOLD_WRITE), "HOLD_WRITE": "step-000008"},
             tmp_path) as job:
        job.wait_for(f"rank 1 holds its write of {ckpt_dir / 'step-000008'}", "step    10 | loss")
        job.kill()
        output = job.output()
    assert (ckpt_dir / "step-000008").is_dir(), output  # begun, and never finished: no .metadata
    assert checkpoints(ckpt_dir) == [ckpt_dir / "step-000004"], output

    rerun = run("ddp_torchrun.py", *every_4)
    assert rerun.returncode == 0, rerun.output
    assert f"resumed from {ckpt_dir / 'step-000004'} at step 4\n" in rerun.output, rerun.output
    assert_ends_like(trained["ddp_torchrun.py"], ckpt_dir)


# Injected into ddp_spawn.py's parent: mp.spawn says when it has started the training processes, and returns 3 s
# later: a stop signal can land between the two, as early as a test can aim one at a parent with children.
SLOW_SPAWN = """
import time
import torch.multiprocessing as mp
spawn = mp.spawn
def slow_spawn(*args, **kwargs):
    context = spawn(*args, **kwargs)
    print("processes spawned", flush=True)
    time.sleep(3)
    return context
mp.spawn = slow_spawn
"""


def test_a_stop_while_ddp_spawn_starts_its_processes_reaches_them(tmp_path):
    """SIGTERM to ddp_spawn.py's parent once its processes exist, before mp.spawn has returned: the parent handles
    stop signals from before the spawn and passes this one on after it, so the job ends, and no process outlives the
    parent (without the handler, the parent died of it and left its processes training). Rank 1 holds step 5 until
    a stop signal reaches it, so that the training cannot end first. A process that gets the signal before its own
    handler dies of it; one after it stops at a logging step. (Multiprocessing's resource tracker, which ignores
    SIGTERM, ends a moment after the parent: the test waits up to 10 s for it.)"""
    with Job("ddp_spawn.py", flags(tmp_path), hold(tmp_path, HOLD_STEP, 1, SLOW_SPAWN), tmp_path) as job:
        job.wait_for("processes spawned")
        os.kill(job.proc.pid, signal.SIGTERM)
        result = job.finish(timeout=120)
        deadline = time.monotonic() + 10
        while tagged_processes(job.tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = tagged_processes(job.tag)
    assert not left, f"{len(left)} processes outlived the parent:\n{result.output}"
    killed = re.search(r"^ddp_spawn\.py: error: process \d terminated with signal SIGTERM$", result.output, re.MULTILINE)
    assert result.returncode == 1 and killed or result.returncode == STOPPED and "stopped by SIGTERM" in result.output, \
        result.output


def test_ddp_spawns_parent_names_the_signal_that_killed_a_process(tmp_path):
    """A process killed says nothing; torchrun would name the signal, and so does ddp_spawn.py's parent, in one
    line, exit 1 (rank 0, in a collective with the dead rank, fails or is ended by the parent)."""
    result = run("ddp_spawn.py", *flags(tmp_path, "--timeout", 30), env=injected(tmp_path, KILL_RANK_1))
    assert result.returncode == 1, result.output
    assert "ddp_spawn.py: error: process 1 terminated with signal SIGKILL" in result.output.splitlines(), \
        result.output


def test_a_rank_stuck_in_a_background_write_fails_after_timeout_and_keeps_the_checkpoint_before(tmp_path):
    """Rank 1 holds its write of step 8's checkpoint for good: rank 0, waiting for it in the saves' own group, fails
    after --timeout (10 s; gloo's default is half an hour, past the 180 s this test waits), and step 4's checkpoint
    is the newest complete one."""
    ckpt_dir = tmp_path / "ckpt"
    with Job("ddp_torchrun.py", flags(tmp_path, "--ckpt-dir", ckpt_dir, "--ckpt-every", 4, "--timeout", 10),
             {**injected(tmp_path, HOLD_WRITE), "HOLD_WRITE": "step-000008"}, tmp_path) as job:
        job.wait_for(f"rank 1 holds its write of {ckpt_dir / 'step-000008'}", "in wait_for_checkpoint")
        output = job.output()
    assert re.search(r"\[rank0\]: .* in wait_for_checkpoint", output), output  # rank 0 learns the save failed
    assert checkpoints(ckpt_dir) == [ckpt_dir / "step-000004"], output
