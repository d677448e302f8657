"""ddp_amp.py, and fsdp.py, tensor_parallel.py and pipeline.py in fp16: mixed precision close to fp32, a loss scaler
that skips an overflowing step on every rank without moving anything, exact resumes with the scale included, and
checkpoints that move to and from ddp_torchrun.py."""

import shutil

import pytest
import torch

from conftest import HALF, ROOT, STEPS, TINY, WARNING, adam_state, injected, load, resume_in, run, scalars

# bf16 keeps 8 significant bits: rounding one number to bf16 changes it by up to 2^-8 relative (its unit
# roundoff). The loss after training in 16 bits must stay within one such rounding of fp32's: closer than bf16
# itself could state the fp32 loss. Measured on TINY, 16 steps, on a CPU: 1.1e-3 relative in bf16, 1.3e-4 in fp16
# (and 9e-4 and 2e-5 for runs handed on half-way to and from ddp_torchrun.py). fp16 keeps 11 bits: the same bound
# holds.
LOSS_RTOL = 2**-8
# The step (counted from 0) that overflows on rank 1: AdamW has moments by then, to keep.
OVERFLOW_STEP = 2

# Run in every process of a run. Under DDP, rank 1's first micro-batch of step OVERFLOW_STEP has its loss scaled
# by inf (its gradients turn inf and NaN, and DDP's all-reduce carries them to every rank). Under FSDP, where each
# rank holds a shard of the gradients, an inf is written into rank 1's shard of the first parameter alone, after
# the reduce-scatter (OVERFLOW_PARAM: into another parameter's): rank 0's own shards stay finite, and it must skip the
# step all the same. In pipeline.py rank
# 1 is the last stage: the inf is on one stage alone, and the first must skip too. After each step's
# scaler.update(), each process saves its weights, AdamW's state (its shards, under FSDP) and scale to SNAPSHOT_DIR.
OVERFLOW = """
import os, torch
from torch.amp import GradScaler

rank, at, grad_accum = int(os.environ.get("RANK", -1)), int(os.environ["OVERFLOW_STEP"]), 2  # TINY's
scale, unscale, step, update = GradScaler.scale, GradScaler.unscale_, GradScaler.step, GradScaler.update
calls, optimizers, updates = [], [], []
local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard

def overflowing_scale(self, outputs):
    calls.append(1)
    scaled = scale(self, outputs)
    loss = os.environ["OVERFLOW_IN"] == "loss" and rank == 1 and len(calls) == at * grad_accum + 1
    return scaled * float("inf") if loss else scaled

def overflowing_unscale(self, optimizer):
    if os.environ["OVERFLOW_IN"] == "shard" and rank == 1 and len(updates) == at:
        local(optimizer.param_groups[0]["params"][int(os.environ.get("OVERFLOW_PARAM", 0))].grad).view(-1)[0] = float("inf")
    return unscale(self, optimizer)

def noting_step(self, optimizer, *args, **kwargs):
    optimizers[:] = [optimizer]
    return step(self, optimizer, *args, **kwargs)

def snapshotting_update(self, *args, **kwargs):
    update(self, *args, **kwargs)
    params = [p for group in optimizers[0].param_groups for p in group["params"]]
    state = [{k: local(v).clone() for k, v in optimizers[0].state[p].items()} for p in params]
    torch.save({"weights": [local(p.detach()).clone() for p in params], "adamw": state, "scale": self.get_scale()},
               os.path.join(os.environ["SNAPSHOT_DIR"], f"rank{rank}-step{len(updates)}.pt"))
    updates.append(1)

GradScaler.scale, GradScaler.unscale_ = overflowing_scale, overflowing_unscale
GradScaler.step, GradScaler.update = noting_step, snapshotting_update
"""
# Each script's fp16, and where its overflow is injected.
FP16 = {"ddp_amp.py": ("loss", "ddp_torchrun.py"), "fsdp.py": ("shard", "fsdp.py"),
        "tensor_parallel.py": ("shard", "tensor_parallel.py"), "pipeline.py": ("shard", "pipeline.py")}


def final_loss(log_dir):
    return scalars(log_dir)["train/loss"][STEPS]


@pytest.fixture(scope="module", params=FP16)
def fp16(request, tmp_path_factory):
    """The script with --precision fp16 on `trained`'s config."""
    out = tmp_path_factory.mktemp("fp16")
    result = run(request.param, *TINY, "--max-steps", STEPS, "--precision", "fp16", "--log-dir", out / "tb")
    assert result.returncode == 0, result.output
    return request.param, result, out / "tb"


