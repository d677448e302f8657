"""fsdp.py: sharded weights, gradients and optimizer state (1/N per process, as measured), bf16 computation over fp32
state, hybrid sharding, checkpoints that resume on another number of processes, compiled and recomputed blocks that
train as the plain ones do."""

import json
import shutil

import pytest

from conftest import (HALF, PARAM_ATOL, STEPS, TINY, WARNING, injected, load, max_param_diff, run, scalars,
                      trains_compiled_like_eager)

# Run in every rank by the optimizer's own step hook: the bytes this rank holds once the gradients and AdamW's
# state exist, counted from the tensors themselves (a DTensor's local shard), and, for the bounds, the bytes and
# rows of every whole parameter, and the sums of the local shards (which rows: the same in a replica of them); how
# long each group of the mesh waits for a stuck rank (private names: a test's, not the script's); and how many
# all-reduces each step ran in a group of 2 of the 4 processes, across replicas (the vote, the logged loss and
# evaluation's sums reduce over all of them).
MEASURE_SHARDS = """
import json, os, torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

all_reduce, across_replicas, per_step = dist.all_reduce, [0], []

def counting_all_reduce(tensor, *args, **kwargs):
    group = kwargs.get("group", args[1] if len(args) > 1 else None)
    across_replicas[0] += group is not None and dist.get_world_size() == 4 and group.size() == 2
    return all_reduce(tensor, *args, **kwargs)

dist.all_reduce = counting_all_reduce

def local(t):
    return t.to_local() if isinstance(t, DTensor) else t

def measure(optimizer, args, kwargs):
    per_step.append(across_replicas[0])
    across_replicas[0] = 0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    held = {"weights": sum(local(p).nbytes for p in params), "gradients": sum(local(p.grad).nbytes for p in params),
            "optimizer": sum(local(t).nbytes for t in state), "whole": sum(p.nbytes for p in params),
            "rows": sum(p.nbytes // p.shape[0] for p in params), "params": len(params),
            "sums": [local(p).double().sum().item() for p in params],
            "timeouts": [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                         for g in params[0].device_mesh.get_all_groups()], "all_reduces": per_step}
    with open(os.path.join(os.environ["MEASURE_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(held, f)

register_optimizer_step_post_hook(measure)
"""


