"""What --compile does to a script's speed: tokens/s and model FLOP/s (and MFU, from the step lines, where the
GPU's peak is known) of eager and compiled runs of the same config, and each run's wall time, compilation included.
A benchmark that prints figures, not a test (pytest does not collect it).

    python tests/benchmark_compile.py [--script ddp_torchrun.py] [--nproc 2] [--repeats 3] [training flags...]
"""

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT, command, scalars

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--script", default="single_gpu.py")
parser.add_argument("--nproc", type=int, default=1, help="processes, for ddp_torchrun.py and ddp_spawn.py")
parser.add_argument("--repeats", type=int, default=3)
args, training_flags = parser.parse_known_args()
training_flags = ["--max-steps", "200", "--log-every", "20", "--eval-every", "100", *training_flags]

runs = {"eager": [], "--compile": []}
with tempfile.TemporaryDirectory() as tmp:
    for repeat in range(args.repeats):
        for mode, results in runs.items():  # alternate, so that a slow spell of the machine hits both
            log_dir = Path(tmp) / f"{mode}-{repeat}"
            start = time.monotonic()
            output = subprocess.run(command(args.script, args.nproc) + ["--log-dir", str(log_dir), *training_flags] +
                                    (["--compile"] if mode == "--compile" else []), cwd=ROOT, check=True,
                                    stdout=subprocess.PIPE, text=True, timeout=1800).stdout
            seconds = time.monotonic() - start
            tb = scalars(log_dir)
            # The first interval holds the warm-up (and the compilation): the rest is the steady state. MFU is in the
            # step lines alone, where the GPU's peak is known.
            steady = {tag: statistics.median(list(tb[tag].values())[1:])
                      for tag in ["train/tokens_per_sec", "train/tflops"]}
            mfu = [float(m) / 100 for m in re.findall(r"\| ([\d.]+)% MFU$", output, re.MULTILINE)][1:]
            results.append({"seconds": seconds, **steady, **({"mfu": statistics.median(mfu)} if mfu else {})})

print(f"{args.script}, {args.nproc} process(es), {args.repeats} runs each, medians; flags: {' '.join(training_flags)}")
for mode, results in runs.items():
    median = {key: statistics.median(r[key] for r in results) for key in results[0]}
    mfu = f", MFU {median['mfu']:.1%}" if "mfu" in median else ""
    print(f"{mode:<10} {median['train/tokens_per_sec']:>12,.0f} tokens/s, "
          f"{median['train/tflops']:.3g} TFLOP/s{mfu}; {median['seconds']:.0f} s a run "
          f"(tokens/s per run: {', '.join(format(r['train/tokens_per_sec'], ',.0f') for r in results)})")
