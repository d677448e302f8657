"""Bad input ends every script quickly, with a one-line message and a non-zero exit, and never
touches an existing checkpoint."""

import hashlib
import shutil

import pytest

from conftest import DISTRIBUTED, SCRIPTS, TINY, run


def fails_cleanly(script, args, message, timeout=30):
    result = run(script, *TINY, *args, timeout=timeout)
    assert result.returncode != 0, result.output
    errors = [line for line in result.output.splitlines() if line.startswith(f"{script}: error: ")]
    assert any(message in line for line in errors), result.output
    # torchrun's agent prints its own report of a failed worker (with its own traceback); the
    # script itself must not crash with one.
    assert f'{script}", line' not in result.output, result.output
    if script != "ddp_torchrun.py":
        assert "Traceback" not in result.output, result.output
    return result


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("batch_size", [0, -8])
def test_batch_size_must_be_positive(script, batch_size):
    fails_cleanly(script, ["--batch-size", batch_size], f"--batch-size must be positive, got {batch_size}")


@pytest.mark.parametrize("script", DISTRIBUTED)
def test_timeout_must_be_positive(script):
    # Zero would not mean "no timeout": every connection would give up at once.
    fails_cleanly(script, ["--timeout", 0], "--timeout must be positive, got 0.0")


@pytest.mark.parametrize("script", SCRIPTS)
def test_batch_size_must_split_evenly(script):
    # 6 sequences split into 2 micro-batches in one process, but not into 2 x 2 with two.
    batch = 6 if script in DISTRIBUTED else 7
    fails_cleanly(script, ["--batch-size", batch], f"--batch-size {batch} is not divisible by")


@pytest.mark.parametrize("script", SCRIPTS)
def test_missing_data_file(script, tmp_path):
    fails_cleanly(script, ["--data", tmp_path / "missing.txt", "--log-dir", tmp_path], "no such file")


@pytest.mark.parametrize("script", SCRIPTS)
def test_empty_data_file(script, tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    fails_cleanly(script, ["--data", tmp_path / "empty.txt", "--log-dir", tmp_path], "has 0 bytes")


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("script", SCRIPTS)
def test_corrupt_checkpoint_is_reported_and_kept(trained, script, tmp_path):
    # What a crash half-way through a non-atomic write would leave: the first half of the file.
    good = (trained["single_gpu.py"].ckpt_dir / "checkpoint.pt").read_bytes()
    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_bytes(good[: len(good) // 2])
    before = digest(ckpt)
    fails_cleanly(script, ["--ckpt-dir", tmp_path, "--log-dir", tmp_path, "--max-steps", 32],
                  "cannot read checkpoint")
    assert digest(ckpt) == before


@pytest.mark.parametrize("script", SCRIPTS)
def test_checkpoint_of_another_model_size_is_reported_and_kept(trained, script, tmp_path):
    ckpt = tmp_path / "checkpoint.pt"
    shutil.copy(trained["single_gpu.py"].ckpt_dir / "checkpoint.pt", ckpt)
    before = digest(ckpt)
    # --d-model 64 after the copied checkpoint's 32 (argparse keeps the last of a repeated flag).
    fails_cleanly(script, ["--d-model", 64, "--ckpt-dir", tmp_path, "--log-dir", tmp_path, "--max-steps", 32],
                  "'d_model': 32")
    assert digest(ckpt) == before
