"""When one process fails, every process ends in seconds with one line. Real failures are asymmetric: one rank runs
out of memory while the others already wait for it in a collective, one disk fills. Each fault here is injected into
one rank only, at the moment it happens in real runs: in a forward pass, in evaluation, in a pipeline stage's backward,
while writing a checkpoint."""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import (DISTRIBUTED, SCRIPTS, STEPS, TINY, TORCHRUN, checkpoint_name, error_lines, import_script, injected,
                      launch, load, max_param_diff, run, tagged_processes)

# Out of memory on one rank (FAIL_RANK) at the FAIL_CALL-th call of attention in training, or in evaluation after
# training has begun (FAIL_IN), as the CUDA allocator reports it. Each failure appends its time to FAILED_AT.
OOM_IN_ATTENTION = """
import os, time
import torch, torch.nn.functional as F
attention, calls, trained = F.scaled_dot_product_attention, [], []
def failing_attention(*args, **kwargs):
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    trained.extend([None] if torch.is_grad_enabled() else [])
    if rank == int(os.environ["FAIL_RANK"]) and trained and torch.is_grad_enabled() == (os.environ["FAIL_IN"] == "training"):
        calls.append(None)
        if len(calls) == int(os.environ["FAIL_CALL"]):
            with open(os.environ["FAILED_AT"], "a") as f:
                f.write(f"{time.time()}\\n")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity "
                                         "of 79.10 GiB of which 1.06 GiB is free. (injected)")
    return attention(*args, **kwargs)
F.scaled_dot_product_attention = failing_attention
"""

# Out of memory in the backward pass of rank FAIL_RANK's FAIL_CALL-th GELU: inside pipelining's stage_backward, which
# re-raises what a stage raises as a RuntimeError whose cause is the original.
OOM_IN_BACKWARD = """
import os, time
import torch
from torch import nn

class FailingBackward(torch.autograd.Function):
    calls = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        if dist.get_rank() == int(os.environ["FAIL_RANK"]):
            FailingBackward.calls.append(None)
            if len(FailingBackward.calls) == int(os.environ["FAIL_CALL"]):
                with open(os.environ["FAILED_AT"], "a") as f:
                    f.write(f"{time.time()}\\n")
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB. (injected)")
        return grad

gelu = nn.GELU.forward
nn.GELU.forward = lambda self, x: FailingBackward.apply(gelu(self, x))
"""

SECONDS = 60  # from the failure to the end of every process: torchrun alone waits 30 s for a process it stops