def measured(tmp_path, nproc, more=""):
    """An environment that runs MEASURE_SHARDS (and `more`), and a function that reads back what each of `nproc`
    ranks held."""
    (tmp_path / "site").mkdir()
    env = {**injected(tmp_path / "site", MEASURE_SHARDS + more), "MEASURE_DIR": str(tmp_path)}
    return env, lambda: [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def check_shards(held, shards):
    """Each rank holds 1/shards of the weights (FSDP2 gives each rank ceil(rows / shards) rows of every parameter:
    at most a row more per tensor), gradients as large, and AdamW's two moments as large plus a step count (an
    fp32 scalar) per parameter."""
    whole = held[0]["whole"]
    for rank in held:
        assert whole / shards - rank["rows"] <= rank["weights"] <= whole / shards + rank["rows"], rank
        assert rank["gradients"] == rank["weights"], rank
        assert rank["optimizer"] == 2 * rank["weights"] + 4 * rank["params"], rank
    assert sum(rank["weights"] for rank in held[:shards]) == whole  # no rank of a replica holds a row twice
    assert held[0]["sums"] != held[1]["sums"]  # different rows


# Run in every rank: how many times attention ran with autograd recording, on real tensors (not count_flops' meta
# ones), written at exit: with --activation-checkpointing, each block's forward runs again in backward.
COUNT_ATTENTION = """
import atexit, os, torch
attention, calls = torch.nn.functional.scaled_dot_product_attention, []

def counting_attention(query, *args, **kwargs):
    calls.extend([1] if torch.is_grad_enabled() and query.device.type != "meta" else [])
    return attention(query, *args, **kwargs)

def write():
    with open(os.path.join(os.environ["MEASURE_DIR"], f"attention{os.environ['RANK']}"), "w") as f:
        f.write(str(len(calls)))

torch.nn.functional.scaled_dot_product_attention = counting_attention
if "RANK" in os.environ:  # a worker, not torchrun's agent
    atexit.register(write)
"""


@pytest.fixture(scope="module")
def recomputed(tmp_path_factory):
    """`halfway`'s fsdp.py run with --activation-checkpointing, each rank noting what it holds, and how many times
    attention ran in training."""
    out = tmp_path_factory.mktemp("recomputed")
    env, held = measured(out, 2, COUNT_ATTENTION)
    result = run("fsdp.py", *TINY, "--max-steps", HALF, "--lr-decay-steps", STEPS, "--activation-checkpointing",
                 "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb", env=env)
    assert result.returncode == 0, result.output
    attention = [int((out / f"attention{rank}").read_text()) for rank in range(2)]
    return out / "ckpt", held(), attention


def test_each_of_2_processes_holds_half_the_training_state(recomputed):
    check_shards(recomputed[1], 2)


def test_activation_checkpointing_recomputes_and_gives_the_same_weights(halfway, recomputed):
    """Each block's forward runs twice per micro-batch (TINY's 2 blocks, 2 micro-batches a step), the second time
    in backward, instead of keeping its activations; the same operations on the same inputs give, on a CPU, the same
    weights bit for bit."""
    ckpt_dir, _, attention = recomputed
    assert attention == [HALF * 2 * 2 * 2] * 2, attention
    assert max_param_diff(load(ckpt_dir)["model"], load(halfway["fsdp.py"].ckpt_dir)["model"]) == 0


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


def trained_in_bf16(script, halfway, tmp_path):
    """`halfway`'s run of `script` in bf16, one micro-batch a step (which sums the same fp32 values as two, in another
    order): the loss within 0.01 of fp32's, and not fp32's, and on each rank the gradients that reach clipping, the
    weights and AdamW's state all fp32. Returns each rank's records of its gradients."""
    (tmp_path / "site").mkdir()
    (tmp_path / "dtypes").mkdir()
    env = {**injected(tmp_path / "site", RECORD_DTYPES), "DTYPE_DIR": str(tmp_path / "dtypes")}
    result = run(script, *TINY, "--max-steps", HALF, "--lr-decay-steps", STEPS, "--precision", "bf16",
                 "--grad-accum", 1, "--log-dir", tmp_path / "tb", env=env)
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    bf16, fp32 = scalars(tmp_path / "tb"), scalars(halfway[script].log_dir)
    assert bf16["train/loss"][2] - bf16["train/loss"][HALF] > 0.4, bf16["train/loss"]
    gaps = [abs(bf16["train/loss"][step] - fp32["train/loss"][step]) for step in fp32["train/loss"]]
    print(f"{script} bf16 against fp32: largest train-loss gap {max(gaps):.3g}")
    assert 0 < max(gaps) < 0.01, gaps
    gradients = []
    for rank in range(2):
        records = [json.loads(line) for line in (tmp_path / "dtypes" / f"rank{rank}").read_text().splitlines()]
        grads, steps = [r for r in records if "grads" in r], [r for r in records if "weights" in r]
        assert len(grads) == len(steps) == HALF, records
        assert all(r["grads"] == ["torch.float32"] for r in grads), grads
        assert all(r["weights"] == r["state"] == ["torch.float32"] for r in steps), steps
        gradients.append(grads)
    return gradients


def test_bf16_trains_close_to_fp32(halfway, tmp_path):
    """bf16 computation (8 bits of mantissa), with gradients reduced, kept and stepped in fp32: the loss follows
    fp32's, training works as well, and the gradients hold values that bf16 cannot: a module that reduced in bf16
    would have none."""
    for rank, grads in enumerate(trained_in_bf16("fsdp.py", halfway, tmp_path)):
        # Reduced in bf16, every value fits bf16; in fp32, the sum of two ranks' bf16 gradients mostly does not,
        # in every gradient that is not all zeros (rank 1's rows of the token embedding: bytes from 128 on, which
        # tiny.txt lacks, are).
        beyond = [sum(counts) for counts in zip(*(r["beyond_bf16"] for r in grads))]
        nonzero = [sum(counts) for counts in zip(*(r["nonzero"] for r in grads))]
        fewest = min(b for b, n in zip(beyond, nonzero) if n)
        print(f"rank {rank}: {sum(beyond) / sum(sum(r['values']) for r in grads):.1%} of the gradients' values are "
              f"beyond bf16; in the fewest of a gradient not all zeros, {fewest}")
        assert fewest > 0, (beyond, nonzero)


@pytest.fixture(scope="module")
def hybrid_halfway(tmp_path_factory):
    """fsdp.py --replicate 2 on 4 processes for HALF steps (2 replicas of 2 shards), each rank noting what it holds."""
    out = tmp_path_factory.mktemp("hybrid")
    env, held = measured(out, 4)
    result = run("fsdp.py", *TINY, "--replicate", 2, "--timeout", 240, "--max-steps", HALF, "--lr-decay-steps", STEPS,
                 "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb", nproc=4, env=env, timeout=300)
    assert result.returncode == 0, result.output
    return out / "ckpt", held()


def test_hybrid_sharding_trains_like_one_process(halfway, hybrid_halfway):
    """2 replicas of 2 shards: each process holds half the training state, as 2 processes of full sharding do,
    the two replicas hold the same rows (rank 2 rank 0's), and the weights are single_gpu.py's. Both groups of the
    mesh wait --timeout (240 s) for a stuck rank, not torch's default for a new group (30 min). Of TINY's 2
    micro-batches a step, the last alone all-reduces across replicas: once a step for each of the 3 units that FSDP
    reduces (the 2 blocks and the root), where each micro-batch would cross nodes twice as often."""
    ckpt_dir, held = hybrid_halfway
    assert [rank["timeouts"] for rank in held] == [[240, 240]] * 4
    assert [rank["all_reduces"] for rank in held] == [[3] * HALF] * 4
    check_shards(held, 2)
    assert held[0:2] == held[2:4], held
    difference = max_param_diff(load(ckpt_dir)["model"], load(halfway["single_gpu.py"].ckpt_dir)["model"])
    print(f"--replicate 2 on 4 processes: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL


def test_hybrid_checkpoint_resumes_fully_sharded(trained, hybrid_halfway, tmp_path):
    """Saved by 2 replicas of 2 shards at HALF, resumed by 2 processes of full sharding: the run ends where
    single_gpu.py's does."""
    ckpt_dir = shutil.copytree(hybrid_halfway[0], tmp_path / "ckpt")
    result = run("fsdp.py", *TINY, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb")
    assert result.returncode == 0, result.output
    assert f"resumed from {ckpt_dir / f'step-{HALF:06d}'} at step {HALF}" in result.output, result.output
    difference = max_param_diff(load(ckpt_dir)["model"], load(trained["single_gpu.py"].ckpt_dir)["model"])
    print(f"hybrid then 2 processes: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL


def test_compiled_blocks_train_like_eager(trained, tmp_path):
    """--compile compiles each block before it is sharded: like eager, as for DDP. Compiled at the first evaluation
    (no autograd), then once more for training, and never for a batch's shape (test_compiled_ddp_trains_like_eager)."""
    recompiles = trains_compiled_like_eager("fsdp.py", trained["fsdp.py"], tmp_path)
    assert recompiles == [1, 1]
