"""pipeline.py: every schedule reaches single_gpu.py's weights and losses, on one stage per process or two, validation
through the stages is exact and holds one micro-batch's logits at a time, each stage loads only what it uses, a
checkpoint of 2 x 2 pipelines resumes in single_gpu.py, compiled and recomputed stages train as the plain ones do, and what
cannot be split is refused. The parametrized tests (training, resume, bad input, preemption) run it too."""

import json
import shutil

import pytest
import torch

from conftest import (HALF, PARAM_ATOL, STEPS, TINY, WARNING, assert_identical, fails_cleanly, import_script, injected,
                      load, max_param_diff, run, scalars, trains_compiled_like_eager)
from test_amp import close_to_fp32
from test_training import LOSS_ATOL


# Run in every rank: each point-to-point operation it issues (its peer, process group, bytes and dtype, and the batch
# of batch_isend_irecv it belongs to) and each wait on one, in the order issued, a line each in P2P_LOG/rank<N>.jsonl:
# what `replay` runs under NCCL's rules. torch's schedules and the script's evaluation call these functions by their
# module's name, which sees the wrappers (send and recv call isend and irecv); P2POp checks its op is one of the two.
RECORD_P2P = """
import inspect, itertools, json, os
import torch.distributed as dist, torch.distributed.distributed_c10d as c10d
numbers, batch = itertools.count(), [None]

def record(event):
    with open(os.path.join(os.environ["P2P_LOG"], f"rank{os.environ['RANK']}.jsonl"), "a") as log:
        log.write(json.dumps(event) + "\\n")

class Noted:  # a Work whose wait is recorded
    def __init__(self, work, numbers):
        self.work, self.numbers = work, numbers
    def wait(self, *args, **kwargs):
        record({"wait": self.numbers})
        return self.work.wait(*args, **kwargs)
    def __getattr__(self, name):
        return getattr(self.work, name)

def recorded(kind, function):
    def p2p(tensor, *args, **kwargs):
        bound = inspect.signature(function).bind(tensor, *args, **kwargs).arguments
        group = bound.get("group") or c10d._get_default_group()
        peer = bound.get("dst", bound.get("src"))
        if peer is None:
            peer = dist.get_global_rank(group, bound.get("group_dst", bound.get("group_src")))
        number = next(numbers)
        record({"op": number, "kind": kind, "peer": peer, "group": group.group_name, "batch": batch[0],
                "bytes": tensor.numel() * tensor.element_size(), "dtype": str(tensor.dtype)[6:]})
        return Noted(function(tensor, *args, **kwargs), [number])
    return p2p

def recorded_batch(ops):
    batch[0] = next(numbers)
    try:
        works = batch_isend_irecv(ops)
    finally:
        batch[0] = None
    return [work if isinstance(work, Noted) else Noted(work, []) for work in works]

batch_isend_irecv, isend, irecv = c10d.batch_isend_irecv, recorded("send", c10d.isend), recorded("recv", c10d.irecv)
for module in dist, c10d:
    module.isend, module.irecv, module.batch_isend_irecv = isend, irecv, recorded_batch  # send, recv call them
"""


def p2p_recorded(directory, code=""):
    """The environment that runs RECORD_P2P, and `code`, in every process, logging into `directory`."""
    (directory / "site").mkdir(parents=True)
    return {**injected(directory / "site", code + RECORD_P2P), "P2P_LOG": str(directory)}


