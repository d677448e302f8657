"""launch_distributed.sh on one node: it trains as torchrun does, restarts a killed worker from the newest checkpoint,
checks communication, refuses a bad environment at once, and builds SLURM's command lines."""

import os
import re
import sys

import pytest
import torch

from conftest import (ROOT, STEPS, TINY, WARNING, adam_state, injected, launch, load,
                      run_command)

# Injected (conftest.injected): rank 1 kills itself (SIGKILL) in step 10 of the job's first try, once step 8's
# checkpoint is complete: the newest, from which torchrun's restart must resume.
KILL_AFTER_THE_CHECKPOINT = """\
import os, pathlib, signal, time
import torch

if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    step, steps = torch.optim.AdamW.step, []

    def dying_step(self, *args, **kwargs):
        steps.append(None)
        if len(steps) == 10:
            saved, deadline = pathlib.Path(os.environ["CKPT_DIR"], "step-000008", ".metadata"), time.monotonic() + 120
            while not saved.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self, *args, **kwargs)

    torch.optim.AdamW.step = dying_step
"""


def train_flags(out):
    return [*TINY, "--max-steps", STEPS, "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb"]


def assert_same_state(ckpt_dir, trained):
    """The newest checkpoint in ckpt_dir holds the weights and moments of `trained`'s, bit for bit."""
    got, expected = load(ckpt_dir), load(trained.ckpt_dir)
    assert got["step"] == expected["step"] == STEPS
    for tensors in (lambda state: state["model"], adam_state):
        assert tensors(got).keys() == tensors(expected).keys()
        assert all(torch.equal(tensors(got)[key], value) for key, value in tensors(expected).items())


def test_check_passes_and_one_node_trains_like_torchrun(trained, tmp_path):
    result = launch("--check", "ddp_torchrun.py", *train_flags(tmp_path))
    assert result.returncode == 0, result.output
    assert "check passed: world size 2 (1 node x 2 processes), backend gloo" in result.output, result.output
    assert "all_reduce of 32 MiB:" in result.output and "GB/s" in result.output, result.output
    assert ("env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120 torchrun --standalone "
            "--nproc-per-node=2 --max-restarts=3 ddp_torchrun.py") in result.output, result.output
    assert "x 2 processes" in result.output, result.output
    assert not WARNING.search(result.output), result.output
    assert_same_state(tmp_path / "ckpt", trained["ddp_torchrun.py"])  # the job conftest's torchrun ran


def test_check_of_one_process_measures_no_bandwidth():
    """One process sends nothing over a link: the check says so, where the bus bandwidth's formula would print 0."""
    result = launch("--check", env={"NPROC_PER_NODE": "1"})
    assert result.returncode == 0, result.output
    assert "check passed: world size 1 (1 node x 1 process), backend gloo" in result.output, result.output
    assert re.search(r"^all_reduce of 32 MiB: [\d.]+ ms, one process: no link to measure$", result.output,
                     re.MULTILINE), result.output


def test_killed_worker_restarts_from_the_newest_checkpoint_and_ends_bit_for_bit(trained, tmp_path):
    """A worker killed after a checkpoint: torchrun ends the other and restarts both (MAX_RESTARTS, default 3), they
    resume from that checkpoint, whole, and the job ends on the uninterrupted run's state. This is also the test that
    no failure on one rank loses a checkpoint or hangs."""
    result = launch("ddp_torchrun.py", *train_flags(tmp_path),
                    env={**injected(tmp_path, KILL_AFTER_THE_CHECKPOINT), "CKPT_DIR": str(tmp_path / "ckpt")})
    assert result.returncode == 0, result.output
    # torchrun saw a failure: its line names the kill, or rank 0's collective that failed after it where both landed
    # in one of torchrun's checks (it times them in whole seconds). The one restart shows in the one resume below.
    assert re.search(r"failed \(exitcode: (-9|1)\) local_rank: [01] ", result.output), result.output
    resumed = [line for line in result.output.splitlines() if line.startswith("resumed from")]
    assert resumed == [f"resumed from {tmp_path / 'ckpt' / 'step-000008'} at step 8"], result.output
    assert_same_state(tmp_path / "ckpt", trained["ddp_torchrun.py"])


