"""pipeline.py: both schedules reach single_gpu.py's weights and losses, validation through the stages is exact
with a last batch that does not divide into micro-batches, checkpoints resume in either direction, four stages
split four blocks, a killed stage restarts, compiled stages train like eager ones, and what cannot be split is
refused. The parametrized tests (training, resume, bad input, profile, bring your own model) run it too."""

import re
import subprocess
import sys

import pytest
import torch

from conftest import (LAUNCHER, PARAM_ATOL, ROOT, STEPS, TINY, WARNING, import_script, kill_a_worker, load, max_param_diff,
                      run, run_command, scalars)
from test_bad_input import fails_cleanly
from test_training import LOSS_ATOL


def same_as_single_gpu(trained, ckpt_dir, log_dir):
    """The largest weight and logged-loss differences from single_gpu.py's run of the same flags."""
    reference = trained["single_gpu.py"]
    weights = max_param_diff(load(reference.ckpt_dir)["model"], load(ckpt_dir)["model"])
    expected, got = scalars(reference.log_dir)["train/loss"], scalars(log_dir)["train/loss"]
    assert expected.keys() == got.keys()
    return weights, max(abs(expected[step] - got[step]) for step in expected)


def same_optimizer_state(got, expected):
    """AdamW's state numbered alike, parameter by parameter: the same step, moments within rounding."""
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for number, state in expected["state"].items():
        assert torch.equal(got["state"][number]["step"], state["step"]), number
        for key in "exp_avg", "exp_avg_sq":
            assert torch.allclose(got["state"][number][key], state[key], rtol=1e-4, atol=1e-9), (number, key)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_schedule_trains_like_single_gpu(trained, schedule, tmp_path):
    """Two stages, 2 micro-batches a step (TINY's --grad-accum 2). The stages send activations and gradients
    unchanged; only the whole-model norm for clipping adds in another order. Seen: 3.0e-7 for both."""
    result = run("pipeline.py", *TINY, "--max-steps", STEPS, "--schedule", schedule, "--ckpt-dir", tmp_path / "ckpt",
                 "--log-dir", tmp_path / "tb")
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    assert f"global batch 8 = 2 micro-batches of 4 | 2 stages, one per process | schedule {schedule}" in result.output
    assert "stage 0 (rank 0): tok_emb, pos_emb, blocks.0\n" in result.output, result.output
    assert "stage 1 (rank 1): blocks.1, norm, head\n" in result.output, result.output
    assert "= 1/3 = 33% of a step (the bubble)" in result.output, result.output
    weights, losses = same_as_single_gpu(trained, tmp_path / "ckpt", tmp_path / "tb")
    print(f"{schedule}: largest weight difference {weights:.2g}, largest logged-loss difference {losses:.2g}")
    assert weights <= PARAM_ATOL and losses <= LOSS_ATOL


def test_four_stages_hold_a_block_each(tmp_path):
    """Four processes on four blocks: the embeddings ride with block 0, the norm and head with block 3. Plain
    `python pipeline.py`, a world of one, holds everything. Both end at the same weights within PARAM_ATOL, and
    their optimizer states are numbered alike (each of the four stages' own numbers from 0 would not be)."""
    flags = [*TINY, "--n-layers", 4, "--grad-accum", 4, "--max-steps", 8, "--ckpt-every", 8]
    four = run("pipeline.py", *flags, "--ckpt-dir", tmp_path / "four", "--log-dir", tmp_path / "tb4", nproc=4,
               timeout=300)
    assert four.returncode == 0, four.output
    for line in ["stage 0 (rank 0): tok_emb, pos_emb, blocks.0\n", "stage 1 (rank 1): blocks.1\n",
                 "stage 2 (rank 2): blocks.2\n", "stage 3 (rank 3): blocks.3, norm, head\n", "= 3/7 = 43% of a step"]:
        assert line in four.output, four.output
    one = run_command([sys.executable, ROOT / "pipeline.py"] + [str(a) for a in flags] + ["--ckpt-dir", tmp_path / "one",
                                                                                          "--log-dir", tmp_path / "tb1"])
    assert one.returncode == 0, one.output
    assert "stage 0 (rank 0): tok_emb, pos_emb, blocks.0, blocks.1, blocks.2, blocks.3, norm, head\n" in one.output
    assert max_param_diff(load(tmp_path / "four")["model"], load(tmp_path / "one")["model"]) <= PARAM_ATOL
    same_optimizer_state(load(tmp_path / "four")["optimizer"], load(tmp_path / "one")["optimizer"])