# And pipeline.py on 2 pipelines of 2 stages: rank 1 is then stage 0's second replica, whose inf its replica sees
# too (through the DTensor gradients' own check), so two ranks of four find one, and every rank must skip alike.
@pytest.fixture(scope="module", params=[*FP16, "pipeline.py --pipelines 2"])
def overflowed(request, tmp_path_factory):
    """The script with --precision fp16 for STEPS steps whose step OVERFLOW_STEP overflows on rank 1, with a
    snapshot of each rank's training state after every step, and its checkpoints at HALF and STEPS kept. Returns
    the script, its other flags, its number of processes and the run's directory."""
    script, *flags = request.param.split()
    nproc = 4 if flags else 2
    out = tmp_path_factory.mktemp("overflowed")
    (out / "site").mkdir()
    (out / "snapshots").mkdir()
    env = {**injected(out / "site", OVERFLOW), "OVERFLOW_STEP": str(OVERFLOW_STEP),
           "OVERFLOW_IN": FP16[script][0], "SNAPSHOT_DIR": str(out / "snapshots")}
    result = run(script, *TINY, *flags, "--max-steps", STEPS, "--precision", "fp16", "--keep-checkpoints", 2,
                 "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb", env=env, nproc=nproc, timeout=300)
    assert result.returncode == 0, result.output
    return script, flags, nproc, out


def test_bf16_close_to_fp32(trained):
    """ddp_amp.py's default: the loss at the end is within bf16's rounding of ddp_torchrun.py's in fp32, and not
    fp32's: the 16-bit computation happened."""
    close_to_fp32("ddp_amp.py bf16", trained["ddp_amp.py"].run, trained["ddp_amp.py"].log_dir,
                  trained["ddp_torchrun.py"].log_dir)


def test_fp16_close_to_fp32(trained, fp16):
    """fp16 with loss scaling: as close to the same script's fp32 (its own; ddp_torchrun.py's for ddp_amp.py)."""
    script, result, log_dir = fp16
    close_to_fp32(f"{script} fp16", result, log_dir, trained[FP16[script][1]].log_dir)


def close_to_fp32(what, result, log_dir, fp32_log_dir):
    assert result.returncode == 0 and not WARNING.search(result.output), result.output
    expected, got = final_loss(fp32_log_dir), final_loss(log_dir)
    gap = abs(got - expected) / expected
    print(f"{what}: train loss {got:.6f} at step {STEPS}, fp32 {expected:.6f}: relative gap {gap:.2g}")
    assert 0 < gap <= LOSS_RTOL


def test_an_overflowing_step_changes_nothing_and_halves_the_scale(overflowed):
    """One rank's inf is every rank's: every rank skips the step, with every weight and every AdamW moment and
    step count as they were (under FSDP each rank's own shards, and rank 0's gradients were finite), the scale
    halves on every rank, and the next step trains again."""
    script, _, nproc, out = overflowed
    snapshots = every_rank_skipped(out, nproc)
    assert all(snapshots[rank, OVERFLOW_STEP - 1]["scale"] == 2.0**16 for rank in range(nproc))  # none before
    for step in range(OVERFLOW_STEP - 1, OVERFLOW_STEP + 2) if script == "ddp_amp.py" else []:  # replicas
        assert all(torch.equal(a, b) for a, b in zip(snapshots[0, step]["weights"], snapshots[1, step]["weights"]))
    assert load(out / "ckpt")["scaler"]["scale"] == 2.0**15  # and no skip since: the run trained on


def every_rank_skipped(out, nproc):
    """Check OVERFLOW's snapshots in `out`: on every rank step OVERFLOW_STEP was skipped (weights and AdamW's state
    as before it), the scale halved, and the next step taken; return them, {(rank, step): snapshot}."""
    snapshots = {(rank, step): torch.load(out / "snapshots" / f"rank{rank}-step{step}.pt", weights_only=True)
                 for rank in range(nproc) for step in range(OVERFLOW_STEP - 1, OVERFLOW_STEP + 2)}

    def same(a, b, what):
        if what == "adamw":
            return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))
        return all(torch.equal(x, y) for x, y in zip(a, b))

    for rank in range(nproc):
        before, skipped, after = (snapshots[rank, step] for step in range(OVERFLOW_STEP - 1, OVERFLOW_STEP + 2))
        assert before["adamw"][0], "AdamW has no state to keep before the overflow"
        for what in "weights", "adamw":
            assert same(before[what], skipped[what], what), (rank, what)
            assert not same(skipped[what], after[what], what), (rank, what)  # the next step is taken
        assert (skipped["scale"], after["scale"]) == (before["scale"] / 2, before["scale"] / 2), rank
    return snapshots


# tensor_parallel.py's GPT with a Linear before its blocks, registered first and planned "norm" (whole weights on every
# rank of a row, each rank its positions): the first parameter AdamW and the loss scaler see is then whole on both
# ranks, and DTensor's own check of the gradients reduces its flag over the dimensions where that first gradient is
# split, here none.
FIRST_WHOLE = [("        self.tok_emb = nn.Embedding(vocab_size, d_model)\n",
                "        self.pre = nn.Linear(d_model, d_model)\n        self.tok_emb = nn.Embedding(vocab_size, d_model)\n"),
               ('"tok_emb": "embedding",', '"pre": "norm", "tok_emb": "embedding",'),
               ("return self.tok_emb(tokens) + self.pos_emb(positions)",
                "return self.pre(self.tok_emb(tokens) + self.pos_emb(positions))")]


