"""launch_distributed.sh on one node: it trains, survives a killed worker, gives up on a broken one,
times out a rendezvous nobody joins, checks communication, and prints its commands."""

import os
import sys
import time

import pytest
import torch

from conftest import (LAUNCHER, PARAM_ATOL, ROOT, STEPS, TINY, WARNING, free_ports, injected, kill_a_worker, launch,
                      load, max_param_diff, run_command, tagged_processes)

RESTART_STEPS = 48  # long enough that a worker killed after the first checkpoint (step 8) dies mid-run


def train_flags(out, steps=STEPS):
    return [*TINY, "--max-steps", steps, "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb"]


def test_single_node_launch_trains_like_torchrun(trained, tmp_path):
    result = launch("ddp_torchrun.py", *train_flags(tmp_path))
    assert result.returncode == 0, result.output
    assert "torchrun --standalone --nproc-per-node=2 --max-restarts=3 ddp_torchrun.py" in result.output
    assert "x world size 2" in result.output
    assert not WARNING.search(result.output), result.output
    # The same job as conftest's torchrun run: the same parameters, bit for bit.
    assert max_param_diff(load(tmp_path / "ckpt")["model"], load(trained["ddp_torchrun.py"].ckpt_dir)["model"]) == 0


def test_one_process_scripts_run_with_python(tmp_path):
    python = {"PYTHON": "python3"}  # what every Python installation has by that name
    result = launch("--dry-run", "single_gpu.py", "--max-steps", 5, env=python)
    assert result.returncode == 0, result.output
    assert result.output.splitlines()[-1] == "python3 single_gpu.py --max-steps 5"
    result = launch("--dry-run", "ddp_spawn.py", env={"NPROC_PER_NODE": "3", **python})
    assert result.output.splitlines()[-1] == "python3 ddp_spawn.py --nproc 3"
    result = launch("ddp_spawn.py", env={"NNODES": "2", "MASTER_ADDR": "127.0.0.1"})
    assert result.returncode == 1 and "ddp_spawn.py runs on one node" in result.output, result.output


def test_killed_worker_restarts_and_resumes_exactly(tmp_path):
    """SIGKILL one worker after the first checkpoint: torchrun restarts the group, it resumes from the
    checkpoint, and the run ends where an uninterrupted one does, bit for bit."""
    reference = launch("ddp_torchrun.py", *train_flags(tmp_path / "reference", RESTART_STEPS), timeout=240)
    assert reference.returncode == 0, reference.output

    out = tmp_path / "killed"
    killed = kill_a_worker([str(LAUNCHER), "ddp_torchrun.py", *map(str, train_flags(out, RESTART_STEPS))],
                           out / "ckpt" / "checkpoint.pt", env={"MAX_RESTARTS": "2"})
    assert killed.run.returncode == 0, killed.run.output
    assert "failed (exitcode: -9) local_rank: 1" in killed.run.output, killed.run.output  # torchrun saw it
    assert killed.resumed_after is not None, killed.run.output
    print(f"killed a worker after the first checkpoint; training resumed {killed.resumed_after:.1f}s later")
    assert f"resumed from {out / 'ckpt' / 'checkpoint.pt'} at step 8" in killed.run.output, killed.run.output

    got, expected = load(out / "ckpt"), load(tmp_path / "reference" / "ckpt")
    assert got["step"] == expected["step"] == RESTART_STEPS
    assert all(torch.equal(got["model"][name], expected["model"][name]) for name in expected["model"])
    assert torch.equal(torch.cat([s["exp_avg_sq"].flatten() for s in got["optimizer"]["state"].values()]),
                       torch.cat([s["exp_avg_sq"].flatten() for s in expected["optimizer"]["state"].values()]))


