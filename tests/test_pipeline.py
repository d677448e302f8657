"""pipeline.py: both schedules reach single_gpu.py's weights and losses, validation through the stages is exact
with a last batch that does not divide into micro-batches, checkpoints resume in either direction, four stages
split four blocks, a killed stage restarts, compiled stages train like eager ones, and what cannot be split is
refused. The parametrized tests (training, resume, bad input, profile, bring your own model) run it too."""

import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import (HALF, LAUNCHER, PARAM_ATOL, ROOT, STEPS, TINY, WARNING, fails_cleanly, import_script, injected,
                      kill_a_worker, load, max_param_diff, numbered, resume_in, run, run_command, scalars,
                      trains_compiled_like_eager)
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
    got, expected = numbered(got), numbered(expected)
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for number, state in expected["state"].items():
        assert torch.equal(got["state"][number]["step"], state["step"]), number
        for key in "exp_avg", "exp_avg_sq":
            # Rounding apart (the scripts add a gradient's terms in other orders: 1.5e-7 seen), as a moment
            # given to another parameter would not be (their values are 1e-5 to 1e-2).
            assert torch.allclose(got["state"][number][key], state[key], rtol=1e-4, atol=1e-6), (number, key)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_each_schedule_trains_like_single_gpu(trained, schedule, tmp_path):
    """Two stages, 2 micro-batches a step (TINY's --grad-accum 2). The stages send activations and gradients
    unchanged; only the whole-model norm for clipping adds in another order. Seen: 3.0e-7 for both."""
    result = run("pipeline.py", *TINY, "--max-steps", STEPS, "--schedule", schedule, "--ckpt-dir", tmp_path / "ckpt",
                 "--log-dir", tmp_path / "tb")
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    assert f"global batch 8 = 2 micro-batches of 4 | 2 stages, 1 per process | schedule {schedule}" in result.output
    assert "stage 0 (rank 0): tok_emb, pos_emb, blocks.0\n" in result.output, result.output
    assert "stage 1 (rank 1): blocks.1, norm, head\n" in result.output, result.output
    assert "= 1/2 = 50% of its compute time (the bubble)" in result.output, result.output
    weights, losses = same_as_single_gpu(trained, tmp_path / "ckpt", tmp_path / "tb")
    print(f"{schedule}: largest weight difference {weights:.2g}, largest logged-loss difference {losses:.2g}")
    assert weights <= PARAM_ATOL and losses <= LOSS_ATOL


@pytest.mark.parametrize("before, after", [(4, 2), (2, 4)])
def test_a_checkpoint_resumes_on_another_number_of_stages(before, after, tmp_path):
    """Four blocks on four processes: the embeddings ride with block 0, the norm and head with block 3. Half the
    run on `before` stages, the rest on `after`: each stage writes its own tensors under the whole model's names,
    and reads its own back however the checkpoint was split. The run ends on the weights and AdamW state of plain
    `python pipeline.py`, a world of one that holds everything, within PARAM_ATOL."""
    flags = [*TINY, "--n-layers", 4, "--grad-accum", 4, "--lr-decay-steps", 8, "--ckpt-every", 4]
    outputs = []
    for nproc, steps in [(before, 4), (after, 8)]:
        result = run("pipeline.py", *flags, "--max-steps", steps, "--ckpt-dir", tmp_path / "split",
                     "--log-dir", tmp_path / f"tb{nproc}", nproc=nproc, timeout=300)
        assert result.returncode == 0, result.output
        outputs.append(result.output)
    four = outputs[0] if before == 4 else outputs[1]
    for line in ["stage 0 (rank 0): tok_emb, pos_emb, blocks.0\n", "stage 1 (rank 1): blocks.1\n",
                 "stage 2 (rank 2): blocks.2\n", "stage 3 (rank 3): blocks.3, norm, head\n", "= 3/4 = 75% of its compute time"]:
        assert line in four, four
    assert f"resumed from {tmp_path / 'split' / 'checkpoint'} at step 4" in outputs[1], outputs[1]
    one = run_command([sys.executable, ROOT / "pipeline.py"] + [str(a) for a in flags] +
                      ["--max-steps", "8", "--ckpt-dir", tmp_path / "one", "--log-dir", tmp_path / "tb1"])
    assert one.returncode == 0, one.output
    assert "stage 0 (rank 0): tok_emb, pos_emb, blocks.0, blocks.1, blocks.2, blocks.3, norm, head\n" in one.output
    got, expected = load(tmp_path / "split"), load(tmp_path / "one")
    assert max_param_diff(got["model"], expected["model"]) <= PARAM_ATOL
    same_optimizer_state(got["optimizer"], expected["optimizer"])


