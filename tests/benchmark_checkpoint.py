"""What a checkpoint costs the training loop: single_gpu.py on a 201.7M-parameter GPT (2.4 GB of weights and AdamW
state), saving every 2 of 8 steps, with --sync-checkpoints (the step waits for the whole write) and without (it waits
for a copy of the state in host memory; a thread writes the copy). Prints, for each and for a run without saves: how
long each save stopped the loop (the last save waits for its write in both: the run ends with it), the run's wall
time and the process's peak resident memory. A benchmark that prints figures, not a test (pytest does not collect it).

    python tests/benchmark_checkpoint.py                     # on this machine: a GPU if there is one
    python tests/benchmark_checkpoint.py --ckpt-dir /scratch # where the checkpoints go: the disk matters

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


def child(config, ckpt_dir, flags):
    """Run single_gpu.py's main() in this process with save_checkpoint timed; print the figures as one JSON line."""
    module = import_script("single_gpu.py")
    save, stalls = module.save_checkpoint, []

    def timed_save(*args, **kwargs):
        start = time.perf_counter()
        result = save(*args, **kwargs)
        stalls.append(time.perf_counter() - start)
        return result

    module.save_checkpoint = timed_save  # main() finds it among the module's globals when it calls it
    saving = [] if config == "no checkpoints" else ["--ckpt-dir", ckpt_dir, "--ckpt-every", "2"]
    sys.argv = ["single_gpu.py", *MODEL, *flags, *saving, *CONFIGS[config]]
    start = time.perf_counter()
    module.main(module.parse_args())
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print("RESULT " + json.dumps({"stalls": stalls, "wall": wall, "peak_rss": peak}), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", help="a directory on the disk to measure (default: a temporary one)")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    flags = ["--max-steps", str(args.max_steps), "--log-every", "2", "--eval-every", "100000", "--log-dir"]
    if args.child:
        return child(args.child, args.ckpt_dir, [*flags, str(Path(args.ckpt_dir) / "tb")])
    print(f"{'config':<20} {'first save':>11} {'then, each':>11} {'last save':>10} {'run':>8} {'peak memory':>12}")
    for config in CONFIGS:
        with tempfile.TemporaryDirectory(dir=args.ckpt_dir) as tmp:
            result = subprocess.run([sys.executable, __file__, f"--child={config}", "--ckpt-dir", tmp,
                                     "--max-steps", str(args.max_steps)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, check=False)
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        if result.returncode != 0 or not lines:
            sys.exit(f"{config} failed:\n{result.stdout}")
        figures = json.loads(lines[0][len("RESULT "):])
        seconds = ["-"] * 3
        if figures["stalls"]:
            first, *between, last = figures["stalls"]
            seconds = [f"{first:.2f} s", f"{statistics.median(between):.2f} s" if between else "-", f"{last:.2f} s"]
        print(f"{config:<20} {seconds[0]:>11} {seconds[1]:>11} {seconds[2]:>10} {figures['wall']:>6.1f} s "
              f"{figures['peak_rss'] / 2**30:>8.2f} GiB", flush=True)
    print(f"{args.max_steps} steps, a save every 2: how long each stopped the training loop (the first allocates the "
          "copy's memory; 'then, each': the median of the others before the last); memory: the process's peak "
          "resident memory, torch included")


if __name__ == "__main__":
    main()