def test_worker_that_raises_fails_the_job_after_its_restarts(tmp_path):
    """A bug restarts a bounded number of times, then the job exits non-zero and leaves no process behind."""
    env = injected(tmp_path, "import os\nif os.environ.get('LOCAL_RANK') == '1':\n"
                             "    import torch\n"
                             "    clip, calls = torch.nn.utils.clip_grad_norm_, []\n"
                             "    def failing_clip(*args, **kwargs):  # the third training step raises\n"
                             "        calls.append(None)\n"
                             "        if len(calls) == 3:\n"
                             "            raise RuntimeError('injected failure in rank 1')\n"
                             "        return clip(*args, **kwargs)\n"
                             "    torch.nn.utils.clip_grad_norm_ = failing_clip\n")
    tag = {"LAUNCH_TEST_TAG": str(tmp_path)}
    result = launch("ddp_torchrun.py", *train_flags(tmp_path), env={"MAX_RESTARTS": "2", **env, **tag}, timeout=120)
    assert result.returncode != 0, result.output
    assert result.output.count("RuntimeError: injected failure in rank 1") == 3, result.output  # a try, two restarts
    print(f"failed after 2 restarts in {result.seconds:.1f}s")
    time.sleep(1)  # a process that outlived the launcher would still be here now
    assert not tagged_processes(tag["LAUNCH_TEST_TAG"]), "processes outlived the job"


def test_stuck_rank_fails_the_job_within_its_timeout(tmp_path):
    """A rank that stops taking part (alive, but never reaching the next all-reduce) ends the job after
    --timeout: the other rank's collective times out, and torchrun stops the stuck one: with SIGKILL, 30 s after
    its SIGTERM, which the stuck rank notes to save at the end of a step it never ends."""
    env = injected(tmp_path, "import os\nif os.environ.get('LOCAL_RANK') == '1':\n"
                             "    import time, torch\n"
                             "    clip, calls = torch.nn.utils.clip_grad_norm_, []\n"
                             "    def stuck_clip(*args, **kwargs):  # the third training step never ends\n"
                             "        calls.append(None)\n"
                             "        if len(calls) == 3:\n"
                             "            time.sleep(3600)\n"
                             "        return clip(*args, **kwargs)\n"
                             "    torch.nn.utils.clip_grad_norm_ = stuck_clip\n")
    tag = {"LAUNCH_TEST_TAG": str(tmp_path)}
    result = launch("ddp_torchrun.py", *train_flags(tmp_path), "--timeout", 5, env={"MAX_RESTARTS": "0", **env, **tag},
                    timeout=280)
    assert result.returncode != 0, result.output
    assert "Timed out waiting 5000ms" in result.output, result.output
    # Seen: 43 s (13 s, and torchrun's 30 s). The bound only has to tell --timeout 5 from the default 300 s: any
    # bound under it, as wide as a loaded machine needs.
    assert result.seconds < 250, f"--timeout 5, yet the job ended after {result.seconds:.0f} s"
    time.sleep(1)
    assert not tagged_processes(tag["LAUNCH_TEST_TAG"]), "processes outlived the job"


def test_peer_that_never_arrives_fails_within_the_timeout(tmp_path):
    # Rank 0 of a world of 2 whose rank 1 never starts: no launcher, just the script and its --timeout.
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports()[0])}
    result = run_command([sys.executable, str(ROOT / "ddp_torchrun.py"), *map(str, train_flags(tmp_path)), "--timeout", "5"],
                         env=env, timeout=280)
    assert result.returncode != 0, result.output
    assert "waiting for clients. 1/2 clients joined" in result.output, result.output
    assert result.seconds < 250, f"--timeout 5 (the default is 300), yet the job ended after {result.seconds:.0f} s"


def test_node_that_never_joins_times_out_clearly(tmp_path):
    result = launch("ddp_torchrun.py", *train_flags(tmp_path),
                    env={"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports()[0]),
                         "JOIN_TIMEOUT": "5", "NPROC_PER_NODE": "1"}, timeout=280)
    assert result.returncode != 0
    assert "waiting up to 5s (JOIN_TIMEOUT) for 2 nodes" in result.output
    assert result.output.rstrip().endswith("RendezvousTimeoutError"), result.output
    assert result.seconds < 250, f"JOIN_TIMEOUT=5 (default 300), yet the launcher gave up after {result.seconds:.0f} s"


