"""fsdp.py: sharded weights, gradients and optimizer state (1/N per process, as measured), bf16, sharded
checkpoints that resume on another number of processes, survive a crash mid-save and convert both ways to
the checkpoint.pt of the other scripts."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import (HALF, LAUNCHER, PARAM_ATOL, STEPS, TINY, WARNING, fails_cleanly, injected, kill_a_worker, load,
                      max_param_diff, resume_in, run, scalars, trains_compiled_like_eager)

# Run in every rank by the optimizer's own step hook: the bytes this rank holds once the gradients and AdamW's
# state exist, counted from the tensors themselves (a DTensor's local shard), and, for the bound, the rows of
# every whole parameter.
MEASURE_MEMORY = """
import json, os, torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

def local(t):
    return t.to_local() if isinstance(t, DTensor) else t

def measure(optimizer, args, kwargs):
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    held = {"weights": sum(local(p).nbytes for p in params), "gradients": sum(local(p.grad).nbytes for p in params),
            "optimizer": sum(local(t).nbytes for t in state), "whole": sum(p.nbytes for p in params),
            "rows": sum(p.nbytes // p.shape[0] for p in params), "params": len(params),
            "sums": [local(p).double().sum().item() for p in params]}  # which rows: the same in a replica of them
    with open(os.path.join(os.environ["MEASURE_DIR"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(held, f)

register_optimizer_step_post_hook(measure)
"""


def mib(line, what):
    return float(re.search(rf"{what} ([\d.]+)", line).group(1))


@pytest.mark.parametrize("nproc", [1, 2])
def test_each_process_holds_a_shard_of_the_training_state(tmp_path, nproc):
    """Weights, gradients and AdamW's state together: on N processes, each holds at most 1/N of a whole
    replica's bytes, plus padding: FSDP2 gives each rank ceil(rows / N) rows of every parameter, so a rank
    holds at most one row more per tensor. The shards add up to the whole; the startup log says the same."""
    env = injected(tmp_path, MEASURE_MEMORY)
    env["MEASURE_DIR"] = str(tmp_path)
    result = run("fsdp.py", *TINY, "--max-steps", 2, "--log-dir", tmp_path / "tb", nproc=nproc, env=env)
    assert result.returncode == 0, result.output
    held = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(nproc)]
    whole = held[0]["whole"]
    for rank in held:
        assert rank["gradients"] == rank["weights"]
        # exp_avg and exp_avg_sq, sharded like the weights, and each parameter's step count: one fp32 scalar
        assert rank["optimizer"] == 2 * rank["weights"] + 4 * rank["params"]
        total = rank["weights"] + rank["gradients"] + rank["optimizer"]
        assert total <= 4 * (whole / nproc + rank["rows"]) + 4 * rank["params"], rank
    assert sum(rank["weights"] for rank in held) == whole  # no rank holds a row twice
    if nproc == 2:
        assert held[0]["weights"] < 0.55 * whole and held[1]["weights"] < 0.55 * whole, held

    line = next(line for line in result.output.splitlines() if "memory per process" in line)
    assert mib(line, "weights") == pytest.approx(held[0]["weights"] / 2**20, abs=0.005), line
    assert mib(line, "against") == pytest.approx(4 * whole / 2**20, abs=0.005), line


# Each process notes, as the gradients reach clipping (reduced, not yet scaled) and after each optimizer step: the
# dtypes of the gradients, weights and AdamW state it holds, and how many of each gradient's values bf16 could not
# hold (a value whose low 16 bits are not all zero).
RECORD_DTYPES = """
import json, os, torch
clip, step = torch.nn.utils.clip_grad_norm_, torch.optim.AdamW.step
def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
def note(**record):
    with open(os.path.join(os.environ["DTYPE_DIR"], f"rank{os.environ['RANK']}"), "a") as f:
        f.write(json.dumps(record) + "\\n")
def recording_clip(parameters, *args, **kwargs):
    parameters = list(parameters)
    grads = [local(p.grad) for p in parameters if p.grad is not None]
    note(grads=sorted({str(g.dtype) for g in grads}), values=[g.numel() for g in grads],
         nonzero=[int(g.count_nonzero()) for g in grads],
         beyond_bf16=[int((g.float().view(torch.int32) & 0xFFFF).count_nonzero()) for g in grads])
    return clip(parameters, *args, **kwargs)
def recording_step(self, *args, **kwargs):
    result = step(self, *args, **kwargs)
    params = [p for group in self.param_groups for p in group["params"]]
    note(weights=sorted({str(local(p).dtype) for p in params}),
         state=sorted({str(local(v).dtype) for p in params for k, v in self.state[p].items() if k != "step"}))
    return result
torch.nn.utils.clip_grad_norm_, torch.optim.AdamW.step = recording_clip, recording_step
"""


def test_bf16_trains_close_to_fp32(trained, tmp_path):
    """bf16 computation (8 bits of mantissa), with gradients reduced, kept and stepped in fp32: the loss follows
    fp32's, training works as well, and the gradients hold values that bf16 cannot. One micro-batch a step (which
    sums the same fp32 values as two, in another order): accumulating two would add bits to a bf16 reduction's."""
    (tmp_path / "site").mkdir()
    (tmp_path / "dtypes").mkdir()
    env = {**injected(tmp_path / "site", RECORD_DTYPES), "DTYPE_DIR": str(tmp_path / "dtypes")}
    result = run("fsdp.py", *TINY, "--max-steps", STEPS, "--precision", "bf16", "--grad-accum", 1, "--log-dir",
                 tmp_path / "tb", env=env)
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    assert "bf16 | memory per process" in result.output
    bf16, fp32 = scalars(tmp_path / "tb"), scalars(trained["fsdp.py"].log_dir)
    assert bf16["train/loss"][2] - bf16["train/loss"][STEPS] > 0.4, bf16["train/loss"]
    gaps = [abs(bf16["train/loss"][step] - fp32["train/loss"][step]) for step in fp32["train/loss"]]
    print(f"bf16 against fp32: largest train-loss gap {max(gaps):.3g}")
    assert 0 < max(gaps) < 0.01, gaps
    for rank in range(2):
        records = [json.loads(line) for line in (tmp_path / "dtypes" / f"rank{rank}").read_text().splitlines()]
        grads, steps = [r for r in records if "grads" in r], [r for r in records if "weights" in r]
        assert len(grads) == len(steps) == STEPS, records
        assert all(r["grads"] == ["torch.float32"] for r in grads), grads
        assert all(r["weights"] == r["state"] == ["torch.float32"] for r in steps), steps
        # Reduced in bf16, every value fits bf16 (seen: 0%); in fp32, the sum of two ranks' bf16 gradients mostly
        # does not (seen: 46% and 48%), in every gradient that is not all zeros (rank 1's rows of the token
        # embedding: bytes from 128 on, which tiny.txt lacks): a module that reduced in bf16 would have none.
        beyond = [sum(counts) for counts in zip(*(r["beyond_bf16"] for r in grads))]
        nonzero = [sum(counts) for counts in zip(*(r["nonzero"] for r in grads))]
        fewest = min(b for b, n in zip(beyond, nonzero) if n)
        print(f"rank {rank}: {sum(beyond) / sum(sum(r['values']) for r in grads):.1%} of the gradients' values are "
              f"beyond bf16; in the fewest of a gradient not all zeros, {fewest}")
        assert fewest > 0, (beyond, nonzero)


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_processes(trained, halfway, tmp_path, before, after):
    """DCP reshards: saved by `before` processes, resumed by `after`, the run ends where single_gpu.py does."""
    ckpt_dir = tmp_path / "ckpt"
    if before == 2:  # the shared run's checkpoint, written by 2 processes
        resume_in(halfway["fsdp.py"], ckpt_dir)
    for nproc, steps in [(before, HALF), (after, STEPS)][before == 2:]:
        result = run("fsdp.py", *TINY, "--max-steps", steps, "--lr-decay-steps", STEPS, "--ckpt-dir", ckpt_dir,
                     "--log-dir", tmp_path / f"tb{nproc}", nproc=nproc)
        assert result.returncode == 0, result.output
    assert f"resumed from {ckpt_dir / 'checkpoint'} at step {HALF}" in result.output
    assert len(list((ckpt_dir / "checkpoint").glob("*.distcp"))) == after  # a file per rank
    difference = max_param_diff(load(ckpt_dir)["model"], load(trained["single_gpu.py"].ckpt_dir)["model"])
    print(f"{before} then {after} processes: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL


def test_checkpoints_convert_both_ways(trained, tmp_path):
    """single_gpu.py's checkpoint.pt resumes in fsdp.py (whose optimizer names the parameters that a plain one
    numbers: Adam's moments must arrive, or the weights would part from single_gpu.py's); then the README's
    one command turns fsdp.py's shards into a checkpoint.pt that single_gpu.py finishes the run from. With
    both in the directory, fsdp.py resumes the later."""
    ckpt_dir = tmp_path / "ckpt"

    def train(script, steps):
        result = run(script, *TINY, "--max-steps", steps, "--lr-decay-steps", STEPS, "--ckpt-dir", ckpt_dir,
                     "--log-dir", tmp_path / f"{script}-{steps}")
        assert result.returncode == 0, result.output
        return result.output

    train("single_gpu.py", 4)
    output = train("fsdp.py", 8)
    assert f"reading {ckpt_dir / 'checkpoint'}.pt" in output and "at step 4" in output, output
    output = train("fsdp.py", 12)  # checkpoint.pt (step 4) is still there: the shards are later
    assert "reading" not in output and f"resumed from {ckpt_dir / 'checkpoint'} at step 8" in output, output
    convert = subprocess.run([sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch",
                              ckpt_dir / "checkpoint", ckpt_dir / "checkpoint.pt"], check=False, capture_output=True, text=True)
    assert convert.returncode == 0, convert.stderr
    output = train("single_gpu.py", STEPS)
    assert f"resumed from {ckpt_dir / 'checkpoint.pt'} at step 12" in output, output
    output = train("fsdp.py", STEPS)  # now checkpoint.pt is the later: it is read, and the run is finished
    assert f"reading {ckpt_dir / 'checkpoint'}.pt" in output and "the run is finished" in output, output

    final = torch.load(ckpt_dir / "checkpoint.pt", weights_only=True)
    assert final["step"] == STEPS
    difference = max_param_diff(final["model"], load(trained["single_gpu.py"].ckpt_dir)["model"])
    print(f"single_gpu.py -> fsdp.py -> single_gpu.py: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL


def test_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(trained, tmp_path):
    """Rank 0 dies after every rank wrote its shards of step 16 and before the metadata that completes them:
    the link still names step 8's directory, which resumes, and the run ends where an uninterrupted one does."""
    env = injected(tmp_path, "import os, signal\nfrom torch.distributed.checkpoint import FileSystemWriter\n"
                             "finish = FileSystemWriter.finish\nsaves = []\n"
                             "def torn_finish(self, *args, **kwargs):\n"
                             "    saves.append(1)\n"
                             "    if len(saves) == 2:\n"
                             "        os.kill(os.getpid(), signal.SIGKILL)\n"
                             "    return finish(self, *args, **kwargs)\n"
                             "FileSystemWriter.finish = torn_finish\n")
    ckpt_dir = tmp_path / "ckpt"
    flags = [*TINY, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb"]
    crashed = run("fsdp.py", *flags, env=env)
    assert crashed.returncode != 0, crashed.output
    torn = ckpt_dir / f"checkpoint-{STEPS:06d}"
    assert list(torn.glob("*.distcp")) and not (torn / ".metadata").exists(), "the crash did not come mid-save"
    assert load(ckpt_dir)["step"] == HALF

    resumed = run("fsdp.py", *flags)
    assert resumed.returncode == 0, resumed.output
    assert f"resumed from {ckpt_dir / 'checkpoint'} at step {HALF}" in resumed.output
    assert max_param_diff(load(ckpt_dir)["model"], load(trained["fsdp.py"].ckpt_dir)["model"]) == 0


def test_killed_worker_restarts_and_resumes_exactly(trained, tmp_path):
    """Under launch_distributed.sh with restarts: SIGKILL rank 1 after the first checkpoint; the restarted
    group resumes from the shards and ends with the uninterrupted run's weights. The first checkpoint comes at step
    4 (saving changes nothing in training), so that the kill lands 12 steps before the end."""
    ckpt_dir = tmp_path / "ckpt"
    flags = [*TINY, "--ckpt-every", 4, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb"]
    killed = kill_a_worker([str(LAUNCHER), "fsdp.py", *map(str, flags)], ckpt_dir / "checkpoint")
    assert killed.run.returncode == 0, killed.run.output
    assert "failed (exitcode: -9) local_rank: 1" in killed.run.output, killed.run.output
    assert f"resumed from {ckpt_dir / 'checkpoint'} at step 4" in killed.run.output, killed.run.output
    assert max_param_diff(load(ckpt_dir)["model"], load(trained["fsdp.py"].ckpt_dir)["model"]) == 0


def test_shards_of_another_model_size_are_reported_and_kept(trained, tmp_path):
    shutil.copytree(trained["fsdp.py"].ckpt_dir, tmp_path / "ckpt", symlinks=True)
    before = load(tmp_path / "ckpt")["model"]
    fails_cleanly("fsdp.py", ["--d-model", 64, "--ckpt-dir", tmp_path / "ckpt", "--max-steps", 32], "'d_model': 32",
                  timeout=60)
    assert max_param_diff(load(tmp_path / "ckpt")["model"], before) == 0


def test_corrupt_shard_is_reported_and_kept(trained, tmp_path):
    shutil.copytree(trained["fsdp.py"].ckpt_dir, tmp_path / "ckpt", symlinks=True)
    shard = next((tmp_path / "ckpt" / "checkpoint").glob("__1_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    # The cause, from the rank that met it (DCP gathers every rank's errors into one exception): a short file.
    fails_cleanly("fsdp.py", ["--ckpt-dir", tmp_path / "ckpt", "--max-steps", 32],
                  f"cannot read checkpoint {tmp_path / 'ckpt' / 'checkpoint'}: Ran out of input", timeout=60)
    assert shard.stat().st_size == 1000


# Every process appends the norm that clip_grad_norm_ returns, made whole (a collective, which every rank runs).
RECORD_NORMS = """
import os, sys, torch
from torch.distributed.tensor import DTensor
clip = torch.nn.utils.clip_grad_norm_

def recording_clip(*args, **kwargs):
    norm = clip(*args, **kwargs)
    value = norm.full_tensor() if isinstance(norm, DTensor) else norm
    name = f"{os.path.basename(sys.argv[0])}-rank{os.environ.get('RANK', '0')}"
    with open(os.path.join(os.environ["NORM_DIR"], name), "a") as f:
        f.write(f"{value.item()!r}\\n")
    return norm

torch.nn.utils.clip_grad_norm_ = recording_clip
"""


def test_clipping_uses_the_whole_models_gradient_norm(tmp_path):
    """The norm of the sharded gradients, on every rank, is the number single_gpu.py computes for the whole
    model, and it is above --grad-clip at first: clipping acts, with the global norm."""
    env = {**injected(tmp_path, RECORD_NORMS), "NORM_DIR": str(tmp_path)}
    for script in "single_gpu.py", "fsdp.py":
        result = run(script, *TINY, "--max-steps", 6, "--log-dir", tmp_path / script, env=env)
        assert result.returncode == 0, result.output
    norms = {path.name: [float(line) for line in path.read_text().split()] for path in tmp_path.glob("*-rank*")}
    expected = norms["single_gpu.py-rank0"]
    assert len(expected) == 6 and expected[0] > 1.0, expected
    assert norms["fsdp.py-rank0"] == norms["fsdp.py-rank1"]
    assert norms["fsdp.py-rank0"] == pytest.approx(expected, rel=1e-5)


def test_compiled_blocks_train_like_eager(trained, tmp_path):
    """--compile compiles each block before it is sharded: like eager, as for DDP (seen: 1.1e-6). Compiled at the
    first evaluation (no autograd), then again for training, and on rank 0 perhaps once more for the short last
    validation batch: at most 2 recompiles per rank (seen: 2 and 1); an evaluation that recompiled every pass would
    add more at steps 8 and 16."""
    recompiles = trains_compiled_like_eager("fsdp.py", trained["fsdp.py"], tmp_path)
    assert all(1 <= count <= 2 for count in recompiles), recompiles


@pytest.fixture(scope="module")
def hybrid_halfway(tmp_path_factory):
    """fsdp.py --replicate 2 on 4 processes for HALF steps (2 replicas of 2 shards), each rank noting what it holds."""
    out = tmp_path_factory.mktemp("hybrid")
    env = {**injected(out, MEASURE_MEMORY), "MEASURE_DIR": str(out)}
    result = run("fsdp.py", *TINY, "--replicate", 2, "--max-steps", HALF, "--lr-decay-steps", STEPS, "--ckpt-dir",
                 out / "ckpt", "--log-dir", out / "tb", nproc=4, env=env)
    assert result.returncode == 0, result.output
    return out, [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_hybrid_sharding_holds_half_the_state_on_each_of_4_processes(hybrid_halfway):
    """2 replicas of 2 shards: each process holds 1/2 of the weights, gradients and AdamW state, as 2 processes
    of full sharding do, and the two replicas hold the same rows."""
    _, held = hybrid_halfway
    whole = held[0]["whole"]
    for rank in held:
        assert rank["gradients"] == rank["weights"] and rank["optimizer"] == 2 * rank["weights"] + 4 * rank["params"]
        assert whole / 2 - rank["rows"] <= rank["weights"] <= whole / 2 + rank["rows"], rank
    # Ranks 0 and 1 shard a replica, as ranks 2 and 3 do (a node each, under torchrun): rank 2 holds rank 0's rows.
    assert held[0]["weights"] + held[1]["weights"] == whole and held[0:2] == held[2:4], held
    assert held[0]["sums"] != held[1]["sums"], held


@pytest.mark.parametrize("before, after", [("hybrid", 2), ("hybrid", 4), (2, "hybrid")])
def test_checkpoints_move_between_hybrid_and_full_sharding(trained, halfway, hybrid_halfway, tmp_path, before, after):
    """Saved by 2 replicas of 2 shards and resumed by 2 or 4 processes of full sharding, or the other way: the run
    ends within PARAM_ATOL of single_gpu.py's weights."""
    ckpt_dir = tmp_path / "ckpt"
    if before == "hybrid":
        shutil.copytree(hybrid_halfway[0] / "ckpt", ckpt_dir, symlinks=True)
    else:
        resume_in(halfway["fsdp.py"], ckpt_dir)
    flags = ["--replicate", 2] if after == "hybrid" else []
    result = run("fsdp.py", *TINY, *flags, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb",
                 nproc=4 if after == "hybrid" else after)
    assert result.returncode == 0, result.output
    assert f"resumed from {ckpt_dir / 'checkpoint'} at step {HALF}" in result.output
    difference = max_param_diff(load(ckpt_dir)["model"], load(trained["single_gpu.py"].ckpt_dir)["model"])
    print(f"{before} then {after}: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL


def test_replicas_that_do_not_divide_the_processes_are_refused():
    fails_cleanly("fsdp.py", ["--replicate", 3], "--replicate 3 does not divide the 2 processes into groups of equal size")