def test_three_blocks_on_two_stages_leave_the_last_the_lighter(tmp_path):
    """A block left over goes to the first stage: the last also holds the norm and the head."""
    result = run("pipeline.py", *TINY, "--n-layers", 3, "--max-steps", 1, "--log-dir", tmp_path)
    assert result.returncode == 0, result.output
    assert "stage 0 (rank 0): tok_emb, pos_emb, blocks.0, blocks.1\n" in result.output, result.output
    assert "stage 1 (rank 1): blocks.2, norm, head\n" in result.output, result.output


def test_validation_is_exact_with_a_short_last_batch(tmp_path):
    """The built-in data's 409 validation sequences in batches of 32 leave 25 at the end, which do not cut
    into 8 micro-batches: the last stage counts only the 25 real samples."""
    flags = ["--d-model", 32, "--n-layers", 2, "--n-heads", 2, "--max-steps", 1, "--grad-accum", 8]
    results = {}
    for script in ["single_gpu.py", "pipeline.py"]:
        result = run(script, *flags, "--log-dir", tmp_path / script)
        assert result.returncode == 0, result.output
        assert "409 of 409 validation samples per evaluation" in result.output, result.output
        results[script] = scalars(tmp_path / script)
    expected, got = results["single_gpu.py"], results["pipeline.py"]
    for step in 0, 1:
        assert got["val/loss"][step] == pytest.approx(expected["val/loss"][step], rel=1e-6)
        assert got["val/accuracy"][step] == expected["val/accuracy"][step]


