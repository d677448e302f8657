"""Bad input ends every script quickly, with a one-line message and a non-zero exit, and never
touches an existing checkpoint."""

import hashlib
import os
import re
import shutil
import sys

import pytest
import torch
from torch.torch_version import TorchVersion

from conftest import (DISTRIBUTED, ROOT, SCRIPTS, STEPS, TINY, TINY_BUILT_IN, TORCHRUN, command, fails_cleanly,
                      import_script, injected, load, run, run_command)


def refused(script, args, tmp_path, monkeypatch):
    """The message with which `script` refuses `args`, its checks run in this process: parse_args(), then the data
    and model sections', in main()'s order. sys.exit's message is the line a run prints before it exits with 1; a
    subprocess would add seconds of start-up to each check (fails_cleanly's tests hold every script, and every
    rank, to printing it)."""
    module = import_script(script)
    monkeypatch.setattr(sys, "argv", [script, *TINY, "--log-dir", str(tmp_path), *map(str, args)])
    with pytest.raises(SystemExit) as stop:
        parsed = module.parse_args()
        train_set, _val_set, data_info = module.build_datasets(parsed)
        module.build_model(parsed, data_info)
        module.make_loader(train_set, parsed.batch_size, parsed)
    return stop.value.code


# Every script, each of whose processes must stop with the line.
@pytest.mark.parametrize("script", SCRIPTS)
def test_batch_size_must_be_positive(script):
    fails_cleanly(script, ["--batch-size", -8], "--batch-size must be positive, got -8")


# Every number that torch or the arithmetic would reject, or that would silently train nothing. The check is the
# same code in every script, as the test above shows; the data and model sections check their own flags.
@pytest.mark.parametrize("script, flag, value, message", [
    ("single_gpu.py", "--batch-size", 0, "--batch-size must be positive, got 0"),
    ("single_gpu.py", "--lr", -1, "--lr must be positive, got -1.0"),
    ("single_gpu.py", "--lr", "nan", "--lr must be positive, got nan"),
    ("single_gpu.py", "--lr", 0, "--lr must be positive, got 0.0"),
    ("single_gpu.py", "--weight-decay", -0.1, "--weight-decay must be zero or more, got -0.1"),
    ("single_gpu.py", "--grad-clip", -1, "--grad-clip must be zero or more, got -1.0"),
    ("single_gpu.py", "--warmup-steps", -1, "--warmup-steps must be zero or more, got -1"),
    ("single_gpu.py", "--lr-decay-steps", 0, "--lr-decay-steps must be positive, got 0"),
    ("single_gpu.py", "--eval-batches", 0, "--eval-batches must be positive, got 0"),
    # Zero would not mean "no timeout": every connection would give up at once; infinity overflows a timedelta.
    *[(script, "--timeout", 0, "--timeout must be positive, got 0.0") for script in DISTRIBUTED],
    ("ddp_spawn.py", "--timeout", "inf", "--timeout must be positive, got inf"),
    ("single_gpu.py", "--seq-len", 0, "--seq-len must be positive, got 0"),
    ("single_gpu.py", "--workers", -1, "--workers must be zero or more, got -1"),
    ("single_gpu.py", "--n-layers", 0, "--n-layers must be positive, got 0"),
    ("single_gpu.py", "--n-heads", -2, "--n-heads must be positive, got -2"),
])
def test_numbers_out_of_range(script, flag, value, message, tmp_path, monkeypatch):
    assert refused(script, [flag, value], tmp_path, monkeypatch) == f"{script}: error: {message}"


# Where the check is code every script shares, single_gpu.py and ddp_torchrun.py (each of its ranks checks,
# and all must stop) stand for the others.
ONE_AND_DDP = ["single_gpu.py", "ddp_torchrun.py"]


@pytest.mark.parametrize("script", ONE_AND_DDP)
def test_sequences_longer_than_the_built_in_data(script):
    # The built-in data has 262,144 tokens at any --seq-len: 100,000 would make 2 sequences. Refused at
    # once, not after generating them (which took minutes when the data was sized by sequences).
    fails_cleanly(script, ["--seq-len", 100_000], "--seq-len 100000 cuts the built-in data's 262,144 tokens into "
                  "fewer than 10 sequences", flags=TINY_BUILT_IN)


