"""Delete, one at a time, each line that a script exists to teach, run the tests that should notice, and
print which deletions they catch. STYLE.md asks for this after any change to a script's strategy lines or
to the tests: a line is guarded only if deleting it fails a test. Not a test itself (pytest does not
collect it): it runs parts of the suite once per row below (84), 37 minutes on two cores (71 rows: 63 caught, 8
that no test on a CPU can catch, each with its reason; then the 5 rows issue 32 rewrote or added: 5 caught; of
issue 33's 3, the 2 a CPU can catch: caught; issue 34's 5: caught; issue 35's 3 new rows and 5 renamed: caught,
2026-11-26).

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
FSDP, PIPELINE, FAILURES = "tests/test_fsdp.py", "tests/test_pipeline.py", "tests/test_failures.py"
PREEMPTION = "tests/test_preemption.py"
KILLED_MID_WRITE = f"{PREEMPTION}::test_a_kill_during_a_background_write_leaves_the_checkpoint_before_which_resumes_bit_for_bit"
DELETIONS = [
    ("ddp_torchrun.py", "sampler.set_epoch(step // steps_per_epoch)", None, TRAINING),
    ("ddp_torchrun.py", "DistributedSampler(train_set, seed=args.seed, drop_last=True)",
     "sampler = DistributedSampler(train_set, drop_last=True)", TRAINING),
    ("ddp_torchrun.py", "step % steps_per_epoch * args.grad_accum * per_process_batch_size",  # the skip after a resume
     "micro_batches = iter(train_loader)", TRAINING),
    ("ddp_torchrun.py", "dist.all_reduce(totals)", None, TRAINING),
    ("ddp_torchrun.py", "dist.all_reduce(loss)", None, TRAINING),
    ("ddp_torchrun.py", "dist.barrier()", None,
     "tests/test_launcher.py::test_rank_that_fails_just_after_a_checkpoint_does_not_lose_it"),
    ("ddp_torchrun.py", "fail(f\"ranks resumed at different steps", None,
     "tests/test_two_nodes.py::test_nodes_that_resume_from_different_checkpoints_stop"),
    ("ddp_torchrun.py", "level=logging.INFO if is_main_process else logging.WARNING",
     'logging.basicConfig(format="%(message)s", level=logging.INFO, stream=sys.stdout)', TRAINING),
    ("ddp_torchrun.py", "atexit.register(leave_process_group)", None,
     "not on a CPU: an error exit without it leaves nothing gloo shows; NCCL warns that the group was not destroyed"),
    ("ddp_torchrun.py", "with model.no_sync() if micro_step < args.grad_accum - 1", "if True:",
     "speed only: without no_sync every micro-step all-reduces, and the sum is the same up to rounding"),
    ("ddp_torchrun.py", "val_set = Subset(val_set, range(rank, len(val_set), world_size))", None,
     "speed only: every rank evaluates every sequence, and the all-reduced sums and counts double alike"),
    ("ddp_torchrun.py", "gc.collect()", None,
     "rare: it avoids an abort at exit seen in 5 of 40 runs; one run seldom shows it"),
    ("single_gpu.py", "sampler.generator.manual_seed(args.seed + step // steps_per_epoch)", None, TRAINING),
    ("single_gpu.py", "exit_diverged(step, \"the weights are no longer finite\")", None,
     f"{BAD_INPUT}::test_weights_that_blow_up_are_never_checkpointed"),
    ("single_gpu.py", "exit_diverged(step, f\"the loss is {train_loss}\")", None,
     f"{BAD_INPUT}::test_diverging_run_stops_and_keeps_the_last_checkpoint"),
    ("single_gpu.py", "saved.update({key: value for key, value in group.items() if key != \"params\"})", None,
     f"{TRAINING}::test_resumed_optimizer_runs_this_devices_kernel"),
    ("single_gpu.py", "if args.grad_clip:", "if True:", f"{TRAINING}::test_grad_clip_zero_turns_clipping_off"),
    ("single_gpu.py", "val_set = Subset(val_set, range(min(num_val, args.eval_batches * args.batch_size)))", None,
     f"{TRAINING}::test_bounded_evaluation_is_the_same_on_any_number_of_ranks"),
    ("single_gpu.py", "tokens = torch.from_file(path, size=num_seqs * seq_len + 1, dtype=torch.uint8)",
     "tokens = torch.frombuffer(bytearray(open(path, 'rb').read()[: num_seqs * seq_len + 1]), dtype=torch.uint8).long()",
     f"{TRAINING}::test_text_file_is_mapped_not_copied"),
    ("single_gpu.py", "tempfile.TemporaryFile(dir=path).close()", None,
     f"{BAD_INPUT}::test_checkpoint_directory_that_cannot_be_written_is_refused"),
    ("launch_distributed.sh", "--ntasks-per-node=1 --cpus-per-task=\"$cpus\"", "--ntasks-per-node=1",
     "tests/test_slurm.py"),
    ("ddp_torchrun.py", "model.compile()", None, f"{SPEED}::test_compiled_ddp_trains_like_eager"),
    ("single_gpu.py", "profiler.step()", None, f"{SPEED}::test_profile_writes_a_trace_per_process"),
    ("ddp_torchrun.py", "flops = units_per_sec * flops_per_unit / world_size",
     "flops = units_per_sec * flops_per_unit", f"{SPEED}::test_flops_per_process_follow_from_tokens_per_second"),
    # The model section owns the loss: a training step that computes a language model's instead fails a classifier.
    ("single_gpu.py", "loss = loss_fn(model(inputs), targets) / args.grad_accum",
     "loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()) / args.grad_accum",
     "tests/test_your_model.py"),
    ("single_gpu.py", "torch.backends.cuda.matmul.allow_tf32 = True", None,
     f"{SPEED}::test_fp32_matmuls_may_use_tf32_on_cuda"),
    ("dataparallel.py", "peak *= torch.cuda.device_count()", None,
     "not on a CPU, which has no peak: MFU is shown on GPUs alone"),
    ("ddp_amp.py", "with torch.autocast(device.type, torch.bfloat16 if args.precision == \"bf16\" else torch.float16):",
     "if True:", "tests/test_amp.py::test_close_to_fp32"),
    ("ddp_amp.py", "scaler.unscale_(optimizer)", None, "tests/test_amp.py::test_close_to_fp32"),
    ("ddp_amp.py", "if after >= before:", "if True:", "tests/test_amp.py"),
    ("ddp_amp.py", "advance_schedule(scheduler, last_scales)  # before", None,
     "tests/test_amp.py::test_a_skip_learned_one_step_later_trains_the_same"),
    ("ddp_amp.py", "advance_schedule(scheduler, scales)", None,
     "tests/test_amp.py::test_resume_matches_an_uninterrupted_run_bit_for_bit"),
    ("ddp_amp.py", "scaler.load_state_dict(state[\"scaler\"])", None,
     "tests/test_amp.py::test_resume_matches_an_uninterrupted_run_bit_for_bit"),
    ("ddp_amp.py", "if args.precision == \"bf16\" and torch.cuda.get_device_capability(device) < (8, 0):", "if False:",
     "tests/test_amp.py::test_bf16_on_a_gpu_without_it_names_another_precision"),
    ("ddp_amp.py", "scaler.update()", None, "tests/test_amp.py"),
    ("ddp_amp.py", "scaler.scale(loss).backward()", "loss.backward()", "tests/test_amp.py"),
    ("ddp_amp.py", "if after < 1:", "if False:",
     "tests/test_amp.py::test_gradients_that_overflow_at_every_scale_stop_the_run"),
    ("fsdp.py", "fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=",
     None, f"{SPEED}::test_profile_writes_a_trace_per_process"),
    ("fsdp.py", "for _ in range(num_batches.item() - len(loader)):", "for _ in range(0):", TRAINING),
    ("fsdp.py", "os.replace(path + \".tmp\", path)", None, FSDP),
    ("fsdp.py", "shutil.rmtree(old, ignore_errors=True)", None,
     f"{TRAINING}::test_keep_checkpoints_keeps_the_last_ones_and_any_of_them_resumes[fsdp.py]"),
    ("pipeline.py", "group[\"params\"] = names", None, f"{PIPELINE}::test_checkpoints_move_to_and_from_single_gpu"),
    # Saves in the background: the copy that training does not change, and the link that moves once every rank wrote.
    ("single_gpu.py", "state = host_copy(state)", None,
     f"{KILLED_MID_WRITE}[single_gpu.py]"),
    ("fsdp.py", "writing = in_background(point_to_checkpoint, writing, path, new, keep)", None,
     f"{KILLED_MID_WRITE}[fsdp.py]"),
    ("single_gpu.py", "torch.cuda.synchronize()  # the copies from the GPU have arrived", None,
     "GPU only, and a large state's: the thread could write a copy before it arrives (a small one arrives first)"),
    ("fsdp.py", "error = next(iter(error.failures.values()))[0] if isinstance(error, dcp.CheckpointException)", None,
     f"{FSDP}::test_corrupt_shard_is_reported_and_kept"),
    ("fsdp.py", "whole = read_checkpoint(path, None)[\"step\"] > read_checkpoint(path, {\"step\": 0})[\"step\"]",
     None, f"{FSDP}::test_checkpoints_convert_both_ways"),
    ("fsdp.py", "if args.precision == \"bf16\" and torch.cuda.get_device_capability(device) < (8, 0):", "if False:",
     "tests/test_amp.py::test_bf16_on_a_gpu_without_it_names_another_precision"),
    ("fsdp.py", "block.compile()", None, f"{FSDP}::test_compiled_blocks_train_like_eager"),
    ("fsdp.py", "init_weights(model, args.seed)", None, TRAINING),
    ("fsdp.py", "block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)", None,
     "tests/test_memory.py::test_activation_checkpointing_trains_alike_in_less_memory"),
    ("pipeline.py", "init_weights(model, args.seed)", None, TRAINING),
    ("pipeline.py", "block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)", None,
     "tests/test_memory.py::test_activation_checkpointing_trains_alike_in_less_memory"),
    ("pipeline.py", "dist.broadcast(loss, src=world_size - 1)", None,
     f"{PIPELINE}::test_each_schedule_trains_like_single_gpu"),
    ("pipeline.py", "dist.broadcast(totals, src=last)", None,
     f"{PIPELINE}::test_validation_is_exact_with_a_short_last_batch_and_each_stage_copies_what_it_reads"),
    ("pipeline.py", "dist.all_reduce(norm)", None, f"{PIPELINE}::test_each_schedule_trains_like_single_gpu"),
    ("pipeline.py", "total_loss += loss.detach() / args.grad_accum", "total_loss += loss.detach()",
     f"{PIPELINE}::test_each_schedule_trains_like_single_gpu"),
    ("pipeline.py", "inputs = torch.cat([inputs, inputs[:1].expand(missing, *inputs.shape[1:])])", None, f"{PIPELINE}::test_validation_is_exact_with_a_short_last_batch_and_each_stage_copies_what_it_reads"),
    ("pipeline.py", "activations[1:] = [x.requires_grad_() for x in activations[1:]]", None,
     f"{PIPELINE}::test_each_schedule_trains_like_single_gpu"),
    # When one process fails (issue 30's lines).
    ("ddp_torchrun.py", "dist.distributed_c10d._abort_process_group()", "dist.destroy_process_group()",
     "not on a CPU: gloo's destroy waits for nothing; NCCL's waits for collectives a failed peer never joins"),
    ("ddp_torchrun.py", "        exit_if_another_process_failed(error)", None,
     f"{FAILURES}::test_out_of_memory_on_one_rank_ends_every_process_in_one_line"),
    ("ddp_torchrun.py", "os.kill(os.getppid(), signal.SIGTERM)", None,
     f"{FAILURES}::test_out_of_memory_on_one_rank_ends_every_process_in_one_line"),
    ("ddp_torchrun.py", "stop = stop_requested(received, stop_group) if step < args.max_steps else 0", None,
     "not on a CPU: the stop check's place before the logging step matters where the loss's .item() waits for NCCL"),
    ("single_gpu.py", "exit_if_out_of_memory(error, f\"evaluation at step {step}\"", "raise",
     f"{FAILURES}::test_out_of_memory_in_evaluation_ends_in_one_line"),
    ("single_gpu.py", "os.remove(path + \".tmp\")", None,
     f"{FAILURES}::test_full_disk_at_the_second_save_ends_in_one_line_and_keeps_the_first"),
    ("fsdp.py", "if dist.get_rank() == 0:  # the partial directory would hold the space", "if False:",
     f"{FAILURES}::test_full_disk_at_the_second_save_ends_in_one_line_and_keeps_the_first"),
    ("pipeline.py", "exit_if_out_of_memory(error, f\"step {step + 1}\", per_process_batch_size, args, device)",
     "raise", f"{FAILURES}::test_out_of_memory_in_a_pipeline_stages_backward_ends_in_one_line"),
    # Issue 31's faults on one rank, and the precision of fsdp.py's gradient reduction (both fully_shard calls).
    ("fsdp.py", "dist.all_reduce(finite, dist.ReduceOp.MIN)", None,
     f"{BAD_INPUT}::test_non_finite_weights_on_one_rank_stop_every_rank"),
    ("pipeline.py", "dist.all_reduce(finite, dist.ReduceOp.MIN)", None,
     f"{BAD_INPUT}::test_non_finite_weights_on_one_rank_stop_every_rank"),
    ("fsdp.py", "reduce_dtype=torch.float32))",
     "fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype))",
     f"{FSDP}::test_bf16_trains_close_to_fp32"),
    ("fsdp.py", "fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch",
     ("fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype, "
     "output_dtype=torch.float32))"),
     f"{FSDP}::test_bf16_trains_close_to_fp32"),
    ("pipeline.py", "stage_module.compile()", None, f"{PIPELINE}::test_compiled_stages_train_like_eager"),
    # Issue 34: hybrid sharding, interleaved stages, memory in --profile, where every rank runs.
    ("fsdp.py", 'init_device_mesh(device.type, (r, n // r), mesh_dim_names=("replicate", "shard"))',
     "init_device_mesh(device.type, (n,))", f"{FSDP}::test_hybrid_sharding_holds_half_the_state_on_each_of_4_processes"),
    ("pipeline.py", "self.held = nn.ModuleList(model.get_submodule(name) for name in part)", "self.held = model",
     f"{PIPELINE}::test_two_stages_per_process_train_like_single_gpu"),
    ("pipeline.py", "order = [sorted(names, key=position.get) for names in order]", None, f"{PIPELINE}::test_a_checkpoint_moves_between_plain_and_interleaved_layouts"),
    ("single_gpu.py", "profile_memory=True, record_shapes=True, with_stack=True)", ")",
     f"{SPEED}::test_profile_writes_a_trace_per_process"),
    ("ddp_torchrun.py", "    log_placement(device)", None, f"{TRAINING}::test_rank_0_logs_where_every_rank_runs"),
    # Issue 35: lines that every script now shares, and ddp_spawn.py's processes given torchrun's environment.
    ("ddp_spawn.py", "os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc))", None,
     f"{TRAINING}::test_rank_0_logs_where_every_rank_runs[ddp_spawn.py]"),
    ("ddp_torchrun.py", "if writer is None:  # every rank but 0, which alone writes", "if False:",
     f"{TRAINING}::test_trains_logs_and_checkpoints[ddp_torchrun.py]"),
    ("ddp_torchrun.py", "if not any(isinstance(e, torch.cuda.OutOfMemoryError) for e in causes(error)):", "if False:",
     f"{FAILURES}::test_out_of_memory_on_one_rank_ends_every_process_in_one_line[ddp_torchrun.py-False]"),
    # The copies: a line deleted from them changes their diff against single_gpu.py or ddp_torchrun.py, whose
    # sizes tests/test_structure.py knows exactly; their behaviour is tested on the scripts above.
    ("ddp_spawn.py", "dist.barrier()", None, "tests/test_structure.py"),
    ("ddp_spawn.py", "fail(f\"ranks resumed at different steps", None, "tests/test_structure.py"),
    ("dataparallel.py", "exit_diverged(step, \"the weights are no longer finite\")", None, "tests/test_structure.py"),
    ("dataparallel.py", "dp_model = nn.DataParallel(model) if device.type == \"cuda\" else model", "dp_model = model",
     ("not on a CPU, where dataparallel.py runs without it; on 2 GPUs or more, tests/test_gpu.py's "
     "test_on_several_gpus_ends_near_single_gpus_weights[dataparallel.py] runs the wrapper")),
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
    [index] = [i for i, line in enumerate(lines) if text in line]
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
