"""ddp_amp.py: mixed precision close to fp32, a loss scaler that skips overflowing steps without moving
anything, exact resumes with the scale included, and checkpoints that move to and from the other scripts."""

import argparse
import logging
import os

import pytest
import torch

from conftest import STEPS, TINY, WARNING, import_script, injected, load, run, scalars

# bf16 keeps 8 significant bits: rounding one number to bf16 changes it by up to 2^-8 relative (its unit
# roundoff). The loss after training in 16 bits must stay within one such rounding of fp32's: closer than bf16
# itself could state the fp32 loss. Measured on TINY, 16 steps: 2.9e-5 relative in bf16, 2.4e-5 in fp16, so the
# bound has a margin of about 100 for changes of torch or hardware. fp16 keeps 11 bits: the same bound holds.
LOSS_RTOL = 2**-8


def train_loss_at_the_end(log_dir):
    return scalars(log_dir)["train/loss"][STEPS]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_close_to_fp32(trained, precision, tmp_path):
    if precision == "bf16":  # the default: the shared run
        log_dir, output = trained["ddp_amp.py"].log_dir, trained["ddp_amp.py"].run.output
    else:
        result = run("ddp_amp.py", *TINY, "--max-steps", STEPS, "--precision", "fp16", "--log-dir", tmp_path / "tb")
        assert result.returncode == 0 and not WARNING.search(result.output), result.output
        log_dir, output = tmp_path / "tb", result.output
    assert f"{precision} autocast: forward and loss" in output
    fp32, amp = train_loss_at_the_end(trained["ddp_torchrun.py"].log_dir), train_loss_at_the_end(log_dir)
    print(f"{precision}: train loss {amp:.6f} at step {STEPS}, fp32 {fp32:.6f}: relative gap {abs(amp - fp32) / fp32:.2g}")
    assert abs(amp - fp32) <= LOSS_RTOL * fp32
    assert abs(amp - fp32) > 1e-6 * fp32  # and yet not fp32's: the 16-bit computation happened


def tiny_fp16_training(fused=False, init_scale=2.0**16):
    """ddp_amp.py's own train_step on a one-block GPT in one process (no group: one micro-batch needs no no_sync),
    and a function that runs one optimizer step of it."""
    module = import_script("ddp_amp.py")
    args = argparse.Namespace(seq_len=8, d_model=16, n_layers=1, n_heads=2, grad_accum=1, grad_clip=1.0, precision="fp16")
    torch.manual_seed(0)
    model, _ = module.build_model(args, {"vocab_size": 16})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    tokens = torch.randint(0, 16, (4, 9), generator=torch.Generator().manual_seed(0))
    batches = iter(lambda: (tokens[:, :-1], tokens[:, 1:]), None)

    def step(last_scales=None, at_once=True):
        """One step; its outcome moves the schedule at once, as at a logging step, or is returned for the next."""
        _, scales = module.train_step(model, optimizer, scheduler, scaler, batches, args, torch.device("cpu"),
                                      last_scales)
        if not at_once:
            return scales
        module.advance_schedule(scheduler, scales)

    return module, model, optimizer, scheduler, scaler, step


@pytest.mark.parametrize("fused", [False, True])
def test_an_overflowing_step_changes_nothing_and_training_goes_on(fused, caplog):
    """A scale too large for fp16 turns the gradients inf: the scaler skips the step (fused AdamW undoes it
    inside its kernel), halves the scale, and the schedule waits; with the scale halved often enough,
    steps are taken again."""
    module, model, optimizer, scheduler, scaler, step = tiny_fp16_training(fused=fused)
    step()  # a normal step first, so that Adam has moments to keep
    assert scheduler.last_epoch == 1
    params = [p.detach().clone() for p in model.parameters()]
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())}
    lr = optimizer.param_groups[0]["lr"]
    scaler.update(new_scale=2.0**40)

    with caplog.at_level(logging.INFO, logger=module.log.name):
        step()
    assert scaler.get_scale() == 2.0**39
    assert "optimizer step skipped, loss scale now 5.49756e+11" in caplog.text
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    for i, state in enumerate(optimizer.state.values()):
        assert all(torch.equal(state[k], moments[i][k]) for k in state), (i, state)
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == lr

    skipped = 1
    while all(torch.equal(p, q) for p, q in zip(model.parameters(), params)):
        step()
        skipped += 1
        assert skipped < 40, "the scale never came down to where steps are taken"
    print(f"fused={fused}: {skipped - 1} skipped steps, then a step at scale {scaler.get_scale():g}")
    assert scaler.get_scale() == 2.0 ** (40 - (skipped - 1))
    assert scheduler.last_epoch == 2