def fail_one_rank(script, tmp_path, code, rank, phase, call, launcher=False):
    """Run `script` with a failure injected into `rank` alone; return the run and the times the failure happened."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    env = {**injected(tmp_path, code), "FAIL_RANK": str(rank), "FAIL_IN": phase, "FAIL_CALL": str(call),
           "FAILED_AT": str(tmp_path / "failed_at"), "LAUNCH_TEST_TAG": tag}
    flags = [*TINY, "--max-steps", STEPS, "--ckpt-dir", tmp_path / "ckpt", "--log-dir", tmp_path / "tb"]
    if launcher:  # with its default restarts
        result = launch(script, *flags, env={**env, "NPROC_PER_NODE": "2"}, timeout=240)
    else:
        result = run(script, *flags, env=env, timeout=240)
    ended = time.time()  # the run returns when every process that holds its output has closed it
    time.sleep(1)
    assert not tagged_processes(tag), f"processes outlived the job:\n{result.output}"
    failed_at = [float(line) for line in (tmp_path / "failed_at").read_text().split()]
    assert len(failed_at) == 1, f"the failure came {len(failed_at)} times: restarted into it\n{result.output}"
    assert ended - failed_at[0] < SECONDS, f"ended {ended - failed_at[0]:.0f} s after the failure:\n{result.output}"
    print(f"\n{script}{' (launcher)' if launcher else ''}: every process ended {ended - failed_at[0]:.1f} s after the "
          f"failure, exit {result.returncode}; lines:\n" +
          "\n".join(line for line in result.output.splitlines() if line.startswith(f"{script}: error:")))
    return result


def assert_one_line_each(script, result, own, nproc):
    """The failing process says why in one line, once; every other training process says, in one line, that another
    one failed; none prints a traceback (torchrun's agent may print its own)."""
    assert result.returncode != 0, result.output
    errors = error_lines(script, result.output)
    assert len([line for line in errors if re.search(own, line)]) == 1, result.output
    others = [line for line in errors if "stops: another process failed or stopped responding" in line]
    assert len(others) == nproc - 1, result.output
    assert len({line.split(" stops:")[0] for line in others}) == nproc - 1, result.output  # one line from each rank
    assert f'{script}", line' not in result.output, result.output  # no traceback from a training process


@pytest.mark.parametrize("script, launcher", [(script, False) for script in SCRIPTS] +
                         [(script, True) for script in TORCHRUN])
def test_out_of_memory_on_one_rank_ends_every_process_in_one_line(script, launcher, tmp_path):
    """The last rank runs out of memory in a forward pass of step 9 while the others go on into the gradients'
    all-reduce. The checkpoint of step 8 stays as it was. Through the launcher (3 restarts), the job ends without
    restarting into the same failure."""
    nproc = 2 if script in DISTRIBUTED else 1
    call = 17 if script == "pipeline.py" else 33  # attention's calls per step: 2 (1 block x 2 micro-batches), else 4
    result = fail_one_rank(script, tmp_path, OOM_IN_ATTENTION, rank=nproc - 1, phase="training", call=call,
                           launcher=launcher)
    micro_batch = 4 if script == "pipeline.py" else 8 // 2 // nproc  # TINY: --batch-size 8, --grad-accum 2
    own = (rf"^{script}: error: out of memory in step 9, on micro-batches of {micro_batch} samples per process \(tried "
           rf"to allocate 2\.00 GiB\): a peak of \d+\.\d\d GiB resident, of \d+\.\d GiB on cpu: --grad-accum 4 trains "
           rf"the same, 8 samples a step, on micro-batches of {micro_batch // 2}")
    assert_one_line_each(script, result, own, nproc)
    assert load(tmp_path / "ckpt")["step"] == 8


def test_out_of_memory_figures_and_advice(monkeypatch):
    """The line gives the allocator's peak, what it reserved, the device's total and the failed request; it leads with
    the flag that helps: --grad-accum where micro-batches can shrink, GPipe's other schedule, which holds fewer
    micro-batches' activations."""
    gib = 2**30
    for name, value in [("get_device_properties", lambda device: type("Properties", (), {"total_memory": 80 * gib})),
                        ("max_memory_allocated", lambda device: (52 + device.index) * gib),
                        ("max_memory_reserved", lambda device: (60 + device.index) * gib),
                        ("device_count", lambda: 2)]:  # dataparallel.py's one process computes on both
        monkeypatch.setattr(torch.cuda, name, value)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ...")
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)  # fail() would stop a torchrun that ran pytest
    lines = {}
    for script, micro_batch, schedule in [("ddp_torchrun.py", 9, None), ("fsdp.py", 1, None), ("pipeline.py", 8, "gpipe"),
                                          ("pipeline.py", 8, "1f1b"), ("dataparallel.py", 9, None)]:
        args = type("Args", (), {"grad_accum": 4, "batch_size": 4 * micro_batch, "schedule": schedule,
                                 "stages_per_process": 1, "memory_snapshot": None})
        with pytest.raises(SystemExit) as exit:
            import_script(script).exit_if_out_of_memory(error, "step 5", micro_batch, args, torch.device("cuda", 0))
        lines[script, schedule] = str(exit.value)
    figures = ": a peak of 52.00 GiB allocated, 60.00 GiB reserved, of 80.0 GiB on cuda:0: "
    assert lines["ddp_torchrun.py", None] == (
        "ddp_torchrun.py: error: out of memory in step 5, on micro-batches of 9 samples per process (tried to allocate "
        f"2.00 GiB){figures}--grad-accum 12 trains the same, 36 samples a step, on micro-batches of 3")
    assert ": a peak of 52.00, 53.00 GiB allocated, 60.00, 61.00 GiB reserved, of 80.0 GiB on cuda:0, cuda:1: " in \
        lines["dataparallel.py", None]
    assert lines["fsdp.py", None].endswith(f"{figures}one sample is the smallest micro-batch: the model must take less "
                                           "memory, or --activation-checkpointing")
    assert lines["pipeline.py", "gpipe"].endswith(f"{figures}--schedule 1f1b, which holds the activations of fewer "
                                                  "micro-batches at once, or --activation-checkpointing")
    assert lines["pipeline.py", "1f1b"].endswith(f"{figures}--grad-accum 8 trains the same, 32 samples a step, on "
                                                 "micro-batches of 4, or --activation-checkpointing")


