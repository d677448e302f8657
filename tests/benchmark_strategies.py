"""Which strategy to pick: each script trains the same model on the same global batch, and this prints a table of
tokens/s, model TFLOP/s, MFU (where the GPU's peak is known) and the peak memory of a process (GPU
memory allocated on CUDA, resident memory on a CPU), each the median of several runs with the warm-up left out.
A benchmark that prints figures, not a test (pytest does not collect it).

    python tests/benchmark_strategies.py                        # the default configs below, 2 processes, eager
    python tests/benchmark_strategies.py --compile --nproc 8 --d-model 768 --n-layers 12 --n-heads 12 \\
        --seq-len 1024 --batch-size 64 --grad-accum 2 --data input.txt     # GPT-2 small on a node of 8 GPUs
    python tests/benchmark_strategies.py --configs single_gpu.py ddp_torchrun.py --nproc 1   # DDP's own overhead

A config is a script, or a script and its flags in one argument ("ddp_amp.py --precision fp16"). Any other
flag goes to every script. Runs alternate between configs, so that a slow spell of the machine hits them all.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT, command, injected, scalars

CONFIGS = ["single_gpu.py", "ddp_torchrun.py", "ddp_amp.py --precision bf16", "ddp_amp.py --precision fp16", "fsdp.py",
           "fsdp.py --precision bf16", "pipeline.py --schedule gpipe", "pipeline.py --schedule 1f1b"]

# Every process of the run reports its peak memory as it exits, in one write (the processes' lines would interleave
# between a print's text and its newline); the torchrun agent and other helpers run another program and stay silent.
REPORT_PEAK_MEMORY = """
import atexit, os, resource, sys

def report():
    if not sys.argv[0].endswith(os.environ["BENCHMARK_SCRIPT"]):
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        os.write(1, f"PEAK_MEMORY cuda {torch.cuda.max_memory_allocated()}\\n".encode())
    else:  # ru_maxrss is in KiB on Linux
        os.write(1, f"PEAK_MEMORY rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}\\n".encode())

atexit.register(report)
"""


def measure(config, nproc, flags, warmup_logs, directory):
    """One run: the median over its logging intervals after the warm-up, and the largest process's peak memory."""
    script, *own_flags = config.split()
    log_dir = Path(directory) / "tb"
    # This environment as it is (unlike the tests': GPUs visible, threads as set), plus the memory report.
    env = {**os.environ, **injected(directory, REPORT_PEAK_MEMORY), "BENCHMARK_SCRIPT": script}
    result = subprocess.run(command(script, nproc) + own_flags + flags + ["--log-dir", str(log_dir)], check=False, env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
    if result.returncode != 0:
        sys.exit(f"{config} failed:\n{result.stdout}")
    tb = scalars(log_dir)
    figures = {}
    for tag in ["train/tokens_per_sec", "train/tflops"]:
        steady = [value for step, value in sorted(tb[tag].items())][warmup_logs:]
        figures[tag] = statistics.median(steady)
    mfu = [float(m) / 100 for m in re.findall(r"\| ([\d.]+)% MFU$", result.stdout, re.MULTILINE)][warmup_logs:]
    if mfu:  # in the step lines alone, where the GPU's peak is known
        figures["mfu"] = statistics.median(mfu)
    peaks = re.findall(r"^PEAK_MEMORY (\w+) (\d+)$", result.stdout, re.MULTILINE)
    figures["memory_kind"] = peaks[0][0] if peaks else "?"
    figures["peak_memory"] = max((int(b) for _, b in peaks), default=float("nan"))
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="what to compare (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2,
                        help="processes of the distributed scripts (default: one per GPU, else 2)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each config; the table shows the median")
    parser.add_argument("--compile", action="store_true", help="also run each config with --compile")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=10)
    args, flags = parser.parse_known_args()
    if args.max_steps // args.log_every < 3:
        parser.error("--max-steps must cover at least 3 logging intervals: the first two may be warm-up")
    configs = args.configs + ([f"{config} --compile" for config in args.configs] if args.compile else [])
    flags += ["--max-steps", str(args.max_steps), "--log-every", str(args.log_every), "--eval-every", "100000"]
    runs = {config: [] for config in configs}
    for _ in range(args.repeats):
        for config in configs:
            # The first interval holds the start-up, and with --compile the compilation (the second, a recompile).
            warmup_logs = 2 if "--compile" in config else 1
            with tempfile.TemporaryDirectory() as tmp:
                runs[config].append(measure(config, args.nproc, flags, warmup_logs, tmp))
            print(f"{config}: {runs[config][-1]['train/tokens_per_sec']:,.0f} tokens/s", file=sys.stderr, flush=True)

    def median(results, tag):
        values = [r[tag] for r in results if tag in r]
        return statistics.median(values) if values else None

    print(f"{'config':<40} {'tokens/s':>10} {'TFLOP/s/proc':>13} {'MFU':>6} {'peak memory/proc':>17}")
    for config, results in runs.items():
        mfu = median(results, "mfu")
        memory = f"{median(results, 'peak_memory') / 2**30:.2f} GiB {results[0]['memory_kind']}"
        print(f"{config:<40} {median(results, 'train/tokens_per_sec'):>10,.0f} "
              f"{median(results, 'train/tflops'):>13.3g} "
              f"{format(mfu, '.0%') if mfu else '-':>6} {memory:>17}")
    print(f"{args.repeats} runs each, {args.nproc} processes for the DDP scripts; tokens/s of the global batch; "
          f"memory: 'cuda' is torch.cuda.max_memory_allocated(), 'rss' the process's peak resident memory")


if __name__ == "__main__":
    main()
