"""What fsdp.py, pipeline.py and tensor_parallel.py are for, in figures: what the 56.8M-parameter GPT of tests/test_memory.py adds to the
peak resident memory of a run's largest process, for 1, 2 and 4 processes; then, on long sequences, what
--activation-checkpointing saves and costs. Measured as that test measures (glibc told to hand freed blocks back;
each process's peak less its peak at main()'s first line). A benchmark that prints figures, not a test (pytest does
not collect it).

    python tests/benchmark_memory.py                          # both tables: about 10 minutes on 2 idle cores
    python tests/benchmark_memory.py --tables checkpointing   # the second alone: about 2 minutes of 2 idle cores
"""

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_memory import BIG, FLAGS, SMALL, peaks

# Long sequences through a narrow model: each process's activations (a batch of 4 sequences of 1,024 tokens through
# 4 blocks of width 256) outweigh its weights (3.2M parameters) many times over. pipeline.py's stage holds 2 blocks
# and, in 1F1B, the activations of up to 2 micro-batches of 4.
LONG = ["--d-model", 256, "--n-layers", 4, "--n-heads", 4, "--seq-len", 1024, "--batch-size", 8, "--eval-batches", 1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", nargs="+", choices=["memory", "checkpointing"], default=["memory", "checkpointing"])
    tables = parser.parse_args().tables
    with tempfile.TemporaryDirectory() as tmp:
        if "memory" in tables:
            memory_table(Path(tmp))
        if "checkpointing" in tables:
            checkpointing_table(Path(tmp))


def memory_table(tmp):
    """The big GPT on 1, 2 and 4 processes: what it adds to the largest process's peak, that less what a small
    model adds (torch, the data, the loop), and what the process held when the model was built."""
    print(f"{'script':<18} {'processes':>9} {'added, big model':>17} {'less a small one':>17} {'at build':>9}")
    for script, counts in [("single_gpu.py", [1]), ("fsdp.py", [1, 2, 4]), ("pipeline.py", [1, 2, 4]),
                           ("tensor_parallel.py", [1, 2, 4])]:
        for nproc in counts:
            big, _ = peaks(script, nproc, [*BIG, *FLAGS[script]], tmp)
            small, _ = peaks(script, nproc, [*SMALL, *FLAGS[script]], tmp)
            print(f"{script:<18} {nproc:>9} {big['end'] / 2**30:>13.3f} GiB {(big['end'] - small['end']) / 2**30:>13.3f}"
                  f" GiB {(big['built'] - small['built']) / 2**30:>5.3f} GiB", flush=True)


def checkpointing_table(tmp):
    """Long sequences on 2 processes, with and without --activation-checkpointing: peak and throughput."""
    print(f"\n{'config, 2 processes':<54} {'added, largest process':>23} {'tokens/s':>9}")
    for script in "fsdp.py", "pipeline.py", "tensor_parallel.py":
        flags = {"pipeline.py": ["--grad-accum", "2"]}.get(script, [])
        for extra in [], ["--activation-checkpointing"]:
            # Steps 2 to 6: the first holds the start-up.
            memory, output = peaks(script, 2, [*LONG, *flags, *extra, "--max-steps", 6, "--log-every", 2], tmp)
            speeds = [int(s.replace(",", "")) for s in re.findall(r"\| ([\d,]+) tokens/s", output)][1:]
            print(f"{' '.join([script, *flags, *extra]):<54} {memory['end'] / 2**30:>19.2f} GiB "
                  f"{sum(speeds) / len(speeds):>9,.0f}", flush=True)


if __name__ == "__main__":
    main()