def test_three_blocks_on_two_stages_leave_the_last_the_lighter(tmp_path):
    """A block left over goes to the first stage: the last also holds the norm and the head."""
    result = run("pipeline.py", *TINY, "--n-layers", 3, "--max-steps", 1, "--log-dir", tmp_path)
    assert result.returncode == 0, result.output
    assert "stage 0 (rank 0): tok_emb, pos_emb, blocks.0, blocks.1\n" in result.output, result.output
    assert "stage 1 (rank 1): blocks.2, norm, head\n" in result.output, result.output


# Each process counts the batches it copies to its device (Tensor.to(..., non_blocking=True)) into COPIES/<rank>.
COUNT_COPIES = """
import atexit, os, pathlib, torch
to, copies = torch.Tensor.to, []
def counting_to(self, *args, **kwargs):
    if kwargs.get("non_blocking"):
        copies.append(None)
    return to(self, *args, **kwargs)
torch.Tensor.to = counting_to
if "RANK" in os.environ:
    atexit.register(lambda: (pathlib.Path(os.environ["COPIES"]) / os.environ["RANK"]).write_text(str(len(copies))))
"""


def test_validation_is_exact_with_a_short_last_batch_and_each_stage_copies_what_it_reads(tmp_path):
    """The built-in data's 409 validation sequences in batches of 32 leave 25 at the end, which do not cut
    into 8 micro-batches: the last stage counts only the 25 real samples. The first stage copies the inputs to its
    device, the last the targets, and no other: one tensor per batch, 13 per evaluation, evaluations at steps 0 and
    1, and a step's batch."""
    flags = ["--d-model", 32, "--n-layers", 2, "--n-heads", 2, "--max-steps", 1, "--grad-accum", 8]
    (tmp_path / "copies").mkdir()
    results = {}
    for script in ["single_gpu.py", "pipeline.py"]:
        env = {**injected(tmp_path, COUNT_COPIES), "COPIES": str(tmp_path / "copies")} if script == "pipeline.py" else None
        result = run(script, *flags, "--log-dir", tmp_path / script, env=env)
        assert result.returncode == 0, result.output
        assert "409 of 409 validation samples per evaluation" in result.output, result.output
        results[script] = scalars(tmp_path / script)
    expected, got = results["single_gpu.py"], results["pipeline.py"]
    for step in 0, 1:
        assert got["val/loss"][step] == pytest.approx(expected["val/loss"][step], rel=1e-6)
        assert got["val/accuracy"][step] == expected["val/accuracy"][step]
    copies = {path.name: int(path.read_text()) for path in (tmp_path / "copies").iterdir()}
    assert copies == {"0": 2 * 13 + 1, "1": 2 * 13 + 1}


CONVERT = [sys.executable, "-m", "torch.distributed.checkpoint.format_utils"]  # the README's commands


@pytest.mark.parametrize("first, second, convert", [("single_gpu.py", "pipeline.py", None),
                                                    ("single_gpu.py", "pipeline.py", "torch_to_dcp"),
                                                    ("pipeline.py", "single_gpu.py", "dcp_to_torch")])
def test_checkpoints_move_to_and_from_single_gpu(trained, halfway, first, second, convert, tmp_path):
    """Half a run in one script, the rest in the other: single_gpu.py's checkpoint.pt is read by every stage directly,
    or turned into DCP shards by torch's command; pipeline.py's shards turn into a checkpoint.pt by the other. Every
    script keys AdamW's state by name, so nothing is renamed. Each way ends on single_gpu.py's weights and moments:
    a stage that took another's moments would part from it (or fail on their shapes)."""
    ckpt_dir = resume_in(halfway[first], tmp_path / "ckpt")
    shards, whole = ckpt_dir / "checkpoint", ckpt_dir / "checkpoint.pt"
    if convert == "dcp_to_torch":
        subprocess.run([*CONVERT, convert, shards, whole], check=True)
        shutil.rmtree(ckpt_dir / f"checkpoint-{HALF:06d}")
        shards.unlink()
    elif convert == "torch_to_dcp":  # into the layout pipeline.py saves: a directory per step, and a link to it
        subprocess.run([*CONVERT, convert, whole, ckpt_dir / f"checkpoint-{HALF:06d}"], check=True)
        shards.symlink_to(f"checkpoint-{HALF:06d}")
        whole.unlink()
    result = run(second, *TINY, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / second)
    assert result.returncode == 0, result.output
    if second == "pipeline.py" and convert is None:
        assert f"reading {whole}, the whole model in one file" in result.output, result.output
        whole.unlink()  # the one that pipeline.py resumed from; its own is the later
    assert f"at step {HALF}" in result.output, result.output
    got, expected = load(ckpt_dir), load(trained["single_gpu.py"].ckpt_dir)
    assert max_param_diff(got["model"], expected["model"]) <= PARAM_ATOL
    same_optimizer_state(got["optimizer"], expected["optimizer"])


