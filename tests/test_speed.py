"""The speed lines every script shares: --compile, --profile, and the FLOP/s and MFU they report."""

import argparse
import json
import logging
import re
import sys

import pytest
import torch

from conftest import (DISTRIBUTED, ROOT, SCRIPTS, TINY, import_script, run, run_command, scalars, trains_compiled_like_eager)


def flops_per_token(d_model=32, n_layers=2, seq_len=16, vocab_size=256):
    """TINY's model counted by hand: the matmul weights of each block, qkv (3d^2), attention output (d^2) and MLP
    (8d^2), then the head (vocabulary x d). The embeddings are lookups; biases and LayerNorms no matmuls."""
    d = d_model
    matmul_weights = n_layers * 12 * d * d + vocab_size * d
    return 6 * matmul_weights + 12 * n_layers * d_model * seq_len


@pytest.mark.parametrize("shape", [{"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64, "vocab_size": 64},  # the default
                                   {"d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024, "vocab_size": 50257}])  # GPT-2
def test_the_gpts_own_flop_count_is_torchs(shape):
    """The GPT's count (6 FLOPs per matmul weight, plus attention's) against torch's FlopCounterMode over a forward
    and backward, which a model section that counts nothing gets: equal, at the default size and GPT-2 small's."""
    module = import_script("single_gpu.py")
    args = argparse.Namespace(**{name: value for name, value in shape.items() if name != "vocab_size"})
    data_info = {"vocab_size": shape["vocab_size"]}
    with torch.device("meta"):
        model, _ = module.build_model(args, data_info)
    by_hand = module.throughput_unit(model, args)[2] * args.seq_len
    tokens = torch.zeros(args.seq_len, dtype=torch.long)
    by_torch = module.measure_flops(args, data_info, (tokens, tokens))
    print(f"\nFLOPs per sequence of {args.seq_len} tokens: {by_hand:,} by hand, {by_torch:,} by FlopCounterMode "
          f"({by_hand / by_torch - 1:+.3%})")
    assert by_torch == by_hand


@pytest.mark.parametrize("script", SCRIPTS)
def test_flops_per_process_follow_from_tokens_per_second(trained, script):
    """tokens/s counts the global batch; FLOP/s is what each process does. No peak is known for a CPU:
    no MFU."""
    result = trained[script]
    tb = scalars(result.log_dir)
    world_size = 2 if script in DISTRIBUTED else 1
    tokens_per_sec, tflops = tb["train/tokens_per_sec"], tb["train/tflops_per_process"]
    assert tflops.keys() == tokens_per_sec.keys()
    for step, value in tflops.items():
        assert value * 1e12 == pytest.approx(tokens_per_sec[step] * flops_per_token() / world_size, rel=1e-5)
    assert "train/mfu" not in tb
    assert "MFU" not in result.run.output
    assert re.search(r"\d tokens/s, [\d.e+-]+ TFLOP/s \| ", result.run.output), result.run.output


def test_mfu_is_against_the_gpus_peak(tmp_path):
    """Where the peak is known, the step line and TensorBoard show MFU = achieved / peak. A CPU has no
    peak, so the test gives single_gpu.py one: 1 GFLOP/s."""
    driver = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); from conftest import import_script; "
              f"script = import_script('single_gpu.py'); script.peak_flops = lambda device, precision: 1e9; "
              f"sys.argv = ['single_gpu.py', *sys.argv[1:]]; script.main(script.parse_args())")
    result = run_command([sys.executable, "-c", driver, *TINY, "--max-steps", "4", "--log-dir", str(tmp_path)])
    assert result.returncode == 0, result.output
    tb = scalars(tmp_path)
    assert sorted(tb["train/mfu"]) == [2, 4]
    for step, mfu in tb["train/mfu"].items():
        assert mfu == pytest.approx(tb["train/tflops_per_process"][step] * 1e12 / 1e9, rel=1e-5)
    printed = [float(m) for m in re.findall(r"TFLOP/s \((\d+)% MFU\)", result.output)]
    assert printed == [round(100 * tb["train/mfu"][step]) for step in (2, 4)], result.output


@pytest.mark.parametrize("name, bf16, tf32", [
    ("NVIDIA H100 80GB HBM3", 989e12, 494.5e12), ("NVIDIA H100 PCIe", 756e12, 378e12), ("NVIDIA H200", 989e12, 494.5e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 156e12), ("NVIDIA A100 80GB PCIe", 312e12, 156e12),
    ("NVIDIA H100 NVL", 835e12, 417.5e12), ("NVIDIA GH200 480GB", 989e12, 494.5e12), ("NVIDIA B200", 2.25e15, 1.1e15),
    ("NVIDIA GB200", None, None), ("NVIDIA H800", None, None), ("NVIDIA H200 NVL", None, None),
    ("NVIDIA GeForce RTX 4090", None, None)])
def test_peak_flops_only_for_gpus_in_the_table(monkeypatch, caplog, name, bf16, tf32):
    """Never a made-up peak: a GPU the table does not name exactly gets FLOP/s alone. fp32 runs compute in TF32,
    measured against its own peak, and the log names the peak used."""
    script = import_script("single_gpu.py")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    with caplog.at_level(logging.INFO, logger=script.log.name):
        figures = [script.peak_flops(torch.device("cuda", 0), precision) for precision in ["bf16", "fp16", "tf32"]]
    assert figures == [bf16, bf16, tf32]
    if tf32:
        assert f"MFU: model FLOP/s over the {name}'s dense tf32 peak, {tf32 / 1e12:g} TFLOP/s" in caplog.text
    assert script.peak_flops(torch.device("cpu"), "tf32") is None


@pytest.mark.parametrize("script", ["single_gpu.py", "dataparallel.py"])
def test_fp32_matmuls_may_use_tf32_on_cuda(monkeypatch, script):
    """What a CPU can check: setup() lets cuBLAS use TF32 for fp32 matmuls (it changes nothing on a CPU)."""
    module = import_script(script)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    module.setup(argparse.Namespace(device="cpu", seed=0))
    assert torch.backends.cuda.matmul.allow_tf32


def test_compiled_ddp_trains_like_eager(trained, tmp_path):
    """Two processes, the model compiled before DDP wraps it: like eager (seen: 6.1e-7). Compiled
    once for training and, at the first evaluation, for evaluation (no autograd), plus once for rank 0's short last
    validation batch (3 of the 5 sequences, in batches of 2): at most 2 recompiles per rank. An evaluation that
    recompiled every pass would add more at steps 8 and 16."""
    recompiles = trains_compiled_like_eager("ddp_torchrun.py", trained["ddp_torchrun.py"], tmp_path)
    assert all(1 <= count <= 2 for count in recompiles), recompiles


@pytest.mark.parametrize("script", SCRIPTS)
def test_profile_writes_a_trace_per_process(script, tmp_path):
    result = run(script, *TINY, "--max-steps", 10, "--profile", "--log-dir", tmp_path)
    assert result.returncode == 0, result.output
    assert f"tracing steps 7 to 9 into {tmp_path / 'trace_rank0.json'}" in result.output, result.output
    world_size = 2 if script in DISTRIBUTED else 1
    assert sorted(p.name for p in tmp_path.glob("trace_rank*.json")) == [f"trace_rank{r}.json" for r in range(world_size)]
    for rank in range(world_size):
        events = json.loads((tmp_path / f"trace_rank{rank}.json").read_text())["traceEvents"]
        names = {event.get("name", "") for event in events}
        assert {"ProfilerStep#6", "ProfilerStep#7", "ProfilerStep#8"} <= names, sorted(names)
        assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names, sorted(names)
        # The gradients' all-reduce, for DDP: gloo's here, NCCL's ("nccl:all_reduce") on GPUs.
        assert any(name.endswith(":all_reduce") for name in names) == (script in DISTRIBUTED), sorted(names)
        # Memory: every allocation and free, with the bytes the allocator holds; each op's input shapes; the Python
        # lines that ran (the profiler's profile_memory, record_shapes and with_stack).
        memory = [event["args"] for event in events if event.get("name") == "[memory]"]
        assert len(memory) > 100 and all("Total Allocated" in args for args in memory), memory[:3]
        dims = [event["args"].get("Input Dims") for event in events if event.get("name") == "aten::mm"]
        assert dims and all([len(shape) for shape in dim] == [2, 2] for dim in dims), dims[:3]  # matrix times matrix
        assert any(event.get("cat") == "python_function" and event["name"].startswith(f"{script}(") for event in events)
        if script == "fsdp.py":  # each block's weights gathered, and the gradients reduce-scattered
            assert {"FSDP::all_gather (blocks.0)", "c10d::_reduce_scatter_base_"} <= names, sorted(names)
