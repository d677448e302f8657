"""Which torch releases run which scripts. For each release: a virtual environment of its own, installed from the
package registry, then every script with 2 processes on the CPU: a run that trains and checkpoints, then a run
that resumes from that checkpoint and finishes, each under a timeout. Prints a Markdown table, a row per release.

    python tests/compat.py                                   # the releases in RELEASES, venvs under /tmp
    python tests/compat.py 2.11.0 2.15.0 --venvs ~/torch-venvs

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

# Every floor in the scripts (2.4, 2.8, 2.10) and the release before each (which the scripts with that floor refuse),
# every release since, and the newest on the registry when last measured.
RELEASES = ["2.4.1", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
ERROR = re.compile(r"^.*(?:\w+Error\b|: error: ).*$", re.MULTILINE)


def venv(release, root):
    """A virtual environment holding torch `release` and what the scripts need besides; its python."""
    python = root / f"torch-{release}" / "bin" / "python"
    found = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], check=False, capture_output=True, text=True) \
        if python.exists() else None
    if found is None or found.returncode != 0 or found.stdout.split("+")[0].strip() != release:
        print(f"installing torch {release} into {python.parent.parent}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", "--clear", python.parent.parent], check=True)
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"torch=={release}",
                        "tensorboard"], check=True)
    return python


def smoke(script, python, timeout):
    """'ok' if the script trains, checkpoints, resumes and exits twice; else what went wrong, in a few words."""
    with tempfile.TemporaryDirectory() as tmp:
        for max_steps, expected in [(8, "saved"), (12, "resumed from")]:  # TINY checkpoints every 8 steps
            argv = command(script, python=str(python)) + [*TINY, "--max-steps", str(max_steps), "--ckpt-dir",
                                                         f"{tmp}/ckpt", "--log-dir", f"{tmp}/tb"]
            result = run_command(argv, timeout=timeout, fail_on_hang=False)
            what = "resume" if expected == "resumed from" else "first run"
            if result.returncode is None:
                return f"{what} hangs" + (" at exit" if f"step {max_steps:>5} | saved" in result.output else "")
            # The first error a worker printed: the launcher's own report of a failed worker comes after it.
            errors = [line.strip() for line in ERROR.findall(result.output) if "ChildFailedError" not in line]
            refused = re.search(r": error: this script needs torch (\S+) or newer", result.output)
            if refused:
                return f"refused: needs {refused.group(1)}"
            if result.returncode != 0 or expected not in result.output:
                reason = errors[0] if errors else f"exit status {result.returncode}"
                return f"{what} fails: `{reason[:120]}`"
    return "ok"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("releases", nargs="*", default=RELEASES, help="torch releases to try (default: %(default)s)")
    parser.add_argument("--venvs", type=Path, default=Path(tempfile.gettempdir()) / "torch-compat",
                        help="one venv per release goes here, torch-RELEASE (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds each run may take before it counts as a hang")
    args = parser.parse_args()
    args.venvs.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    print("| torch | " + " | ".join(script[:-3] for script in SCRIPTS) + " |")
    print("| --- " * (len(SCRIPTS) + 1) + "|")
    for release in args.releases:
        python = venv(release, args.venvs)
        print(f"| {release} | " + " | ".join(smoke(script, python, args.timeout) for script in SCRIPTS) + " |", flush=True)


if __name__ == "__main__":
    main()