def test_a_save_after_only_skipped_steps_leaves_adamw_without_state(tmp_path):
    """Every step so far skipped, AdamW has no state. torch's get_state_dict makes one by stepping it at lr 0 (step 1,
    zero moments), on rank 0 alone, which saves: the ranks' next real steps would differ. The save undoes it, writes
    an empty state, and that resumes to an AdamW as fresh as the uninterrupted one."""
    module, model, optimizer, scheduler, scaler, step = tiny_fp16_training(init_scale=2.0**40)
    step()
    assert scaler.get_scale() == 2.0**39 and not optimizer.state  # skipped
    config = {"fresh": True}
    path = str(tmp_path / "checkpoint.pt")
    module.save_checkpoint(path, model, optimizer, scheduler, scaler, 1, config, 1, None, True)  # written on return
    assert not optimizer.state and torch.load(path, weights_only=True)["optimizer"]["state"] == {}
    _, model, optimizer, scheduler, scaler, _ = tiny_fp16_training()
    assert module.load_checkpoint(path, model, optimizer, scheduler, scaler, config, torch.device("cpu")) == 1
    assert not optimizer.state and scaler.get_scale() == 2.0**39


def test_a_skip_learned_one_step_later_trains_the_same():
    """The script passes each step's scales to the next step, which moves the schedule before its own update:
    every weight, the scale and the schedule end as where each step's outcome is read at once."""
    ends = []
    for at_once in [True, False]:
        module, model, _, scheduler, scaler, step = tiny_fp16_training(init_scale=2.0**24)
        scales = None
        for _ in range(12):
            scales = step(scales, at_once)
        module.advance_schedule(scheduler, scales)
        ends.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale(), scheduler.last_epoch))
    (params, scale, epoch), (deferred_params, deferred_scale, deferred_epoch) = ends
    assert epoch == 6, epoch  # 6 steps skipped, then 6 taken
    assert all(torch.equal(p, q) for p, q in zip(params, deferred_params))
    assert (scale, epoch) == (deferred_scale, deferred_epoch)


def test_gradients_that_overflow_at_every_scale_stop_the_run():
    """Weights that have become inf make every gradient NaN: each step is skipped and the scale halves, and once
    it falls below 1 no scale can help. The run stops with one line instead of skipping forever."""
    _, model, _, scheduler, scaler, step = tiny_fp16_training(init_scale=4.0)
    with torch.no_grad():
        model.head.weight.fill_(float("inf"))
    for scale in [2.0, 1.0]:  # skipped, halved
        step()
        assert scaler.get_scale() == scale
    with pytest.raises(SystemExit, match="inf or NaN at a loss scale below 1: training diverged"):
        step()
    assert scheduler.last_epoch == 0


# What each script's --precision offers instead: ddp_amp.py fp16 (with loss scaling), fsdp.py fp32.
@pytest.mark.parametrize("script, advice", [("ddp_amp.py", r" \(the default\): {} has no bf16; use --precision fp16"),
                                            ("fsdp.py", r": {} has no bf16; use --precision fp32")])
@pytest.mark.parametrize("name, capability, fails", [
    ("Tesla V100-SXM2-16GB", (7, 0), True), ("Tesla T4", (7, 5), True), ("NVIDIA A100-SXM4-80GB", (8, 0), False)])
def test_bf16_on_a_gpu_without_it_names_another_precision(monkeypatch, script, advice, name, capability, fails):
    """Before Ampere (compute capability 8) GPUs have no bf16: --precision bf16 then stops before joining the group."""
    module = import_script(script)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    joined = []
    monkeypatch.setattr(module.dist, "init_process_group", lambda *a, **k: joined.append(True))
    monkeypatch.setattr(module.atexit, "register", lambda function: None)
    for variable in "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT":  # setup() sets what is missing: undone after
        monkeypatch.setenv(variable, os.environ.get(variable, "0"))  # the test
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    args = argparse.Namespace(device=None, precision="bf16", seed=0, timeout=60)
    if fails:
        with pytest.raises(SystemExit, match="--precision bf16" + advice.format(name)):
            module.setup(args)
        assert not joined
    else:
        module.setup(args)
        assert joined