def test_check_passes_and_reports_bandwidth():
    result = launch("--check")
    assert result.returncode == 0, result.output
    assert "check passed: world size 2 (1 node x 2 processes), backend gloo" in result.output
    assert "all_reduce of 32 MiB:" in result.output and "GB/s" in result.output


def test_check_names_the_rank_that_fails(tmp_path):
    # Rank 1's all_reduce comes back off by one, as from a broken link or a bad GPU.
    env = injected(tmp_path, "import os\nif os.environ.get('RANK') == '1':\n"
                             "    import torch.distributed as dist\n"
                             "    all_reduce = dist.all_reduce\n"
                             "    dist.all_reduce = lambda tensor, *a, **k: (all_reduce(tensor, *a, **k), tensor.add_(1))[0]\n")
    result = launch("--check", "ddp_torchrun.py", *train_flags(tmp_path), env=env)
    assert result.returncode != 0, result.output
    assert "check failed on rank 1:" in result.output
    assert "rank 1 on" in result.output and "all_reduce gave 4, expected 3" in result.output
    assert not (tmp_path / "ckpt").exists(), "training ran after a failed check"


# The CPUs each node's task gets: sbatch's --cpus-per-task, else the fewest the job holds on a node.
@pytest.mark.parametrize("cpus, expected", [({"SLURM_CPUS_PER_TASK": "16", "SLURM_JOB_CPUS_PER_NODE": "72(x2)"}, 16),
                                            ({"SLURM_JOB_CPUS_PER_NODE": "72,36"}, 36),
                                            ({"SLURM_JOB_CPUS_PER_NODE": "72(x2)"}, 72)])
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
        "env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 --rdzv-backend=c10d "
        "--rdzv-endpoint=localhost:24242 --rdzv-id=4242 --rdzv-conf=join_timeout=300 --nproc-per-node=4 "
        "--max-restarts=3 ddp_torchrun.py --batch-size 64 --ckpt-dir ckpt")
    assert "note: this job holds" not in result.output


def test_slurm_job_with_one_cpu_per_node_is_told(tmp_path):
    """sbatch without --cpus-per-task often gets one CPU per node: 4 workers would share it."""
    (tmp_path / "scontrol").write_text("#!/bin/sh\nprintf 'localhost\\nn2\\n'\n")
    (tmp_path / "scontrol").chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost,n2", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_GPUS_PER_NODE": "4", "SLURM_JOB_CPUS_PER_NODE": "1(x2)",
             "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    result = launch("--dry-run", "ddp_torchrun.py", "--ckpt-dir", "ckpt", env=slurm)
    assert result.returncode == 0, result.output
    assert ("launch_distributed.sh: note: this job holds 1 CPU(s) per node for 4 processes each; ask sbatch for "
            "more with --cpus-per-task=N (or --exclusive)") in result.output


def test_slurm_mode_needs_a_job_id():
    """Outside an allocation $SLURM_JOB_ID is empty: every torchrun would invent its own rendezvous id and wait."""
    result = launch("ddp_torchrun.py", env={"SLURM_JOB_ID": "", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"})
    assert result.returncode == 1
    assert result.output.strip() == ("launch_distributed.sh: error: SLURM variables are set but SLURM_JOB_ID is empty: "
                                     "run this through sbatch or inside salloc")


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "2"}, "NNODES=2 needs MASTER_ADDR"),
    ({"NNODES": "2", "MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR no-such-host.invalid does not resolve"),
    ({"MAX_RESTARTS": "lots"}, "MAX_RESTARTS must be a whole number, got 'lots'"),
    ({"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "MASTER_ADDR": "127.0.0.1", "SLURM_JOB_CPUS_PER_NODE": "N/A"},
     "cannot tell the job's CPUs per node from SLURM_CPUS_PER_TASK or SLURM_JOB_CPUS_PER_NODE (got 'N/A')"),
])
def test_bad_environment_fails_at_once(env, message):
    result = launch("ddp_torchrun.py", env=env, timeout=30)
    assert result.returncode == 1
    assert result.output.strip().startswith(f"launch_distributed.sh: error: {message}"), result.output