def test_an_inf_in_a_split_gradient_skips_every_rank_whatever_the_first_parameter(tmp_path):
    """The model's first parameter whole on both ranks; an inf in rank 1's half of the token embedding's gradient
    (its second), at step OVERFLOW_STEP: both ranks skip the step and halve the scale, as every other fp16 run does
    (the script reduces the flag over every rank itself)."""
    source = (ROOT / "tensor_parallel.py").read_text()
    for old, new in FIRST_WHOLE:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    (tmp_path / "tensor_parallel.py").write_text(source)
    (tmp_path / "site").mkdir()
    (tmp_path / "snapshots").mkdir()
    env = {**injected(tmp_path / "site", OVERFLOW), "OVERFLOW_STEP": str(OVERFLOW_STEP), "OVERFLOW_IN": "shard",
           "OVERFLOW_PARAM": "1", "SNAPSHOT_DIR": str(tmp_path / "snapshots")}
    result = run(tmp_path / "tensor_parallel.py", *TINY, "--max-steps", OVERFLOW_STEP + 2, "--precision", "fp16",
                 "--log-dir", tmp_path / "tb", env=env)
    assert result.returncode == 0, result.output
    every_rank_skipped(tmp_path, 2)


# The scale is a loss scaler's state in the checkpointing section every script shares: resumed in DDP, in FSDP, and on
# 2 x 2 pipelines (whose inf check is the script's own).
@pytest.mark.parametrize("overflowed", ["ddp_amp.py", "fsdp.py", "pipeline.py --pipelines 2"], indirect=True)
def test_resume_matches_an_uninterrupted_run_bit_for_bit(overflowed, tmp_path):
    """Resumed from the overflowed run's step HALF, fp16 ends with its weights, AdamW state, schedule and loss
    scaler (halved before HALF, where a fresh scaler would start at 2^16 again), bit for bit."""
    script, flags, nproc, out = overflowed
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt" / f"step-{HALF:06d}", ckpt_dir / f"step-{HALF:06d}")
    result = run(script, *TINY, *flags, "--max-steps", STEPS, "--precision", "fp16", "--ckpt-dir", ckpt_dir,
                 "--log-dir", tmp_path / "tb", nproc=nproc, timeout=300)
    assert result.returncode == 0, result.output
    assert f"resumed from {ckpt_dir / f'step-{HALF:06d}'} at step {HALF}" in result.output, result.output

    resumed, uninterrupted = load(ckpt_dir), load(out / "ckpt")
    assert uninterrupted["step"] == resumed["step"] == STEPS
    assert uninterrupted["scaler"]["scale"] == 2.0**15
    assert resumed["scaler"] == uninterrupted["scaler"]
    for name, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    moments = adam_state(uninterrupted)
    assert moments and adam_state(resumed).keys() == moments.keys()
    for name, value in moments.items():
        assert torch.equal(adam_state(resumed)[name], value), name
    expected, got = scalars(out / "tb")["train/loss"], scalars(tmp_path / "tb")["train/loss"]
    assert got == {step: loss for step, loss in expected.items() if step > HALF}


def test_a_checkpoint_moves_from_ddp_torchrun(trained, halfway, tmp_path, first="ddp_torchrun.py", then="ddp_amp.py"):
    """The first half in fp32, the second in bf16, whose scaler is off, asking the checkpoint for its state: the run
    resumes, its weights keep their names and fp32, and it ends within bf16's rounding of fp32's loss. (A checkpoint
    with a scaler's state moves into a script without one in tests/test_pipeline.py: 2 x 2 pipelines' into
    single_gpu.py.)"""
    ckpt_dir = resume_in(halfway[first], tmp_path / "ckpt")
    result = run(then, *TINY, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb")
    assert result.returncode == 0, result.output
    assert f"resumed from {ckpt_dir / f'step-{HALF:06d}'} at step {HALF}" in result.output, result.output
    state, reference = load(ckpt_dir), load(trained["ddp_torchrun.py"].ckpt_dir)
    assert state["step"] == STEPS and state["model"].keys() == reference["model"].keys()
    assert all(value.dtype == torch.float32 for value in state["model"].values())
    expected, got = final_loss(trained["ddp_torchrun.py"].log_dir), final_loss(tmp_path / "tb")
    print(f"{first} then {then}: train loss {got:.6f} at step {STEPS}, fp32 {expected:.6f}")
    assert abs(got - expected) <= LOSS_RTOL * expected