# A start-up scale of 2^24 overflows the first steps of TINY in fp16: the runs below skip steps, so resuming must
# restore the scale and the schedule that the skips held back.
HIGH_SCALE = """
import functools, torch
torch.amp.GradScaler.__init__ = functools.partialmethod(torch.amp.GradScaler.__init__, init_scale=2.0**24)
"""


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_matches_an_uninterrupted_run_bit_for_bit(precision, tmp_path):
    env = injected(tmp_path, HIGH_SCALE)
    flags = [*TINY, "--precision", precision, "--lr-decay-steps", STEPS]
    whole = run("ddp_amp.py", *flags, "--max-steps", STEPS, "--ckpt-dir", tmp_path / "whole", "--log-dir",
                tmp_path / "tb-whole", env=env)
    assert whole.returncode == 0, whole.output
    if precision == "fp16":
        assert whole.output.count("optimizer step skipped") >= 2, whole.output
    first = run("ddp_amp.py", *flags, "--max-steps", STEPS // 2, "--ckpt-dir", tmp_path / "parts", "--log-dir",
                tmp_path / "tb-first", env=env)
    assert first.returncode == 0, first.output
    second = run("ddp_amp.py", *flags, "--max-steps", STEPS, "--ckpt-dir", tmp_path / "parts", "--log-dir",
                 tmp_path / "tb-second", env=env)
    assert second.returncode == 0 and "resumed from" in second.output, second.output

    resumed, uninterrupted = load(tmp_path / "parts"), load(tmp_path / "whole")
    assert resumed["scaler"] == uninterrupted["scaler"] and resumed["scheduler"] == uninterrupted["scheduler"]
    # The schedule learns of a skip one step later: it must still have held back for exactly the skipped steps.
    assert uninterrupted["scheduler"]["last_epoch"] == STEPS - whole.output.count("optimizer step skipped")
    if precision == "fp16":
        assert 1 < resumed["scaler"]["scale"] < 2.0**24
    else:
        assert resumed["scaler"] == {}  # bf16 needs no scaling: the scaler is off
    for name, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    for index, state in uninterrupted["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(resumed["optimizer"]["state"][index][key], value), (index, key)
    expected, got = scalars(tmp_path / "tb-whole")["train/loss"], scalars(tmp_path / "tb-second")["train/loss"]
    assert got == {step: loss for step, loss in expected.items() if step > STEPS // 2}


def test_checkpoints_move_to_and_from_the_other_scripts(trained, tmp_path):
    """ddp_torchrun.py's checkpoint resumes here in fp16 (a fresh scaler), and this script's, scaler state
    and all, resumes in single_gpu.py, which ignores the scaler: the run ends close to single_gpu.py's own."""
    ckpt_dir = tmp_path / "ckpt"
    keys = None
    for quarter, (script, flags) in enumerate([("ddp_torchrun.py", []), ("ddp_amp.py", ["--precision", "fp16"]),
                                               ("single_gpu.py", [])], start=1):
        result = run(script, *TINY, *flags, "--max-steps", quarter * STEPS // 4, "--lr-decay-steps", STEPS,
                     "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / script)
        assert result.returncode == 0, result.output
        assert load(ckpt_dir)["step"] == quarter * STEPS // 4
        if quarter > 1:
            assert f"resumed from {ckpt_dir / 'checkpoint.pt'} at step {(quarter - 1) * STEPS // 4}" in result.output
        ckpt = load(ckpt_dir)
        keys = keys or ckpt["model"].keys()
        assert ckpt["model"].keys() == keys and all(value.dtype == torch.float32 for value in ckpt["model"].values())
        if script == "ddp_amp.py":
            assert 1 <= ckpt["scaler"]["scale"] <= 2.0**16  # torch's starting scale, or less after an overflow
    # Where the run ends: single_gpu.py's train losses (steps 10 and 12), after 4 steps in fp16, within
    # test_close_to_fp32's bound of its own uninterrupted fp32 run's.
    got, expected = (scalars(log_dir)["train/loss"] for log_dir in (tmp_path / "single_gpu.py",
                                                                     trained["single_gpu.py"].log_dir))
    gaps = {step: abs(loss / expected[step] - 1) for step, loss in got.items()}
    print(f"handed on through ddp_amp.py --precision fp16: train losses from fp32's, relative: {gaps}")
    assert sorted(gaps) == [10, 12] and max(gaps.values()) <= 2**-8, gaps
