"""Every script trains, agrees with single_gpu.py, validates exactly and resumes exactly."""

import pytest
import torch

from conftest import DISTRIBUTED, PARAM_ATOL, SCRIPTS, STEPS, TINY, WARNING, load, max_param_diff, run, scalars

LOSS_ATOL = 1e-5


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
    assert ckpt["config"] == {"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2}


@pytest.mark.parametrize("script", SCRIPTS[1:])
def test_same_parameters_and_losses_as_single_gpu(trained, script):
    reference, other = trained["single_gpu.py"], trained[script]
    assert reference.run.returncode == 0 and other.run.returncode == 0, other.run.output
    assert max_param_diff(load(reference.ckpt_dir)["model"], load(other.ckpt_dir)["model"]) <= PARAM_ATOL

    expected, got = scalars(reference.log_dir)["train/loss"], scalars(other.log_dir)["train/loss"]
    assert expected.keys() == got.keys()
    assert all(abs(expected[step] - got[step]) <= LOSS_ATOL for step in expected), (expected, got)


@pytest.mark.parametrize("script", DISTRIBUTED)
def test_validation_is_exact_across_ranks(trained, script):
    """Step 0: every script holds the same initial weights, so 1 and 2 processes must agree on the
    whole validation split (409 sequences, which 2 ranks cannot split evenly)."""
    reference, other = trained["single_gpu.py"], trained[script]
    assert "409 validation sequences" in reference.run.output
    assert "409 validation sequences" in other.run.output
    expected, got = scalars(reference.log_dir), scalars(other.log_dir)
    # Only the grouping of the fp32 per-batch sums differs (accumulated in fp64).
    assert got["val/loss"][0] == pytest.approx(expected["val/loss"][0], rel=1e-6)
    assert got["val/accuracy"][0] == expected["val/accuracy"][0]


@pytest.mark.parametrize("script", ["single_gpu.py", "ddp_torchrun.py"])
def test_resume_matches_an_uninterrupted_run_bit_for_bit(trained, script, tmp_path):
    half = STEPS // 2
    ckpt_dir = tmp_path / "ckpt"
    first = run(script, *TINY, "--max-steps", half, "--lr-decay-steps", STEPS, "--ckpt-dir", ckpt_dir,
                "--log-dir", tmp_path / "tb1")
    assert first.returncode == 0, first.output
    assert load(ckpt_dir)["step"] == half

    second = run(script, *TINY, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb2")
    assert second.returncode == 0, second.output
    assert f"resumed from {ckpt_dir / 'checkpoint.pt'} at step {half}" in second.output

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
    assert got == {step: loss for step, loss in expected.items() if step > half}

    again = run(script, *TINY, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb3")
    assert again.returncode == 0, again.output
    assert "the run is finished" in again.output
    assert torch.equal(load(ckpt_dir)["model"]["head.weight"], resumed["model"]["head.weight"])


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
