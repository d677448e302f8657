"""The speed lines every script shares: tokens/s, FLOP/s and MFU of all processes, TF32, --compile and --profile."""

import argparse
import json
import logging
import types

import pytest
import torch

from conftest import DISTRIBUTED, SCRIPTS, TINY, import_script, run, scalars, trains_compiled_like_eager

# TINY's model, whose FLOPs the scripts count with torch's FlopCounterMode.
TINY_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16, "vocab_size": 256}


def count_flops(shape):
    """single_gpu.py's count of the training FLOPs of one sequence of a GPT of `shape`."""
    module = import_script("single_gpu.py")
    args = argparse.Namespace(**{name: value for name, value in shape.items() if name != "vocab_size"})
    tokens = torch.zeros(args.seq_len, dtype=torch.long)
    return module.count_flops(args, {"vocab_size": shape["vocab_size"]}, (tokens, tokens))


@pytest.mark.parametrize("shape", [{"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64, "vocab_size": 64},
                                   {"d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024,
                                    "vocab_size": 50257}], ids=["default", "gpt2-small"])
def test_torch_counts_a_forward_and_a_backward(shape):
    """What count_flops measures, by hand: 6 FLOPs per matmul weight and token (2 forward, 4 backward) for each
    block's qkv (3d^2), attention output (d^2) and MLP (8d^2) and the head (vocabulary x d), and attention's two
    products, 12 x seq_len x d per layer and token (counted whole, causal or not). Embeddings are lookups; biases
    and LayerNorms, no matmuls. At the default size and GPT-2 small's."""
    d, layers, seq_len = shape["d_model"], shape["n_layers"], shape["seq_len"]
    by_hand = (6 * (layers * 12 * d * d + shape["vocab_size"] * d) + 12 * layers * seq_len * d) * seq_len
    by_torch = count_flops(shape)
    print(f"\nFLOPs per sequence of {seq_len} tokens: {by_hand:,} by hand, {by_torch:,} by FlopCounterMode")
    assert by_torch == by_hand


@pytest.mark.parametrize("script", SCRIPTS)
def test_flops_follow_from_tokens_per_second(trained, script):
    """FLOP/s = tokens/s / tokens per sample x torch's FLOPs per sample, both of all processes together. A CPU has no
    peak: no MFU."""
    result = trained[script]
    assert result.run.returncode == 0, result.run.output
    tb = scalars(result.log_dir)
    flops_per_token = count_flops(TINY_MODEL) / TINY_MODEL["seq_len"]
    tokens_per_sec, tflops = tb["train/tokens_per_sec"], tb["train/tflops"]
    assert tflops.keys() == tokens_per_sec.keys() and len(tflops) == 8
    for step, value in tflops.items():
        assert value * 1e12 == pytest.approx(tokens_per_sec[step] * flops_per_token, rel=1e-5)
    assert "MFU" not in result.run.output


# Dense 16-bit peaks from NVIDIA's datasheets: a name matches the most specific entry of the table, word for word (a
# GH200 is no H200, a GB200 no B200: the table leaves them out). TF32's is half.
PEAKS = [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
         ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
         ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA B200", 2250e12), ("NVIDIA GH200 480GB", None),
         ("NVIDIA GB200", None), ("NVIDIA H800", None), ("NVIDIA GeForce RTX 4090", None), ("NVIDIA L4", None),
         ("Tesla V100-SXM2-32GB", None)]


@pytest.mark.parametrize("name, peak", PEAKS)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_mfu_only_against_a_known_gpus_peak(monkeypatch, caplog, name, peak, precision):
    """The step line's speed is of all processes together, over the training steps alone: MFU is FLOP/s over the
    GPUs' peak for the run's precision (fp32's matmuls run in TF32), and is there only for a GPU the table names,
    never a made-up peak. Meter alone, on a GPU's name (no GPU needed): restarted after 50 s (an evaluation's),
    then 2 s of training to the line."""
    script = import_script("single_gpu.py")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    clock = iter([100.0, 150.0, 152.0, 152.0, 200.0]).__next__
    monkeypatch.setattr(script, "time", types.SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(script, "count_flops", lambda args, data_info, sample: 2e12)  # 2 TFLOP a sample
    args, sample = argparse.Namespace(batch_size=8), (torch.zeros(16), torch.zeros(16))  # 16 tokens a sample
    meter = script.Meter(args, {}, 0, sample, 2, torch.device("cuda", 0), precision)  # 2 processes
    meter.restart(0)
    with caplog.at_level(logging.INFO, logger=script.log.name):
        scalars = meter.log(2, 1.0, 1e-3)  # 2 steps of 8 samples in 2 s: 8 samples/s, 16 TFLOP/s
    assert scalars == {"train/loss": 1.0, "train/lr": 1e-3, "train/tokens_per_sec": 128.0, "train/tflops": 16.0}
    line = caplog.messages[-1]
    assert line.startswith("step     2 | loss 1.0000 | lr 1.00e-03 | 128 tokens/s | 16 TFLOP/s"), line
    if peak is None:
        assert meter.peak is None and "MFU" not in line, line
    else:
        expected = 2 * (peak / 2 if precision == "fp32" else peak)  # two GPUs'
        assert meter.peak == expected
        assert line.endswith(f" | {16e12 / expected:.1%} MFU"), line
    assert script.Meter(args, {}, 0, sample, 2, torch.device("cpu"), precision).peak is None


@pytest.mark.parametrize("script", ["single_gpu.py", "dataparallel.py"])
def test_fp32_matmuls_may_use_tf32_on_cuda(script):
    """What a CPU can check: setup() lets fp32 matmuls run in TF32 ("high"; it changes nothing on a CPU). The
    distributed scripts' setup() holds the same line, and joins a process group besides."""
    module, before = import_script(script), torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.random.fork_rng():  # setup() seeds torch's generator too
            module.setup(argparse.Namespace(device="cpu", seed=0))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_compiled_ddp_trains_like_eager(trained, tmp_path):
    """Two processes, the model compiled before DDP wraps it: like eager. Compiled at the first evaluation (no
    autograd), then once more for training, and never again: TINY's 9 validation sequences, which no batch of 8
    divides, are cut to the whole batch, so no pass has a shape of its own (a short last batch recompiled the
    model with a dynamic batch size, and training then ran that graph)."""
    recompiles = trains_compiled_like_eager("ddp_torchrun.py", trained["ddp_torchrun.py"], tmp_path)
    assert recompiles == [1, 1]


@pytest.mark.parametrize("script", ["single_gpu.py", "fsdp.py"])
def test_profile_writes_a_trace_per_process(script, tmp_path):
    """--profile traces steps 7 to 9 (the profiler's 6 to 8), once (torch's schedule repeats without repeat=1: a run
    of 20 steps would end on steps 16 to 18), into a Chrome trace per process, with the training's
    operators: the matmuls, AdamW's step, and in fsdp.py FSDP's gathers and reduce-scatters of each block. Every
    script holds the same start_profiler() and profiler.step(): one process, and the script whose trace shows most."""
    result = run(script, *TINY, "--max-steps", 20, "--profile", "--log-dir", tmp_path)
    assert result.returncode == 0, result.output
    world_size = 2 if script in DISTRIBUTED else 1
    assert sorted(path.name for path in tmp_path.glob("trace_rank*.json")) == [f"trace_rank{rank}.json"
                                                                              for rank in range(world_size)]
    for rank in range(world_size):
        names = {event.get("name", "") for event in json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
                 ["traceEvents"]}
        steps = {name for name in names if name.startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#6", "ProfilerStep#7", "ProfilerStep#8"}, sorted(names)
        assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names, sorted(names)
        if script == "fsdp.py":
            assert {"FSDP::all_gather (blocks.0)", "c10d::_reduce_scatter_base_"} <= names, sorted(names)
