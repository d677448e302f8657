"""Bad input ends a run with a one-line message and a non-zero exit, on every rank, and never touches an existing
checkpoint; a run that diverges stops, and saves nothing after the step where it did."""

import re
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import (ROOT, STEPS, TINY, TORCHRUN, checkpoints, error_lines, fails_cleanly, import_script, injected,
                      load, resume_in, run_command)


# The configuration section is the same code in every script but for each strategy's own flags
# (tests/test_structure.py counts each diff exactly): single_gpu.py stands for all, ddp_torchrun.py for the
# distributed flags. argparse says what is wrong with the flag, in its own words.
@pytest.mark.parametrize("script, args, message", [
    ("single_gpu.py", ["--batch-size", 0], "argument --batch-size: 0 is not > 0"),  # a positive int
    ("single_gpu.py", ["--max-steps", 1.5], r"argument --max-steps: invalid \w+ value: '1\.5'"),  # not an int
    ("single_gpu.py", ["--n-heads", -2], "argument --n-heads: -2 is not > 0"),  # the model section's own
    ("single_gpu.py", ["--seq-len", 0], "argument --seq-len: 0 is not > 0"),  # the data section's own
    ("single_gpu.py", ["--lr", -1], "argument --lr: -1 is not > 0"),  # a positive float
    ("single_gpu.py", ["--lr", "nan"], "argument --lr: nan is not > 0"),
    ("single_gpu.py", ["--lr", "inf"], "argument --lr: inf is not > 0"),
    ("single_gpu.py", ["--warmup-steps", -1], "argument --warmup-steps: -1 is not >= 0"),  # zero or more
    ("single_gpu.py", ["--grad-clip", -1], "argument --grad-clip: -1 is not >= 0"),
    ("single_gpu.py", ["--device", "tpu"], r"argument --device: invalid choice: 'tpu' \(choose from .*\)"),  # a choice
    ("ddp_torchrun.py", ["--timeout", 0], "argument --timeout: 0 is not > 0"),  # zero would give up at once
    ("ddp_torchrun.py", ["--timeout", "inf"], "argument --timeout: inf is not > 0"),  # overflows a timedelta
])
def test_bad_flags_are_refused_by_argparse(script, args, message, monkeypatch, capsys):
    """parse_args() in this process: a subprocess would add seconds of start-up to each (the next test runs one)."""
    module = import_script(script)
    monkeypatch.setattr(sys, "argv", [script, *TINY, *map(str, args)])
    with pytest.raises(SystemExit) as stop:
        module.parse_args()
    assert stop.value.code == 2
    lines = error_lines(script, capsys.readouterr().err)
    assert len(lines) == 1 and re.fullmatch(rf"{re.escape(script)}: error: {message}", lines[0]), lines


def test_a_bad_flag_ends_the_process_with_argparses_line():
    result = fails_cleanly("single_gpu.py", ["--lr", -1], "argument --lr: -1 is not > 0")
    assert result.returncode == 2 and "step " not in result.output, result.output


@pytest.mark.parametrize("script", TORCHRUN)
def test_a_torchrun_script_started_by_python_alone_says_how_to_start_it(script, monkeypatch, capsys):
    """Without torchrun's environment (RANK and the rest), init_process_group would fail in a traceback: parse_args()
    refuses in one line that gives the command, once argparse has had its say (--help still works). In this
    process."""
    module = import_script(script)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [script])
    with pytest.raises(SystemExit) as stop:
        module.parse_args()
    assert stop.value.code == f"{script}: error: start it with torchrun: torchrun --standalone --nproc_per_node=2 " \
                              f"{script}"


def test_python_alone_ends_a_torchrun_script_in_one_line(tmp_path):
    """The same as a user meets it: `python ddp_torchrun.py`, one line, no traceback, nothing trained."""
    result = run_command([sys.executable, "ddp_torchrun.py", *TINY, "--log-dir", tmp_path])
    assert result.returncode == 1, result.output
    assert result.output.strip() == "ddp_torchrun.py: error: start it with torchrun: torchrun --standalone " \
                                    "--nproc_per_node=2 ddp_torchrun.py", result.output


