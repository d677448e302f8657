"""Delete, one at a time, each line that a script exists to teach, run the tests that should notice, and
print which deletions they catch. STYLE.md asks for this after any change to a script's strategy lines or
to the tests: a line is guarded only if deleting it fails a test. Not a test itself (pytest does not
collect it): it runs parts of the suite once per row below.

    python tests/check_deletions.py [SUBSTRING]   # only the deletions whose line contains SUBSTRING

A deletion that no test can catch says why in the table below: such a line changes cost, not results.
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (file, the line's text, what replaces it (None: `pass`), the tests that should fail, or why none can).
TRAINING, BAD_INPUT, SPEED = "tests/test_training.py", "tests/test_bad_input.py", "tests/test_speed.py"
FSDP, PIPELINE, AMP = "tests/test_fsdp.py", "tests/test_pipeline.py", "tests/test_amp.py"
PREEMPTION, LAUNCHER = "tests/test_preemption.py", "tests/test_launcher.py"
TP, YOUR_MODEL = "tests/test_tensor_parallel.py", "tests/test_your_model.py"
RESUME = f"{TRAINING}::test_resume_matches_an_uninterrupted_run_bit_for_bit"
SAME_AS_SINGLE = f"{TRAINING}::test_same_parameters_and_losses_as_single_gpu"
STOP = f"{PREEMPTION}::test_stop_signal_saves_at_the_documented_step_and_the_rerun_ends_bit_for_bit"
DELETIONS = [
    # Exactness: the data order, the skip after a resume, exact evaluation, weights by name.
    ("single_gpu.py", "sampler.generator.manual_seed(args.seed + step // steps_per_epoch)", None,
     SAME_AS_SINGLE),  # the resume lands in the first epoch, whose order an unseeded generator repeats
    ("single_gpu.py", "train_loader.sampler.start = step % steps_per_epoch * args.batch_size // world_size",
     None, f"{RESUME}[single_gpu.py]"),
    ("single_gpu.py", 'generator = torch.Generator().manual_seed(zlib.crc32(f"{seed} {name}".encode()))',
     "generator = torch.Generator().manual_seed(seed)", SAME_AS_SINGLE),
    ("ddp_torchrun.py", "sampler.set_epoch(step // steps_per_epoch)", None, SAME_AS_SINGLE),
    ("ddp_torchrun.py", "dist.all_reduce(totals)", None, f"{TRAINING}::test_validation_is_exact_across_ranks"),
    ("ddp_torchrun.py", "dist.all_reduce(loss)", None, SAME_AS_SINGLE),
    ("ddp_torchrun.py", "return DistributedDataParallel(model, gradient_as_bucket_view=True)", "return model",
     SAME_AS_SINGLE),
    ("ddp_torchrun.py", "with model.no_sync() if micro_step < args.grad_accum - 1", "if True:",
     "speed only: without no_sync every micro-step all-reduces, and the sum is the same up to rounding"),
    ("ddp_torchrun.py", "val_set = Subset(val_set, range(rank, len(val_set), world_size))", None,
     "speed only: every rank evaluates every sample, and the all-reduced sums and counts double alike"),
    ("ddp_torchrun.py", "optimizer.zero_grad(set_to_none=False)", "optimizer.zero_grad(set_to_none=True)",
     "speed only: DDP copies each new gradient into its bucket, the same values"),
    ("ddp_torchrun.py", "torch._dynamo.config.optimize_ddp = dist.get_world_size() > 1", None,
     "speed only: in a world of one the compiled graph is cut at DDP's buckets, for the same result"),
    # Checkpoints: the one section every script shares.
    ("single_gpu.py", "for old in complete_checkpoints(args.ckpt_dir)[:-args.keep_checkpoints]:", "for old in []:",
     f"{TRAINING}::test_keep_checkpoints_keeps_the_newest_complete_ones_and_a_crash_mid_save_is_skipped"),
    ("single_gpu.py", 'done = glob.glob(os.path.join(glob.escape(ckpt_dir), "step-*", ".metadata"))',
     'done = glob.glob(os.path.join(glob.escape(ckpt_dir), "step-*", "*"))',
     f"{TRAINING}::test_keep_checkpoints_keeps_the_newest_complete_ones_and_a_crash_mid_save_is_skipped"),
    ("single_gpu.py", "return dcp.async_save(state, storage_writer=writer, process_group=group,",
     "return dcp.async_save(state, storage_writer=writer, process_group=group)",
     "speed only: each save allocates its host copy anew (tests/benchmark_checkpoint.py), the same files"),
    ("single_gpu.py", "writer = dcp.FileSystemWriter(path, per_thread_copy_ahead=0)", "writer = dcp.FileSystemWriter(path)",
     f"{TRAINING}::test_the_checkpoint_writer_makes_no_cuda_call_where_there_is_cuda"),
    ("fsdp.py", "optim_state_dict={**optimizer_state, **settings}, options=BY_NAME)",
     "optim_state_dict=optimizer_state, options=BY_NAME)",
     f"{TRAINING}::test_a_resume_trains_with_its_own_lr_and_weight_decay_and_names_them"),
    ("single_gpu.py", "value.load_state_dict(state[name])", None, f"{RESUME}[single_gpu.py]"),
    ("ddp_torchrun.py", "dist.broadcast_object_list(from_rank_0)", None, f"{RESUME}[ddp_torchrun.py]"),
    ("single_gpu.py", 'raise ValueError(f"it holds a model', None,
     f"{BAD_INPUT}::test_checkpoint_of_another_model_size_is_refused_and_kept"),
    ("single_gpu.py", "wait_for_checkpoint(last_save, args)\n                log.info", None,
     ("not in one process, whose exit waits for DCP's thread anyway; it keeps the distributed scripts from "
      "destroying the process group under a save still in flight, and prunes before exit 75")),
    # Stop signals and divergence.
    ("fsdp.py", "stop = stop_vote(signals_received) if voting else 0",
     "stop = signals_received[0] if voting and signals_received else 0", f"{STOP}[fsdp-rank-1-alone]"),
    ("ddp_spawn.py", "signals_received = catch_stop_signals()  # from before the spawn", "signals_received = []",
     f"{PREEMPTION}::test_a_stop_while_ddp_spawn_starts_its_processes_reaches_them"),
    ("ddp_torchrun.py", "signal.signal(signum, signal.SIG_IGN)", None, f"{STOP}[torchrun]"),
    ("ddp_torchrun.py", 'multiprocessing_context="spawn" if args.workers else None,', None,
     f"{STOP}[torchrun]"),  # under Python 3.14's default, forkserver, which the test sets
    ("fsdp.py", 'fail(f"the weights are not finite at step {step}', None,
     f"{BAD_INPUT}::test_non_finite_weights_on_one_rank_stop_every_rank_without_saving"),
    ("fsdp.py", "dist.all_reduce(finite, dist.ReduceOp.MIN)", None,
     f"{BAD_INPUT}::test_non_finite_weights_on_one_rank_stop_every_rank_without_saving"),
    ("single_gpu.py", 'fail(f"the loss is {loss} at step {step}', None,
     f"{BAD_INPUT}::test_a_loss_that_turns_nan_stops_the_run_without_saving"),
    # The training step, and what the model section owns.
    ("single_gpu.py", "if args.grad_clip:", "if True:", f"{TRAINING}::test_grad_clip_zero_turns_clipping_off"),
    ("single_gpu.py", "loss = loss_fn(model(inputs), targets) / args.grad_accum",
     "loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()) / args.grad_accum",
     "tests/test_your_model.py"),
    # --data: read per sample, not copied into each process, and sent to a spawned loader worker as a path.
    ("single_gpu.py", "self.path, self.seq_len = path, seq_len",
     "self.path, self.seq_len, self.copy = path, seq_len, torch.tensor(list(open(path, 'rb').read()))",
     f"{TRAINING}::test_text_file_is_read_not_copied"),
    ("ddp_torchrun.py", "self.path, self.seq_len = path, seq_len",
     "self.path, self.seq_len, self.map = path, seq_len, torch.from_file(path, size=len(path))",
     f"{RESUME}[ddp_torchrun.py]"),
    ("ddp_torchrun.py", "val_set = Subset(val_set, range(val_batches * args.batch_size))", None,
     f"{SPEED}::test_compiled_ddp_trains_like_eager"),
    # Launching: the classic launch command, and srun without torchrun.
    ("ddp_torchrun.py", 'add_flag("--local-rank", "--local_rank", help=argparse.SUPPRESS)', None,
     f"{LAUNCHER}::test_the_classic_launch_command_trains_like_torchrun"),
    ("ddp_torchrun.py", 'if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "RANK" not in os.environ:',
     "if False:", f"{LAUNCHER}::test_srun_without_torchrun_is_refused_in_one_line"),
    ("ddp_torchrun.py", 'if "RANK" not in os.environ:  # python alone', "if False:",
     f"{BAD_INPUT}::test_python_alone_ends_a_torchrun_script_in_one_line"),
    ("single_gpu.py", "parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)",
     "parser = argparse.ArgumentParser(description=__doc__)",
     "tests/test_structure.py::test_help_gives_every_flags_meaning_and_default"),
    # Speed you can see.
    ("single_gpu.py", "profiler.step()", None, f"{SPEED}::test_profile_writes_a_trace_per_process"),
    ("ddp_torchrun.py", "model.compile()", None, f"{SPEED}::test_compiled_ddp_trains_like_eager"),
    ("single_gpu.py", 'torch.set_float32_matmul_precision("high")', None,
     f"{SPEED}::test_fp32_matmuls_may_use_tf32_on_cuda"),
    ("single_gpu.py", 'self.peak = peak and world_size * peak / (2 if precision == "fp32" else 1)',
     "self.peak = peak", f"{SPEED}::test_mfu_only_against_a_known_gpus_peak"),
    ("single_gpu.py", "meter.restart(step)\n            if step >= args.max_steps:", None,
     "speed only: the step line's window keeps an evaluation's time (test_speed.py holds restart() itself)"),
    # The training step and the model section.
    ("single_gpu.py", "self.residual_std = 0.02 / math.sqrt(2 * n_layers)", "self.residual_std = 0.02",
     f"{TRAINING}::test_init_scales_the_residual_projections_as_gpt2s"),
    # Mixed precision.
    ("ddp_amp.py", "with torch.autocast(device.type, dtype):", "if True:", f"{AMP}::test_bf16_close_to_fp32"),
    ("ddp_amp.py", "scaler.unscale_(optimizer)", None, f"{AMP}::test_fp16_close_to_fp32[ddp_amp.py]"),
    ("ddp_amp.py", 'extras = {"scaler": scaler}', "extras = {}",
     f"{AMP}::test_resume_matches_an_uninterrupted_run_bit_for_bit[ddp_amp.py]"),
    ("fsdp.py", 'param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)',
     "param_dtype = None", f"{AMP}::test_fp16_close_to_fp32[fsdp.py]"),
    ("fsdp.py", "scaler.step(optimizer)", "optimizer.step()",
     f"{AMP}::test_an_overflowing_step_changes_nothing_and_halves_the_scale[fsdp.py]"),
    # FSDP.
    ("fsdp.py", "fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype, torch.float32))",
     None, "tests/test_memory.py::test_four_processes_each_hold_a_fraction_and_never_the_whole_model[fsdp.py]"),
    ("fsdp.py", "value = distribute_tensor(value, on_host, tensor.placements, src_data_rank=None)",
     "value = distribute_tensor(value, on_host, tensor.placements)",
     "speed only: rank 0 sends each shard its own values, which every rank drew alike"),
    ("fsdp.py", "model.set_requires_all_reduce(micro_step == args.grad_accum - 1)", None,
     f"{FSDP}::test_hybrid_sharding_trains_like_one_process"),
    ("fsdp.py", "if r == 1:", "if True:", f"{FSDP}::test_hybrid_sharding_trains_like_one_process"),
    ("fsdp.py", "sharding, _ = dist.new_subgroups_by_enumeration(grid.tolist(), timeout=timeout)",
     "sharding, _ = dist.new_subgroups_by_enumeration(grid.tolist())",
     f"{FSDP}::test_hybrid_sharding_trains_like_one_process"),
    ("fsdp.py", "block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)", None,
     f"{FSDP}::test_activation_checkpointing_recomputes_and_gives_the_same_weights"),
    # Pipelines.
    ("pipeline.py", "dist.all_reduce(totals)  # the last stages' sums; zeros on the others", None,
     f"{TRAINING}::test_validation_is_exact_across_ranks[pipeline.py]"),
    ("pipeline.py", "dist.all_reduce(found, dist.ReduceOp.MAX)", None,
     f"{AMP}::test_an_overflowing_step_changes_nothing_and_halves_the_scale[pipeline.py]"),
    # A sum: 2 of 4 ranks find the inf, and fused AdamW skips a step only where the flag is exactly 1.
    ("pipeline.py", "dist.all_reduce(found, dist.ReduceOp.MAX)", "dist.all_reduce(found)",
     f"{AMP} -k pipelines"),
    # Activations sent in fp32 under bf16: the same numbers (both ends compute in bf16), twice the bytes.
    ("pipeline.py", "sent = lambda x, s: x.to(param_dtype) if param_dtype and 0 < s < num_stages else x",
     "sent = lambda x, s: x", f"{PIPELINE}::test_bf16_on_two_pipelines_trains_close_to_fp32"),
    ("pipeline.py", "indices = indices[self.share]", None,
     f"{PIPELINE}::test_two_pipelines_of_two_stages_train_like_single_gpu"),
    # The whole model's norm: each process's shards, summed over every rank; a stage's whole norm on each of its R
    # replicas would count it R times.
    ("pipeline.py", "norm = torch.nn.utils.get_total_norm([g.to_local() for g in grads]) ** 2",
     "norm = torch.nn.utils.get_total_norm(grads).full_tensor() ** 2",
     f"{PIPELINE}::test_two_pipelines_of_two_stages_train_like_single_gpu"),
    # Tensor parallelism.
    ("tensor_parallel.py", 'parallelize_module(model, mesh["tensor"], plan)', None,
     f"{TP}::test_each_of_4_processes_holds_a_quarter_of_the_training_state"),
    ("tensor_parallel.py", "qkv = self.qkv(self.attn_norm(x)).view(batch, seq_len, -1, 3, self.head_dim)",
     "qkv = self.qkv(self.attn_norm(x)).view(batch, seq_len, 3, -1, self.head_dim).transpose(2, 3)",
     f"{TP}::test_two_heads_a_process_need_qkv_stored_head_by_head"),  # q|k|v: wrong split by rows
    ("tensor_parallel.py", "with loss_parallel():", "if True:", f"{SAME_AS_SINGLE}[tensor_parallel.py]"),
    ("tensor_parallel.py", "sampler = DistributedSampler(train_set, data_size, data_rank, seed=args.seed,",
     "sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)",
     f"{TP}::test_two_rows_of_two_train_like_one_process"),
    ("tensor_parallel.py", "tensor_parallel, _ = dist.new_subgroups_by_enumeration(grid.tolist(), timeout=timeout)",
     "tensor_parallel, _ = dist.new_subgroups_by_enumeration(grid.tolist())",
     f"{TP}::test_two_rows_of_two_train_like_one_process"),
    # Models no one here wrote (issue 64).
    ("tensor_parallel.py", "setattr(model.get_submodule(parent), attr, model.get_parameter(first))", None,
     f"{YOUR_MODEL}::test_a_llama_shaped_model_trains_in_every_script[tensor_parallel.py]"),  # untied: more weights
    ("tensor_parallel.py", "model(sample.new_empty((1, *sample.shape), device=next(model.parameters()).device))",
     None, f"{TP}::test_what_a_model_cannot_split_is_refused"),
    ("tensor_parallel.py", "module.register_forward_hook(lambda module, args, output: output.redistribute(", None,
     f"{TP}::test_one_gather_a_norm_the_llama_runs_no_more_collectives_than_the_gpt"),
    ("tensor_parallel.py", "dist.all_reduce(found, dist.ReduceOp.MAX)  # all ranks'", None,
     f"{AMP}::test_an_inf_in_a_split_gradient_skips_every_rank_whatever_the_first_parameter"),
    ("tensor_parallel.py", "best, index = (DTensor.from_local(t, mesh, [Shard(-1)]).full_tensor()",
     "best, index = best.squeeze(-1).unsqueeze(-1), index",
     f"{YOUR_MODEL}::test_a_llama_shaped_model_trains_in_every_script[tensor_parallel.py]"),  # its accuracy
    ("single_gpu.py", 'fail(f"init_tensor() has no values for {name}: give them, as for the others")',
     "value.normal_(0.0, 0.02, generator=generator)",
     f"{BAD_INPUT}::test_init_tensor_refuses_a_tensor_it_does_not_know"),
    ("single_gpu.py", 'return GPT(**config), {**config, "qkv": "by head"}', "return GPT(**config), config",
     f"{BAD_INPUT}::test_a_checkpoint_of_the_old_qkv_layout_is_refused_and_kept"),
    ("context_parallel.py", "k, v = (torch.cat(chunks[::2] + chunks[::-2], 2) for chunks in (k, v))",
     "k, v = (torch.cat(chunks, 2) for chunks in (k, v))", f"{SAME_AS_SINGLE}[context_parallel.py]"),  # rank order
    ("context_parallel.py", "self.masks = [causal_lower_right(len(x), int(x[-1]) + 1) for x in",
     "self.masks = [causal_lower_right(len(x), seq_len) for x in self.positions.chunk(2)]",
     f"{SAME_AS_SINGLE}[context_parallel.py]"),  # attends ahead
    ("context_parallel.py", "block.forward = functools.partial(attention, block.forward)", None,
     f"{SAME_AS_SINGLE}[context_parallel.py]"),  # the check refuses a model it does not reach
    ("context_parallel.py", "model.forward = functools.partial(model.forward, positions=positions.to(device))",
     None, f"{SAME_AS_SINGLE}[context_parallel.py]"),  # positions 0, 1, ... on every rank
    ("context_parallel.py", "sampler = DistributedSampler(train_set, data_size, data_rank, seed=args.seed,",
     "sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)",
     f"{SAME_AS_SINGLE}[context_parallel.py]"),  # a row's ranks read different samples
    ("tensor_parallel.py", 'logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)',
     None, f"{TRAINING}::test_trains_logs_and_checkpoints[tensor_parallel.py]"),
]


def copy_of_the_repository(destination):
    """The files git would commit, as they are now: tracked and new, not ignored."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split("\n")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, destination / name)


