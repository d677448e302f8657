"""Every script trains, agrees with single_gpu.py, validates exactly, and resumes exactly, from its own checkpoints and
from any other script's on any number of processes."""

import argparse
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (DISTRIBUTED, FP32, HALF, PARAM_ATOL, ROOT, SCRIPTS, STEPS, TINY, TORCHRUN, WARNING, adam_state,
                      assert_identical, checkpoints, command, import_script, injected, load, max_param_diff, resume_in,
                      run, run_command, scalars)

LOSS_ATOL = 1e-5
TAGS = {"train/loss", "train/lr", "train/tokens_per_sec", "train/tflops", "val/loss", "val/accuracy"}
CONFIG = {"vocab_size": 256, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2, "qkv": "by head"}
NPROC = {script: 2 if script in DISTRIBUTED else 1 for script in SCRIPTS}


def resume(script, ckpt_dir, log_dir, steps=STEPS, *flags, env=None, nproc=2):
    """Run `script` on in `ckpt_dir` to `steps` (the schedule set for STEPS); return its output."""
    result = run(script, *TINY, "--max-steps", steps, "--lr-decay-steps", STEPS, "--ckpt-dir", ckpt_dir,
                 "--log-dir", log_dir, *flags, env=env, nproc=nproc, timeout=300 if nproc > 2 else 180)
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    return result.output


@pytest.mark.smoke
@pytest.mark.parametrize("script", SCRIPTS)
def test_trains_logs_and_checkpoints(trained, script):
    result = trained[script]
    assert result.run.returncode == 0, result.run.output
    assert not WARNING.search(result.run.output), result.run.output

    tb = scalars(result.log_dir)
    assert tb.keys() == TAGS
    train_loss = tb["train/loss"]
    assert sorted(train_loss) == list(range(2, STEPS + 1, 2))
    assert train_loss[2] - train_loss[STEPS] > 1.5, train_loss  # 5.46 to 2.97
    assert sorted(tb["val/loss"]) == [0, HALF, STEPS]
    assert tb["val/loss"][0] - tb["val/loss"][STEPS] > 1.5, tb["val/loss"]  # 5.54 to 3.04
    assert tb["val/accuracy"][STEPS] > tb["val/accuracy"][0] + 0.1, tb["val/accuracy"]
    assert all(v > 0 for name in ("train/tokens_per_sec", "train/tflops") for v in tb[name].values())
    # Each step line gives the rate that step trained with: TINY's schedule, written out (lr 1e-2, 2 steps of warmup,
    # cosine decay to a tenth at STEPS), at step 2, still warming up, and at each step of the decay after it.
    for step, lr in tb["train/lr"].items():
        index, warmup = step - 1, 2
        factor = (index + 1) / warmup if index < warmup else 0.55 + 0.45 * math.cos(math.pi * (index - warmup) / 14)
        assert lr == pytest.approx(1e-2 * factor, rel=1e-6), (step, lr)

    # Console lines from one process only: a second rank would print every line again.
    for line in ["global batch 8 = ", "step     2 | loss ", "step    16 | saving ", "step    16 | val loss "]:
        assert result.run.output.count(line) == 1, (line, result.run.output)

    # The default --keep-checkpoints 1 leaves step 16's alone: a file per process, and DCP's .metadata.
    assert checkpoints(result.ckpt_dir) == [result.ckpt_dir / f"step-{STEPS:06d}"]
    assert sorted(path.name for path in result.ckpt_dir.iterdir()) == [f"step-{STEPS:06d}"]
    files = sorted(path.name for path in (result.ckpt_dir / f"step-{STEPS:06d}").iterdir())
    assert files == [".metadata", *[f"__{rank}_0.distcp" for rank in range(NPROC[script])]]
    state = load(result.ckpt_dir)
    assert state.keys() == {"model", "optimizer", "step", "config"}, state.keys()  # the schedule: from the step
    assert state["step"] == STEPS and state["config"] == CONFIG
    names = set(state["model"])  # as the model names them: no "module." of DDP, no "_orig_mod." of compile
    assert "blocks.0.qkv.weight" in names and not any(name.startswith(("module.", "_orig_mod.")) for name in names)
    assert adam_state(state).keys() == {f"state.{name}.{key}" for name in names
                                        for key in ("step", "exp_avg", "exp_avg_sq")}
    assert all(step == STEPS for key, step in adam_state(state).items() if key.endswith(".step"))


