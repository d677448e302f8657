"""launch_distributed.sh under a real Slurm: a private controller and two slurmd on this machine, emulating
two nodes, run `sbatch launch_distributed.sh ddp_torchrun.py`, stopped and requeued on the way, and the job trains
exactly as torchrun does on one node. Needs root and Debian's slurmctld, slurmd, slurm-client and munge; skips
without them."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import LAUNCHER, ROOT, STEPS, TINY, free_ports, load, max_param_diff
from test_preemption import HOLD_STEP, hold

PROGRAMS = ["mungekey", "munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel"]
# Nodes named by loopback addresses: the launcher makes the allocation's first node name the rendezvous
# host, and these resolve on any machine, with no /etc/hosts entries and no MASTER_ADDR to bypass that code.
NODES = ["127.0.0.1", "127.0.0.2"]
JOB_NAME = "test_slurm"
JOB_TIMEOUT = 180
# CPUs per emulated node: both nodes are this machine, and a node configured with more CPUs than the
# machine has is drained. Two, where there are, so that a job's worker bound to one CPU shows.
CPUS = min(2, len(os.sched_getaffinity(0)))


def wait_until(condition, seconds):
    """Poll condition() until it holds (True) or `seconds` pass (False)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def running(pid):
    # A daemon's parent is init, which in a container may never reap it: a zombie counts as exited.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # after "pid (command)"
    except OSError:
        return False


def stop(pid_file):
    """Stop the daemon whose PID pid_file holds, and wait until it has exited; never by name, as other
    Slurm daemons may run on this machine."""
    if not pid_file.exists():  # it never started, or it exited and removed the file
        return
    pid = int(pid_file.read_text())
    for sig in signal.SIGTERM, signal.SIGKILL:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if wait_until(lambda: not running(pid), 10):
            return


def daemon_logs(directory):
    return "\n".join(f"==> {log.name} <==\n{log.read_text()}" for log in sorted(directory.glob("*.log")))


@pytest.fixture(scope="session")
def slurm():
    """A private Slurm cluster of two nodes on this machine, with its own munge key and socket, ports, state
    and logs in a temporary directory; yields the environment that points Slurm's commands at it."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run Slurm's and munge's daemons")
    missing = [program for program in PROGRAMS if shutil.which(program) is None]
    if missing:
        pytest.skip(f"needs Slurm and munge ({', '.join(missing)} not found): "
                    "apt-get install slurmctld slurmd slurm-client munge")
    with tempfile.TemporaryDirectory(prefix="test_slurm-") as tmp:
        tmp = Path(tmp)
        tmp.chmod(0o755)  # munged refuses a socket that not every user can reach: any user's job needs it
        controller_port, *node_ports = free_ports(1 + len(NODES))
        node_lines = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 CPUs={CPUS} Port={port}"
                               for name, port in zip(NODES, node_ports))
        # proctrack/linuxproc: no cgroups, which containers often lack. task/affinity binds a job's tasks to
        # the CPUs they were given (with sched_setaffinity), as clusters do. %n: the node's name.
        # cred_expire=5: a requeued job may start again 5 s after it stopped, not the default 120 s.
        # MinJobAge=5 makes sbatch --wait check on the job every 2 s; with the default, 300, it checks at 2, 10
        # and 42 s, so a job done in 11 s would return at 42 s.
        (tmp / "slurm.conf").write_text(f"""\
