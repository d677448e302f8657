"""tensor_parallel.py: every layer split across T processes, and with T < N the blocks sharded by FSDP across the rows
of T. On 4 processes (2 rows of 2) each holds a quarter of the training state and ends on single_gpu.py's weights;
its checkpoint resumes on 2; with two heads a process, qkv's rows must be stored head by head (read q|k|v, a split
cuts across heads); bf16 computes in 16 bits over fp32 state; compiled and recomputed blocks train as the plain ones
do; and what cannot be split is refused in one line. Its runs on 2 processes (T 2) are in the tests every
script has (tests/test_training.py: single_gpu.py's weights, exact validation, a resume bit for bit, checkpoints
moved between scripts)."""

import argparse
import fnmatch
import json
import shutil

import pytest
import torch

from conftest import (HALF, PARAM_ATOL, STEPS, TINY, WARNING, error_lines, fails_cleanly, import_script,
                      injected, load, max_param_diff, run, scalars, trains_compiled_like_eager)
from test_fsdp import COUNT_ATTENTION, measured, trained_in_bf16
from test_training import LOSS_ATOL
from test_your_model import LLAMA, LLAMA_FLAGS, TENSOR_PARALLEL_PROBES, with_model_section

SCRIPT = "tensor_parallel.py"


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """tensor_parallel.py --tensor-parallel 2 on 4 processes for HALF steps, with --activation-checkpointing: 2 rows
    of 2 processes, each rank noting what it holds and how many times attention ran in training."""
    out = tmp_path_factory.mktemp("two_by_two")
    env, held = measured(out, 4, COUNT_ATTENTION)
    result = run(SCRIPT, *TINY, "--tensor-parallel", 2, "--activation-checkpointing", "--timeout", 240,
                 "--max-steps", HALF, "--lr-decay-steps", STEPS, "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb",
                 nproc=4, env=env, timeout=300)
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    attention = [int((out / f"attention{rank}").read_text()) for rank in range(4)]
    return result, out, held(), attention