def replay(directory):
    """Replay the point-to-point operations RECORD_P2P logged in `directory` under NCCL's rules, and return how many
    ran, or fail naming the operations at the head of each queue when none can run on (a deadlock). The rules: the
    operations between two ranks outside a batch share one queue, both ways, and those of a batch_isend_irecv the
    group's one queue (its whole communicator), each batch a unit; a queue runs its units in the order issued; a
    send completes only with its receive (a send larger than NCCL's buffer, a few MiB, waits so), both at the heads
    of their queues; and an operation issued after a wait starts once what was waited for completed (a CUDA stream
    waits for it). A send and its receive must be the same size."""
    ops, after, queues = {}, {}, {}
    for path in directory.glob("rank*.jsonl"):
        rank, waited = int(path.stem[4:]), set()
        for event in map(json.loads, path.read_text().splitlines()):
            if "wait" in event:
                waited |= {(rank, number) for number in event["wait"]}
                continue
            op, batch = (rank, event["op"]), event["batch"]
            ops[op], after[op] = event, frozenset(waited)
            key = (event["group"],) + (("batch",) if batch is not None else tuple(sorted((rank, event["peer"]))))
            units = queues.setdefault((rank, key), [])
            if batch is not None and units and ops[units[-1][-1]]["batch"] == batch:
                units[-1].append(op)
            else:
                units.append([op])
    done = set()

    def head(rank, key):  # the unit a queue runs now, if it may start
        unit = next((unit for unit in queues.get((rank, key), []) if not set(unit) <= done), None)
        return unit if unit and all(after[op] <= done for op in unit) else None

    def first(unit, kind, peer):
        return next((op for op in unit if op not in done and ops[op]["kind"] == kind and ops[op]["peer"] == peer),
                    None)

    progress = True
    while progress:
        progress = False
        for (rank, key) in queues:
            unit = head(rank, key)
            for send in [op for op in unit or [] if ops[op]["kind"] == "send"]:
                peer = ops[send]["peer"]
                theirs = head(peer, key)
                receive = theirs and first(theirs, "recv", rank)
                if send in done or send != first(unit, "send", peer) or receive is None:
                    continue
                assert ops[send]["bytes"] == ops[receive]["bytes"], (send, ops[send], receive, ops[receive])
                done |= {send, receive}
                progress = True
    stuck = {queue: [ops[op] for op in unit] for queue, units in queues.items() for unit in units
             if not set(unit) <= done and unit is next(u for u in units if not set(u) <= done)}
    assert not stuck, f"deadlocked on NCCL after {len(done)} of {len(ops)} operations; at the queues' heads: {stuck}"
    return len(ops)


def p2p_dtypes(directory):
    """The dtypes of the tensors every rank sent or received."""
    return {json.loads(line)["dtype"] for path in directory.glob("rank*.jsonl") for line in path.read_text().splitlines()
            if '"op"' in line}


def differences(reference, ckpt_dir, log_dir):
    """The largest weight and logged-loss differences from `reference`'s run (a conftest.Trained)."""
    weights = max_param_diff(load(reference.ckpt_dir)["model"], load(ckpt_dir)["model"])
    expected, got = scalars(reference.log_dir)["train/loss"], scalars(log_dir)["train/loss"]
    assert expected.keys() == got.keys()
    return weights, max(abs(expected[step] - got[step]) for step in expected)


@pytest.mark.parametrize("schedule, schedule_class", [
    ("gpipe", "ScheduleLoopedBFS"), ("1f1b", "Schedule1F1B"), ("zero-bubble", "ScheduleInterleavedZeroBubble")])
