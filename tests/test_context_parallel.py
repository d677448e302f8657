"""context_parallel.py: each sequence split across a row of C processes (each rank 2 of 2C chunks: r and 2C - 1 - r),
attention over the row's keys and values, FSDP across every process. On 4 processes (2 rows of 2) it ends on
single_gpu.py's weights on the built-in data; bf16 computes in 16 bits over fp32 state; compiled blocks train as
eager ones do; a model it cannot split is refused in one line; and a process holds less of a long sequence than
fsdp.py's. Its runs on 2 processes (C 2, on --data, where positions matter) are in the tests every script has
(tests/test_training.py: single_gpu.py's weights, exact validation, a resume bit for bit, checkpoints moved between
scripts and numbers of processes, on 4 processes too; tests/test_your_model.py: the Llama-shaped model)."""

import argparse

import pytest

from conftest import (HALF, PARAM_ATOL, ROOT, STEPS, TINY, TINY_BUILT_IN, WARNING, error_lines, import_script, load,
                      max_param_diff, run, scalars, trains_compiled_like_eager)
from test_fsdp import trained_in_bf16
from test_memory import peaks
from test_training import LOSS_ATOL

SCRIPT = "context_parallel.py"


@pytest.fixture(scope="module")
def built_in(tmp_path_factory):
    """single_gpu.py and context_parallel.py --context-parallel 2 on 4 processes (2 rows of 2, each rank a quarter of
    every sequence), on the built-in data for HALF steps; the latter with --activation-checkpointing (each block's
    attention runs again in backward, across the row) and a loader worker (which cuts each batch to the rank's
    positions)."""
    out = tmp_path_factory.mktemp("built_in")
    flags = [*TINY_BUILT_IN, "--max-steps", HALF, "--lr-decay-steps", STEPS]
    reference = run("single_gpu.py", *flags, "--ckpt-dir", out / "one" / "ckpt", "--log-dir", out / "one" / "tb")
    assert reference.returncode == 0, reference.output
    result = run(SCRIPT, *flags, "--context-parallel", 2, "--activation-checkpointing", "--workers", 1,
                 "--ckpt-dir", out / "ckpt", "--log-dir", out / "tb", nproc=4, timeout=300)
    assert result.returncode == 0, result.output
    assert not WARNING.search(result.output), result.output
    return result, out


def test_two_rows_of_two_train_like_one_process(built_in):
    """2 x 2 on the built-in data: the weights, the losses and the validation are single_gpu.py's, and the line on the
    batch names the split."""
    result, out = built_in
    assert "global batch 8 = 2 x 2 micro-batches x 2 rows of 2\n" in result.output, result.output
    difference = max_param_diff(load(out / "ckpt")["model"], load(out / "one" / "ckpt")["model"])
    print(f"2 x 2 processes: largest difference from single_gpu.py's weights {difference:.2g}")
    assert difference <= PARAM_ATOL
    expected, got = scalars(out / "one" / "tb"), scalars(out / "tb")
    assert expected["train/loss"].keys() == got["train/loss"].keys()
    assert all(abs(expected["train/loss"][s] - got["train/loss"][s]) <= LOSS_ATOL for s in got["train/loss"]), got
    for step in 0, HALF:  # as tests/test_training.py's test_validation_is_exact_across_ranks bounds it
        assert got["val/loss"][step] == pytest.approx(expected["val/loss"][step], rel=1e-6)
        assert abs(got["val/accuracy"][step] - expected["val/accuracy"][step]) <= 1 / 128


def test_c_defaults_to_a_nodes_processes(trained):
    """Without --context-parallel, C is torchrun's LOCAL_WORLD_SIZE: here both processes, one row."""
    assert "global batch 8 = 4 x 2 micro-batches x 1 rows of 2\n" in trained[SCRIPT].run.output


@pytest.mark.parametrize("flags, world_size, message", [
    ({"context_parallel": 4}, 6, "--context-parallel 4 must divide 6 processes, and 2 x 4 --seq-len"),
    ({"context_parallel": 2, "seq_len": 18}, 2, "--context-parallel 2 must divide 2 processes, and 2 x 2 --seq-len"),
    ({"context_parallel": None, "seq_len": 12}, 8, "--context-parallel 8 must divide 8 processes, and 2 x 8 --seq-len")])