@pytest.mark.parametrize("script", ONE_AND_DDP)
def test_checkpoint_directory_that_is_a_file_is_refused_before_training(script, tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("a file, not a directory")
    result = fails_cleanly(script, ["--ckpt-dir", path, "--log-dir", tmp_path / "tb"],
                           f"--ckpt-dir {path} is not a directory this process can write to: File exists")
    assert "step " not in result.output, "trained before refusing"
    assert path.read_text() == "a file, not a directory"


def test_checkpoint_directory_that_cannot_be_written_is_refused(tmp_path):
    """A directory that exists but takes no files: read-only to this user, or, for root (whom permissions do
    not stop), a read-only filesystem mounted over it in a mount namespace of the run's own."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    command = [sys.executable, str(ROOT / "single_gpu.py"), *TINY, "--ckpt-dir", str(ckpt), "--log-dir", str(tmp_path)]
    if os.geteuid() != 0:
        ckpt.chmod(0o555)
    elif shutil.which("unshare") and run_command(["unshare", "--mount", "true"], timeout=30).returncode == 0:
        command = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$1" && shift && exec "$@"', "sh",
                   str(ckpt), *command]
    else:
        pytest.skip("root, and no mount namespace (unshare --mount) to make a read-only directory in")
    result = run_command(command, timeout=30)
    assert result.returncode == 1, result.output
    assert result.output.strip().splitlines()[-1].startswith(
        f"single_gpu.py: error: --ckpt-dir {ckpt} is not a directory this process can write to: "), result.output
    assert "step " not in result.output


def test_log_directory_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "tb").write_text("")
    fails_cleanly("single_gpu.py", ["--log-dir", tmp_path / "tb"],
                  f"--log-dir {tmp_path / 'tb'} is not a directory this process can write to: File exists")


@pytest.mark.parametrize("script", SCRIPTS)
def test_batch_size_must_split_evenly(script):
    # 6 sequences split into 2 micro-batches in one process, but not into 2 x 2 with two. pipeline.py's processes
    # hold stages, not samples: it cuts the batch into micro-batches only, as single_gpu.py does.
    batch = 6 if script in DISTRIBUTED and script != "pipeline.py" else 7
    fails_cleanly(script, ["--batch-size", batch], f"--batch-size {batch} is not divisible by")


@pytest.mark.parametrize("script", ONE_AND_DDP)  # the data section is every script's (tests/test_structure.py)
def test_missing_data_file(script, tmp_path):
    fails_cleanly(script, ["--data", tmp_path / "missing.txt", "--log-dir", tmp_path], "no such file")


@pytest.mark.parametrize("script", ONE_AND_DDP)  # the data section is every script's (tests/test_structure.py)
def test_empty_data_file(script, tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    fails_cleanly(script, ["--data", tmp_path / "empty.txt", "--log-dir", tmp_path], "has 0 bytes")


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


# A script for each checkpointing section: single_gpu.py's, which dataparallel.py and ddp_spawn.py share
# (tests/test_structure.py), ddp_torchrun.py's ranks, ddp_amp.py's with its scaler, and fsdp.py's and pipeline.py's
# (the same section, reading a checkpoint.pt on every rank).
READERS = ["single_gpu.py", "ddp_torchrun.py", "ddp_amp.py", "fsdp.py", "pipeline.py"]


@pytest.mark.parametrize("script", READERS)
def test_corrupt_checkpoint_is_reported_and_kept(trained, script, tmp_path):
    # What a crash half-way through a non-atomic write would leave: the first half of the file.
    good = (trained["single_gpu.py"].ckpt_dir / "checkpoint.pt").read_bytes()
    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_bytes(good[: len(good) // 2])
    before = digest(ckpt)
    fails_cleanly(script, ["--ckpt-dir", tmp_path, "--log-dir", tmp_path, "--max-steps", 32],
                  "cannot read checkpoint")
    assert digest(ckpt) == before


@pytest.mark.parametrize("script", READERS)
def test_checkpoint_of_another_model_size_is_reported_and_kept(trained, script, tmp_path):
    ckpt = tmp_path / "checkpoint.pt"
    shutil.copy(trained["single_gpu.py"].ckpt_dir / "checkpoint.pt", ckpt)
    before = digest(ckpt)
    # --d-model 64 after the copied checkpoint's 32 (argparse keeps the last of a repeated flag).
    fails_cleanly(script, ["--d-model", 64, "--ckpt-dir", tmp_path, "--log-dir", tmp_path, "--max-steps", 32],
                  "'d_model': 32")
    assert digest(ckpt) == before


@pytest.mark.parametrize("script", ONE_AND_DDP)
def test_diverging_run_stops_and_keeps_the_last_checkpoint(trained, script, tmp_path):
    """A run that resumes a good checkpoint with a learning rate that blows up stops at the first logged
    non-finite loss, names the step and what to try, and leaves the checkpoint as it was. Run again as the
    message says, with a lower --lr, it resumes from that checkpoint and trains to the end."""
    ckpt = tmp_path / "checkpoint.pt"
    shutil.copy(trained["single_gpu.py"].ckpt_dir / "checkpoint.pt", ckpt)
    before = digest(ckpt)
    flags = ["--ckpt-dir", tmp_path, "--log-dir", tmp_path / "tb", "--max-steps", 2 * STEPS]
    result = fails_cleanly(script, ["--lr", 1e6, *flags], "training diverged and stops, writing no checkpoint",
                           steps=None)
    assert re.search(r"the loss is (nan|inf) at step \d+: .*; try a lower --lr, or clipping with a lower --grad-clip$",
                     result.output, re.MULTILINE), result.output
    assert digest(ckpt) == before

    result = run(script, *TINY, *flags)  # TINY's --lr
    assert result.returncode == 0, result.output
    assert f"at step {STEPS}" in result.output and load(tmp_path)["step"] == 2 * STEPS


@pytest.mark.parametrize("script", [*ONE_AND_DDP, "fsdp.py"])  # fsdp.py: each rank checks its shards, then all agree
def test_weights_that_blow_up_are_never_checkpointed(script, tmp_path):
    """With --lr 1e30 the first step leaves huge but finite weights (checkpointed), and the second
    non-finite ones: the run stops at that checkpoint, before the loss is next logged (step 3), and keeps
    step 1's."""
    fails_cleanly(script, ["--lr", 1e30, "--log-every", 3, "--ckpt-every", 1, "--ckpt-dir", tmp_path,
                           "--log-dir", tmp_path / "tb"], "the weights are no longer finite at step 2", steps=2)
    state = load(tmp_path)
    assert state["step"] == 1
    assert all(weights.isfinite().all() for weights in state["model"].values())


# After its second optimizer step, rank 1 alone finds a NaN in the first weights it holds: a shard, or a stage's.
ONE_RANKS_NAN = ("import os, torch\n"
                 "step, steps_taken = torch.optim.AdamW.step, []\n"
                 "def poisoning_step(self, *args, **kwargs):\n"
                 "    result = step(self, *args, **kwargs)\n"
                 "    steps_taken.append(None)\n"
                 "    if len(steps_taken) == 2 and os.environ.get('RANK') == '1':\n"
                 "        weights = self.param_groups[0]['params'][0]\n"
                 "        with torch.no_grad():\n"
                 "            (weights.to_local() if hasattr(weights, 'to_local') else weights).view(-1)[0] = float('nan')\n"
                 "    return result\n"
                 "torch.optim.AdamW.step = poisoning_step\n")


@pytest.mark.parametrize("script", ["fsdp.py", "pipeline.py"])  # where each rank holds weights no other rank has
def test_non_finite_weights_on_one_rank_stop_every_rank(script, tmp_path):
    """Rank 1's weights turn non-finite while rank 0's stay finite: both ranks stop at the same checkpoint with the
    same line (each checks its own, then all agree), and step 1's checkpoint stays."""
    fails_cleanly(script, ["--log-every", 3, "--ckpt-every", 1, "--ckpt-dir", tmp_path], "the weights are no longer "
                  "finite at step 2", steps=2, code=ONE_RANKS_NAN)
    state = load(tmp_path)
    assert state["step"] == 1
    assert all(weights.isfinite().all() for weights in state["model"].values())


@pytest.mark.parametrize("script", SCRIPTS)
def test_profile_needs_nine_steps(script):
    fails_cleanly(script, ["--profile", "--max-steps", 8], "--profile traces steps 7 to 9, but --max-steps 8 stops before")


def test_compile_refused_under_dataparallel_on_several_gpus(tmp_path):
    """nn.DataParallel's replicas would share the original model's compiled forward, and its weights on GPU 0.
    Two GPUs are faked: the check comes before anything touches one."""
    env = injected(tmp_path, "import torch\ntorch.cuda.device_count = lambda: 2\n")
    result = run_command(command("dataparallel.py") + [*TINY, "--compile", "--log-dir", str(tmp_path)], env=env, timeout=30)
    assert result.returncode != 0
    assert result.output.strip() == ("dataparallel.py: error: --compile does not work with nn.DataParallel on several "
                                     "GPUs: use DistributedDataParallel (a process per GPU), or one GPU"), result.output


@pytest.mark.parametrize("script", TORCHRUN)
def test_more_processes_than_gpus_is_refused(script, tmp_path):
    """Local rank 3 on a node of two GPUs (faked: nothing touches a GPU before the check) stops with one line, not
    CUDA's "invalid device ordinal"."""
    env = {**injected(tmp_path, "import torch\ntorch.cuda.is_available = lambda: True\n"
                                "torch.cuda.device_count = lambda: 2\n"), "LOCAL_RANK": "3"}
    result = run_command([sys.executable, str(ROOT / script), *TINY, "--device", "cuda", "--log-dir", str(tmp_path)],
                         env=env, timeout=30)
    assert result.returncode != 0
    assert result.output.strip() == (f"{script}: error: local rank 3 has no GPU: this node has 2; start at most that "
                                     f"many per node (--nproc_per_node)"), result.output


@pytest.mark.parametrize("script", TORCHRUN)
def test_one_gpu_per_process_is_used_whatever_its_local_rank(script, monkeypatch, tmp_path):
    """srun --gpus-per-task=1, or a Kubernetes operator, shows each process its own GPU alone and keeps the real
    LOCAL_RANK: local rank 3 uses the GPU it sees. Under torchrun, or without CUDA_VISIBLE_DEVICES, one GPU for
    local rank 3 is refused.
    (Faked in this process: one GPU, and a process group that is not formed.)"""
    module = import_script(script)
    used = []
    for name, value in [("is_available", lambda: True), ("device_count", lambda: 1), ("set_device", lambda d: None),
                        ("get_device_capability", lambda d: (9, 0))]:
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(module.dist, "init_process_group", lambda *args, **kwargs: used.append(kwargs["device_id"]))
    monkeypatch.setattr(module.atexit, "register", lambda function: None)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    for name, value in [("LOCAL_RANK", "3"), ("RANK", "3"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "localhost"),
                        ("MASTER_PORT", "0"), ("CUDA_VISIBLE_DEVICES", "GPU-5d2e")]:
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)  # fail() would stop a torchrun that ran pytest
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(sys, "argv", [script, "--device", "cuda", "--log-dir", str(tmp_path)])
    args = module.parse_args()
    assert module.setup(args) == torch.device("cuda", 0) and used == [torch.device("cuda", 0)]
    # torchrun's workers share one environment: there, one visible GPU is one GPU for all of them.
    for torchrun, visible in [("job", "GPU-5d2e"), (None, None)]:
        for name, value in [("TORCHELASTIC_RUN_ID", torchrun), ("CUDA_VISIBLE_DEVICES", visible)]:
            monkeypatch.setenv(name, value) if value else monkeypatch.delenv(name, raising=False)
        with pytest.raises(SystemExit) as stop:
            module.setup(args)
        assert stop.value.code == (f"{script}: error: local rank 3 has no GPU: this node has 1; start at most that "
                                   "many per node (--nproc_per_node)")