@pytest.mark.parametrize("first, second", [("single_gpu.py", "pipeline.py"), ("pipeline.py", "single_gpu.py")])
def test_checkpoints_move_to_and_from_single_gpu(trained, first, second, tmp_path):
    """Half a run in one script, the rest in the other: the same weights and AdamW moments as single_gpu.py
    alone. The optimizer state is numbered as single_gpu.py numbers it, so a wrong merge of the stages'
    states would put one parameter's moments on another (or fail on their shapes)."""
    ckpt_dir = tmp_path / "ckpt"
    for script, steps in [(first, STEPS // 2), (second, STEPS)]:
        result = run(script, *TINY, "--max-steps", steps, "--lr-decay-steps", STEPS, "--ckpt-dir", ckpt_dir,
                     "--log-dir", tmp_path / script)
        assert result.returncode == 0, result.output
    assert f"resumed from {ckpt_dir / 'checkpoint.pt'} at step {STEPS // 2}" in result.output, result.output
    got, expected = load(ckpt_dir), load(trained["single_gpu.py"].ckpt_dir)
    assert max_param_diff(got["model"], expected["model"]) <= PARAM_ATOL
    same_optimizer_state(got["optimizer"], expected["optimizer"])


def test_a_converted_fsdp_checkpoint_resumes_with_its_moments(trained, tmp_path):
    """fsdp.py's shards, converted by the README's command, key AdamW's state by parameter name, not number:
    matched by position, the moments arrive, and the run ends on single_gpu.py's weights and state."""
    result = run("fsdp.py", *TINY, "--max-steps", STEPS // 2, "--lr-decay-steps", STEPS, "--ckpt-dir", tmp_path / "fsdp",
                 "--log-dir", tmp_path / "tb")
    assert result.returncode == 0, result.output
    (tmp_path / "ckpt").mkdir()
    subprocess.run([sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch",
                    tmp_path / "fsdp" / "checkpoint", tmp_path / "ckpt" / "checkpoint.pt"], check=True)
    assert isinstance(next(iter(load(tmp_path / "ckpt")["optimizer"]["state"])), str)
    result = run("pipeline.py", *TINY, "--max-steps", STEPS, "--ckpt-dir", tmp_path / "ckpt", "--log-dir", tmp_path / "tb")
    assert result.returncode == 0, result.output
    got, expected = load(tmp_path / "ckpt"), load(trained["single_gpu.py"].ckpt_dir)
    assert max_param_diff(got["model"], expected["model"]) <= PARAM_ATOL
    same_optimizer_state(got["optimizer"], expected["optimizer"])


@pytest.mark.parametrize("tie, message", [
    (lambda model: setattr(model.head, "weight", model.tok_emb.weight), "share a parameter (tied weights)"),
    (lambda model: setattr(model, "scale", torch.nn.Parameter(torch.ones(1))), "a parameter of the model itself"),
])
def test_a_model_it_cannot_split_is_refused(tie, message):
    """Split silently, a tied weight would train as two copies, and a parameter outside every module on every
    stage: refused with one line instead."""
    module = import_script("pipeline.py")
    model, _ = module.build_model(module.argparse.Namespace(seq_len=4, d_model=8, n_layers=2, n_heads=2),
                                  {"vocab_size": 16})
    tie(model)
    with pytest.raises(SystemExit, match=re.escape(message)):
        module.split_model(model, 0, 2, torch.zeros(1, 4, dtype=torch.long))


def test_killed_stage_restarts_and_resumes_exactly(tmp_path):
    """SIGKILL the second stage after the first checkpoint, under the launcher: the job restarts, every stage
    reads its part of the checkpoint, and the run ends with the uninterrupted run's weights, bit for bit."""
    steps = 32
    flags = lambda out: [*TINY, "--max-steps", steps, "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb"]  # noqa: E731
    reference = run("pipeline.py", *flags(tmp_path / "reference"))
    assert reference.returncode == 0, reference.output
    out = tmp_path / "killed"
    killed = kill_a_worker([str(LAUNCHER), "pipeline.py", *map(str, flags(out))], out / "ckpt" / "checkpoint.pt",
                           env={"MAX_RESTARTS": "2"})
    assert killed.run.returncode == 0, killed.run.output
    assert "failed (exitcode: -9) local_rank: 1" in killed.run.output, killed.run.output
    assert killed.resumed_after is not None, killed.run.output
    got, expected = load(out / "ckpt"), load(tmp_path / "reference" / "ckpt")
    assert got["step"] == expected["step"] == steps
    assert all(torch.equal(got["model"][name], expected["model"][name]) for name in expected["model"])


def test_more_stages_than_blocks_is_refused():
    result = run("pipeline.py", *TINY, "--max-steps", 1, "--grad-accum", 4, nproc=3)
    assert result.returncode != 0, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("pipeline.py: error: ")]
    assert any("3 processes make 3 pipeline stages, but the model has 2 blocks: run at most 2 processes" in line
               for line in errors), result.output
    assert 'pipeline.py", line' not in result.output, result.output


def test_1f1b_needs_a_micro_batch_per_stage():
    fails_cleanly("pipeline.py", ["--grad-accum", 1, "--batch-size", 8],
                  "--schedule 1f1b needs at least as many micro-batches as stages: --grad-accum 1 is fewer than 2 processes")


def test_gpipe_runs_one_micro_batch(tmp_path):
    """GPipe has no such limit: one micro-batch a step, the stages taking turns (a bubble of 50%)."""
    result = run("pipeline.py", *TINY, "--max-steps", 4, "--grad-accum", 1, "--schedule", "gpipe",
                 "--log-dir", tmp_path)
    assert result.returncode == 0, result.output
    assert "= 1/2 = 50% of a step (the bubble)" in result.output, result.output
    assert re.search(r"step +4 \| loss \d", result.output), result.output


def test_compiled_stages_train_like_eager(trained, tmp_path):
    """--compile compiles each stage's module. Inductor's fused kernels add in another order: within PARAM_ATOL
    of the eager run, as for DDP (seen: 2.8e-6)."""
    ckpt_dir = tmp_path / "ckpt"
    result = run("pipeline.py", *TINY, "--max-steps", STEPS, "--compile", "--ckpt-dir", ckpt_dir, "--log-dir",
                 tmp_path / "tb", env={"TORCH_LOGS": "recompiles"}, timeout=600)
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    # Proof that each stage was compiled: the first call, in the step-0 evaluation, runs without autograd, and
    # training then compiles it again.
    for rank in range(2):
        assert re.search(rf"^\[rank{rank}\]:.*Recompiling function forward", result.output, re.MULTILINE), result.output
    difference = max_param_diff(load(ckpt_dir)["model"], load(trained["pipeline.py"].ckpt_dir)["model"])
    print(f"pipeline.py --compile: largest difference from the eager run's weights {difference:.2g}")
    assert difference <= PARAM_ATOL