def test_each_schedule_trains_like_single_gpu(trained, schedule, schedule_class, tmp_path):
    """Two stages, 2 micro-batches a step (TINY's --grad-accum 2). The stages send activations and gradients
    unchanged; only the whole-model norm for clipping adds in another order, so the weights cannot tell the schedules
    apart: the log line names the one that ran. 1f1b, the default, is `trained`'s run. The others' sends and receives,
    training's and evaluation's, replay on NCCL's rules without a deadlock."""
    if schedule == "1f1b":
        run_, ckpt_dir, log_dir = trained["pipeline.py"].run, trained["pipeline.py"].ckpt_dir, trained["pipeline.py"].log_dir
    else:
        ckpt_dir, log_dir = tmp_path / "ckpt", tmp_path / "tb"
        run_ = run("pipeline.py", *TINY, "--max-steps", STEPS, "--schedule", schedule, "--ckpt-dir", ckpt_dir,
                   "--log-dir", log_dir, env=p2p_recorded(tmp_path / "p2p"))
        assert replay(tmp_path / "p2p") > 0
    assert run_.returncode == 0, run_.output
    assert not WARNING.search(run_.output), run_.output
    assert "stage 0 (rank 0): tok_emb, pos_emb, blocks.0\n" in run_.output, run_.output
    assert "stage 1 (rank 1): blocks.1, norm, head\n" in run_.output, run_.output
    assert f"global batch 8 = 4 x 2 micro-batches x 1 pipelines | {schedule_class}\n" in run_.output, run_.output
    weights, losses = differences(trained["single_gpu.py"], ckpt_dir, log_dir)
    print(f"{schedule}: largest weight difference {weights:.2g}, largest logged-loss difference {losses:.2g}")
    assert weights <= PARAM_ATOL and losses <= LOSS_ATOL


def test_two_stages_per_process_train_like_single_gpu(tmp_path):
    """Four blocks on 2 processes, stages 0 and 2 on rank 0, 1 and 3 on rank 1, under interleaved 1F1B; and on 2
    pipelines of 2 processes (--pipelines 2) under interleaved zero-bubble, whose backward splits in two: each ends on
    single_gpu.py's weights with the same flags. Each rank sends to and receives from the other, both ways: their
    sends and receives, in training and evaluation, replay on NCCL's rules without a deadlock (evaluation's each stage
    a micro-batch at a time, its receives one by one, deadlocked after 2)."""
    flags = [*TINY, "--n-layers", 4, "--max-steps", HALF]
    reference = run("single_gpu.py", *flags, "--ckpt-dir", tmp_path / "single", "--log-dir", tmp_path / "tb1")
    assert reference.returncode == 0, reference.output
    for name, more, nproc, schedule_class in [("one", [], 2, "ScheduleInterleaved1F1B"),
                                              ("two", ["--pipelines", 2, "--schedule", "zero-bubble"], 4,
                                               "ScheduleInterleavedZeroBubble")]:
        result = run("pipeline.py", *flags, "--stages-per-process", 2, *more, "--ckpt-dir", tmp_path / name,
                     "--log-dir", tmp_path / f"tb-{name}", nproc=nproc, timeout=300,
                     env=p2p_recorded(tmp_path / f"p2p-{name}"))
        assert result.returncode == 0, result.output
        print(f"2 stages per process, {name} pipeline(s): {replay(tmp_path / f'p2p-{name}')} sends and receives "
              f"replayed on NCCL's rules")
        assert not WARNING.search(result.output), result.output
        r = nproc // 2  # a stage's replicas: the log names the first's rank
        for line in ["stage 0 (rank 0): tok_emb, pos_emb, blocks.0\n", f"stage 1 (rank {r}): blocks.1\n",
                     "stage 2 (rank 0): blocks.2\n", f"stage 3 (rank {r}): blocks.3, norm, head\n",
                     f"= {4 // nproc * 2} x 2 micro-batches x {nproc // 2} pipelines | {schedule_class}\n"]:
            assert line in result.output, result.output
        difference = max_param_diff(load(tmp_path / name)["model"], load(tmp_path / "single")["model"])
        print(f"2 stages per process, {name} pipeline(s): largest difference from single_gpu.py's weights "
              f"{difference:.2g}")
        assert difference <= PARAM_ATOL


@pytest.fixture(scope="module")
def two_pipelines(tmp_path_factory):
    """pipeline.py --pipelines 2 on 4 processes for STEPS steps: 2 pipelines of 2 stages, each stage sharded over its
    2 replicas, each pipeline fed half of each batch; its checkpoints at HALF and STEPS kept, and its sends and
    receives in `p2p`."""
    out = tmp_path_factory.mktemp("two-pipelines")
    result = run("pipeline.py", *TINY, "--pipelines", 2, "--max-steps", STEPS, "--keep-checkpoints", 2,
                 "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb", nproc=4, timeout=300,
                 env=p2p_recorded(out / "p2p"))
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    return result, out / "ckpt", out / "tb"


