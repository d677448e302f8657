"""How often torchrun recovers from a worker killed with SIGKILL, and how long it takes, with the
rendezvous store shared between the agent and its workers (torchrun's default) and not shared
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as launch_distributed.sh runs it). A benchmark that prints
figures, not a test (pytest does not collect it).

    python tests/benchmark_restarts.py [--runs 5]

A run recovered when the job exits 0 and its final parameters equal an uninterrupted run's bit for bit.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT, TINY, kill_a_worker, load, run_command

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--runs", type=int, default=5, help="killed runs for each setting")
parser.add_argument("--timeout", type=float, default=180, help="seconds before a run counts as hung")
args = parser.parse_args()


def torchrun(out):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2",
            str(ROOT / "ddp_torchrun.py"), *TINY, "--max-steps", "48", "--ckpt-dir", str(out), "--log-dir", str(out / "tb")]


with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    reference = run_command(torchrun(tmp / "reference"), timeout=args.timeout)
    assert reference.returncode == 0, reference.output
    expected = load(tmp / "reference")["model"]
    for disable in ["0", "1"]:
        recovered, latencies = 0, []
        for i in range(args.runs):
            out = tmp / f"disable-{disable}-{i}"
            killed = kill_a_worker(torchrun(out), out / "checkpoint.pt", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": disable},
                                   timeout=args.timeout)
            exact = killed.run.returncode == 0 and all(torch.equal(load(out)["model"][k], v) for k, v in expected.items())
            recovered += exact
            if killed.resumed_after is not None:
                latencies.append(killed.resumed_after)
            resumed = f"resumed {killed.resumed_after:.1f}s after the kill" if killed.resumed_after else "never resumed"
            print(f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE={disable} run {i + 1}: exit {killed.run.returncode}, {resumed}, "
                  f"{'parameters equal' if exact else 'NOT RECOVERED'} ({killed.run.seconds:.0f}s)", flush=True)
            if not exact:
                print("   last lines: " + " | ".join(killed.run.output.strip().splitlines()[-3:]), flush=True)
        median = f", kill to resume median {statistics.median(latencies):.1f}s" if latencies else ""
        print(f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE={disable}: {recovered}/{args.runs} recovered{median}", flush=True)