def test_fsdp_and_pipeline_resume_each_others_checkpoints(trained, tmp_path):
    """The same DCP layout, the tensors under the whole model's names: fsdp.py's shards resume on pipeline.py's
    stages and back, with no conversion, and the run ends on single_gpu.py's weights and AdamW moments."""
    ckpt_dir = tmp_path / "ckpt"
    for script, steps in [("fsdp.py", 6), ("pipeline.py", 12), ("fsdp.py", STEPS)]:
        result = run(script, *TINY, "--max-steps", steps, "--lr-decay-steps", STEPS, "--ckpt-dir", ckpt_dir,
                     "--log-dir", tmp_path / f"{script}-{steps}")
        assert result.returncode == 0, result.output
        if steps > 6:
            assert f"resumed from {ckpt_dir / 'checkpoint'} at step {6 if steps == 12 else 12}" in result.output
    got, expected = load(ckpt_dir), load(trained["single_gpu.py"].ckpt_dir)
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
        module.split_model(model, [0], 2, torch.zeros(1, 4, dtype=torch.long))


def test_killed_stage_restarts_and_resumes_exactly(tmp_path):
    """SIGKILL the second stage after the first checkpoint, under the launcher: the job restarts, every stage
    reads its part of the checkpoint, and the run ends with the uninterrupted run's weights, bit for bit."""
    steps = 32
    flags = lambda out: [*TINY, "--max-steps", steps, "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb"]
    reference = run("pipeline.py", *flags(tmp_path / "reference"))
    assert reference.returncode == 0, reference.output
    out = tmp_path / "killed"
    killed = kill_a_worker([str(LAUNCHER), "pipeline.py", *map(str, flags(out))], out / "ckpt" / "checkpoint",
                           env={"MAX_RESTARTS": "2"})
    assert killed.run.returncode == 0, killed.run.output
    assert "failed (exitcode: -9) local_rank: 1" in killed.run.output, killed.run.output
    assert f"resumed from {out / 'ckpt' / 'checkpoint'} at step 8" in killed.run.output, killed.run.output
    got, expected = load(out / "ckpt"), load(tmp_path / "reference" / "ckpt")
    assert got["step"] == expected["step"] == steps
    assert all(torch.equal(got["model"][name], expected["model"][name]) for name in expected["model"])


@pytest.mark.parametrize("nproc, per_process", [(3, 1), (2, 2)])
def test_more_stages_than_blocks_is_refused(nproc, per_process):
    result = run("pipeline.py", *TINY, "--max-steps", 1, "--grad-accum", 4, "--stages-per-process", per_process,
                 nproc=nproc)
    assert result.returncode != 0, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("pipeline.py: error: ")]
    assert any(f"{nproc * per_process} pipeline stages (processes x --stages-per-process), but the model has 2 blocks: "
               "make at most 2" in line
               for line in errors), result.output
    assert 'pipeline.py", line' not in result.output, result.output


def test_1f1b_needs_a_micro_batch_per_stage():
    fails_cleanly("pipeline.py", ["--grad-accum", 1, "--batch-size", 8],
                  "--schedule 1f1b cannot run 1 micro-batches on 2 stages: Number of microbatches (1) must be greater than or equal "
                  "to the number of stages (2).")


def test_gpipe_runs_one_micro_batch(tmp_path):
    """GPipe has no such limit: one micro-batch a step, the stages taking turns (a bubble as long as its compute)."""
    result = run("pipeline.py", *TINY, "--max-steps", 4, "--grad-accum", 1, "--schedule", "gpipe",
                 "--log-dir", tmp_path)
    assert result.returncode == 0, result.output
    assert "= 1/1 = 100% of its compute time (the bubble)" in result.output, result.output
    assert re.search(r"step +4 \| loss \d", result.output), result.output


