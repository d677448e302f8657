"""What fsdp.py and pipeline.py are for, in figures: the peak resident memory of a run's largest process on the
201.7M-parameter GPT of tests/test_memory.py, for 1, 2 and 4 processes; then, on long sequences, what
--activation-checkpointing saves and costs. Measured as that test measures (glibc told to hand freed blocks back).
A benchmark that prints figures, not a test (pytest does not collect it).

    python tests/benchmark_memory.py                          # both tables: about 15 minutes on 2 cores
    python tests/benchmark_memory.py --tables checkpointing   # the second alone: 2 minutes
"""

import argparse

import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_memory import BIG, FLAGS, LONG, SMALL, peak


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", nargs="+", choices=["memory", "checkpointing"], default=["memory", "checkpointing"])
    tables = parser.parse_args().tables
    with tempfile.TemporaryDirectory() as tmp:
        if "memory" in tables:
            memory_table(tmp)
        if "checkpointing" in tables:
            checkpointing_table(tmp)


def memory_table(tmp):
    """The 201.7M-parameter GPT on 1, 2 and 4 processes: the largest process's peak, and that less a small model's."""
    print(f"{'script':<14} {'processes':>9} {'peak, largest process':>22} {'less a small model':>19}")
    for script, counts in [("single_gpu.py", [1]), ("fsdp.py", [1, 2, 4]), ("pipeline.py", [1, 2, 4])]:
        for nproc in counts:
            big, _ = peak(script, nproc, *BIG, *FLAGS[script], "--log-dir", Path(tmp) / "tb")
            small, _ = peak(script, nproc, *SMALL, *FLAGS[script], "--log-dir", Path(tmp) / "tb")
            print(f"{script:<14} {nproc:>9} {big / 2**30:>18.2f} GiB {(big - small) / 2**30:>15.2f} GiB", flush=True)


def checkpointing_table(tmp):
    """Long sequences on 2 processes, with and without --activation-checkpointing: peak and throughput."""
    print(f"\n{'config, 2 processes':<54} {'peak, largest process':>22} {'tokens/s':>9}")
    for script in "fsdp.py", "pipeline.py":
        flags = {"fsdp.py": [], "pipeline.py": ["--grad-accum", "2"]}[script]
        for extra in [], ["--activation-checkpointing"]:
            # Steps 2 to 6: the first holds the start-up.
            memory, output = peak(script, 2, *LONG, *flags, *extra, "--max-steps", 6, "--log-every", 2,
                                  "--log-dir", Path(tmp) / "tb")
            speeds = re.findall(r"\| ([\d,]+) tokens/s", output)
            speed = sum(int(s.replace(",", "")) for s in speeds[1:]) / len(speeds[1:])
            print(f"{' '.join([script, *flags, *extra]):<54} {memory / 2**30:>18.2f} GiB {speed:>9,.0f}", flush=True)


if __name__ == "__main__":
    main()