@pytest.mark.parametrize("script", SCRIPTS)
def test_out_of_memory_in_evaluation_ends_in_one_line(script, tmp_path):
    """The last rank runs out of memory in the evaluation of step 8, the first after training began, where the
    others wait to add up the sums."""
    nproc = 2 if script in DISTRIBUTED else 1
    result = fail_one_rank(script, tmp_path, OOM_IN_ATTENTION, rank=nproc - 1, phase="evaluation", call=1)
    own = (rf"^{script}: error: out of memory in evaluation at step 8, on micro-batches of \d samples per process "
           rf"\(tried to allocate 2\.00 GiB\): a peak of \d+\.\d\d GiB resident, of \d+\.\d GiB on cpu: --grad-accum ")
    assert_one_line_each(script, result, own, nproc)
    assert load(tmp_path / "ckpt")["step"] == 8  # saved at the end of step 8, just before: whole


def test_out_of_memory_in_a_pipeline_stages_backward_ends_in_one_line(tmp_path):
    """Stage 0 runs out of memory in a backward pass (pipelining wraps the error), while stage 1 waits for it."""
    result = fail_one_rank("pipeline.py", tmp_path, OOM_IN_BACKWARD, rank=0, phase="training", call=5)
    own = (r"^pipeline.py: error: out of memory in step \d, on micro-batches of 4 samples per process \(tried to "
           r"allocate 512\.00 MiB\): a peak of \d+\.\d\d GiB resident, of \d+\.\d GiB on cpu: ")
    assert_one_line_each("pipeline.py", result, own, nproc=2)


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size at tmp_path/disk (root only), unmounted after the test."""
    path = tmp_path / "disk"
    path.mkdir()
    mounted = []

    def mount(size):
        mounted.append(path)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=False,
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root): {result.stderr.strip()}")
        return path

    yield mount
    if mounted:
        subprocess.run(["umount", "--lazy", str(path)], check=False, capture_output=True)


def size_on_disk(path):
    path = Path(path)
    files = [path] if path.is_file() else [f for f in path.resolve().rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files)


@pytest.mark.parametrize("script", SCRIPTS)
def test_full_disk_at_the_second_save_ends_in_one_line_and_keeps_the_first(halfway, trained, script, small_disk):
    """--ckpt-dir on a disk with room for one checkpoint and a half: the save of step 16, written in the background
    beside step 8's, runs out of space while training goes on. The next save, step 20's, waits for it first: one line
    names the path and the OS error, no partial file is left to hold the space, and step 8's checkpoint is whole: a
    rerun reads it."""
    ckpt = trained[script].ckpt_dir / checkpoint_name(script)
    disk = small_disk(int(1.5 * size_on_disk(ckpt)))
    flags = [*TINY, "--max-steps", STEPS + 4, "--lr-decay-steps", STEPS, "--ckpt-dir", disk, "--log-dir", disk.parent / "tb"]
    result = run(script, *flags)
    assert result.returncode != 0, result.output
    assert re.search(rf"^step +{STEPS} \| saving .* in the background$", result.output, re.MULTILINE), result.output
    assert re.search(rf"^step +{STEPS + 2} \| loss", result.output, re.MULTILINE), result.output  # trained on
    saved = disk / checkpoint_name(script)
    new = f"{saved}-{STEPS:06d}" if script in ("fsdp.py", "pipeline.py") else saved  # DCP's new directory
    line = rf"^{script}: error: cannot write checkpoint {re.escape(str(new))}: \[Errno 28\] No space left on device$"
    lines = [error for error in error_lines(script, result.output) if re.search(line, error)]
    writers = 2 if script in ("fsdp.py", "pipeline.py") else 1  # every rank writes its part, or rank 0 alone
    assert len(lines) == writers, result.output
    if script in DISTRIBUTED and writers == 1:  # the other rank waited for rank 0's save
        peer = rf"^{script}: error: rank 1 stops: another process failed"
        assert any(re.search(peer, error) for error in error_lines(script, result.output)), result.output
    assert f'{script}", line' not in result.output, result.output
    print(f"\n{script}: {lines[0]}")
    assert sorted(os.listdir(disk)) == sorted([saved.name] + ([f"{saved.name}-{8:06d}"] if writers == 2 else []))
    assert max_param_diff(load(disk)["model"], load(halfway[script].ckpt_dir)["model"]) == 0
    rerun = run(script, *TINY, "--max-steps", 8, "--ckpt-dir", disk, "--log-dir", disk.parent / "tb")
    assert rerun.returncode == 0 and f"{saved} is at step 8: the run is finished" in rerun.output, rerun.output