def test_two_pipelines_of_two_stages_train_like_single_gpu(trained, two_pipelines):
    """Ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1 (a stage's replicas side by side, in one node where R divides
    a node's processes; the log names the first); pipeline j is ranks j and 2 + j. Micro-batches of 2: the weights, logged losses and validation
    are single_gpu.py's, within the tolerance of fp32 sums; the stages send fp32, and replay on NCCL's rules."""
    result, ckpt_dir, log_dir = two_pipelines
    assert replay(ckpt_dir.parent / "p2p") > 0
    assert {dtype for dtype in p2p_dtypes(ckpt_dir.parent / "p2p") if "float" in dtype} == {"float32"}
    assert "global batch 8 = 2 x 2 micro-batches x 2 pipelines | Schedule1F1B\n" in result.output, result.output
    assert "stage 1 (rank 2): blocks.1, norm, head\n" in result.output, result.output
    weights, losses = differences(trained["single_gpu.py"], ckpt_dir / f"step-{STEPS:06d}", log_dir)
    expected, got = scalars(trained["single_gpu.py"].log_dir)["val/loss"], scalars(log_dir)["val/loss"]
    assert expected.keys() == got.keys() == {0, HALF, STEPS}
    validation = max(abs(expected[step] - got[step]) for step in expected)
    print(f"2 pipelines of 2 stages: largest weight difference {weights:.2g}, logged loss {losses:.2g}, "
          f"validation loss {validation:.2g}")
    assert weights <= PARAM_ATOL and losses <= LOSS_ATOL and validation <= LOSS_ATOL