ClusterName=test
SlurmctldHost=localhost
SlurmctldPort={controller_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={tmp}/munge.socket,cred_expire=5
StateSaveLocation={tmp}/state
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdSpoolDir={tmp}/spool-%n
SlurmdPidFile={tmp}/slurmd-%n.pid
SlurmdLogFile={tmp}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
MpiDefault=none
JobCompType=jobcomp/none
ReturnToService=2
MinJobAge=5
{node_lines}
PartitionName=emulated Nodes=ALL Default=YES State=UP
""")
        (tmp / "state").mkdir()
        # SLURM_CONF reaches every Slurm command, the job's srun and scontrol included (sbatch exports the
        # environment). A SLURM_* or SBATCH_* variable of an allocation that runs these tests is not ours.
        env = {name: value for name, value in os.environ.items() if not name.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env["SLURM_CONF"] = str(tmp / "slurm.conf")
        daemons = {tmp / "munged.pid": ["munged", f"--socket={tmp}/munge.socket", f"--key-file={tmp}/munge.key",
                                        f"--pid-file={tmp}/munged.pid", f"--log-file={tmp}/munged.log",
                                        f"--seed-file={tmp}/munged.seed"],
                   tmp / "slurmctld.pid": ["slurmctld"]}
        for name in NODES:  # one slurmd per node, told which node it is
            daemons[tmp / f"slurmd-{name}.pid"] = ["slurmd", "-N", name]

        start = time.monotonic()
        try:
            subprocess.run(["mungekey", "--create", f"--keyfile={tmp}/munge.key"], check=True, capture_output=True,
                           timeout=30)
            for argv in daemons.values():  # each forks into the background, writes its PID file, and returns
                started = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=30)
                if started.returncode != 0:
                    pytest.fail(f"{' '.join(argv)} failed: {started.stdout}{started.stderr}\n{daemon_logs(tmp)}")

            def idle():
                states = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%t"], check=False, env=env, capture_output=True,
                                        text=True, timeout=10).stdout.split()
                return states == ["idle"] * len(NODES)

            if not wait_until(idle, 30):
                pytest.fail(f"the Slurm nodes were not idle 30 s after starting:\n{daemon_logs(tmp)}")
            version = subprocess.run(["sinfo", "--version"], check=False, env=env, capture_output=True, text=True, timeout=10)
            print(f"\n{version.stdout.strip()}: nodes idle {time.monotonic() - start:.1f} s after starting")
            yield env
        finally:
            start = time.monotonic()
            for pid_file in reversed(daemons):  # the nodes, the controller, then munge
                stop(pid_file)
            print(f"\nSlurm and munge stopped in {time.monotonic() - start:.1f} s")


def test_sbatch_trains_on_two_nodes_and_a_stop_before_the_time_limit_requeues_to_the_same_end(slurm, trained,
                                                                                                 tmp_path):
    """`sbatch launch_distributed.sh ddp_torchrun.py` on two nodes, one process each (the world of 2 that conftest's
    torchrun run trains), told to stop in step 5 as the launcher's #SBATCH --signal=B:USR1@120 tells it before the
    time limit (here by scancel): the workers save at one step and stop, the job requeues itself, and its second
    start resumes and ends on the uninterrupted run's weights, bit for bit. Both ranks hold step 5 until the stop
    reaches one of them: SLURM signals each node's step on its own, and one rank's signal must stop both."""
    # MASTER_PORT: the launcher's default, 20000 + job id % 10000, is the same for every fresh cluster, so two runs
    # of this test at once would meet in one rendezvous. OMP_NUM_THREADS and PATH: what conftest.run_command gives
    # every script. SLURM_CPU_BIND=cores: tasks bound to their CPUs, as on clusters that enforce it, where a task
    # that srun gives one CPU (its default since Slurm 22.05 ignores the job's --cpus-per-task) binds every worker to
    # it. Each worker reports the CPUs it may run on.
    rendezvous_port = free_ports(1)[0]
    env = dict(slurm, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{slurm['PATH']}",
               NPROC_PER_NODE="1", MASTER_PORT=str(rendezvous_port), SLURM_CPU_BIND="cores",
               **hold(tmp_path, HOLD_STEP, "every", also="if 'LOCAL_RANK' in os.environ:\n"
                                                   "    cpus = sorted(os.sched_getaffinity(0))\n"
                                                   "    print(f'rank {os.environ[\"RANK\"]} may run on CPUs {cpus}', "
                                                   "flush=True)\n"))
    job_output = tmp_path / "job.out"

    def output():
        return job_output.read_text() if job_output.exists() else ""

    def report():  # the job's output, and what Slurm's daemons did with its signals
        return f"{output()}\n{daemon_logs(Path(slurm['SLURM_CONF']).parent)}"

    # The node and task counts come from the launcher's #SBATCH lines, as for a user; the CPUs, as the launcher's
    # header says, from sbatch's command line.
    argv = ["sbatch", "--wait", "--parsable", f"--job-name={JOB_NAME}", f"--output={job_output}", f"--chdir={tmp_path}",
            f"--cpus-per-task={CPUS}", str(LAUNCHER), str(ROOT / "ddp_torchrun.py"), *TINY, "--max-steps", str(STEPS),
            "--ckpt-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "tb")]
    sbatch = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: f"holding step {HOLD_STEP}" in output(), JOB_TIMEOUT), report()
        subprocess.run(["scancel", "--batch", "--signal=USR1", f"--name={JOB_NAME}"], env=env, check=True, timeout=30)
        job_id, errors = sbatch.communicate(timeout=JOB_TIMEOUT)
    finally:
        if sbatch.poll() is None:  # killing sbatch leaves the job running: cancel it, so that no rank outlives the test
            sbatch.kill()
            subprocess.run(["scancel", f"--name={JOB_NAME}"], check=False, env=env, timeout=30)
            wait_until(lambda: not subprocess.run(["squeue", "--noheader", f"--name={JOB_NAME}"], check=False, env=env,
                                                  capture_output=True, text=True, timeout=10).stdout.strip(), 60)
    log = output()  # both starts of the job, one after the other (#SBATCH --open-mode=append)
    assert sbatch.returncode == 0, f"{job_id}{errors}\n{report()}"

    job_id = job_id.strip()
    srun = [line.split() for line in log.splitlines() if line.startswith("srun ")]
    assert len(srun) == 2, report()  # a start, and the requeued one
    assert all({"--nodes=2", "--ntasks-per-node=1", f"--cpus-per-task={CPUS}", "torchrun", "--nnodes=2",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={NODES[0]}:{rendezvous_port}",
                f"--rdzv-id={job_id}"} <= set(line) for line in srun), log
    assert log.count("x 2 processes") == 2, log
    affinity = dict(re.findall(r"^rank (\d) may run on CPUs (\[.*\])$", log, re.MULTILINE))
    print(f"\nworkers' CPUs: {affinity}")
    assert sorted(affinity) == ["0", "1"], log
    assert all(len(cpus.split(",")) == CPUS for cpus in affinity.values()), affinity

    step = HOLD_STEP + 1  # the distributed scripts' stop: the vote of the next logging step (TINY: every 2)
    assert f"step {step:>5} | stopped by SIGTERM: run again to resume" in log, report()
    assert f"launch_distributed.sh: stopped by SIGUSR1: job {job_id} goes back in the queue" in log, report()
    assert f"resumed from {tmp_path / 'ckpt' / f'step-{step:06d}'} at step {step}" in log, report()
    got, expected = load(tmp_path / "ckpt"), load(trained["ddp_torchrun.py"].ckpt_dir)
    assert got["step"] == STEPS
    diff = max_param_diff(got["model"], expected["model"])
    print(f"\nSLURM job {job_id} on nodes {', '.join(NODES)}, stopped at step {step}, requeued and resumed: largest "
          f"parameter difference from one-node torchrun: {diff:.3g}")
    assert diff == 0
