"""launch_distributed.sh on two nodes: the same command, started once per node, forms one job that
trains exactly as torchrun does on one node, and --check passes across both. The nodes are two
launchers on localhost, and, where this machine lets root make network namespaces, two namespaces
joined by a veth pair, each with its own address and hostname as two machines have."""

import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (LAUNCHER, PARAM_ATOL, ROOT, STEPS, TINY, WARNING, Run, environment, free_ports, injected, kill_all,
                      load, max_param_diff)

TIMEOUT = 180
# Both nodes take the same settings, as on a cluster. One process per node: the world of 2 that conftest's
# torchrun run trains, on two cores. A node that never joins fails the job after JOIN_TIMEOUT, within TIMEOUT.
NODE_ENV = {"NNODES": "2", "NPROC_PER_NODE": "1", "JOIN_TIMEOUT": "60"}
ADDRESSES = {"node1": "10.77.0.1", "node2": "10.77.0.2"}  # private to the namespaces: the machine never sees them


# How a multi-node job can end, through no fault of its own (pytorch/pytorch#123678): after the last step
# every node's torchrun closes the rendezvous in the store that the host node's torchrun keeps, and the host
# may close it and exit first. A node that comes later finds the store gone: it logs TCPStore's C++ warning
# with a stack (one per failed store call; torch 2.4 logs none), then that it "has failed to shutdown the
# rendezvous" (twice in torch 2.4), and exits 0 all the same. That message, at the very end of a node's
# output, is the only one a test lets through.
SHUTDOWN_RACE = re.compile(
    r"(^\[W\d{4} [\d:.]+ TCPStore\.cpp:\d+\] \[c10d\] \w+ failed on SocketImpl\([^\n]*\n(?:[^\n]+\n)*\n)*"  # and its stack
    r"(^W\d{4} [\d:.]+ \d+ \S+/dynamic_rendezvous\.py:\d+\] The node '\S+' has failed to shutdown the rendezvous "
    r"'\S+' due to an error of type RendezvousConnectionError\.\n)+\Z", re.MULTILINE)


def warnings(output):
    """The warnings in a node's output, less the shutdown race above."""
    return WARNING.findall(SHUTDOWN_RACE.sub("", output))


def test_only_the_shutdown_race_is_let_through():
    """The pattern takes the race's lines and no others: a warning between them still counts."""
    stack = ("[W1122 16:28:49.570148546 TCPStore.cpp:115] [c10d] recvVector failed on SocketImpl(fd=3): Failed to recv\n"
             "Exception raised from recvBytes at Utils.hpp:787 (most recent call first):\n"
             "frame #0: c10::Error::Error(c10::SourceLocation)\n\n")
    race = ("W1122 16:28:49.898000 14606 site-packages/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1298] "
            "The node 'localhost_14606_0' has failed to shutdown the rendezvous 'ddp_torchrun' due to an error of type "
            "RendezvousConnectionError.\n")
    assert warnings("step 16 | val loss 3.0258\n" + stack + race) == []
    assert warnings(stack + race + race) == []  # torch 2.4 logs it twice
    assert warnings(stack + "UserWarning: something real\n" + stack + race) == ["[W1122 ", "Warning"]
    assert warnings(race + "step 17\n") == ["W1122 "]  # not at the end: not the race


def train_flags(out):
    # One --ckpt-dir for both nodes, as on a shared filesystem: only global rank 0 writes, on either node.
    return [*TINY, "--max-steps", STEPS, "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb"]


def run_nodes(commands, envs, log_dir):
    """Start one command per node at once and wait for all; return each node's Run. Past TIMEOUT, kill every
    process they started and fail with every node's output."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    logs = [log_dir / f"node{i}.log" for i in range(len(commands))]
    procs = []
    start = time.monotonic()
    try:
        for command, env, log in zip(commands, envs, logs):
            with open(log, "w") as out:  # a file, not a pipe: nothing blocks on a node whose output nobody reads
                procs.append(subprocess.Popen([str(a) for a in command], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                              env=environment({**env, "LAUNCH_TEST_TAG": tag}), start_new_session=True))
        while any(proc.poll() is None for proc in procs) and time.monotonic() < start + TIMEOUT:
            time.sleep(0.1)
    finally:
        hung = [proc for proc in procs if proc.poll() is None]
        for proc in hung:
            kill_all(proc, tag)
        for proc in procs:
            proc.wait()
    seconds = time.monotonic() - start
    outputs = [log.read_text() for log in logs]
    if hung:
        pytest.fail(f"the nodes ran past {TIMEOUT}s:\n" +
                    "\n".join(f"==> node {i} <==\n{output}" for i, output in enumerate(outputs)))
    return [Run(proc.returncode, output, seconds) for proc, output in zip(procs, outputs)]


def assert_trained_like_torchrun(nodes, out, trained, where):
    output = "\n".join(node.output for node in nodes)
    assert all(node.returncode == 0 for node in nodes), output
    assert all("torchrun --nnodes=2 --rdzv-backend=c10d" in node.output for node in nodes), output
    # One job of 2 (two jobs of 1 would each say "world size 1"), whose rank 0 alone prints.
    assert output.count("x world size 2") == 1, output
    state = load(out / "ckpt")
    assert state["step"] == STEPS
    diff = max_param_diff(state["model"], load(trained["ddp_torchrun.py"].ckpt_dir)["model"])
    print(f"{where}: largest parameter difference from torchrun on one node {diff:g}, {nodes[0].seconds:.1f}s")
    assert diff <= PARAM_ATOL


def assert_check_passed(nodes):
    output = "\n".join(node.output for node in nodes)
    assert all(node.returncode == 0 for node in nodes), output
    assert "check passed: world size 2 (2 nodes x 1 process), backend gloo" in output


def on_localhost(*args):
    """The launcher's command line for node 0 and node 1 on this machine, with their environments."""
    # Both nodes resolve MASTER_ADDR to this machine: NODE_RANK says which of them hosts the rendezvous.
    env = {**NODE_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports()[0])}
    return [[LAUNCHER, *args]] * 2, [{**env, "NODE_RANK": str(rank)} for rank in range(2)]


