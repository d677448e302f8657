"""What DDP costs in one process: tokens/s of single_gpu.py and of ddp_torchrun.py as a world of
one, on the same config. A benchmark that prints figures, not a test (pytest does not collect it).

    python tests/benchmark_overhead.py [--repeats 3] [--device cpu|cuda] [extra training flags...]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT, scalars  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--device", default="cpu")
args, training_flags = parser.parse_known_args()
training_flags = ["--max-steps", "200", "--log-every", "20", "--eval-every", "1000", *training_flags]

results = {"single_gpu.py": [], "ddp_torchrun.py": []}
with tempfile.TemporaryDirectory() as tmp:
    for repeat in range(args.repeats):
        for script in results:  # alternate, so that a slow spell of the machine hits both
            log_dir = Path(tmp) / f"{script}-{repeat}"
            subprocess.run([sys.executable, str(ROOT / script), "--device", args.device, "--log-dir", str(log_dir),
                            *training_flags], check=True, stdout=subprocess.DEVNULL, timeout=900)
            per_log = scalars(log_dir)["train/tokens_per_sec"]
            steady = [v for step, v in sorted(per_log.items())][1:]  # the first interval includes warm-up
            results[script].append(statistics.median(steady))

for script, runs in results.items():
    print(f"{script:<16} median {statistics.median(runs):>9,.0f} tokens/s, best {max(runs):>9,.0f} "
          f"({', '.join(f'{r:,.0f}' for r in runs)})")
for name, pick in [("median", statistics.median), ("best", max)]:
    single, ddp = (pick(results[s]) for s in results)
    print(f"DDP wrapper overhead at one process ({name} run): {100 * (single - ddp) / single:+.1f}%")
