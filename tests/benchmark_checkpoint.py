"""What a checkpoint costs the training loop: single_gpu.py on a 201.7M-parameter GPT (2.4 GB of weights and AdamW
state), saving every 2 of 8 steps by default with torch's distributed checkpoint in the background (dcp.async_save:
the loop waits for the write before, and for the copy of the state to host memory; a thread writes the copy), and
without saving. Prints how long each save stopped the loop, and of that the wait for the write before; how long the
run waited at its end for the last write; the run's wall time and the process's peak resident memory. A benchmark
that prints figures, not a test (pytest does not collect it).

    python tests/benchmark_checkpoint.py                     # on this machine: a GPU if there is one
    python tests/benchmark_checkpoint.py --ckpt-dir /scratch # where the checkpoints go: the disk matters
    python tests/benchmark_checkpoint.py --max-steps 1500 --ckpt-every 500   # a GPU: time for each write to end

Each config runs in a process of its own, which imports the script, times its save_checkpoint and
wait_for_checkpoint, and runs its main().
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
CONFIGS = ["no checkpoints", "in the background"]


def child(config, ckpt_dir, ckpt_every, flags):
    """Run single_gpu.py's main() in this process with save_checkpoint and wait_for_checkpoint timed; print the
    figures as one JSON line."""
    module = import_script("single_gpu.py")
    save, wait, stalls, waits, in_save = module.save_checkpoint, module.wait_for_checkpoint, [], [], [False]

    def timed_save(*args, **kwargs):
        start, in_save[0] = time.perf_counter(), True
        result = save(*args, **kwargs)
        stalls.append(time.perf_counter() - start)
        in_save[0] = False
        return result

    def timed_wait(*args, **kwargs):
        start = time.perf_counter()
        result = wait(*args, **kwargs)
        waits.append((in_save[0], time.perf_counter() - start))
        return result

    # main() and save_checkpoint find them among the module's globals when they call them.
    module.save_checkpoint, module.wait_for_checkpoint = timed_save, timed_wait
    saving = [] if config == "no checkpoints" else ["--ckpt-dir", ckpt_dir, "--ckpt-every", str(ckpt_every)]
    sys.argv = ["single_gpu.py", *MODEL, *flags, *saving]
    start = time.perf_counter()
    module.main(module.parse_args())
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print("RESULT " + json.dumps({"stalls": stalls, "waits_in_save": [s for inside, s in waits if inside],
                                  "final_wait": sum(s for inside, s in waits if not inside), "wall": wall,
                                  "peak_rss": peak}), flush=True)


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
    print(f"{'config':<18} {'first save':>11} {'then, each':>11} {'(write before)':>15} {'last save':>10} "
          f"{'end wait':>9} {'run':>8} {'peak memory':>12}")
    for config in CONFIGS:
        with tempfile.TemporaryDirectory(dir=args.ckpt_dir) as tmp:
            result = subprocess.run([sys.executable, __file__, f"--child={config}", "--ckpt-dir", tmp,
                                     "--max-steps", str(args.max_steps), "--ckpt-every", str(args.ckpt_every)],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
        lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
        if result.returncode != 0 or not lines:
            sys.exit(f"{config} failed:\n{result.stdout}")
        figures = json.loads(lines[0][len("RESULT "):])
        seconds = ["-"] * 5
        if figures["stalls"]:
            (first, *between, last), before = figures["stalls"], figures["waits_in_save"][1:-1]
            seconds = [f"{first:.2f} s", f"{statistics.median(between):.2f} s" if between else "-",
                       f"{statistics.median(before):.2f} s" if before else "-", f"{last:.2f} s",
                       f"{figures['final_wait']:.2f} s"]
        print(f"{config:<18} {seconds[0]:>11} {seconds[1]:>11} {seconds[2]:>15} {seconds[3]:>10} {seconds[4]:>9} "
              f"{figures['wall']:>6.1f} s {figures['peak_rss'] / 2**30:>8.2f} GiB", flush=True)
    print(f"{args.max_steps} steps, a save every {args.ckpt_every}: how long each save stopped the training loop "
          "('then, each': the median of the saves between the first and the last, and of that the wait for the write "
          "before, which saves too close together add); 'end wait': the run waiting for the last write before it "
          "ends; memory: the process's peak resident memory, torch included")


if __name__ == "__main__":
    main()
