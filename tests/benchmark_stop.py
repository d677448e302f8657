"""What the stop check costs each training step: ddp_torchrun.py's stop_requested(), a one-number all-reduce through
gloo on the CPU, timed in --nproc processes, next to the time of one training step of ddp_torchrun.py at its default
size on as many processes. A benchmark that prints figures, not a test.

    python tests/benchmark_stop.py [--nproc 2] [--calls 5000]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import free_ports, import_script, run, scalars


def time_checks(rank, nproc, port, calls, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    script = import_script("ddp_torchrun.py")
    group = dist.new_group(backend="gloo")
    received = []
    for _ in range(100):  # warm-up: connections, buffers
        script.stop_requested(received, group)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        script.stop_requested(received, group)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    if rank == 0:
        results.put(times)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(time_checks, args=(args.nproc, free_ports(1)[0], args.calls, results), nprocs=args.nproc)
    times = results.get()
    check = statistics.median(times)
    print(f"stop_requested() on {args.nproc} CPU processes: median {check * 1e6:.0f} us, "
          f"90th percentile {statistics.quantiles(times, n=10)[-1] * 1e6:.0f} us ({args.calls} calls)")

    with tempfile.TemporaryDirectory() as tmp:
        steps = 40
        result = run("ddp_torchrun.py", "--max-steps", steps, "--log-every", 20, "--eval-every", 1000, "--log-dir", tmp,
                     nproc=args.nproc, timeout=600)
        assert result.returncode == 0, result.output
        tokens_per_sec = scalars(tmp)["train/tokens_per_sec"][steps]  # steps 21 to 40: past the warm-up
    step = 32 * 64 / tokens_per_sec  # the default --batch-size 32 of --seq-len 64 tokens
    print(f"a training step of ddp_torchrun.py at its default size on {args.nproc} CPU processes: {step * 1e3:.1f} ms; "
          f"the check is {check / step:.2%} of it")