def delete(path, text, replacement):
    """Replace the one line (or call over several lines) that holds `text` with `replacement`, or with
    `pass`, at the line's indentation; in a shell script, replace just the text."""
    source = path.read_text()
    assert source.count(text) == 1, f"{path.name}: {text!r} found {source.count(text)} times"
    if path.suffix == ".sh":
        path.write_text(source.replace(text, replacement))
        return
    lines = source.splitlines(keepends=True)
    index = source[: source.index(text)].count("\n")  # the line where it starts (text over lines: the first)
    indent = lines[index][: len(lines[index]) - len(lines[index].lstrip())]
    end = index + 1
    while lines[index].count("(") > lines[index].count(")") and end < len(lines):  # a call over several lines
        lines[index] += lines[end]
        del lines[end]
    lines[index] = f"{indent}{replacement or 'pass'}\n"
    path.write_text("".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("only", nargs="?", default="", help="run only the deletions whose line contains this")
    args = parser.parse_args()
    results = []
    for file, text, replacement, tests in DELETIONS:
        if args.only not in text:
            continue
        if not tests.startswith("tests/"):
            results.append((file, text, "not tested", tests))
            continue
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "repo"
            copy_of_the_repository(copy)
            delete(copy / file, text, replacement)
            start = time.monotonic()
            run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests.split()],
                                 check=False, cwd=copy, capture_output=True, text=True)
            verdict = {0: "MISSED", 1: "caught"}.get(run.returncode, f"pytest exit {run.returncode}")
            failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")][:1]
            results.append((file, text, verdict, f"{tests} ({time.monotonic() - start:.0f} s) {' '.join(failed)}"))
        print(f"{results[-1][2]:<10} {file}: {text}", flush=True)
    print()
    for file, text, verdict, detail in results:
        print(f"{verdict:<10} {file}: {text}\n           {detail}")
    sys.exit(1 if any(verdict not in ("caught", "not tested") for _, _, verdict, _ in results) else 0)


if __name__ == "__main__":
    main()