def test_one_process_scripts_run_with_python(tmp_path):
    python = {"PYTHON": "python3", **without_gpus(tmp_path)}  # python3: what every Python installation has
    result = launch("--dry-run", "single_gpu.py", "--max-steps", 5, env=python)
    assert result.returncode == 0, result.output
    assert result.output.splitlines()[-1] == "python3 single_gpu.py --max-steps 5"
    result = launch("--dry-run", "ddp_spawn.py", env={"NPROC_PER_NODE": "3", **python})
    assert result.output.splitlines()[-1] == "python3 ddp_spawn.py --nproc 3"


def test_check_names_the_rank_that_fails(tmp_path):
    # Rank 1's all_reduce comes back off by one, as from a broken link or a bad GPU.
    env = injected(tmp_path, "import os\nif os.environ.get('RANK') == '1':\n"
                             "    import torch.distributed as dist\n"
                             "    all_reduce = dist.all_reduce\n"
                             "    dist.all_reduce = lambda tensor, *a, **k: (all_reduce(tensor, *a, **k), "
                             "tensor.add_(1))[0]\n")
    result = launch("--check", "ddp_torchrun.py", *train_flags(tmp_path), env=env)
    assert result.returncode != 0, result.output
    assert "check failed on rank 1:" in result.output, result.output
    assert "rank 1 on" in result.output and "all_reduce gave 4, expected 3" in result.output, result.output
    assert not (tmp_path / "ckpt").exists(), "training ran after a failed check"


def without_gpus(directory, node1=None):
    """An environment in which the launcher's checks run without torch: a stand-in module that counts no GPUs, the
    one thing the launcher asks torch before it starts a script (importing torch takes seconds). With `node1`, this
    node is named node1, which resolves to that address (gloo listens on the address of its node's name)."""
    (directory / "torch.py").write_text("class cuda:\n    device_count = staticmethod(lambda: 0)\n")
    return injected(directory, "" if node1 is None else
                    "import socket\n"
                    "getaddrinfo = socket.getaddrinfo\n"
                    "socket.gethostname = lambda: 'node1'\n"
                    "socket.getaddrinfo = lambda host, *args, **kwargs: getaddrinfo("
                    f"'{node1}' if host == 'node1' else host, *args, **kwargs)\n")


MULTI = {"NNODES": "2", "MASTER_ADDR": "10.77.0.2"}  # an address literal: it resolves without a name server