def test_a_ckpt_dir_it_cannot_write_in_ends_the_run_before_the_first_step(tmp_path):
    """A path through a file: DCP would find out at the first save, --ckpt-every steps in, with a traceback."""
    (tmp_path / "file").touch()
    ckpt_dir = tmp_path / "file" / "ckpt"
    result = fails_cleanly("ddp_torchrun.py", ["--ckpt-dir", ckpt_dir], f"cannot write in --ckpt-dir {ckpt_dir}")
    assert "step " not in result.output, result.output


def section_refuses(args, build, monkeypatch):
    """The line with which single_gpu.py's data or model section, `build`(module, parsed args), ends the run given
    `args`: called in this process, as main() calls it (the sections are every script's: tests/test_structure.py)."""
    module = import_script("single_gpu.py")
    monkeypatch.setattr(sys, "argv", ["single_gpu.py", *TINY, *map(str, args)])
    with pytest.raises(SystemExit) as stop:
        build(module, module.parse_args())
    return stop.value.code


def test_init_tensor_refuses_a_tensor_it_does_not_know(monkeypatch):
    """The GPT's init_tensor(), the one a user copies, draws what it knows by layer and name; a buffer (rotary
    frequencies, say) or a layer of another kind it refuses, rather than fill it with N(0, 0.02) noise, as it did
    until 2026-11-29, in every script alike, silently."""
    def added_buffer(module, args):
        model, _ = module.build_model(args, {"vocab_size": 256})
        model.blocks["1"].register_buffer("inv_freq", torch.ones(4), persistent=False)
        module.init_weights(model, 0)

    message = section_refuses([], added_buffer, monkeypatch)
    assert message == "single_gpu.py: error: init_tensor() has no values for blocks.1.inv_freq: give them, as for " \
                      "the others"


def test_heads_must_divide_the_width(monkeypatch):
    message = section_refuses(["--n-heads", 3], lambda module, args: module.build_model(args, {"vocab_size": 256}),
                              monkeypatch)
    assert message == "single_gpu.py: error: --n-heads 3 does not divide --d-model 32"


# Each rank of ddp_torchrun.py checks, and all must stop (ddp_spawn.py, ddp_amp.py and fsdp.py share its line);
# pipeline.py's processes hold stages, not samples: it cuts the batch into micro-batches alone, as single_gpu.py.
@pytest.mark.parametrize("script, batch, message", [
    ("single_gpu.py", 7, "--batch-size 7 does not divide into 1 processes x --grad-accum 2"),
    ("ddp_torchrun.py", 6, "--batch-size 6 does not divide into 2 processes x --grad-accum 2"),
    ("pipeline.py", 7, "--batch-size 7 does not divide into 1 pipelines x --grad-accum 2"),
])
def test_batch_size_must_split_evenly(script, batch, message):
    fails_cleanly(script, ["--batch-size", batch], message)


def test_fsdp_replicas_must_divide_the_processes():
    fails_cleanly("fsdp.py", ["--replicate", 3], "--replicate 3 does not divide 2 processes evenly")


def test_dataparallel_refuses_compile_on_several_gpus(monkeypatch):
    """nn.DataParallel's replicas copy the module's attributes, its compiled forward too, which runs GPU 0's weights
    on every GPU's inputs. Two GPUs made believe, in this process: prepare_model refuses before it touches CUDA."""
    module = import_script("dataparallel.py")
    monkeypatch.setattr(sys, "argv", ["dataparallel.py", *TINY, "--compile"])
    monkeypatch.setattr(module.torch.cuda, "device_count", lambda: 2)
    args = module.parse_args()
    model, _ = module.build_model(args, {"vocab_size": 256})
    with pytest.raises(SystemExit) as stop:
        module.prepare_model(model, args, module.torch.device("cuda"))
    assert stop.value.code == ("dataparallel.py: error: --compile takes one GPU: each nn.DataParallel replica would "
                               "run GPU 0's model")