def test_rank_that_fails_just_after_a_checkpoint_does_not_lose_it(tmp_path):
    """With --sync-checkpoints, rank 0 takes 3 s to write the step-8 checkpoint; rank 1 fails in the first thing it
    does after the checkpoint (validation at step 8). The barrier after the save holds rank 1 until the checkpoint is
    written, so with it the checkpoint is there whatever the timing. (Written in the background, the default, a
    checkpoint has torchrun's grace period to end its write; a kill during it leaves the one before: see
    test_preemption.py.) Without it, rank 1 fails at once and
    torchrun, which looks at its workers every 0.1 s, stops rank 0 long before its 3 s save ends: SIGTERM, which
    rank 0 notes to stop after the save, then SIGKILL after a grace period, 30 s in torchrun and 1 s here (a save of
    a large model can take longer than 30 s)."""
    env = injected(tmp_path, "import os\n"
                             "from torch.distributed.elastic.multiprocessing.api import PContext\n"
                             "close = PContext.close\n"
                             "PContext.close = lambda self, death_sig=None, timeout=30: close(self, death_sig, 1)\n"
                             "if os.environ.get('RANK') == '0':\n"
                             "    import time, torch\n"
                             "    save = torch.save\n"
                             "    def slow_save(*args, **kwargs):\n"
                             "        time.sleep(3)\n"
                             "        return save(*args, **kwargs)\n"
                             "    torch.save = slow_save\n"
                             "if os.environ.get('RANK') == '1':\n"
                             "    import torch, torch.nn.functional as F\n"
                             "    zero_grad, cross_entropy, steps = torch.optim.Optimizer.zero_grad, F.cross_entropy, []\n"
                             "    def counting_zero_grad(self, *args, **kwargs):  # called once, at the end of each step\n"
                             "        steps.append(None)\n"
                             "        return zero_grad(self, *args, **kwargs)\n"
                             "    def failing_cross_entropy(*args, **kwargs):\n"
                             "        if len(steps) == 8:\n"
                             "            raise RuntimeError('injected failure in rank 1 after step 8')\n"
                             "        return cross_entropy(*args, **kwargs)\n"
                             "    torch.optim.Optimizer.zero_grad = counting_zero_grad\n"
                             "    F.cross_entropy = failing_cross_entropy\n")
    result = launch("ddp_torchrun.py", *train_flags(tmp_path), "--sync-checkpoints", env={"MAX_RESTARTS": "0", **env})
    assert result.returncode != 0, result.output
    assert "injected failure in rank 1 after step 8" in result.output, result.output
    assert load(tmp_path / "ckpt")["step"] == 8


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(trained, tmp_path):
    """Killed in the middle of writing the step-16 checkpoint, the run leaves step 8's intact; run
    again, it resumes from there and ends where an uninterrupted run does."""
    env = injected(tmp_path, "import os, signal, torch\nsave = torch.save\nsaves = []\n"
                             "def torn_save(obj, f, *args, **kwargs):\n"
                             "    saves.append(obj)\n"
                             "    if len(saves) == 2:  # the second checkpoint: write part of it, then die\n"
                             "        f.write(b'PK' * 1000)\n"
                             "        f.flush()\n"
                             "        os.kill(os.getpid(), signal.SIGKILL)\n"
                             "    return save(obj, f, *args, **kwargs)\n"
                             "torch.save = torn_save\n")
    out = tmp_path / "run"
    crashed = launch("ddp_torchrun.py", *train_flags(out), env=dict(env, MAX_RESTARTS="0"))
    assert crashed.returncode != 0, crashed.output
    assert (out / "ckpt" / "checkpoint.pt.tmp").exists(), "the crash did not happen while writing"
    assert load(out / "ckpt")["step"] == 8

    resumed = launch("ddp_torchrun.py", *train_flags(out))
    assert resumed.returncode == 0, resumed.output
    assert "resumed from" in resumed.output and "at step 8" in resumed.output
    got, expected = load(out / "ckpt")["model"], load(trained["ddp_torchrun.py"].ckpt_dir)["model"]
    assert max_param_diff(got, expected) <= PARAM_ATOL