@pytest.mark.parametrize("script, env, node1, message", [
    ("ddp_torchrun.py", {"NNODES": "2"}, None, "NNODES=2 needs MASTER_ADDR"),
    ("ddp_torchrun.py", {"NNODES": "2", "MASTER_ADDR": "no-such-host.invalid"}, None,
     "MASTER_ADDR no-such-host.invalid does not resolve"),
    ("ddp_torchrun.py", {"MAX_RESTARTS": "lots"}, None, "MAX_RESTARTS must be a whole number, got 'lots'"),
    ("ddp_torchrun.py", {"SHUTDOWN_TIMEOUT": "2m"}, None, "SHUTDOWN_TIMEOUT must be a whole number, got '2m'"),
    ("ddp_spawn.py", {"NNODES": "2", "MASTER_ADDR": "127.0.0.1"}, None,
     "ddp_spawn.py runs on one node; use ddp_torchrun.py for NNODES > 1"),
    ("ddp_torchrun.py", MULTI, "127.0.1.1", ("this node's name node1 resolves to 127.0.1.1, which other nodes cannot "
     "reach (a loopback address): map it to the node's network address in /etc/hosts, or set GLOO_SOCKET_IFNAME")),
    ("ddp_torchrun.py", MULTI, "192.0.2.7", ("this node's name node1 resolves to 192.0.2.7, not an address of this "
     "node, so gloo would listen on loopback, which other nodes cannot reach")),
    ("ddp_torchrun.py", {"SLURM_JOB_ID": "", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"}, None,
     "SLURM variables are set but SLURM_JOB_ID is empty: run this through sbatch or inside salloc"),
    ("ddp_torchrun.py", {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "MASTER_ADDR": "127.0.0.1",
                         "SLURM_JOB_CPUS_PER_NODE": "N/A"}, None,
     "cannot tell the job's CPUs per node from SLURM_CPUS_PER_TASK or SLURM_JOB_CPUS_PER_NODE (got 'N/A')"),
])
def test_bad_environment_fails_at_once(script, env, node1, message, tmp_path):
    result = launch(script, env={**env, **without_gpus(tmp_path, node1)}, timeout=60)
    assert result.returncode == 1, result.output
    assert result.output.strip().startswith(f"launch_distributed.sh: error: {message}"), result.output


# In a SLURM allocation of 2 nodes of 4 GPUs: one torchrun per node under srun, the rendezvous on the first host, the
# job's id naming it, and the CPUs each node's task gets: sbatch's --cpus-per-task, else the fewest the job holds on
# a node; too few for the node's processes is told.
@pytest.mark.parametrize("cpus, expected", [({"SLURM_CPUS_PER_TASK": "16", "SLURM_JOB_CPUS_PER_NODE": "72(x2)"}, 16),
                                            ({"SLURM_JOB_CPUS_PER_NODE": "72,36"}, 36),
                                            ({"SLURM_JOB_CPUS_PER_NODE": "1(x2)"}, 1)])
def test_dry_run_in_slurm_allocation(tmp_path, cpus, expected):
    # scontrol is SLURM's own; this stand-in expands the node list as it would (tests/test_slurm.py runs the real one).
    (tmp_path / "scontrol").write_text("#!/bin/sh\nprintf 'localhost\\nn2\\n'\n")
    (tmp_path / "scontrol").chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost,n2", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_GPUS_PER_NODE": "a100:4", "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", **cpus}
    result = launch("--dry-run", "ddp_torchrun.py", "--batch-size", 64, "--ckpt-dir", "ckpt", env=slurm)
    assert result.returncode == 0, result.output
    assert result.output.splitlines()[-1] == (
        f"srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task={expected} --kill-on-bad-exit=1 "
        "env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120 torchrun --nnodes=2 "
        "--rdzv-backend=c10d "
        "--rdzv-endpoint=localhost:24242 --rdzv-id=4242 --rdzv-conf=join_timeout=300 --nproc-per-node=4 "
        "--max-restarts=3 ddp_torchrun.py --batch-size 64 --ckpt-dir ckpt")
    note = ("launch_distributed.sh: note: this job holds 1 CPU(s) per node for 4 processes each; ask sbatch for more "
            "with --cpus-per-task=N (or --exclusive)")
    assert (note in result.output) == (expected < 4), result.output


def test_the_classic_launch_command_trains_like_torchrun(trained, tmp_path):
    """`python -m torch.distributed.launch` (every classic guide's command; deprecated, and passing --local-rank=N to
    each process unless --use-env): the scripts take the flag, hidden, and train as under torchrun."""
    result = run_command([sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2",
                          str(ROOT / "ddp_torchrun.py"), *map(str, train_flags(tmp_path))])
    assert result.returncode == 0, result.output
    assert "--local-rank" not in run_command([sys.executable, ROOT / "ddp_torchrun.py", "--help"]).output
    assert_same_state(tmp_path / "ckpt", trained["ddp_torchrun.py"])


@pytest.mark.parametrize("script", ["ddp_torchrun.py", "ddp_spawn.py"])
def test_srun_without_torchrun_is_refused_in_one_line(script, tmp_path):
    """`srun --ntasks=2 python SCRIPT`: each task has SLURM's variables and no torchrun's. Left alone, each would
    train as a world of its own into the one --ckpt-dir; each refuses instead, before it writes anything. The other
    torchrun scripts hold the same lines (test_structure.py holds ddp_amp.py's and fsdp.py's to ddp_torchrun.py's;
    pipeline.py's are a copy)."""
    slurm = {"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
    result = run_command([sys.executable, ROOT / script, *map(str, train_flags(tmp_path))], env=slurm, timeout=60)
    assert result.returncode != 0, result.output
    assert result.output.splitlines()[-1] == (f"{script}: error: srun started several tasks, not torchrun: start "
                                              "one torchrun per node under srun"), result.output
    assert not (tmp_path / "ckpt").exists()
