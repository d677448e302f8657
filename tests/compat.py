"""Which torch releases run which scripts. For each release: a virtual environment of its own, installed from the
package registry (or an interpreter you name), then every script with 2 processes on the CPU, and the 2-D and 16-bit
layouts in CONFIGS on 4: a run that trains 8 steps and checkpoints, then a run that resumes from that checkpoint and
finishes, each under a timeout. Prints a Markdown table, a row per release.

    python tests/compat.py                                   # the releases in RELEASES, venvs under /tmp
    python tests/compat.py 2.11.0 2.15.0 --venvs ~/torch-venvs
    python tests/compat.py --python /path/to/venv/bin/python python3   # interpreters you have: no install

Not part of the test suite: each release is gigabytes to install (on Linux, PyPI's wheels are CUDA builds, which
run on a CPU). A venv that already holds its release is reused.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import ROOT, SCRIPTS, TINY, command, run_command

# Beyond each script's defaults: what else the releases must run, with its processes. Hybrid sharding, 2 pipelines of 2
# stages in fp16, two stages a process under zero-bubble, tensor parallelism on 2 rows of 2 in bf16, fp16 with a scaler,
# context parallelism on 2 rows of 2 in bf16.
CONFIGS = {**dict.fromkeys(SCRIPTS, 2), "fsdp.py --replicate 2": 4, "pipeline.py --pipelines 2 --precision fp16": 4,
           "pipeline.py --stages-per-process 2 --n-layers 4 --schedule zero-bubble": 2,
           "tensor_parallel.py --tensor-parallel 2 --precision bf16": 4, "ddp_amp.py --precision fp16": 2,
           "context_parallel.py --context-parallel 2 --precision bf16": 4}

# The floor of every script (requirements.txt: torch>=2.10) and the release before it, every release since, and the
# newest on the registry when last measured.
RELEASES = ["2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
ERROR = re.compile(r"^.*(?:\w+Error\b|: error: ).*$", re.MULTILINE)


def venv(release, root):
    """A virtual environment holding torch `release` and what the scripts need besides; its python."""
    python = root / f"torch-{release}" / "bin" / "python"
    if not python.exists() or version(python) != release:
        print(f"installing torch {release} into {python.parent.parent}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", "--clear", python.parent.parent], check=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"torch=={release}",
                        "tensorboard"], check=True)
    return python


def version(python):
    """The torch release that `python` imports (without its local tag, +cpu or +cu128), or None."""
    found = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], check=False, capture_output=True,
                           text=True)
    return found.stdout.split("+")[0].strip() if found.returncode == 0 else None


def smoke(config, python, timeout):
    """'ok' if the config trains, checkpoints, resumes and exits twice; else what went wrong, in a few words."""
    script, *flags = config.split()
    with tempfile.TemporaryDirectory() as tmp:
        for max_steps, expected in [(8, "saving"), (12, "resumed from")]:  # TINY checkpoints every 8 steps
            argv = command(script, CONFIGS[config], python=str(python)) + [
                *TINY, *flags, "--max-steps", str(max_steps), "--ckpt-dir", f"{tmp}/ckpt", "--log-dir", f"{tmp}/tb"]
            result = run_command(argv, timeout=timeout, fail_on_hang=False)
            what = "resume" if expected == "resumed from" else "first run"
            if result.returncode is None:
                return f"{what} hangs" + (" at exit" if f"step {max_steps:>5} | val loss" in result.output else "")
            # The first error a worker printed: the launcher's own report of a failed worker comes after it.
            errors = [line.strip() for line in ERROR.findall(result.output) if "ChildFailedError" not in line]
            if result.returncode != 0 or expected not in result.output:
                reason = errors[0] if errors else f"exit status {result.returncode}"
                return f"{what} fails: `{reason[:120]}`"
    return "ok"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("releases", nargs="*", help=f"torch releases to install and try (default: {RELEASES}, "
                        "unless --python names interpreters)")
    parser.add_argument("--python", nargs="+", default=[], type=Path,
                        help="interpreters with torch and tensorboard installed, tried as they are")
    parser.add_argument("--venvs", type=Path, default=Path(tempfile.gettempdir()) / "torch-compat",
                        help="one venv per release goes here, torch-RELEASE (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds each run may take before it counts as a hang")
    args = parser.parse_args()
    releases = args.releases or ([] if args.python else RELEASES)
    os.chdir(ROOT)
    print("| torch | " + " | ".join(f"`{config}`" for config in CONFIGS) + " |")
    print("| --- " * (len(CONFIGS) + 1) + "|")
    for python in args.python:
        row(version(python) or f"{python}: no torch", python, args.timeout)
    for release in releases:
        args.venvs.mkdir(parents=True, exist_ok=True)
        row(release, venv(release, args.venvs), args.timeout)


def row(release, python, timeout):
    print(f"| {release} | " + " | ".join(smoke(config, python, timeout) for config in CONFIGS) + " |", flush=True)


if __name__ == "__main__":
    main()