def readme_floors():
    """{script: the oldest torch it runs on}, from the README's table of floors."""
    rows = re.findall(r"^\| `(\w+\.py)` \| (\d+)\.(\d+) \|", (ROOT / "README.md").read_text(), re.MULTILINE)
    return {script: (int(major), int(minor)) for script, major, minor in rows}


@pytest.mark.parametrize("script", SCRIPTS)
def test_too_old_a_torch_is_refused(script, monkeypatch):
    """The release before the script's floor in the README (faked in this process) stops its import with the line
    naming both versions, before the imports that such a torch may lack; the floor's own first release passes."""
    major, minor = readme_floors()[script]
    older = f"{major}.{minor - 1}.0+cu124"
    monkeypatch.setattr(torch, "__version__", TorchVersion(older))
    with pytest.raises(SystemExit) as stop:
        import_script(script)
    assert stop.value.code == f"{script}: error: this script needs torch {major}.{minor} or newer, found {older}"
    monkeypatch.setattr(torch, "__version__", TorchVersion(f"{major}.{minor}.0+cu124"))
    import_script(script)


def test_too_old_a_torch_prints_one_line_and_nothing_else(tmp_path):
    """What the user sees of the refusal above: that line alone, from a process whose torch says so from start-up."""
    major, minor = readme_floors()["single_gpu.py"]
    older = f"{major}.{minor - 1}.0+cu124"
    env = injected(tmp_path, f"import torch\nfrom torch.torch_version import TorchVersion\n"
                             f"torch.__version__ = TorchVersion({older!r})\n")
    result = run_command([sys.executable, str(ROOT / "single_gpu.py"), "--help"], env=env, timeout=60)
    assert result.returncode == 1
    assert result.output == f"single_gpu.py: error: this script needs torch {major}.{minor} or newer, found {older}\n"