def test_two_pipelines_resume_bit_for_bit_and_hand_on_to_one_process(trained, two_pipelines, tmp_path):
    """Resumed at HALF on the same 2 x 2, the run ends on the uninterrupted one's checkpoint bit for bit; resumed by
    single_gpu.py (one process, whole tensors), on single_gpu.py's weights."""
    _, ckpt_dir, _ = two_pipelines
    for script, nproc in ("pipeline.py", 4), ("single_gpu.py", 1):
        resumed = tmp_path / script[:-3]
        shutil.copytree(ckpt_dir / f"step-{HALF:06d}", resumed / f"step-{HALF:06d}")
        result = run(script, *TINY, *["--pipelines", 2] * (nproc == 4), "--max-steps", STEPS, "--ckpt-dir", resumed,
                     "--log-dir", tmp_path / f"tb-{script}", nproc=nproc, timeout=300)
        assert result.returncode == 0, result.output
        assert f"resumed from {resumed / f'step-{HALF:06d}'} at step {HALF}" in result.output, result.output
    assert_identical(load(tmp_path / "pipeline"), load(ckpt_dir / f"step-{STEPS:06d}"))
    difference = max_param_diff(load(tmp_path / "single_gpu")["model"], load(trained["single_gpu.py"].ckpt_dir)["model"])
    print(f"2 x 2 pipelines, then single_gpu.py: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL


def test_bf16_on_two_pipelines_trains_close_to_fp32(two_pipelines, tmp_path):
    """--precision bf16 on 2 x 2: weights gathered and computed in bf16, kept, reduced and stepped in fp32 (the
    checkpoint's), the loss within bf16's rounding of fp32's, and not fp32's (tests/test_amp.py has fp16); the
    activations and their gradients cross between stages in bf16, half fp32's bytes (torch's own handshake between
    stages sends int32)."""
    result = run("pipeline.py", *TINY, "--pipelines", 2, "--precision", "bf16", "--max-steps", STEPS, "--ckpt-dir",
                 tmp_path / "ckpt", "--log-dir", tmp_path / "tb", nproc=4, timeout=300, env=p2p_recorded(tmp_path / "p2p"))
    close_to_fp32("pipeline.py bf16, 2 x 2", result, tmp_path / "tb", two_pipelines[2])
    assert {dtype for dtype in p2p_dtypes(tmp_path / "p2p") if "float" in dtype} == {"bfloat16"}
    assert all(value.dtype == torch.float32 for value in load(tmp_path / "ckpt")["model"].values())


@pytest.mark.parametrize("args, message, nproc", [
    (["--stages-per-process", 2], "4 stages for 2 blocks: fewer processes or stages each", 2),
    (["--schedule", "zero-bubble", "--compile"], "--compile and --schedule zero-bubble do not mix", 1),
    (["--n-layers", 4, "--stages-per-process", 2], "--stages-per-process 2 needs pipelines of several processes", 1),
    # Torch's own checks of the micro-batches against the schedule, in one line.
    (["--grad-accum", 1], "--schedule 1f1b, --grad-accum 1 micro-batches: Number of microbatches (1) must be", 2),
    (["--n-layers", 4, "--stages-per-process", 2, "--batch-size", 5, "--grad-accum", 5],
     "--schedule 1f1b, --grad-accum 5 micro-batches: Interleaved 1F1B requires the number of microbatches", 2),
])
def test_what_it_cannot_run_is_refused(args, message, nproc):
    fails_cleanly("pipeline.py", args, message, nproc=nproc)


def test_a_model_without_its_parts_is_refused():
    """A model that is not embed(), blocks, output() cannot be cut into stages: one line, before any process talks."""
    module = import_script("pipeline.py")
    with pytest.raises(SystemExit, match=r"^pipeline\.py: error: Linear lacks embed\(\), a ModuleDict named blocks"):
        module.split_model(torch.nn.Linear(2, 2), None, None, None)


def test_compiled_stages_train_like_eager(trained, tmp_path):
    """--compile compiles each stage's module: like eager, within PARAM_ATOL; compiled for evaluation (no autograd)
    and once more for training, never for a batch's shape."""
    recompiles = trains_compiled_like_eager("pipeline.py", trained["pipeline.py"], tmp_path)
    assert recompiles == [1, 1]


# Run in every rank: how many times attention ran with autograd recording, on real tensors (not split_model's or
# count_flops' meta ones), written at exit: with --activation-checkpointing, each block's forward runs again in
# backward.
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


def test_activation_checkpointing_recomputes_and_gives_the_same_weights(halfway, tmp_path):
    """Each rank's block runs twice per micro-batch (1 block per stage, 2 micro-batches a step), the second time in
    backward, instead of keeping its activations; the same operations on the same inputs give, on a CPU, the same
    weights bit for bit as `halfway`'s plain run."""
    (tmp_path / "site").mkdir()
    env = {**injected(tmp_path / "site", COUNT_ATTENTION), "MEASURE_DIR": str(tmp_path)}
    result = run("pipeline.py", *TINY, "--max-steps", HALF, "--lr-decay-steps", STEPS, "--activation-checkpointing",
                 "--ckpt-dir", tmp_path / "ckpt", "--log-dir", tmp_path / "tb", env=env)
    assert result.returncode == 0, result.output
    attention = [int((tmp_path / f"attention{rank}").read_text()) for rank in range(2)]
    assert attention == [HALF * 2 * 2] * 2, attention
    assert max_param_diff(load(tmp_path / "ckpt")["model"], load(halfway["pipeline.py"].ckpt_dir)["model"]) == 0


# Run in every process: each forward of a Linear whose outputs are the vocabulary's 256 bytes (the head), on real
# tensors, notes how many of the head's outputs are alive then (held by weak references: only what the process still
# holds keeps one alive), the most in evaluation (no autograd) and in training; each rank writes its two at exit.
COUNT_LOGITS = """
import atexit, json, os, weakref, torch
alive, most = [], {"evaluation": 0, "training": 0}

def note(module, inputs, output):
    if isinstance(module, torch.nn.Linear) and output.shape[-1] == 256 and output.device.type != "meta":
        alive[:] = [ref for ref in alive if ref() is not None] + [weakref.ref(output)]
        mode = "training" if torch.is_grad_enabled() else "evaluation"
        most[mode] = max(most[mode], len(alive))

def write():
    with open(os.path.join(os.environ["COUNT_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(most, f)

torch.nn.modules.module.register_module_forward_hook(note)
if "RANK" in os.environ:  # a worker, not torchrun's agent
    atexit.register(write)
"""


def test_evaluation_holds_one_micro_batchs_logits(tmp_path):
    """The last stage sums each micro-batch's loss and accuracy and lets its logits go before the next micro-batch's
    (TINY: 2 a batch): it holds one micro-batch's logits at a time, where a forward-only schedule.step() kept all the
    batch's (torch's schedules cache every micro-batch's output for a backward, and merge them). Training holds at
    least as many (torch 2.13's 1F1B: both micro-batches', seen)."""
    (tmp_path / "site").mkdir()
    env = {**injected(tmp_path / "site", COUNT_LOGITS), "COUNT_DIR": str(tmp_path)}
    result = run("pipeline.py", *TINY, "--max-steps", 4, "--log-dir", tmp_path / "tb", env=env)
    assert result.returncode == 0, result.output
    held = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert held[0] == {"evaluation": 0, "training": 0}, held  # the first stage has no head
    print(f"\nthe last stage's logits held at once: {held[1]}")
    assert held[1]["evaluation"] == 1 <= held[1]["training"], held


# Run in every process: the shapes of each batch its loaders collate, and how many samples it read from the training
# set (the Subset over range(0, ...) of the dataset itself, as tests/test_training.py counts them), written at exit.
RECORD_BATCHES = """
import atexit, json, os, torch
import torch.utils.data._utils.collate as collate
from torch.utils.data import Subset
shapes, read, collated, getitems = set(), [0], collate.default_collate, Subset.__getitems__

def recording_collate(batch):
    result = collated(batch)
    shapes.add(tuple(tuple(t.shape) for t in result))
    return result

def counting_getitems(self, indices):
    if isinstance(self.indices, range) and self.indices.start == 0 and not isinstance(self.dataset, Subset):
        read[0] += len(indices)
    return getitems(self, indices)

def write():
    with open(os.path.join(os.environ["RECORD_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"shapes": sorted(shapes), "read": read[0]}, f)

collate.default_collate, Subset.__getitems__ = recording_collate, counting_getitems
if "RANK" in os.environ:  # a worker, not torchrun's agent
    atexit.register(write)
"""


def test_each_stage_loads_only_what_it_uses(tmp_path):
    """3 stages (a block each; 4 micro-batches, as 1F1B needs): the first stage's batches hold the inputs alone, the
    last's the targets alone, and the middle stage's nothing, read from no sample; in training and in evaluation
    (batches of TINY's 8 sequences of 16 bytes). tests/test_training.py holds the 2-stage runs to single_gpu.py's
    numbers, and their resume to the uninterrupted run, fetching no sample twice. A pipeline of 3 sends one way
    between any two ranks: its sends and receives replay on NCCL's rules."""
    env = {**p2p_recorded(tmp_path / "p2p", RECORD_BATCHES), "RECORD_DIR": str(tmp_path)}
    result = run("pipeline.py", *TINY, "--n-layers", 3, "--grad-accum", 4, "--max-steps", 2, "--log-dir", tmp_path / "tb",
                 nproc=3,
                 env=env)
    assert result.returncode == 0, result.output
    assert "stage 1 (rank 1): blocks.1\n" in result.output, result.output
    held = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert [rank["shapes"] for rank in held] == [[[[8, 16], [8, 0]]], [[[8, 0], [8, 0]]], [[[8, 0], [8, 16]]]], held
    assert [rank["read"] for rank in held] == [16, 0, 16], held  # 2 steps of 8
    assert replay(tmp_path / "p2p") > 0
