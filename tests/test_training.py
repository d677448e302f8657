"""Every script trains, agrees with single_gpu.py, validates exactly and resumes exactly."""

import argparse
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from conftest import (DISTRIBUTED, FP32, HALF, PARAM_ATOL, ROOT, SCRIPTS, STEPS, TINY, TINY_BUILT_IN, WARNING,
                      checkpoint_name, fails_cleanly, import_script, injected, load, max_param_diff, numbered, resume_in,
                      run, scalars)

LOSS_ATOL = 1e-5


@pytest.mark.smoke
@pytest.mark.parametrize("script", SCRIPTS)
def test_trains_logs_and_checkpoints(trained, script):
    result = trained[script]
    assert result.run.returncode == 0, result.run.output
    assert not WARNING.search(result.run.output), result.run.output

    tb = scalars(result.log_dir)
    assert {"train/loss", "train/lr", "train/tokens_per_sec", "val/loss", "val/accuracy"} <= tb.keys()
    train_loss = tb["train/loss"]
    assert sorted(train_loss) == list(range(2, STEPS + 1, 2))
    assert train_loss[2] - train_loss[STEPS] > 0.4, train_loss
    assert sorted(tb["val/loss"]) == [0, 8, 16]
    assert tb["val/loss"][0] - tb["val/loss"][STEPS] > 0.4, tb["val/loss"]
    assert tb["val/accuracy"][STEPS] > tb["val/accuracy"][0] + 0.1, tb["val/accuracy"]
    assert all(v > 0 for v in tb["train/tokens_per_sec"].values())

    # Console lines from one process only: a second rank would print every line again.
    assert result.run.output.count("step    16 | val loss") == 1, result.run.output
    assert result.run.output.count("global batch 8 = ") == 1, result.run.output

    ckpt = load(result.ckpt_dir)
    assert {"model", "optimizer", "scheduler", "step", "config"} <= ckpt.keys()
    assert ckpt["step"] == STEPS
    assert not any(name.startswith("module.") for name in ckpt["model"]), list(ckpt["model"])
    assert ckpt["config"] == {"vocab_size": 256, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2}


@pytest.mark.smoke
@pytest.mark.parametrize("script", FP32[1:])
def test_same_parameters_and_losses_as_single_gpu(trained, script):
    reference, other = trained["single_gpu.py"], trained[script]
    assert reference.run.returncode == 0 and other.run.returncode == 0, other.run.output
    assert max_param_diff(load(reference.ckpt_dir)["model"], load(other.ckpt_dir)["model"]) <= PARAM_ATOL

    expected, got = scalars(reference.log_dir)["train/loss"], scalars(other.log_dir)["train/loss"]
    assert expected.keys() == got.keys()
    assert all(abs(expected[step] - got[step]) <= LOSS_ATOL for step in expected), (expected, got)