def test_compiled_stages_train_like_eager(trained, tmp_path):
    """--compile compiles each stage's module: like eager, as for DDP (seen: 1.6e-6). Compiled at the
    first evaluation (no autograd), then again for training, and on rank 0 perhaps once more for the short last
    validation batch: at most 2 recompiles per rank (seen: 1 and 1); an evaluation that recompiled every pass would
    add more at steps 8 and 16."""
    recompiles = trains_compiled_like_eager("pipeline.py", trained["pipeline.py"], tmp_path)
    assert all(1 <= count <= 2 for count in recompiles), recompiles


# Four blocks, so that 2 processes hold 2 stages each: stage s on process s mod 2.
FOUR_BLOCKS = [*TINY, "--n-layers", 4, "--lr-decay-steps", STEPS]


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory):
    """single_gpu.py's run of FOUR_BLOCKS, for STEPS steps: the weights the interleaved runs must end on."""
    out = tmp_path_factory.mktemp("four_blocks")
    result = run("single_gpu.py", *FOUR_BLOCKS, "--max-steps", STEPS, "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb")
    assert result.returncode == 0, result.output
    return load(out / "ckpt")


@pytest.mark.parametrize("schedule", ["gpipe", "zero-bubble"])
def test_two_stages_per_process_train_like_single_gpu(four_blocks, schedule, tmp_path):
    """Looped GPipe and interleaved zero-bubble, on stages 0 and 2 on rank 0, 1 and 3 on rank 1: single_gpu.py's
    weights (seen: 5.3e-7 for both), the layout in the log, and the bubble a quarter of the compute (1 idle slot
    for 2 stages x 2 micro-batches)."""
    result = run("pipeline.py", *FOUR_BLOCKS, "--stages-per-process", 2, "--schedule", schedule, "--max-steps", STEPS,
                 "--ckpt-dir", tmp_path / "ckpt", "--log-dir", tmp_path / "tb")
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    for line in ["| 4 stages, 2 per process |", "stage 0 (rank 0): tok_emb, pos_emb, blocks.0\n", "stage 1 (rank 1): blocks.1\n",
                 "stage 2 (rank 0): blocks.2\n", "stage 3 (rank 1): blocks.3, norm, head\n", "= 1/4 = 25% of its compute time"]:
        assert line in result.output, result.output
    difference = max_param_diff(load(tmp_path / "ckpt")["model"], four_blocks["model"])
    print(f"{schedule}, 2 stages per process: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL


def test_a_checkpoint_moves_between_plain_and_interleaved_layouts(four_blocks, tmp_path):
    """Interleaved 1F1B (2 stages per process) to step 6, one stage per process to step 11, interleaved again to
    the end: each layout reads the other's checkpoint, and the run ends on single_gpu.py's weights and AdamW state,
    its parameters in the model's order."""
    for per_process, steps in [(2, 6), (1, 11), (2, STEPS)]:
        result = run("pipeline.py", *FOUR_BLOCKS, "--stages-per-process", per_process, "--max-steps", steps,
                     "--ckpt-dir", tmp_path / "ckpt", "--log-dir", tmp_path / f"tb{steps}")
        assert result.returncode == 0, result.output
        assert f"{2 * per_process} stages, {per_process} per process" in result.output, result.output
    assert f"resumed from {tmp_path / 'ckpt' / 'checkpoint'} at step 11" in result.output, result.output
    got = load(tmp_path / "ckpt")
    difference = max_param_diff(got["model"], four_blocks["model"])
    print(f"interleaved, plain, interleaved: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL
    same_optimizer_state(got["optimizer"], four_blocks["optimizer"])  # stage 2's names after stage 1's, as unsplit


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_micro_batches_an_interleaved_schedule_cannot_take_are_refused(schedule):
    """Torch's interleaved schedules run the micro-batches in rounds of one per process: 5 do not divide into 2."""
    fails_cleanly("pipeline.py", ["--n-layers", 4, "--stages-per-process", 2, "--schedule", schedule, "--batch-size", 10,
                                  "--grad-accum", 5],
                  f"--schedule {schedule} cannot run 5 micro-batches on 4 stages: ")


def test_zero_bubble_with_compile_is_refused():
    fails_cleanly("pipeline.py", ["--schedule", "zero-bubble", "--compile"],
                  "--schedule zero-bubble runs each backward in two halves, which a compiled graph's backward cannot")


def test_stages_per_process_in_a_world_of_one_are_refused():
    fails_cleanly("pipeline.py", ["--n-layers", 4, "--stages-per-process", 2],
                  "--stages-per-process 2 shrinks the bubble of several processes: one has none", nproc=1)