@pytest.mark.parametrize("flag", ["--compile", "--activation-checkpointing"])
def test_fsdp_refuses_what_it_does_per_block_for_a_model_without_blocks(flag, monkeypatch):
    """fsdp.py compiles and recomputes each block: a model without them would get neither, silently."""
    module = import_script("fsdp.py")
    monkeypatch.setattr(sys, "argv", ["fsdp.py", *TINY, flag])
    monkeypatch.setenv("RANK", "0")  # as torchrun starts it
    with pytest.raises(SystemExit) as stop:
        module.prepare_model(module.nn.Linear(2, 2), module.parse_args(), module.torch.device("cpu"))
    assert stop.value.code == ("fsdp.py: error: --compile and --activation-checkpointing work on the model's blocks: "
                               "it has none")


def test_too_few_samples(tmp_path):
    # tiny.txt's 9 validation sequences make no whole batch of 64; 10 sequences leave 1 to validate on.
    fails_cleanly("single_gpu.py", ["--batch-size", 64], "84 training and 9 validation samples are too few")
    data = tmp_path / "ten.txt"
    data.write_bytes((ROOT / "tests" / "tiny.txt").read_bytes()[:10 * 16 + 1])
    fails_cleanly("ddp_torchrun.py", ["--data", data], "9 training and 1 validation samples are too few")


@pytest.mark.parametrize("size", [None, 16])  # none; as long as --seq-len 16, and no next byte to predict
def test_missing_or_short_data_file(size, tmp_path, monkeypatch):
    path = tmp_path / "data.txt"
    if size is not None:
        path.write_bytes(b"x" * size)
    message = section_refuses(["--data", path], lambda module, args: module.build_datasets(args), monkeypatch)
    assert message == f"single_gpu.py: error: --data {path}: no such file, or not longer than --seq-len 16"


def files(directory):
    """{path: bytes} of every file under `directory`."""
    return {path: path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


# A checkpoint is read by the checkpointing section every script shares: single_gpu.py, and fsdp.py's ranks, which
# each read their shards of it (a corrupt one; a model of another size is refused by the config, read first).
@pytest.mark.parametrize("script", ["single_gpu.py"])
def test_checkpoint_of_another_model_size_is_refused_and_kept(trained, script, tmp_path):
    ckpt_dir = resume_in(trained["single_gpu.py"], tmp_path / "ckpt")
    before = files(ckpt_dir)
    config = "{'vocab_size': 256, 'seq_len': 16, 'd_model': %d, 'n_layers': 2, 'n_heads': 2, 'qkv': 'by head'}"
    # --d-model 64 after the checkpoint's 32 (argparse keeps the last of a repeated flag).
    result = fails_cleanly(script, ["--d-model", 64, "--ckpt-dir", ckpt_dir, "--max-steps", 2 * STEPS],
                           f"cannot resume from {ckpt_dir}/step-{STEPS:06d}: it holds a model {config % 32}, this run "
                           f"builds {config % 64}")
    assert "step " not in result.output, result.output
    assert files(ckpt_dir) == before


def test_a_checkpoint_of_the_old_qkv_layout_is_refused_and_kept(trained, tmp_path):
    """Until 2026-11-28 qkv's rows were q|k|v, all heads' q first (GPT-2's layout); read head by head the same
    weights are another model, which would resume with no error and train on, wrong. A checkpoint's config now
    names the layout: one saved before, without it, is refused in one line."""
    state = load(trained["single_gpu.py"].ckpt_dir)
    del state["config"]["qkv"]  # as the config was
    ckpt_dir = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=ckpt_dir / f"step-{STEPS:06d}")
    before = files(ckpt_dir)
    result = fails_cleanly("single_gpu.py", ["--ckpt-dir", ckpt_dir, "--max-steps", 2 * STEPS],
                           f"cannot resume from {ckpt_dir}/step-{STEPS:06d}: ")
    assert "config.qkv" in error_lines("single_gpu.py", result.output)[0], result.output
    assert "step " not in result.output, result.output
    assert files(ckpt_dir) == before