@pytest.mark.smoke
@pytest.mark.parametrize("script", DISTRIBUTED)
def test_validation_is_exact_across_ranks(trained, script):
    """Step 0: every script holds the same initial weights, so 1 and 2 processes must agree on the
    whole validation split (5 sequences, which 2 ranks cannot split evenly)."""
    reference, other = trained["single_gpu.py"], trained[script]
    assert "5 of 5 validation samples per evaluation" in reference.run.output
    assert "5 of 5 validation samples per evaluation" in other.run.output
    expected, got = scalars(reference.log_dir), scalars(other.log_dir)
    # Only the grouping of the fp32 per-batch sums differs (accumulated in fp64).
    assert got["val/loss"][0] == pytest.approx(expected["val/loss"][0], rel=1e-6)
    assert got["val/accuracy"][0] == expected["val/accuracy"][0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_rank_0_logs_where_every_rank_runs(trained, script):
    """One line per host, from rank 0 alone, naming each rank once with its device (a world of one: rank 0)."""
    output, host = trained[script].run.output, socket.gethostname()
    ranks = "rank 0 on cpu, rank 1 on cpu" if script in DISTRIBUTED else "rank 0 on cpu"
    assert [line for line in output.splitlines() if line.startswith(f"{host}: ")] == [f"{host}: {ranks}"]


# Every sample the training set hands out, one line each in the file $FETCHES, from every process (loader workers
# included). The training set is the Subset of range(0, ...) over the dataset itself; the validation sets are others.
COUNT_FETCHES = """import os, torch.utils.data
Subset = torch.utils.data.Subset
getitem, getitems = Subset.__getitem__, Subset.__getitems__

def note(subset, count):
    if isinstance(subset.indices, range) and subset.indices.start == 0 and not isinstance(subset.dataset, Subset):
        with open(os.environ["FETCHES"], "a") as f:
            f.write("fetched\\n" * count)

def counted_getitem(self, index):
    note(self, 1)
    return getitem(self, index)

def counted_getitems(self, indices):
    note(self, len(indices))
    return getitems(self, indices)

Subset.__getitem__, Subset.__getitems__ = counted_getitem, counted_getitems
"""


# In the smoke tier, a script for each way to save and resume: dataparallel.py and ddp_spawn.py save and load with
# single_gpu.py's and ddp_torchrun.py's checkpointing section (tests/test_structure.py), so they wait for --full.
@pytest.mark.parametrize("script", [pytest.param(script, marks=[] if script in ("dataparallel.py", "ddp_spawn.py")
                                                 else [pytest.mark.smoke]) for script in SCRIPTS])
def test_resume_matches_an_uninterrupted_run_bit_for_bit(trained, halfway, script, tmp_path):
    """Stopped at step HALF with a checkpoint and run again, each script ends on its uninterrupted run's weights,
    AdamW state and logged losses, bit for bit. ddp_torchrun.py resumes with loader workers: the same numbers."""
    workers = 2 if script == "ddp_torchrun.py" else 0
    ckpt_dir = resume_in(halfway[script], tmp_path / "ckpt")
    assert load(ckpt_dir)["step"] == HALF
    second = run(script, *TINY, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb2",
                 "--workers", workers, env={**injected(tmp_path, COUNT_FETCHES), "FETCHES": str(tmp_path / "fetches")})
    assert second.returncode == 0, second.output
    assert f"resumed from {ckpt_dir / checkpoint_name(script)} at step {HALF}" in second.output
    if script in ("fsdp.py", "pipeline.py"):  # the link moved to the new directory, and the old one went
        assert sorted(p.name for p in ckpt_dir.iterdir()) == ["checkpoint", f"checkpoint-{STEPS:06d}"]
    # Step 8 is 3 steps into an epoch of 5: those 3 steps' samples are skipped by index, never fetched. The run
    # fetches what steps 9 to 16 train on, 8 samples a step (every stage of pipeline.py loads whole batches, and
    # one sample at start-up for its shape), and with workers what they prefetch past each of the 3 epochs it
    # touches: at most 2 workers x 2 batches of 2 samples per rank.
    fetched, trained_on = len((tmp_path / "fetches").read_text().split()), (STEPS - HALF) * 8
    if script == "pipeline.py":
        trained_on = 2 * (trained_on + 1)
    print(f"\n{script} --workers {workers}: resumed at step {HALF}, fetched {fetched} samples to train on {trained_on}")
    assert fetched == trained_on if workers == 0 else trained_on <= fetched <= trained_on + 3 * 2 * (2 * 2 * 2)

    resumed, uninterrupted = load(ckpt_dir), load(trained[script].ckpt_dir)
    assert resumed["step"] == STEPS
    for name, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    for index, state in uninterrupted["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(resumed["optimizer"]["state"][index][key], value), (index, key)
    # The losses logged after the restart are the uninterrupted run's, exactly.
    expected = scalars(trained[script].log_dir)["train/loss"]
    got = scalars(tmp_path / "tb2")["train/loss"]
    assert got == {step: loss for step, loss in expected.items() if step > HALF}


@pytest.mark.parametrize("script", ["single_gpu.py", "fsdp.py"])  # a checkpoint.pt, and a DCP directory
def test_keep_checkpoints_keeps_the_last_ones_and_any_of_them_resumes(trained, script, tmp_path):
    """--keep-checkpoints 3, a save every 4 steps: after 12 steps, those of steps 4, 8 and 12, numbered; the resumed
    run's save at 16 removes step 4's. Then the README's command makes step 8's the latest, in place, and a run with
    the default (1) resumes from it and keeps its latest alone. Both runs end on the uninterrupted weights, bit for
    bit."""
    ckpt_dir, pt = tmp_path / "ckpt", ".pt" if script == "single_gpu.py" else ""

    def train(steps, keep, resumed_at=None):
        result = run(script, *TINY, "--max-steps", steps, "--lr-decay-steps", STEPS, "--ckpt-every", 4,
                     "--keep-checkpoints", keep, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb")
        assert result.returncode == 0, result.output
        assert resumed_at is None or f"resumed from {ckpt_dir / checkpoint_name(script)} at step {resumed_at}" in result.output
        got, expected = load(ckpt_dir), load(trained[script].ckpt_dir)["model"]
        assert steps < STEPS or all(torch.equal(got["model"][name], expected[name]) for name in expected)
        return sorted(path.name for path in ckpt_dir.glob("checkpoint-*"))

    assert train(12, 3) == [f"checkpoint-{step:06d}{pt}" for step in (4, 8, 12)]
    assert train(STEPS, 3, resumed_at=12) == [f"checkpoint-{step:06d}{pt}" for step in (8, 12, 16)]
    assert (ckpt_dir / checkpoint_name(script)).samefile(ckpt_dir / f"checkpoint-{STEPS:06d}{pt}")  # the latest
    # The README's way back: a new name for the file (`cp` would write step 8 into step 16's file), or a new link.
    back = ["ln", "-f", "checkpoint-000008.pt", "checkpoint.pt"] if pt else ["ln", "-sfn", "checkpoint-000008", "checkpoint"]
    subprocess.run(back, cwd=ckpt_dir, check=True)
    if pt:
        assert torch.load(ckpt_dir / f"checkpoint-{STEPS:06d}.pt", weights_only=True)["step"] == STEPS  # untouched
    assert train(STEPS, 1, resumed_at=8) == ([] if pt else [f"checkpoint-{STEPS:06d}"])


def test_every_checkpoint_names_the_optimizer_state_and_an_older_numbered_one_still_resumes(trained, halfway, tmp_path):
    """Every script keys AdamW's state by parameter name (torch's get_state_dict), so torch's converters need no help.
    A checkpoint.pt from before 2026-11-26 numbers it, as optimizer.state_dict() does: single_gpu.py resumes it bit
    for bit (set_state_dict maps numbers by position) and saves names; fsdp.py and pipeline.py, whose load of a whole
    state fails on numbers (a KeyError from torch, 2.8 to 2.13), refuse it in one line and leave it as it was."""
    for script in trained:
        state = load(trained[script].ckpt_dir)["optimizer"]
        assert all(isinstance(key, str) for key in state["state"]) and state["state"].keys() == {
            name for group in state["param_groups"] for name in group["params"]}, script
    ckpt_dir = resume_in(halfway["single_gpu.py"], tmp_path / "ckpt")
    path = ckpt_dir / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    state["optimizer"] = numbered(state["optimizer"])
    torch.save(state, path)
    before = path.read_bytes()
    for script in "fsdp.py", "pipeline.py":
        fails_cleanly(script, ["--ckpt-dir", ckpt_dir, "--max-steps", STEPS], f"{path} numbers its optimizer state, as "
                      "the one-file scripts did before 2026-11-26: run the script that wrote it, as it is now, a step "
                      "further to save it with names")
        assert path.read_bytes() == before
    result = run("single_gpu.py", *TINY, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb")
    assert result.returncode == 0 and f"resumed from {path} at step {HALF}" in result.output, result.output
    resumed, uninterrupted = load(ckpt_dir), load(trained["single_gpu.py"].ckpt_dir)
    assert resumed["optimizer"]["state"].keys() == uninterrupted["optimizer"]["state"].keys()  # names again
    for name, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    for name, state in uninterrupted["optimizer"]["state"].items():
        assert all(torch.equal(resumed["optimizer"]["state"][name][key], value) for key, value in state.items()), name


@pytest.mark.parametrize("script", ["single_gpu.py", "fsdp.py"])  # a checkpoint.pt, and a DCP directory
def test_a_finished_run_started_again_trains_no_more(trained, script, tmp_path):
    ckpt_dir = resume_in(trained[script], tmp_path / "ckpt")
    again = run(script, *TINY, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb")
    assert again.returncode == 0, again.output
    assert "the run is finished" in again.output and "step    16 | loss" not in again.output, again.output
    assert max_param_diff(load(ckpt_dir)["model"], load(trained[script].ckpt_dir)["model"]) == 0


def test_checkpoints_move_between_scripts(trained, tmp_path):
    """One run handed from script to script, a quarter each, ends where single_gpu.py alone ends."""
    ckpt_dir = tmp_path / "ckpt"
    order = ["single_gpu.py", "ddp_torchrun.py", "ddp_spawn.py", "dataparallel.py"]
    for quarter, script in enumerate(order, start=1):
        result = run(script, *TINY, "--max-steps", quarter * STEPS // 4, "--lr-decay-steps", STEPS,
                     "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / script)
        assert result.returncode == 0, result.output
        assert load(ckpt_dir)["step"] == quarter * STEPS // 4
    assert max_param_diff(load(ckpt_dir)["model"], load(trained["single_gpu.py"].ckpt_dir)["model"]) <= PARAM_ATOL


def test_bounded_evaluation_is_the_same_on_any_number_of_ranks(tmp_path):
    """--eval-batches 3 evaluates the first 3 global batches (24) of the built-in data's 1638 validation
    sequences, the same ones on 1 and on 2 processes."""
    results = {}
    for script in ["single_gpu.py", "ddp_torchrun.py"]:
        result = run(script, *TINY_BUILT_IN, "--max-steps", 1, "--eval-batches", 3, "--log-dir", tmp_path / script)
        assert result.returncode == 0, result.output
        assert "24 of 1638 validation samples per evaluation" in result.output, result.output
        results[script] = scalars(tmp_path / script)
    expected, got = results["single_gpu.py"], results["ddp_torchrun.py"]
    assert got["val/loss"][0] == pytest.approx(expected["val/loss"][0], rel=1e-6)
    assert got["val/accuracy"][0] == expected["val/accuracy"][0]


def test_grad_clip_zero_turns_clipping_off(tmp_path):
    """0 means no clipping, not a clip to zero (which would zero every gradient): the weights are those
    of a clip that no gradient reaches, bit for bit."""
    weights = {}
    for clip in ["0", "1e9"]:
        result = run("single_gpu.py", *TINY, "--max-steps", 4, "--grad-clip", clip, "--ckpt-dir", tmp_path / clip,
                     "--log-dir", tmp_path / "tb")
        assert result.returncode == 0, result.output
        weights[clip] = load(tmp_path / clip)["model"]
    assert all(torch.equal(weights["0"][name], weights["1e9"][name]) for name in weights["0"])


@pytest.mark.parametrize("script", FP32)  # ddp_amp.py's checkpoint functions take its scaler too: see test_amp.py
@pytest.mark.parametrize("saved_fused", [False, True])
def test_resumed_optimizer_runs_this_devices_kernel(script, saved_fused, tmp_path, request):
    """A checkpoint written on a CPU holds fused=False in its parameter groups; resumed on a GPU, the
    optimizer must still run the fused kernel that this run built it with (and a GPU's checkpoint on a
    CPU, the other way round). Fused AdamW runs on CPUs too, so both directions are checked here."""
    module = import_script(script)
    sharded = script == "fsdp.py"
    sharded_or_staged = script in ("fsdp.py", "pipeline.py")
    if sharded_or_staged:  # their functions need a process group: a world of one, in this process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        request.addfinalizer(dist.destroy_process_group)
    # pipeline.py's save also takes every stage's parameter names, group by group (in a world of one, this process's).
    order = (lambda model, optimizer: [module.param_names(model, optimizer)]) if script == "pipeline.py" else lambda *_: []
    flags = argparse.Namespace(seq_len=4, d_model=8, n_layers=1, n_heads=2)
    tokens = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))

    def build(fused):
        torch.manual_seed(0)
        model, config = module.build_model(flags, {"vocab_size": 16})
        if sharded:
            fsdp_flags = argparse.Namespace(precision="fp32", compile=False, activation_checkpointing=False, replicate=1)
            module.shard_model(model, fsdp_flags, torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), config

    def train_one_step(model, optimizer, scheduler):
        model(tokens).logsumexp(-1).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    *saved, config = build(fused=saved_fused)
    train_one_step(*saved)
    path = str(tmp_path / checkpoint_name(script))
    # Step 1, keep 1 checkpoint, none in progress, written before it returns (in the world's group, where DCP's).
    module.save_checkpoint(path, *saved, 1, config, *order(*saved[:2]), 1, None, True,
                           *[dist.group.WORLD] if sharded_or_staged else [])

    model, optimizer, scheduler, config = build(fused=not saved_fused)
    cpu = torch.device("cpu")
    assert module.load_checkpoint(path, model, optimizer, scheduler, config, cpu) == 1
    assert [group["fused"] for group in optimizer.param_groups] == [not saved_fused]
    for param, saved_param in zip(model.parameters(), saved[0].parameters()):  # Adam's moments arrived
        for key in "exp_avg", "exp_avg_sq":
            assert torch.equal(local(optimizer.state[param][key]), local(saved[1].state[saved_param][key]))
    train_one_step(model, optimizer, scheduler)  # and the kernel runs with them
    assert all(optimizer.state[param]["step"].item() == 2 for param in model.parameters())


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def test_text_file_is_mapped_not_copied(tmp_path):
    """--data leaves the file's bytes in the page cache, one copy that every process of a node shares,
    instead of reading them into int64 tensors of its own (8 bytes per byte: 320 MB per process for
    this 40 MB file). The data section is every script's, so single_gpu.py stands for them all."""
    data = tmp_path / "corpus.bin"
    data.write_bytes(torch.randint(0, 256, (40 * 2**20,), dtype=torch.uint8).numpy().tobytes())
    code = f"""
import argparse, sys
sys.path.insert(0, {str(ROOT)!r})
import single_gpu

def resident(kind):  # bytes of this process's memory: RssAnon its own; RssFile mapped from files, RssShmem from tmpfs
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(kind + ":")) * 1024

def mapped():
    return resident("RssFile") + resident("RssShmem")

before = resident("RssAnon"), mapped()
train, val, _ = single_gpu.build_datasets(argparse.Namespace(data={str(data)!r}, seq_len=64))
for dataset in train, val:
    for i in range(0, len(dataset), 64):  # 64 sequences of 64 bytes: one from every 4 KiB page of the file
        dataset[i]
print(resident("RssAnon") - before[0], mapped() - before[1])
"""
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    own, mapped = map(int, result.stdout.split())
    print(f"40 MiB --data file: {own / 2**20:.1f} MiB of this process's own memory, {mapped / 2**20:.1f} MiB mapped")
    assert own < 4 * 2**20, f"{own / 2**20:.0f} MiB copied into the process"
    assert mapped > 36 * 2**20, f"only {mapped / 2**20:.0f} MiB of the file mapped: was it read some other way?"


# Registered at start-up, before the script's own exit handler, so it runs after it (atexit is last in, first out):
# what is left of gloo once the script has destroyed its process group, just before Python shuts down.
GLOO_THREADS_AT_EXIT = """
import atexit, os

def report():
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    # Who reports: a rank (RANK: torchrun's, or ddp_spawn.py's run() sets it), or any other process.
    who = os.environ.get("RANK") or "other"
    print(f"gloo threads at exit: {sum('gloo' in name for name in names)} ({who})", flush=True)

atexit.register(report)
"""


# Not fsdp.py: on torch 2.13 fully_shard keeps a reference to the group that no Python object holds, so its group
# and threads live until the process ends, whatever the script does.
@pytest.mark.parametrize("script", [script for script in DISTRIBUTED if script != "fsdp.py"])
def test_no_gloo_thread_outlives_the_process_group(script, tmp_path):
    """destroy_process_group() joins gloo's threads only if nothing else holds the group. One that ran on into
    Python's shutdown aborted a CI run ("terminate called without an active exception"), rarely, as such races
    do: this checks the cause every time instead. Two steps: the optimizer and the checkpoint are part of it."""
    result = run(script, *TINY, "--max-steps", 2, "--ckpt-dir", tmp_path / "ckpt", "--log-dir", tmp_path / "tb",
                 env=injected(tmp_path, GLOO_THREADS_AT_EXIT))
    assert result.returncode == 0, result.output
    # Every process reports: the ranks, and what started them. Not anchored to lines: the ranks write to one pipe,
    # and two reports can land on one line.
    reports = re.findall(r"gloo threads at exit: (\d+) \((\w+)\)", result.output)
    ranks = sorted(who for _, who in reports if who != "other")
    assert ranks == ["0", "1"], result.output
    assert all(count == "0" for count, _ in reports), result.output