def test_two_nodes_on_localhost_train_like_torchrun_on_one(trained, tmp_path):
    nodes = run_nodes(*on_localhost("ddp_torchrun.py", *train_flags(tmp_path)), tmp_path)
    assert_trained_like_torchrun(nodes, tmp_path, trained, "two nodes on localhost")
    assert not any(warnings(node.output) for node in nodes), "\n".join(node.output for node in nodes)


def test_the_shutdown_race_leaves_a_successful_job(trained, tmp_path):
    """Force the race that SHUTDOWN_RACE describes: node 1's torchrun closes the rendezvous only once node
    0's, the host, has exited and taken the store with it. The job still succeeds, and that one message,
    recognised, is the only warning."""
    commands, envs = on_localhost("ddp_torchrun.py", *train_flags(tmp_path))
    envs[1] = {**envs[1], **injected(tmp_path, """\
import os, sys
if os.path.basename(sys.argv[0]) == "torchrun":
    import socket, time
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    close = dynamic_rendezvous.DynamicRendezvousHandler._close
    def close_once_the_store_is_gone(self):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), 1).close()
                time.sleep(0.1)
            except OSError:
                break
        return close(self)
    dynamic_rendezvous.DynamicRendezvousHandler._close = close_once_the_store_is_gone
""")}
    nodes = run_nodes(commands, envs, tmp_path)
    assert_trained_like_torchrun(nodes, tmp_path, trained, "two nodes, shutdown race forced")
    assert SHUTDOWN_RACE.search(nodes[1].output), nodes[1].output
    assert not any(warnings(node.output) for node in nodes), "\n".join(node.output for node in nodes)


def test_nodes_that_resume_from_different_checkpoints_stop(trained, tmp_path):
    """Each node given a --ckpt-dir of its own (node-local disks): node 0's holds step 16, node 1's
    nothing. Training on would mix two states; every rank stops at once and says why."""
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    for path in dirs:
        path.mkdir()
    shutil.copy(trained["ddp_torchrun.py"].ckpt_dir / "checkpoint.pt", dirs[0])
    before = hashlib.sha256((dirs[0] / "checkpoint.pt").read_bytes()).hexdigest()
    _, envs = on_localhost()
    commands = [[LAUNCHER, "ddp_torchrun.py", *TINY, "--max-steps", 2 * STEPS, "--ckpt-dir", path, "--log-dir", path / "tb"]
                for path in dirs]
    nodes = run_nodes(commands, [{**env, "MAX_RESTARTS": "0"} for env in envs], tmp_path)
    output = "\n".join(node.output for node in nodes)
    assert all(node.returncode != 0 for node in nodes), output
    assert ("ddp_torchrun.py: error: ranks resumed at different steps [0, 16]: all must read one checkpoint, in a "
            "shared --ckpt-dir") in output, output
    assert "step    17" not in output, "trained after the ranks disagreed"
    assert hashlib.sha256((dirs[0] / "checkpoint.pt").read_bytes()).hexdigest() == before


