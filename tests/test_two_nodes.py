"""launch_distributed.sh on two nodes: the same command, started once per node (here, twice on localhost, one
process each), forms one job that trains as torchrun does on one node."""

import os
import re
import subprocess
import time

import pytest

from conftest import (LAUNCHER, PARAM_ATOL, ROOT, STEPS, TINY, WARNING, environment, free_ports, kill_all, load,
                      max_param_diff)

TIMEOUT = 180

# How a multi-node job can end, through no fault of its own (pytorch/pytorch#123678): after the last step
# every node's torchrun closes the rendezvous in the store that the host node's torchrun keeps, and the host
# may close it and exit first. A node that comes later finds the store gone: it logs TCPStore's C++ warning
# with a stack (one per failed store call), then that it "has failed to shutdown the rendezvous", and exits 0 all
# the same. Its keep-alive heartbeat, every 5 s until that shutdown, can fail the same way just before. Those
# messages, at the very end of a node's output, are the only ones a test lets through.
SHUTDOWN_RACE = re.compile(
    r"(^\[W\d{4} [\d:.]+ TCPStore\.cpp:\d+\] \[c10d\] \w+ failed on SocketImpl\([^\n]*\n(?:[^\n]+\n)*\n"  # and its stack
    r"|^W\d{4} [\d:.]+ \d+ \S+/dynamic_rendezvous\.py:\d+\] The node '\S+' has failed to send a keep-alive "
    r"heartbeat to the rendezvous '\S+' due to an error of type RendezvousConnectionError\.\n)*"
    r"(^W\d{4} [\d:.]+ \d+ \S+/dynamic_rendezvous\.py:\d+\] The node '\S+' has failed to shutdown the rendezvous "
    r"'\S+' due to an error of type RendezvousConnectionError\.\n)+\Z", re.MULTILINE)


def warnings(output):
    """The warnings in a node's output, less the shutdown race above."""
    return WARNING.findall(SHUTDOWN_RACE.sub("", output))


def test_only_the_shutdown_race_is_let_through():
    """The pattern takes the race's lines and no others: a warning between them still counts."""
    stack = ("[W1122 16:28:49.570148546 TCPStore.cpp:115] [c10d] recvVector failed on SocketImpl(fd=3): Failed to "
             "recv\nException raised from recvBytes at Utils.hpp:787 (most recent call first):\n"
             "frame #0: c10::Error::Error(c10::SourceLocation)\n\n")
    race = ("W1122 16:28:49.898000 14606 site-packages/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1298] "
            "The node 'localhost_14606_0' has failed to shutdown the rendezvous 'ddp_torchrun' due to an error of type "
            "RendezvousConnectionError.\n")
    assert warnings("step 16 | val loss 3.0258\n" + stack + race) == []
    assert warnings(stack + "UserWarning: something real\n" + stack + race) == ["[W1122 ", "Warning"]
    assert warnings(race + "step 17\n") == ["W1122 "]  # not at the end: not the race


def test_two_nodes_on_localhost_train_like_torchrun_on_one(trained, tmp_path):
    # Both nodes take the same settings, as on a cluster, and resolve MASTER_ADDR to this machine: NODE_RANK says
    # which one hosts the rendezvous. One process per node: the world of 2 that conftest's torchrun run trains. One
    # --ckpt-dir for both, as on a shared filesystem.
    env = {"NNODES": "2", "NPROC_PER_NODE": "1", "JOIN_TIMEOUT": "60", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_ports()[0]), "LAUNCH_TEST_TAG": f"{os.getpid()}-{time.monotonic_ns()}"}
    argv = [str(a) for a in [LAUNCHER, "ddp_torchrun.py", *TINY, "--max-steps", STEPS, "--ckpt-dir", tmp_path / "ckpt",
                             "--log-dir", tmp_path / "tb"]]
    logs, nodes = [tmp_path / f"node{rank}.log" for rank in range(2)], []
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as out:  # a file, not a pipe: nothing blocks on a node whose output nobody reads
                nodes.append(subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                              env=environment({**env, "NODE_RANK": str(rank)}),
                                              start_new_session=True))
        deadline = time.monotonic() + TIMEOUT
        while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        hung = [node for node in nodes if node.poll() is None]
        for node in hung:
            kill_all(node, env["LAUNCH_TEST_TAG"])
        for node in nodes:
            node.wait()
    outputs = [log.read_text() for log in logs]
    output = "\n".join(f"==> node {rank} <==\n{text}" for rank, text in enumerate(outputs))
    if hung:
        pytest.fail(f"the nodes ran past {TIMEOUT}s:\n{output}")
    assert all(node.returncode == 0 for node in nodes), output
    assert all("torchrun --nnodes=2 --rdzv-backend=c10d" in text for text in outputs), output
    # One job of 2 (two jobs of 1 would each print "x 1 processes"), whose rank 0 alone prints.
    assert output.count("x 2 processes") == 1, output
    assert not any(warnings(text) for text in outputs), output
    state = load(tmp_path / "ckpt")
    assert state["step"] == STEPS
    diff = max_param_diff(state["model"], load(trained["ddp_torchrun.py"].ckpt_dir)["model"])
    print(f"two nodes on localhost: largest parameter difference from torchrun on one node {diff:g}")
    assert diff <= PARAM_ATOL