@pytest.mark.smoke
@pytest.mark.parametrize("script", TORCHRUN)
def test_torchrun_trains_as_the_tests_warm_start_does(trained, script, tmp_path):
    """The tests start most runs' processes from a warm start, as torchrun would (conftest.py's `warm`). Here torchrun
    itself starts each of its scripts, from a cold start as a user's: the checkpoint is the warm run's, bit for bit,
    and no warning comes from what a process does first (imports, sitecustomize, the environment)."""
    result = run_command(command(script) + [*map(str, TINY), "--max-steps", str(STEPS), "--ckpt-dir",
                                            str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "tb")])
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    assert_identical(load(tmp_path / "ckpt"), load(trained[script].ckpt_dir))


@pytest.mark.smoke
@pytest.mark.parametrize("script", FP32[1:])
def test_same_parameters_and_losses_as_single_gpu(trained, script):
    reference, other = trained["single_gpu.py"], trained[script]
    assert reference.run.returncode == 0 and other.run.returncode == 0, other.run.output
    difference = max_param_diff(load(reference.ckpt_dir)["model"], load(other.ckpt_dir)["model"])
    print(f"{script}: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL

    expected, got = scalars(reference.log_dir)["train/loss"], scalars(other.log_dir)["train/loss"]
    assert expected.keys() == got.keys()
    assert all(abs(expected[step] - got[step]) <= LOSS_ATOL for step in expected), (expected, got)


@pytest.mark.smoke
@pytest.mark.parametrize("script", DISTRIBUTED)
def test_validation_is_exact_across_ranks(trained, script):
    """Step 0: every script holds the same initial weights, so 1 and 2 processes must agree on the whole validation
    split (of TINY's 9 sequences the whole batch of 8: 4 on each rank, and in pipeline.py all 8 through the stages)."""
    reference, other = trained["single_gpu.py"], trained[script]
    expected, got = scalars(reference.log_dir), scalars(other.log_dir)
    # Only the grouping of the fp32 per-batch sums differs (accumulated in fp64), and the logits' rounding in a batch
    # of another size: two logits within 1e-7 of each other may trade the argmax, one prediction in 128 (on some CPU).
    assert got["val/loss"][0] == pytest.approx(expected["val/loss"][0], rel=1e-6)
    assert abs(got["val/accuracy"][0] - expected["val/accuracy"][0]) <= 1 / 128


# Every sample the training loader fetches, one line each in the file $FETCHES, from every process (loader workers
# included). The training set is the Subset of range(0, ...) over the dataset itself; the validation sets are others.
# The loader fetches a batch with __getitems__; the scripts' start-up reads of train_set[0] (a sample's shape and
# FLOPs) go through __getitem__ and are not counted.
COUNT_FETCHES = """import os, torch.utils.data
Subset = torch.utils.data.Subset
getitems = Subset.__getitems__

def counted_getitems(self, indices):
    if isinstance(self.indices, range) and self.indices.start == 0 and not isinstance(self.dataset, Subset):
        where = "worker" if torch.utils.data.get_worker_info() else "main"  # which process fetched it
        with open(os.environ["FETCHES"], "a") as f:
            f.write(f"{where}\\n" * len(indices))
    return getitems(self, indices)

Subset.__getitems__ = counted_getitems
"""

# Registered at start-up, so it runs after everything the script does: what is left of gloo once the script has
# destroyed its process group, just before Python shuts down. A gloo thread that runs on into the shutdown can abort
# the process ("terminate called without an active exception"), rarely, as such races do: this checks the cause
# every time instead.
GLOO_THREADS_AT_EXIT = """
import atexit, os, sys

def name(task):  # a thread that ends meanwhile has none
    try:
        with open(f"/proc/self/task/{task}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""

def report():
    names = [name(task) for task in os.listdir("/proc/self/task")]
    # A rank (torchrun's, or ddp_spawn.py's run() sets it), or another: torchrun, or a loader worker (which on
    # torch 2.10 may end with its stdout closed: nothing to report to). torch 2.14's worker forgets its WorkerInfo as
    # its loop ends, before exit: its start is noted instead.
    if sys.stdout.closed:
        return
    who = "other" if os.environ.get("A_LOADER_WORKER") else os.environ.get("RANK", "other")
    print(f"gloo threads at exit: {sum('gloo' in name for name in names)} ({who})", flush=True)

import torch.utils.data._utils.worker as worker
WorkerInfo = worker.WorkerInfo
class NotedWorkerInfo(WorkerInfo):  # made once in each loader worker, as its loop starts
    def __init__(self, **kwargs):
        os.environ["A_LOADER_WORKER"] = "1"
        super().__init__(**kwargs)
worker.WorkerInfo = NotedWorkerInfo
atexit.register(report)
"""


# Rank 1 lists the checkpoint directory as a node whose view of a shared disk lags behind rank 0's can: without the
# newest checkpoint. Every rank must resume from rank 0's.
LAGGING_LISTING = """
import glob, os
listed = glob.glob

def lagging_glob(pattern, **kwargs):
    found = sorted(listed(pattern, **kwargs))
    return found[:-1] if os.environ.get("RANK") == "1" and pattern.endswith(".metadata") else found

glob.glob = lagging_glob
"""


# All nine save and resume with one checkpointing section (tests/test_structure.py): in the smoke tier, the one
# process of single_gpu.py and the ranks of ddp_torchrun.py stand for the others. dataparallel.py's one process
# saves as single_gpu.py's does, and ddp_amp.py's ranks as ddp_torchrun.py's (tests/test_amp.py resumes it in fp16,
# bit for bit); ddp_spawn.py's stopped run, run again, ends bit for bit in tests/test_preemption.py: the full tier
# leaves them out.
@pytest.mark.parametrize("script", [pytest.param(script, marks=[pytest.mark.smoke] * (script in ("single_gpu.py",
                                                 "ddp_torchrun.py"))) for script in SCRIPTS
                                    if script not in ("dataparallel.py", "ddp_amp.py", "ddp_spawn.py")])
def test_resume_matches_an_uninterrupted_run_bit_for_bit(trained, halfway, script, tmp_path):
    """Stopped at step HALF with a checkpoint and run again, each script ends on its uninterrupted run's checkpoint
    (weights, AdamW state, bit for bit) and logs its losses, with no word on a setting that differs. ddp_torchrun.py resumes with loader workers,
    spawned, which are sent the --data dataset by pickling: the same numbers, though rank 1 does not see the
    checkpoint it resumes from (LAGGING_LISTING). And every process ends with no gloo thread left (but those with a
    DeviceMesh, fsdp.py's, tensor_parallel.py's, context_parallel.py's and pipeline.py's: on
    torch 2.13 DTensor's process-wide caches keep the DeviceMesh, which holds the group, so its threads live until the
    process ends; see pytorch/pytorch#172504)."""
    workers = 1 if script == "ddp_torchrun.py" else 0
    ckpt_dir = resume_in(halfway[script], tmp_path / "ckpt")
    assert load(ckpt_dir)["step"] == HALF
    output = resume(script, ckpt_dir, tmp_path / "tb", STEPS, "--workers", workers,
                    env={**injected(tmp_path, COUNT_FETCHES + GLOO_THREADS_AT_EXIT + LAGGING_LISTING),
                         "FETCHES": str(tmp_path / "fetches")})
    assert f"resumed from {ckpt_dir}/step-{HALF:06d} at step {HALF}\n" in output, output
    assert "from this run's flags" not in output, output
    assert checkpoints(ckpt_dir) == [ckpt_dir / f"step-{STEPS:06d}"]  # step 8's went: --keep-checkpoints 1
    # Step 8 is 8 steps into an epoch of 10: those 8 steps' samples are skipped by index, never fetched. The run
    # fetches what steps 9 to 16 train on, 8 samples a step (each of pipeline.py's 2 stages its half of each), and a
    # worker what it prefetches past that: per rank, each of the 2 epochs' last, partial batch of 2 samples, and at
    # most 2 batches of 4 at the end (12 samples on this machine): at most 2 x (2 x 2 + 2 x 4) = 24.
    fetches, trained_on = (tmp_path / "fetches").read_text().split(), (STEPS - HALF) * 8
    fetched = len(fetches)
    if script in ("pipeline.py", "tensor_parallel.py", "context_parallel.py"):  # 2 ranks read every sample
        trained_on *= 2
    print(f"\n{script} --workers {workers}: resumed at step {HALF}, fetched {fetched} samples to train on {trained_on}")
    assert fetched == trained_on if workers == 0 else trained_on <= fetched <= trained_on + 24
    assert set(fetches) == {"worker" if workers else "main"}  # the loader's own processes, with --workers

    # Every process reports: the ranks, and what started them. Not anchored to lines: the ranks write to one pipe, and
    # two reports can land on one line.
    reports = re.findall(r"gloo threads at exit: (\d+) \((\w+)\)", output)
    assert sorted(who for _, who in reports if who != "other") == (["0", "1"] if script in DISTRIBUTED else []), output
    meshed = ("fsdp.py", "tensor_parallel.py", "pipeline.py", "context_parallel.py")
    assert script in meshed or all(count == "0" for count, _ in reports), output

    assert_identical(load(ckpt_dir), load(trained[script].ckpt_dir))
    # The losses logged after the restart are the uninterrupted run's, exactly.
    expected = scalars(trained[script].log_dir)["train/loss"]
    assert scalars(tmp_path / "tb")["train/loss"] == {step: loss for step, loss in expected.items() if step > HALF}


def test_a_resume_trains_with_its_own_lr_and_weight_decay_and_names_them(halfway, tmp_path):
    """fsdp.py's step 8, resumed with a lower --lr and --weight-decay (as after a divergence): the run trains with
    both (the step line's rate is the new schedule's; the optimizer's settings, saved again at the end, are the new
    ones), from the checkpoint's weights, moments and step, and says once which settings differ from the
    checkpoint's run's (the sharded optimizer's state, where each rank holds its own part of every tensor)."""
    ckpt_dir = resume_in(halfway["fsdp.py"], tmp_path / "ckpt")
    output = resume("fsdp.py", ckpt_dir, tmp_path / "tb", STEPS, "--lr", 5e-3, "--weight-decay", 0.05)
    said = re.findall(r"^(\w+) (.*), from this run's flags; the checkpoint's run had (.*)$", output, re.MULTILINE)
    assert sorted(said) == [("initial_lr", "0.005", "0.01"), ("weight_decay", "0.05", "0.1")], output
    assert f"resumed from {ckpt_dir}/step-{HALF:06d} at step {HALF}\n" in output, output
    lr = scalars(tmp_path / "tb")["train/lr"]
    assert lr[10] == pytest.approx(5e-3 * (0.55 + 0.45 * math.cos(math.pi * 7 / 14)), rel=1e-6), lr
    settings = load(ckpt_dir)["optimizer"]
    assert settings["param_groups.blocks.0.qkv.weight.weight_decay"] == 0.05
    assert settings["param_groups.blocks.0.qkv.weight.initial_lr"] == 5e-3
    assert settings["param_groups.blocks.0.attn_norm.weight.weight_decay"] == 0.0


def test_init_scales_the_residual_projections_as_gpt2s(monkeypatch):
    """GPT-2's initialisation: every matrix N(0, 0.02) but the two a block adds to the residual stream, attention's
    output and the MLP's second, N(0, 0.02 / sqrt(2 x layers)), so the stream's variance does not grow with depth;
    by name, so every script starts from these values (4 layers, width 256: 65,536 values a matrix, 0.3% apart)."""
    module = import_script("single_gpu.py")
    monkeypatch.setattr(sys, "argv", ["single_gpu.py", "--d-model", "256", "--n-layers", "4", "--n-heads", "4"])
    model, _ = module.build_model(module.parse_args(), {"vocab_size": 64})
    module.init_weights(model, 0)
    for name, weight in model.named_parameters():
        if weight.dim() == 2:
            expected = 0.02 / math.sqrt(8) if name.endswith(("attn_out.weight", "mlp.2.weight")) else 0.02
            assert weight.std().item() == pytest.approx(expected, rel=0.03), name


def test_checkpoints_move_between_scripts_and_numbers_of_processes(trained, halfway, tmp_path):
    """One run handed on: single_gpu.py's step 8 (one process, whole tensors) trained on by fsdp.py to step 10 (two
    processes, each a shard of every tensor), that by context_parallel.py to step 12 (four processes: two rows of two,
    each a half of every sequence, all a shard of every tensor), that by tensor_parallel.py to step 14 (two processes,
    each a part of every layer), that by pipeline.py to step 16 (four processes: two pipelines of two stages, each
    stage's tensors sharded over its two replicas). It ends on single_gpu.py's uninterrupted weights and losses within
    the tolerance of fp32 sums."""
    ckpt_dir = resume_in(halfway["single_gpu.py"], tmp_path / "ckpt")
    output = resume("fsdp.py", ckpt_dir, tmp_path / "fsdp", 10)
    assert f"resumed from {ckpt_dir}/step-{HALF:06d} at step {HALF}\n" in output, output
    output = resume("context_parallel.py", ckpt_dir, tmp_path / "context_parallel", 12, "--context-parallel", 2,
                    nproc=4)
    assert f"resumed from {ckpt_dir}/step-000010 at step 10\n" in output, output
    output = resume("tensor_parallel.py", ckpt_dir, tmp_path / "tensor_parallel", 14)
    assert f"resumed from {ckpt_dir}/step-000012 at step 12\n" in output, output
    output = resume("pipeline.py", ckpt_dir, tmp_path / "pipeline", STEPS, "--pipelines", 2, nproc=4)
    assert f"resumed from {ckpt_dir}/step-000014 at step 14\n" in output, output
    reference = trained["single_gpu.py"]
    difference = max_param_diff(load(ckpt_dir)["model"], load(reference.ckpt_dir)["model"])
    print(f"single_gpu.py, fsdp.py, context_parallel.py, tensor_parallel.py, pipeline.py: largest difference from "
          f"single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL
    expected = scalars(reference.log_dir)["train/loss"]
    got = {step: loss for name in ("fsdp", "context_parallel", "tensor_parallel", "pipeline")
           for step, loss in scalars(tmp_path / name)["train/loss"].items()}
    assert got.keys() == {step for step in expected if step > HALF}
    assert all(abs(expected[step] - got[step]) <= LOSS_ATOL for step in got), (expected, got)


def test_torchs_converter_takes_a_checkpoint_to_one_file_and_back(trained, halfway, tmp_path):
    """The README's commands: fsdp.py's step 8 (two shards of every tensor) into one torch.save file that
    torch.load reads anywhere, and back into a DCP directory, which holds what the original held, bit for bit,
    and from which single_gpu.py (one process) trains on to single_gpu.py's uninterrupted weights."""
    original = halfway["fsdp.py"].ckpt_dir / f"step-{HALF:06d}"
    assert halfway["fsdp.py"].run.returncode == 0, halfway["fsdp.py"].run.output
    back = tmp_path / "ckpt" / f"step-{HALF:06d}"
    for mode, src, dst in [("dcp_to_torch", original, tmp_path / "checkpoint.pt"),
                           ("torch_to_dcp", tmp_path / "checkpoint.pt", back)]:
        subprocess.run([sys.executable, "-m", "torch.distributed.checkpoint.format_utils", mode, str(src), str(dst)],
                       check=True, timeout=120)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == HALF and state["config"] == CONFIG
    assert_identical(load(back), load(original))

    output = resume("single_gpu.py", tmp_path / "ckpt", tmp_path / "tb")
    assert f"resumed from {back} at step {HALF}\n" in output, output
    difference = max_param_diff(load(tmp_path / "ckpt")["model"], load(trained["single_gpu.py"].ckpt_dir)["model"])
    print(f"fsdp.py's step 8, converted and back, to single_gpu.py: largest difference {difference:.2g}")
    assert difference <= PARAM_ATOL


def test_keep_checkpoints_keeps_the_newest_complete_ones_and_a_crash_mid_save_is_skipped(trained, tmp_path):
    """--keep-checkpoints 3, a save every 4 steps: after 12 steps, steps 4, 8 and 12. A crash while step 12 was
    written leaves its directory without .metadata (DCP writes it last): the run again resumes from step 8, saves
    12 and 16 again, keeps the newest three, and ends on the uninterrupted run bit for bit."""
    ckpt_dir = tmp_path / "ckpt"
    flags = ["--ckpt-every", 4, "--keep-checkpoints", 3]
    resume("single_gpu.py", ckpt_dir, tmp_path / "tb", 12, *flags)
    assert checkpoints(ckpt_dir) == [ckpt_dir / f"step-{step:06d}" for step in (4, 8, 12)]
    (ckpt_dir / "step-000012" / ".metadata").unlink()
    output = resume("single_gpu.py", ckpt_dir, tmp_path / "tb2", STEPS, *flags)
    assert f"resumed from {ckpt_dir}/step-000008 at step 8\n" in output, output
    assert checkpoints(ckpt_dir) == [ckpt_dir / f"step-{step:06d}" for step in (8, 12, 16)]
    assert_identical(load(ckpt_dir), load(trained["single_gpu.py"].ckpt_dir))
    # Past step 999999 the names grow a digit: ordered as text, step-1000000 would be the oldest, deleted as saved.
    # A user's copy in the directory (step-999999.bak) is no checkpoint: taken for the newest, it would have every
    # real one pruned, and be resumed from ever after.
    for name in ("step-999999", "step-1000000", "step-999999.bak"):
        (tmp_path / "late" / name).mkdir(parents=True)
        (tmp_path / "late" / name / ".metadata").touch()
    late = import_script("single_gpu.py").complete_checkpoints(str(tmp_path / "late"))
    assert [Path(path).name for path in late] == ["step-999999", "step-1000000"]


def test_the_checkpoint_writer_makes_no_cuda_call_where_there_is_cuda(tmp_path, monkeypatch):
    """Where CUDA is, DCP's writer thread picks by default a loader that copies tensors to the host on a CUDA stream
    of its own (its _OverlappingCpuLoader: a context on GPU 0 for every rank of a node, and a wait that
    torch.cuda.set_sync_debug_mode refuses), though the state it writes is a host copy already. Here CUDA is made
    to seem there once the copy is made, and that loader fails: a save must not choose it (in the checkpointing
    section, the same in every script)."""
    from torch.distributed.checkpoint import filesystem

    def cuda_loader(*args, **kwargs):
        raise AssertionError("the writer thread chose the loader that copies from the GPU")

    script = import_script("single_gpu.py")
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(4)).sum().backward()
    optimizer.step()  # a state to save: for an empty one, get_state_dict takes a step, which asks the GPU its stream
    args = argparse.Namespace(ckpt_dir=str(tmp_path), keep_checkpoints=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(filesystem, "_OverlappingCpuLoader", cuda_loader)
    script.wait_for_checkpoint(script.save_checkpoint(model, optimizer, {}, 1, {}, args, None), args)
    assert checkpoints(tmp_path) == [tmp_path / "step-000001"]
    assert torch.equal(load(tmp_path)["model"]["weight"], model.weight.detach())


def test_grad_clip_zero_turns_clipping_off(halfway, tmp_path):
    """0 means no clipping, not a clip to zero (which would zero every gradient: nothing learnt): the loss falls as
    far as with the default clip at 1, and the weights are not the clipped run's, which TINY's gradients reach."""
    output = resume("single_gpu.py", tmp_path / "ckpt", tmp_path / "tb", HALF, "--grad-clip", 0)
    assert "resumed" not in output
    clipped, unclipped = scalars(halfway["single_gpu.py"].log_dir)["train/loss"], scalars(tmp_path / "tb")["train/loss"]
    assert unclipped[2] - unclipped[HALF] > 1.0, unclipped  # 5.46 to 3.55 clipped
    difference = max_param_diff(load(tmp_path / "ckpt")["model"], load(halfway["single_gpu.py"].ckpt_dir)["model"])
    print(f"--grad-clip 0: largest difference from the clipped run's weights {difference:.2g}, losses {unclipped} "
          f"against {clipped}")
    assert difference > 1e-3


def test_text_file_is_read_not_copied(tmp_path):
    """--data leaves the file's bytes in the page cache, one copy that every process of a node shares,
    instead of reading them into int64 tensors of its own (8 bytes per byte: 320 MB per process for
    this 40 MB file), and each sample is the file's bytes at its offset. The data section is every
    script's, so single_gpu.py stands for them all."""
    data = tmp_path / "corpus.bin"
    data.write_bytes(torch.randint(0, 256, (40 * 2**20,), dtype=torch.uint8).numpy().tobytes())
    code = f"""
import argparse, sys, torch
sys.path.insert(0, {str(ROOT)!r})
import single_gpu

def resident():  # bytes of this process's own memory (not the page cache's, nor mapped from files)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:")) * 1024

before = resident()
train, val, _ = single_gpu.build_datasets(argparse.Namespace(data={str(data)!r}, seq_len=64))
for dataset in train, val:
    for i in range(0, len(dataset), 64):  # 64 sequences of 64 bytes: one from every 4 KiB page of the file
        dataset[i]
own = resident() - before
checked, wrong = 0, 0
with open({str(data)!r}, "rb") as file:
    for i in range(0, len(train.dataset), 997):  # sequence i: bytes 64 i to 64 i + 64, its target one on
        file.seek(64 * i)
        expected = torch.tensor(list(file.read(65)))
        inputs, targets = train.dataset[i]
        checked += 1
        wrong += not torch.equal(inputs, expected[:-1]) or not torch.equal(targets, expected[1:])
print(own, checked, wrong)
"""
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    own, checked, wrong = map(int, result.stdout.split())
    print(f"40 MiB --data file: {own / 2**20:.1f} MiB of this process's own memory; {wrong} of {checked} samples wrong")
    assert own < 4 * 2**20, f"{own / 2**20:.0f} MiB copied into the process"
    assert checked > 600 and wrong == 0