def test_two_rows_of_two_train_like_one_process(halfway, two_by_two):
    """2 x 2: the weights, the losses and the validation are single_gpu.py's; the line on the batch names the split;
    and both groups of the mesh wait --timeout (240 s) for a stuck rank, not torch's default for a new group."""
    result, out, held, _ = two_by_two
    assert "global batch 8 = 2 x 2 micro-batches x 2 rows of 2\n" in result.output, result.output
    assert [rank["timeouts"] for rank in held] == [[240, 240]] * 4
    reference = halfway["single_gpu.py"]
    difference = max_param_diff(load(out / "ckpt")["model"], load(reference.ckpt_dir)["model"])
    print(f"2 x 2 processes: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL
    expected, got = scalars(reference.log_dir), scalars(out / "tb")
    assert expected["train/loss"].keys() == got["train/loss"].keys()
    assert all(abs(expected["train/loss"][s] - got["train/loss"][s]) <= LOSS_ATOL for s in got["train/loss"]), got
    for step in 0, HALF:  # as tests/test_training.py's test_validation_is_exact_across_ranks bounds it
        assert got["val/loss"][step] == pytest.approx(expected["val/loss"][step], rel=1e-6)
        assert abs(got["val/accuracy"][step] - expected["val/accuracy"][step]) <= 1 / 128


def replicated_bytes():
    """The bytes of TINY's GPT's parameters that tensor parallelism leaves whole: the norms' and a "row" layer's bias
    (by the model's tensor_plan)."""
    module = import_script("single_gpu.py")
    with torch.device("meta"):
        model, _ = module.build_model(argparse.Namespace(d_model=32, n_layers=2, n_heads=2, seq_len=16),
                                      {"vocab_size": 256})
    styles = [(pattern, style) for pattern, style in model.tensor_plan.items()]
    total = 0
    for name, param in model.named_parameters():
        layer, _, kind = name.rpartition(".")
        style = next(style for pattern, style in styles if fnmatch.fnmatchcase(layer, pattern))
        total += param.nbytes * (style == "norm" or (style == "row" and kind == "bias"))
    return total


def test_each_of_4_processes_holds_a_quarter_of_the_training_state(two_by_two):
    """Each rank holds a quarter of every matrix and embedding (a half by rows or columns in its row of 2, then a
    half of that by FSDP), and half of each vector that every rank of a row computes with whole: the norms and the
    biases that a "row" layer adds after its sum. Gradients as large, AdamW's two moments too, plus a step count
    (an fp32 scalar) per parameter. No rank holds what another holds of a split tensor."""
    _, _, held, _ = two_by_two
    whole, whole_vectors = held[0]["whole"], replicated_bytes()
    print(f"\nweights {whole} bytes, of which {whole_vectors} in vectors whole on each rank of a row; rank 0 holds "
          f"{held[0]['weights']}")
    for rank in held:
        assert rank["weights"] == (whole - whole_vectors) / 4 + whole_vectors / 2, rank
        assert rank["gradients"] == rank["weights"], rank
        assert rank["optimizer"] == 2 * rank["weights"] + 4 * rank["params"], rank
    assert len({json.dumps(rank["sums"]) for rank in held}) == 4  # four different parts


def test_activation_checkpointing_recomputes_each_block(two_by_two):
    """Each block's forward runs twice per micro-batch (TINY's 2 blocks, 2 micro-batches a step), the second time in
    backward, on every rank: the split blocks are recomputed as fsdp.py's whole ones are."""
    assert two_by_two[3] == [HALF * 2 * 2 * 2] * 4, two_by_two[3]


def test_checkpoint_of_two_rows_resumes_on_two_processes(trained, two_by_two, tmp_path):
    """Saved by 2 x 2 processes at HALF (each tensor cut twice), resumed by 2 (cut once): the run ends where
    single_gpu.py's does."""
    ckpt_dir = shutil.copytree(two_by_two[1] / "ckpt", tmp_path / "ckpt")
    result = run(SCRIPT, *TINY, "--max-steps", STEPS, "--ckpt-dir", ckpt_dir, "--log-dir", tmp_path / "tb")
    assert result.returncode == 0, result.output
    assert f"resumed from {ckpt_dir / f'step-{HALF:06d}'} at step {HALF}" in result.output, result.output
    difference = max_param_diff(load(ckpt_dir)["model"], load(trained["single_gpu.py"].ckpt_dir)["model"])
    print(f"2 x 2 then 2 processes: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL


def test_bf16_trains_close_to_fp32(halfway, tmp_path):
    """bf16 computation over fp32 state, through FSDP's policy as in fsdp.py (with T = N, FSDP's dimension has one
    process: it only casts): the loss follows fp32's within bf16's rounding, and the gradients that reach clipping,
    the weights and AdamW's state are fp32."""
    trained_in_bf16(SCRIPT, halfway, tmp_path)


def test_compiled_blocks_train_like_eager(trained, tmp_path):
    """--compile compiles each split block (DTensor's collectives inside the graph, on gloo too): like eager, compiled
    at the first evaluation (no autograd), then once more for training."""
    recompiles = trains_compiled_like_eager(SCRIPT, trained[SCRIPT], tmp_path)
    assert recompiles == [1, 1]


@pytest.mark.parametrize("flags, world_size, message", [
    ({"tensor_parallel": 3}, 6, None),
    ({"tensor_parallel": 4}, 6, "--tensor-parallel 4 does not divide 6 processes evenly"),
    ({"tensor_parallel": 4, "n_heads": 2}, 8, "--tensor-parallel 4 does not divide --n-heads 2"),
    ({"tensor_parallel": 2, "seq_len": 9}, 2, "--tensor-parallel 2 does not divide --seq-len 9"),
    ({"tensor_parallel": None, "n_heads": 6}, 4, "--tensor-parallel 4 does not divide --n-heads 6")])
def test_what_cannot_be_split_is_refused(flags, world_size, message):
    """T must divide the processes into rows, and each process must hold whole heads and whole positions; T's
    default is the processes of a node (here all, without torchrun's LOCAL_WORLD_SIZE)."""
    args = argparse.Namespace(**{"tensor_parallel": None, "n_heads": 12, "seq_len": 48, **flags})
    size = import_script(SCRIPT).tensor_parallel_size
    if message is None:
        assert size(args, world_size) == 3
        return
    with pytest.raises(SystemExit) as stop:
        size(args, world_size)
    assert stop.value.code == f"{SCRIPT}: error: {message}"


def test_a_refusal_stops_every_rank():
    fails_cleanly(SCRIPT, ["--tensor-parallel", 3], "--tensor-parallel 3 does not divide 2 processes evenly")


def test_two_heads_a_process_need_qkv_stored_head_by_head(tmp_path):
    """4 heads on 2 processes, 2 each (TINY's 2 heads give each process one, where both readings agree): as the
    model section stores qkv, head by head, tensor_parallel.py ends on single_gpu.py's weights. (Read q|k|v, a split
    by rows gives a process q of two heads where it wants q, k and v of one: 0.06 from one process's weights, with
    no error, on 2026-11-28; tests/check_deletions.py's row for that line shows this test failing.)"""
    flags = [*TINY, "--n-heads", 4, "--max-steps", 4, "--eval-every", 4, "--ckpt-every", 4]
    weights = {}
    for script, nproc in [("single_gpu.py", 1), (SCRIPT, 2)]:
        out = tmp_path / script[:-3]
        result = run(script, *flags, "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb", nproc=nproc)
        assert result.returncode == 0 and not WARNING.search(result.output), result.output
        weights[script] = load(out / "ckpt")["model"]
    same = max_param_diff(weights[SCRIPT], weights["single_gpu.py"])
    print(f"\n2 heads a process, from one process's weights: {same:.2g}")
    assert same <= PARAM_ATOL


def test_t_defaults_to_the_processes_of_one_node(monkeypatch):
    """On 2 nodes of 2 processes (torchrun's LOCAL_WORLD_SIZE 2), T is 2: each layer split within a node, FSDP
    across the nodes, as the README advises, without a flag."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = argparse.Namespace(tensor_parallel=None, n_heads=12, seq_len=48)
    assert import_script(SCRIPT).tensor_parallel_size(args, 4) == 2


def probes(directory):
    """What TENSOR_PARALLEL_PROBES wrote in `directory`, for each of 2 ranks."""
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(2)]


def second_step(probed):
    """Each collective's count in a rank's second training step (no evaluation in it), from its running counts."""
    first, second = probed["steps"][:2]
    return {name: count - first.get(name, 0) for name, count in second.items() if count > first.get(name, 0)}


def test_one_gather_a_norm_the_llama_runs_no_more_collectives_than_the_gpt(llamas, tmp_path):
    """A "norm" gathers its output's positions once for the column layers it feeds: the Llama's q, k and v (gate and
    up), separate Linears called by keyword, split without a gather each. In its second step, against the GPT's
    (whose qkv and MLP's first are one Linear each): no more all-gathers, reduce-scatters or all-reduces, where
    columns that gathered their own inputs ran 5 all-gathers a block for the GPT's 2."""
    (tmp_path / "site").mkdir()
    env = {**injected(tmp_path / "site", TENSOR_PARALLEL_PROBES), "PROBES": str(tmp_path)}
    result = run(SCRIPT, *TINY, "--max-steps", 2, "--log-dir", tmp_path / "tb", env=env)
    assert result.returncode == 0, result.output
    gpt, llama = second_step(probes(tmp_path)[0]), second_step(probes(llamas[SCRIPT][3] / "probes")[0])
    print(f"\none step, 2 blocks, collectives: the GPT {gpt}, the Llama {llama}")
    collectives = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
    assert all(gpt[name] > 0 for name in collectives), gpt
    # All-reduces too: a column that redistributed its gathered input again would all-reduce its input's gradient.
    assert all(llama.get(name, 0) <= gpt[name] for name in collectives), (llama, gpt)


def test_evaluation_holds_a_share_of_the_logits(llamas):
    """Evaluation takes the loss from each rank's share of the vocabulary (as loss_parallel() does in training) and
    the accuracy from each share's best logit: what it makes whole is, for each prediction of a forward pass (4
    sequences of 16), the T shares' best logits and their indices (4 x 16 x 2), not its logits (4 x 16 x 256); and
    validation is single_gpu.py's (test_a_llama_shaped_model_trains_in_every_script)."""
    held = [rank["evaluation's whole tensor"] for rank in probes(llamas[SCRIPT][3] / "probes")]
    print(f"\nthe largest tensor evaluation made whole, on each rank: {held}")
    assert held == [4 * 16 * 2] * 2, held


@pytest.mark.parametrize("change, message", [
    (("n-kv-heads", 1), "--tensor-parallel 2 does not split this model: shape '[1, 16, -1, 8]' is invalid"),
    (('"head": "vocabulary"', '"head": "row"'),
     "head.weight is tied to embed_tokens.weight, but the tensor_plan splits them differently")])
def test_what_a_model_cannot_split_is_refused(change, message, tmp_path):
    """A key and value head for 2 processes (the model's own error, in a forward pass on the meta device, before
    anything is allocated), and a tied head that its plan splits otherwise than its embedding: one line each, on
    every rank, before any step."""
    section, flags = LLAMA, list(LLAMA_FLAGS)
    if change[0] == "n-kv-heads":
        flags += ["--n-kv-heads", change[1]]
    else:
        section = LLAMA.replace(*change)
    result = run(with_model_section(SCRIPT, tmp_path, section), *flags, "--log-dir", tmp_path / "tb")
    assert result.returncode != 0, result.output
    errors = error_lines(SCRIPT, result.output)
    assert len(errors) == 2 and all(message in line for line in errors), result.output
    assert f'{SCRIPT}", line' not in result.output and "step " not in result.output, result.output
