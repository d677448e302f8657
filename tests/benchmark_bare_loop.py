"""What a script's step costs beyond the model's: each script beside a bare loop of the same model, batch and
strategy (no wrapper, DistributedDataParallel, fully_shard on each block then the root, or tensor_parallel.py's
plan through parallelize_module, then fully_shard), eager and compiled,
runs alternated. The bare loop is written here, apart from the scripts: it takes the model and one batch from
the script's model and data sections, and the script's AdamW and schedule (what is compared is the loop, not the
optimizer's settings), and then does only forward, backward, clipping, the optimizer's and schedule's steps and
zero_grad, on a batch already on the device: no loader, logging, loss accumulation, checkpoint or stop check. A
benchmark that prints figures, not a test (pytest does not collect it).

    python tests/benchmark_bare_loop.py                  # a CPU: one thread, a GPT of width 32 and one block
    python tests/benchmark_bare_loop.py --d-model 768 --n-layers 12 --n-heads 12 --seq-len 1024 \\
        --batch-size 16 --max-steps 120 --log-every 20   # GPT-2 small's shape on one GPU

Each script's figure is the median of its logging intervals after the first two (compilation, the first
evaluation); the bare loop's is timed over the same steps. The ratio is the median of each run's against the
bare loop run after it, printed with their range: a slow spell of the machine moves both of a pair. --nproc
processes for the distributed scripts (default 1: on one GPU, what each wrapper costs over none).
"""

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT, command, import_script, scalars

CONFIGS = ["single_gpu.py", "ddp_torchrun.py", "ddp_amp.py --precision bf16", "fsdp.py", "tensor_parallel.py"]
DDP = ["ddp_spawn.py", "ddp_torchrun.py", "ddp_amp.py"]  # the scripts this bare loop can stand beside, and the sharded
SHARDED = ["fsdp.py", "tensor_parallel.py"]
CPU_FLAGS = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "64", "--batch-size", "16",
             "--max-steps", "800", "--log-every", "100"]


def bare_loop(config, flags, compiled):
    """One process of the bare loop (torchrun starts several): prints the global tokens/s, from rank 0."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    script, *own_flags = config.split()
    module = import_script(script)
    sys.argv = [script, *own_flags, *flags]
    args = module.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank, world_size = 0, 1
    if script != "single_gpu.py":
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_float32_matmul_precision("high")
    train_set, _, info = module.build_datasets(args)
    model = module.build_model(args, info)[0].to(device)
    split = contextlib.nullcontext
    if script == "tensor_parallel.py":  # every process one row: the plan's styles, then FSDP over a column of one
        mesh = init_device_mesh(device.type, (1, world_size), mesh_dim_names=("shard", "tensor"))
        parallelize_module(model, mesh["tensor"], {name: module.STYLES[style]
                                                   for name, style in model.tensor_plan.items()})
        split = loss_parallel
    per_process = args.batch_size // (world_size * args.grad_accum)
    inputs, targets = (torch.stack(t).to(device) for t in zip(*(train_set[i] for i in range(per_process))))
    dtype = torch.bfloat16 if getattr(args, "precision", "fp32") == "bf16" else None
    if script in SHARDED:  # bf16 through FSDP's policy, not autocast, as fsdp.py does
        policy = MixedPrecisionPolicy(dtype or torch.float32, torch.float32)
        for block in [*model.blocks.values(), model]:
            if compiled and block is not model:
                block.compile()
            fully_shard(block, mesh=mesh["shard"] if script == "tensor_parallel.py" else None, mp_policy=policy)
        dtype = None
    elif compiled:
        model.compile()
    if script in DDP:
        model = DistributedDataParallel(model)
    optimizer = module.configure_optimizer(model, args)

    def steps(count):
        for _ in range(count):
            for _ in range(args.grad_accum):
                with torch.autocast(device.type, dtype, enabled=dtype is not None), split():
                    loss = module.loss_fn(model(inputs), targets) / args.grad_accum
                    loss.backward()
            if args.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * module.lr_factor(0, args)
            optimizer.step()
            optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()

    warmup = 2 * args.log_every
    steps(warmup)
    start = time.perf_counter()
    steps(args.max_steps - warmup)
    seconds = time.perf_counter() - start
    if rank == 0:
        tokens = (args.max_steps - warmup) * args.batch_size * targets[0].numel()
        print(f"BARE {tokens / seconds}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def measure(config, flags, compiled, nproc, directory):
    """tokens/s of the script, and of the bare loop, in one run each."""
    script, *own_flags = config.split()
    mode = ["--compile"] if compiled else []
    result = subprocess.run(command(script, nproc) + own_flags + flags + mode + ["--log-dir", f"{directory}/tb"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"{config} failed:\n{result.stdout}")
    intervals = sorted(scalars(f"{directory}/tb")["train/tokens_per_sec"].items())[2:]
    bare = [sys.executable, *(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                              if script != "single_gpu.py" else []), __file__]
    result = subprocess.run([*bare, "--bare", config, *(["--compiled"] if compiled else []), *flags], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("BARE ")]
    if result.returncode != 0 or not lines:
        sys.exit(f"bare loop of {config} failed:\n{result.stdout}")
    return statistics.median(value for _, value in intervals), float(lines[0].split()[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--bare", help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args, flags = parser.parse_known_args()
    if any(config.split()[0] not in ["single_gpu.py", *DDP, *SHARDED] for config in args.configs):
        parser.error(f"--configs: {', '.join(['single_gpu.py', *DDP, *SHARDED])}, with their flags")
    if args.bare:
        return bare_loop(args.bare, flags, args.compiled)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        flags = [*CPU_FLAGS, *flags]
    flags += ["--eval-every", "1000000"]
    runs = {(config, mode): [] for config in args.configs for mode in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for (config, mode), results in runs.items():  # alternated: a slow spell hits every config
                results.append(measure(config, flags, mode == "compiled", args.nproc, f"{tmp}/{len(results)}{mode}"
                                       f"{config.replace(' ', '')}"))
                print(f"  {config} {mode}: script {results[-1][0]:,.0f}, bare {results[-1][1]:,.0f} tokens/s",
                      flush=True)
    print(f"\n{'config':<28} {'mode':<9} {'script':>12} {'bare loop':>12} {'ratio':>6}  {'range':>9}   (tokens/s, "
          f"medians of {args.repeats}; {args.nproc} process(es))")
    for (config, mode), results in runs.items():  # a ratio per run and its bare loop, run back to back
        script, bare = (statistics.median(r[i] for r in results) for i in (0, 1))
        ratios = [s / b for s, b in results]
        print(f"{config:<28} {mode:<9} {script:>12,.0f} {bare:>12,.0f} {statistics.median(ratios):>6.2f}  "
              f"{min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