def test_check_on_two_nodes_on_localhost(tmp_path):
    assert_check_passed(run_nodes(*on_localhost("--check"), tmp_path))


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory):
    """Two network namespaces joined by a veth pair, node1's at 10.77.0.1 and node2's at 10.77.0.2, and a hosts
    file that names them; yields ({hostname: namespace}, hosts file). Skips where the machine does not allow it."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to create network namespaces and bind-mount /etc/hosts")
    missing = [program for program in ("ip", "unshare", "mount", "hostname") if shutil.which(program) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (iproute2, util-linux)")
    namespaces = {name: f"test_two_nodes_{os.getpid()}_{name}" for name in ADDRESSES}
    # Interface names may be 15 characters at most.
    veths = {name: f"v{os.getpid() % 10**7}{name}" for name in ADDRESSES}
    created = []
    try:
        for name in ADDRESSES:
            ip("netns", "add", namespaces[name])
            created.append(namespaces[name])
        ip("link", "add", veths["node1"], "type", "veth", "peer", "name", veths["node2"])
        for name, address in ADDRESSES.items():
            ip("link", "set", veths[name], "netns", namespaces[name])
            ip("-n", namespaces[name], "addr", "add", f"{address}/24", "dev", veths[name])
            ip("-n", namespaces[name], "link", "set", veths[name], "up")
            ip("-n", namespaces[name], "link", "set", "lo", "up")  # up on a machine, down in a new namespace
    except subprocess.CalledProcessError as e:
        for namespace in created:
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", veths["node1"]], check=False, capture_output=True, timeout=30)  # if never moved
        pytest.skip(f"cannot make network namespaces here (needs CAP_NET_ADMIN and CAP_SYS_ADMIN): "
                    f"{' '.join(e.cmd)}: {e.stderr.strip()}")
    hosts = tmp_path_factory.mktemp("hosts") / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{address} {name}\n" for name, address in ADDRESSES.items()))
    yield namespaces, hosts
    for namespace in namespaces.values():
        # Nothing left running may keep a namespace (and its veth end) alive after it is deleted.
        pids = subprocess.run(["ip", "netns", "pids", namespace], check=False, capture_output=True, text=True, timeout=30).stdout
        for pid in pids.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True, timeout=30)


def on_two_machines(namespaces, hosts, *args):
    """The launcher's command line for node1 and node2, each in its namespace, with their environments."""
    # torchrun's rank-0 agent gives the workers its hostname as MASTER_ADDR, and gloo listens on the address
    # its hostname resolves to: with the machine's name and /etc/hosts (127.0.0.1 on both nodes) the job hangs.
    # So each node gets its own hostname (unshare --uts) and the hosts file, bind-mounted over /etc/hosts in a
    # mount namespace of its own (unshare --mount makes its mounts private: the machine's /etc/hosts is untouched).
    # The same environment on both, as the usage text shows: no NODE_RANK (node1 finds it hosts by its name),
    # and the default port, free in a fresh namespace.
    commands = [["ip", "netns", "exec", namespace, "unshare", "--uts", "--mount", "sh", "-c",
                 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"', "sh", hosts, name,
                 LAUNCHER, *args] for name, namespace in namespaces.items()]
    return commands, [{**NODE_ENV, "MASTER_ADDR": "node1"}] * len(commands)


def test_two_machines_train_like_torchrun_on_one(namespaces, trained, tmp_path):
    etc_hosts, hostname = Path("/etc/hosts").read_text(), socket.gethostname()
    nodes = run_nodes(*on_two_machines(*namespaces, "ddp_torchrun.py", *train_flags(tmp_path)), tmp_path)
    assert (Path("/etc/hosts").read_text(), socket.gethostname()) == (etc_hosts, hostname), "a node leaked its own"
    assert_trained_like_torchrun(nodes, tmp_path, trained, "two nodes in network namespaces")
    assert "\nnode1: rank 0 on cpu\nnode2: rank 1 on cpu\n" in nodes[0].output, nodes[0].output  # rank 0's lines, a host each


def test_check_on_two_machines(namespaces, tmp_path):
    assert_check_passed(run_nodes(*on_two_machines(*namespaces, "--check"), tmp_path))


# A GPU node (8 GPUs, faked for the launcher's count) or a CPU one: gloo is used on both, beside NCCL on GPUs. Its
# name resolves to loopback (Debian names a machine 127.0.1.1 in /etc/hosts), or to an address of another machine.
@pytest.mark.parametrize("gpus, address, reason", [
    (0, "127.0.1.1", "which other nodes cannot reach (a loopback address)"),
    (8, "127.0.1.1", "which other nodes cannot reach (a loopback address)"),
    (8, "10.77.0.99", "not an address of this node, so gloo would listen on loopback, which other nodes cannot reach")])
def test_node_whose_name_gloo_cannot_use_is_refused(namespaces, tmp_path, gpus, address, reason):
    """torchrun would hand that name to the other node's workers, which would wait on an address nobody listens on
    until the timeout; gloo would fail to start on one not this node's: the launcher refuses at once."""
    names, _ = namespaces
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} node1\n10.77.0.2 node2\n")
    commands, envs = on_two_machines({"node1": names["node1"]}, hosts, "ddp_torchrun.py")
    env = {**envs[0], "MASTER_ADDR": "node2"}
    if gpus:
        env.update(injected(tmp_path, f"import torch\ntorch.cuda.device_count = lambda: {gpus}\n"))
    [node] = run_nodes(commands, [env], tmp_path)
    assert node.returncode == 1
    assert node.output.strip() == (f"launch_distributed.sh: error: this node's name node1 resolves to {address}, "
                                   f"{reason}: map it to the node's network address in /etc/hosts, or set "
                                   "GLOO_SOCKET_IFNAME to its network interface (NCCL_SOCKET_IFNAME too, if NCCL picks "
                                   "a wrong one)"), node.output
    # At once: that line alone, without the "waiting up to 60s (JOIN_TIMEOUT)" that comes before the rendezvous.