@pytest.mark.parametrize("script", ["single_gpu.py", "fsdp.py"])
def test_corrupt_checkpoint_is_refused_and_kept(trained, script, tmp_path):
    # What a disk that lost the end of a file leaves: DCP's .metadata, and the first half of the data.
    ckpt_dir = resume_in(trained["single_gpu.py"], tmp_path / "ckpt")
    data = ckpt_dir / f"step-{STEPS:06d}" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
    before = files(ckpt_dir)
    result = fails_cleanly(script, ["--ckpt-dir", ckpt_dir, "--max-steps", 2 * STEPS],
                           f"cannot resume from {ckpt_dir}/step-{STEPS:06d}: ")
    assert "step " not in result.output, result.output
    assert files(ckpt_dir) == before


# After its POISON_AFTER-th optimizer step, a process (of rank POISON_RANK, if set) sets the first weights it holds to
# NaN: the token embedding, which every input reads; a shard of it (fsdp.py); a stage's first (pipeline.py).
POISON = """import os, torch
step, steps_taken = torch.optim.AdamW.step, []

def poisoning_step(self, *args, **kwargs):
    result = step(self, *args, **kwargs)
    steps_taken.append(None)
    rank = os.environ.get("POISON_RANK")
    if len(steps_taken) == int(os.environ["POISON_AFTER"]) and rank in (None, os.environ.get("RANK", "0")):
        weights = self.param_groups[0]["params"][0]
        with torch.no_grad():
            (weights.to_local() if hasattr(weights, "to_local") else weights).fill_(float("nan"))
    return result

torch.optim.AdamW.step = poisoning_step
"""


def poisoned(tmp_path, after, rank=None):
    env = {**injected(tmp_path, POISON), "POISON_AFTER": str(after)}
    return env if rank is None else {**env, "POISON_RANK": str(rank)}


def saved_nothing_from(ckpt_dir, step, written):
    """The checkpoints a run left that stopped at `step`: that of step `written`, which a later save waited for, and
    none of `step` or later; every complete one holds finite weights."""
    assert ckpt_dir / f"step-{written:06d}" in checkpoints(ckpt_dir)
    assert not any(int(path.name[5:]) >= step for path in ckpt_dir.glob("step-*")), list(ckpt_dir.iterdir())
    for path in checkpoints(ckpt_dir):
        assert all(weights.isfinite().all() for weights in load(path)["model"].values()), path


# Saves at 2 and 4; the weights turn NaN in step 5, so step 6's loss, the first logged after, is NaN. In
# ddp_torchrun.py rank 0's alone: the loss logged is every rank's, so both stop.
@pytest.mark.parametrize("script", ["single_gpu.py", "ddp_torchrun.py"])
def test_a_loss_that_turns_nan_stops_the_run_without_saving(script, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    result = fails_cleanly(script, ["--ckpt-every", 2, "--keep-checkpoints", 5, "--ckpt-dir", ckpt_dir],
                           "the loss is nan at step 6: training diverged; try a lower --lr",
                           env=poisoned(tmp_path, 5, rank=0 if script == "ddp_torchrun.py" else None))
    assert "step     6 | loss" not in result.output, result.output
    assert len(error_lines(script, result.output)) == (2 if script == "ddp_torchrun.py" else 1), result.output
    saved_nothing_from(ckpt_dir, 6, written=2)


# Rank 1's shard, or stage, alone turns NaN in step 3, at a save (--ckpt-every 1) and before any loss is logged after
# it: each rank checks its own weights, then all agree, and every rank stops with the line.
@pytest.mark.parametrize("script", ["fsdp.py", "pipeline.py"])
def test_non_finite_weights_on_one_rank_stop_every_rank_without_saving(script, tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    result = fails_cleanly(script, ["--ckpt-every", 1, "--keep-checkpoints", 5, "--ckpt-dir", ckpt_dir],
                           "the weights are not finite at step 3: diverged, and not saved",
                           env=poisoned(tmp_path, 3, rank=1))
    assert len(error_lines(script, result.output)) == 2, result.output  # rank 0's are finite: it heard from rank 1
    saved_nothing_from(ckpt_dir, 3, written=1)