def test_what_cannot_be_split_is_refused(flags, world_size, message):
    """C must divide the processes into rows, and each sequence into 2C chunks (C's default: a node's processes, here
    all, without torchrun's LOCAL_WORLD_SIZE). In this process: the checks come before any group is made."""
    args = argparse.Namespace(**{"context_parallel": None, "seq_len": 48, "timeout": 60, **flags})
    with pytest.raises(SystemExit) as stop:
        import_script(SCRIPT).context_parallel_group(args, world_size)
    assert stop.value.code == f"{SCRIPT}: error: {message}"


def test_bf16_trains_close_to_fp32(halfway, tmp_path):
    """bf16 computation over fp32 state, through FSDP's policy as in fsdp.py: keys and values gathered in bf16, the
    loss within bf16's rounding of fp32's, the gradients, weights and AdamW's state fp32."""
    trained_in_bf16(SCRIPT, halfway, tmp_path)


def test_compiled_blocks_train_like_eager(trained, tmp_path):
    """--compile compiles each block with its attention across the row (the all-gather in the graph, the causal masks
    built once, outside it): like eager, compiled at the first evaluation, then once more for training."""
    recompiles = trains_compiled_like_eager(SCRIPT, trained[SCRIPT], tmp_path)
    assert recompiles == [1, 1]


# The GPT's model section changed as a user's model might be: a forward() that takes no positions (each rank holds
# positions that are not 0, 1, ...), attention written out by hand (nothing the script can reach), and SDPA given a
# mask of its own (the script splits causal attention alone).
MODELS = {
    "no positions": ([("    def forward(self, tokens, positions=None):", "    def forward(self, tokens):"),
                      ("x = self.embed(tokens, positions)", "x = self.embed(tokens)")],
                     "needs the model's forward(tokens, positions=...)"),
    "attention by hand": ([("F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                            ("torch.softmax((q @ k.transpose(-2, -1) / self.head_dim**0.5).masked_fill(torch.ones("
                            "seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1), float('-inf')), -1) @ v"))],
                          "splits F.scaled_dot_product_attention: the blocks call none"),
    "a mask of its own": ([("F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                            ("F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(seq_len, seq_len, "
                            "dtype=torch.bool, device=q.device).tril())"))],
                          "splits causal attention alone: is_causal=True, no attn_mask")}


@pytest.mark.parametrize("model", MODELS)
def test_a_model_it_cannot_split_is_refused_in_one_line(model, tmp_path):
    """One line on every rank, from a forward pass before anything is allocated: no step, no traceback."""
    changes, message = MODELS[model]
    text = (ROOT / SCRIPT).read_text()
    for old, new in changes:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (tmp_path / SCRIPT).write_text(text)
    result = run(tmp_path / SCRIPT, *TINY, "--log-dir", tmp_path / "tb")
    assert result.returncode != 0, result.output
    errors = error_lines(SCRIPT, result.output)
    assert len(errors) == 2 and all(message in line for line in errors), result.output
    assert f'{SCRIPT}", line' not in result.output and "step " not in result.output, result.output


# A sequence long enough that its activations outweigh the weights: 2,048 tokens through 2 blocks of width 512, one
# head (on a CPU the causal masks are materialized, (S/2C) x S per chunk and head: a head keeps them small).
LONG = ["--d-model", 512, "--n-layers", 2, "--n-heads", 1, "--seq-len", 2048, "--batch-size", 2, "--max-steps", 1,
        "--eval-batches", 1]


def test_a_process_holds_less_of_a_long_sequence_than_fsdps(tmp_path):
    """fsdp.py on 2 processes holds the activations of a whole sequence each (a micro-batch of one per process, the
    fewest there are); context_parallel.py on 2 (C 2), with micro-batches of one sequence split between them, half
    of each: the same global batch, the same weights' shares. What each adds to its peak resident set from its start
    (as tests/test_memory.py measures it): seen 0.20 GiB against 0.25 (80%). On a CPU the causal masks and the
    attention weights are materialized, (S/2C) x S a chunk, which a GPU's flash kernel never holds: there, all but
    the gathered keys and values is 1/C."""
    fsdp, _ = peaks("fsdp.py", 2, LONG, tmp_path)
    context, output = peaks(SCRIPT, 2, [*LONG, "--grad-accum", 2], tmp_path)
    assert "global batch 2 = 1 x 2 micro-batches x 1 rows of 2" in output, output
    print(f"\na sequence of 2,048 tokens: fsdp.py adds {fsdp['end'] / 2**30:.2f} GiB a process, context_parallel.py "
          f"{context['end'] / 2**30:.2f} GiB ({context['end'] / fsdp['end']:.0%})")
    assert context["end"] <= 0.9 * fsdp["end"]
