"""What optimizer.zero_grad(set_to_none=...) costs under DDP with gradient_as_bucket_view=True: tokens/s
of ddp_torchrun.py with each setting, runs alternated. A benchmark that prints figures, not a test.

    python tests/benchmark_zero_grad.py [--nproc 2] [--repeats 3] [extra training flags...]

With set_to_none=True each backward allocates fresh gradients and DDP copies them into its buckets;
with False the gradients stay views of the buckets and are zeroed in place.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT, scalars

# Loaded by every process through PYTHONPATH: makes every zero_grad call use the setting under test.
PATCH = """import os, torch
zero_grad = torch.optim.Optimizer.zero_grad
torch.optim.Optimizer.zero_grad = lambda self, set_to_none=True: zero_grad(self, os.environ["SET_TO_NONE"] == "1")
"""

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--nproc", type=int, default=2)
parser.add_argument("--repeats", type=int, default=3)
args, training_flags = parser.parse_known_args()
training_flags = ["--max-steps", "200", "--log-every", "20", "--eval-every", "1000", *training_flags]

results = {"set_to_none=True": [], "set_to_none=False": []}
with tempfile.TemporaryDirectory() as tmp:
    (Path(tmp) / "sitecustomize.py").write_text(PATCH)
    for repeat in range(args.repeats):
        for setting, runs in results.items():  # alternate, so that a slow spell of the machine hits both
            log_dir = Path(tmp) / f"{setting}-{repeat}"
            env = dict(os.environ, PYTHONPATH=tmp, SET_TO_NONE="1" if setting.endswith("True") else "0",
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                            str(ROOT / "ddp_torchrun.py"), "--log-dir", str(log_dir), *training_flags],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, timeout=900)
            per_log = scalars(log_dir)["train/tokens_per_sec"]
            runs.append(statistics.median([v for step, v in sorted(per_log.items())][1:]))  # after warm-up

for setting, runs in results.items():
    print(f"{setting:<18} median {statistics.median(runs):>9,.0f} tokens/s, best {max(runs):>9,.0f} "
          f"({', '.join(f'{r:,.0f}' for r in runs)})")
