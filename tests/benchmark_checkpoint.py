"""What a checkpoint costs the training loop: single_gpu.py on a 201.7M-parameter GPT (2.4 GB of weights and AdamW
state), saving every 2 of 8 steps by default, with --sync-checkpoints (the step waits for the whole write) and without
(it waits for a copy of the state in host memory; a thread writes the copy). Prints, for each and for a run without
saves: how long each save stopped the loop (the last save waits for its write in both: the run ends with it), the
run's wall time and the process's peak resident memory. A benchmark that prints figures, not a test (pytest does not
collect it).

    python tests/benchmark_checkpoint.py                     # on this machine: a GPU if there is one
    python tests/benchmark_checkpoint.py --ckpt-dir /scratch # where the checkpoints go: the disk matters
    python tests/benchmark_checkpoint.py --max-steps 1500 --ckpt-every 500   # a GPU: time for each write to end

Each config runs in a process of its own, which imports the script, times its save_checkpoint and runs its main().
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import import_script

MODEL = ["--d-model", "1024", "--n-layers", "16", "--n-heads", "8", "--seq-len", "32", "--batch-size", "8"]
CONFIGS = {"no checkpoints": [], "--sync-checkpoints": ["--sync-checkpoints"], "in the background": []}


def child(config, ckpt_dir, ckpt_every, flags):
    """Run single_gpu.py's main() in this process with save_checkpoint timed, and within it the wait for the write
    before (the first wait_for_checkpoint of each save); print the figures as one JSON line."""
    module = import_script("single_gpu.py")
    save, wait, stalls, waits = module.save_checkpoint, module.wait_for_checkpoint, [], []

    def timed_save(*args, **kwargs):
        start = time.perf_counter()
        result = save(*args, **kwargs)
        stalls.append(time.perf_counter() - start)
        return result

    def timed_wait(*args, **kwargs):
        start = time.perf_counter()
        result = wait(*args, **kwargs)
        if len(waits) < len(stalls) + 1:  # the save's first: for the write before
            waits.append(time.perf_counter() - start)
        return result

    # main() and save_checkpoint find them among the module's globals when they call them.
    module.save_checkpoint, module.wait_for_checkpoint = timed_save, timed_wait
    saving = [] if config == "no checkpoints" else ["--ckpt-dir", ckpt_dir, "--ckpt-every", str(ckpt_every)]
    sys.argv = ["single_gpu.py", *MODEL, *flags, *saving, *CONFIGS[config]]
    start = time.perf_counter()
    module.main(module.parse_args())
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print("RESULT " + json.dumps({"stalls": stalls, "waits": waits, "wall": wall, "peak_rss": peak}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", help="a directory on the disk to measure (default: a temporary one)")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--ckpt-every", type=int, default=2, help="on a GPU, enough steps for a write to end (500)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    flags = ["--max-steps", str(args.max_steps), "--log-every", "2", "--eval-every", "100000", "--log-dir"]
    if args.child:
        return child(args.child, args.ckpt_dir, args.ckpt_every, [*flags, str(Path(args.ckpt_dir) / "tb")])
    print(f"{'config':<20} {'first save':>11} {'then, each':>11} {'(write before)':>15} {'last save':>10} {'run':>8} "
          f"{'peak memory':>12}")
    for config in CONFIGS:
        with tempfile.TemporaryDirectory(dir=args.ckpt_dir) as tmp:
            result = subprocess.run([sys.executable, __file__, f"--child={config}", "--ckpt-dir", tmp,
                                     "--max-steps", str(args.max_steps), "--ckpt-every", str(args.ckpt_every)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, check=False)
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        if result.returncode != 0 or not lines:
            sys.exit(f"{config} failed:\n{result.stdout}")
        figures = json.loads(lines[0][len("RESULT "):])
        seconds = ["-"] * 4
        if figures["stalls"]:
            (first, *between, last), waits = figures["stalls"], figures["waits"][1:-1]
            seconds = [f"{first:.2f} s", f"{statistics.median(between):.2f} s" if between else "-",
                       f"{statistics.median(waits):.2f} s" if waits else "-", f"{last:.2f} s"]
        print(f"{config:<20} {seconds[0]:>11} {seconds[1]:>11} {seconds[2]:>15} {seconds[3]:>10} {figures['wall']:>6.1f} s "
              f"{figures['peak_rss'] / 2**30:>8.2f} GiB", flush=True)
    print(f"{args.max_steps} steps, a save every {args.ckpt_every}: how long each save stopped the training loop (the "
          "first allocates the copy's memory; 'then, each': the median of the others before the last, and of it the "
          "wait for the write before, which saves too close together add); memory: the process's peak resident "
          "memory, torch included")


if __name__ == "__main__":
    main()
