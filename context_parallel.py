"""Train a small GPT with context parallelism: rows of C processes split each sequence, FSDP across.

    torchrun --standalone --nproc_per_node=2 context_parallel.py  # --seq-len 4096: a half each
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        --rdzv-id=JOB context_parallel.py                         # C: a node's, FSDP across
    tensorboard --logdir runs                     # loss, accuracy, learning rate, throughput
"""

import argparse
import contextlib
import datetime
import functools
import glob
import itertools
import logging
import math
import os
import shutil
import signal
import sys
import time
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol  # its all-gather: renamed in 2.13
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, TensorDataset
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's notice: save, then stop


# -- configuration ------------------------------------------------------------

def fail(message):
    """Exit with a one-line error and no traceback: bad input is for the user to fix."""
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")

def number(kind, positive=True):
    """An argparse type: a finite number of `kind`, above zero (positive=False: zero or more)."""
    def parse(text):
        value = kind(text)
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"{text} is not {'>' if positive else '>='} 0")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value"
    return parse

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help: the docstring as it is written, then every flag with its default."""

def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_flag = parser.add_argument
    add_flag("--batch-size", type=number(int), default=32, help="global batch: samples per step")
    add_flag("--grad-accum", type=number(int), default=1, help="micro-batches per step")
    add_flag("--max-steps", type=number(int), default=300, help="optimizer steps to train")
    add_flag("--lr", type=number(float), default=3e-3, help="peak learning rate")
    add_flag("--warmup-steps", type=number(int, False), default=30, help="of linear warmup to --lr")
    add_flag("--lr-decay-steps", type=number(int), help="cosine decay's last; None: --max-steps")
    add_flag("--weight-decay", type=number(float, False), default=0.1, help="AdamW's, of matrices")
    add_flag("--grad-clip", type=number(float, False), default=1.0, help="max grad norm; 0: off")
    add_flag("--log-every", type=number(int), default=10, help="steps between logs")
    add_flag("--eval-every", type=number(int), default=100, help="steps between evaluations")
    add_flag("--eval-batches", type=number(int), default=20, help="batches per evaluation")
    add_flag("--log-dir", default=os.path.join("runs", os.path.basename(__file__)[:-3]),
             help="for TensorBoard, and --profile's traces")
    add_flag("--ckpt-dir", help="save checkpoints here, and resume from the newest; None: none")
    add_flag("--ckpt-every", type=number(int), default=100, help="steps between checkpoints")
    add_flag("--keep-checkpoints", type=number(int), default=1, help="checkpoints kept, the newest")
    add_flag("--workers", type=number(int, False), default=0, help="spawned loader processes")
    add_flag("--device", choices=["cpu", "cuda"], help="None: cuda if there is one")
    add_flag("--seed", type=int, default=0, help="of the weights, the data's order and dropout")
    add_flag("--compile", action="store_true", help="torch.compile the model")
    add_flag("--profile", action="store_true", help="trace steps 7 to 9 into --log-dir")
    add_flag("--timeout", type=number(float), default=300, help="seconds to wait for a stuck rank")
    add_flag("--precision", choices=["fp32", "bf16", "fp16"], default="fp32", help="for compute")
    add_flag("--context-parallel", type=number(int), help="C split a sequence; None: a node's all")
    add_flag("--activation-checkpointing", action="store_true", help="recompute blocks in backward")
    add_flag("--local-rank", "--local_rank", help=argparse.SUPPRESS)  # torch.distributed.launch's
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "RANK" not in os.environ:
        fail("srun started several tasks, not torchrun: start one torchrun per node under srun")
    add_data_args(parser.add_argument_group("data"))
    add_model_args(parser.add_argument_group("model"))
    args = parser.parse_args()
    if "RANK" not in os.environ:  # python alone: init_process_group would fail in torch's words
        fail(f"start it with torchrun: torchrun --standalone --nproc_per_node=2 {sys.argv[0]}")
    return args


# -- data ---------------------------------------------------------------------

def add_data_args(parser):
    parser.add_argument("--data", help="a text file to model byte by byte; None: built-in data")
    parser.add_argument("--seq-len", type=number(int), default=64, help="tokens per sequence")

def markov_sequences(seq_len, num_tokens=2**18, vocab_size=64, seed=1234):
    """Sequences of a fixed random Markov chain, whose entropy rate is the lowest loss there is."""
    gen = torch.Generator().manual_seed(seed)
    transitions = torch.randn(vocab_size, vocab_size, generator=gen, dtype=torch.float64)
    transitions = torch.softmax(3 * transitions, 1)
    stationary = torch.linalg.matrix_power(transitions, 200)[0]  # any row: the long-run frequencies
    entropy = -(stationary[:, None] * transitions * transitions.log()).sum().item()
    log.info(f"built-in data: a Markov chain whose entropy rate, {entropy:.4f}, is the lowest loss")
    tokens = torch.empty(num_tokens // seq_len, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(stationary, len(tokens), replacement=True, generator=gen)
    for t in range(seq_len):
        tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=gen)[:, 0]
    return TensorDataset(tokens[:, :-1], tokens[:, 1:]), vocab_size  # (input, target) pairs

class TextFile(Dataset):
    """A file's bytes as (input, target) sequences, read per sample: one page-cache copy for all."""

    def __init__(self, path, seq_len):
        self.path, self.seq_len = path, seq_len
        self.num_seqs = (os.path.getsize(path) - 1) // seq_len if os.path.isfile(path) else 0
        if self.num_seqs < 1:
            fail(f"--data {path}: no such file, or not longer than --seq-len {seq_len}")

    def __len__(self):
        return self.num_seqs

    def __getitem__(self, i):
        with open(self.path, "rb") as file:  # each time: a loader worker, however started, opens it
            file.seek(i * self.seq_len)
            tokens = torch.frombuffer(bytearray(file.read(self.seq_len + 1)), dtype=torch.uint8)
        return tokens[:-1].long(), tokens[1:].long()

def build_datasets(args):
    """Train and validation sets, the last tenth held out, and what the model needs to know."""
    if args.data:
        dataset, vocab_size = TextFile(args.data, args.seq_len), 256
    else:
        dataset, vocab_size = markov_sequences(args.seq_len)
    num_train = len(dataset) - len(dataset) // 10
    val_set = Subset(dataset, range(num_train, len(dataset)))
    return Subset(dataset, range(num_train)), val_set, {"vocab_size": vocab_size}


# -- model --------------------------------------------------------------------

def add_model_args(parser):
    parser.add_argument("--d-model", type=number(int), default=64, help="width of the model")
    parser.add_argument("--n-layers", type=number(int), default=2, help="transformer blocks")
    parser.add_argument("--n-heads", type=number(int), default=4, help="attention heads")

class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each added to the stream."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.attn_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)  # rows: q, k, v of head 0, of 1...
        self.attn_out = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        batch, seq_len, _ = x.shape  # by head, -1 heads: a split by rows (tensor_parallel.py) works
        qkv = self.qkv(self.attn_norm(x)).view(batch, seq_len, -1, 3, self.head_dim)
        q, k, v = qkv.transpose(1, 2).unbind(3)  # each (batch, heads, seq_len, head_dim)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attn.transpose(1, 2).reshape(batch, seq_len, -1))
        return x + self.mlp(self.mlp_norm(x))

class GPT(nn.Module):
    def __init__(self, vocab_size, seq_len, d_model, n_layers, n_heads):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        # Blocks by name ("0", "1", ...): FSDP shards them one by one, a pipeline stage keeps some.
        self.blocks = nn.ModuleDict({str(i): Block(d_model, n_heads) for i in range(n_layers)})
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.residual_std = 0.02 / math.sqrt(2 * n_layers)  # GPT-2's: a stream added to 2n times
        self.tensor_plan = {  # for tensor_parallel.py: how it splits each layer ("*": every block)
            "tok_emb": "embedding", "pos_emb": "embedding", "norm": "norm", "head": "vocabulary",
            "blocks.*.attn_norm": "norm", "blocks.*.qkv": "column", "blocks.*.attn_out": "row",
            "blocks.*.mlp_norm": "norm", "blocks.*.mlp.0": "column", "blocks.*.mlp.2": "row"}

    def init_tensor(self, name, value, generator):
        """Fill `value` with tensor `name`'s initial values, as GPT-2's: N(0, 0.02), biases 0."""
        module, kind = self.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        if isinstance(module, nn.LayerNorm) and kind in ("weight", "bias"):
            value.fill_(1.0 if kind == "weight" else 0.0)
        elif isinstance(module, nn.Linear) and kind == "bias":
            value.zero_()
        elif isinstance(module, (nn.Linear, nn.Embedding)) and kind == "weight":
            into_stream = name.endswith(("attn_out.weight", "mlp.2.weight"))  # 2 a block
            value.normal_(0.0, self.residual_std if into_stream else 0.02, generator=generator)
        else:  # a buffer, or a layer of another kind: noise would be wrong, and silently
            fail(f"init_tensor() has no values for {name}: give them, as for the others")

    def forward(self, tokens, positions=None):  # embed(), the blocks, output(): a pipeline stage
        x = self.embed(tokens, positions)  # runs its parts; positions: context_parallel.py's share
        for block in self.blocks.values():
            x = block(x)
        return self.output(x)

    def embed(self, tokens, positions=None):
        if positions is None:  # the whole sequence's
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_emb(tokens) + self.pos_emb(positions)

    def output(self, x):
        return self.head(self.norm(x))

def build_model(args, data_info):
    """The model, and its configuration: checkpoints keep it, and a resumed run must match it."""
    if args.d_model % args.n_heads:
        fail(f"--n-heads {args.n_heads} does not divide --d-model {args.d_model}")
    config = {"vocab_size": data_info["vocab_size"], "seq_len": args.seq_len,
              "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads}
    return GPT(**config), {**config, "qkv": "by head"}  # its rows' order: q|k|v before 2026-11-28

def loss_fn(logits, targets, reduction="mean"):
    """Cross-entropy of each prediction: logits (..., classes), targets (...)."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction=reduction)


# -- setup --------------------------------------------------------------------

def setup(args):
    """This process's device, its rank (number) and the world size (how many processes train)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_float32_matmul_precision("high")  # fp32 matmuls on TF32 tensor cores (Ampere on)
    torch.manual_seed(args.seed)  # a model without init_tensor(); main() reseeds by rank
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))  # local rank r: GPU r
        torch.cuda.set_device(device)
    dist.init_process_group(  # join the others: NCCL between GPUs; gloo for CPU tensors
        "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=args.timeout))
    logging.basicConfig(format="%(message)s", stream=sys.stdout,  # the console: rank 0's alone
                        level=logging.INFO if dist.get_rank() == 0 else logging.WARNING)
    return device, dist.get_rank(), dist.get_world_size()

all_gather = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)
class ContextParallel(torch.overrides.TorchFunctionMode):
    """Causal attention, however a block calls it (F.scaled_dot_product_attention), over the row."""

    def __init__(self, row, seq_len):
        super().__init__()
        c, r, self.row, self.reached = dist.get_world_size(row), dist.get_rank(row), row, False
        chunks = torch.arange(seq_len).view(2 * c, -1)  # r and 2C - 1 - r: as much causal work each
        self.positions = torch.cat([chunks[r], chunks[2 * c - 1 - r]])  # this rank's, of a sequence
        # Each chunk attends to the keys up to its own end. Built here: a compiled block cannot.
        self.masks = [causal_lower_right(len(x), int(x[-1]) + 1) for x in self.positions.chunk(2)]

    def __call__(self, forward, *args, **kwargs):  # a block's, within the mode: its recompute too
        with self:  # (in backward, where a mode entered around the step is gone)
            return forward(*args, **kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # each torch call in the mode
        attention = func is F.scaled_dot_product_attention
        self.reached |= attention  # once True (main()'s check), constant: no recompile
        return (self.attention if attention else func)(*args, **(kwargs or {}))

    def attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **options):
        if attn_mask is not None or not is_causal:
            fail("context parallelism splits causal attention alone: is_causal=True, no attn_mask")
        # All ranks' keys and values, (batch, heads, positions, head_dim); backward reduce-scatters
        k, v = (all_gather(t.contiguous(), 2, self.row).split(q.shape[2] // 2, 2) for t in (k, v))
        k, v = (torch.cat(chunks[::2] + chunks[::-2], 2) for chunks in (k, v))  # s: s, 2C - 1 - s
        return torch.cat([F.scaled_dot_product_attention(
            part, k[:, :, :mask.seq_len_kv], v[:, :, :mask.seq_len_kv], mask, dropout_p, **options)
            for part, mask in zip(q.chunk(2, 2), self.masks)], 2)  # part: a chunk of queries

def context_parallel_group(args, world_size):
    """C, and this process's row: ranks iC to iC + C - 1, which share each sequence."""
    c = args.context_parallel or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # a node's
    if world_size % c or args.seq_len % (2 * c):
        fail(f"--context-parallel {c} must divide {world_size} processes, and 2 x {c} --seq-len")
    grid, timeout = torch.arange(world_size).view(-1, c), datetime.timedelta(seconds=args.timeout)
    return c, dist.new_subgroups_by_enumeration(grid.tolist(), timeout=timeout)[0]  # this rank's

def share(positions, batch):  # a loader's batch, each sample cut to this rank's positions
    return [tensor[:, positions] for tensor in torch.utils.data.default_collate(batch)]

def prepare_model(model, args, device):
    """Shard the model in place: each block a unit that FSDP gathers just before it runs and frees
    after, the root the rest; then give each rank's shards their initial values, on this device."""
    if not hasattr(model, "blocks") and (args.compile or args.activation_checkpointing):
        fail("--compile and --activation-checkpointing work on the model's blocks: it has none")
    # Every process shards it (a row's too: each holds a share of positions, and its gradients).
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type, mesh_dim_names=("shard",))
    # 16 bits: weights gathered and computed in 16 bits, gradients reduced in fp32 into fp32 shards.
    param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
    for block in model.blocks.values() if hasattr(model, "blocks") else []:
        if args.activation_checkpointing:  # keeps the block's input alone; backward recomputes
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        if args.compile:  # each block alone: FSDP's gathers run between the graphs
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype, torch.float32))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype, torch.float32,
                                                                 output_dtype=torch.float32))
    if hasattr(model, "init_tensor"):  # else it was built whole, with its values
        model.to_empty(device=device)  # allocates this rank's shards, uninitialised
    init_weights(model, args.seed)
    return model.to(device)

@torch.no_grad()
def init_weights(model, seed):
    """Give each tensor init_tensor()'s values, seeded by its name: the same however it is split."""
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if hasattr(model, "init_tensor"):
            value = torch.empty(tensor.shape, dtype=tensor.dtype)
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed} {name}".encode()))
            model.init_tensor(name, value, generator)
            if isinstance(tensor, DTensor):  # a shard: cut on the host, so no GPU holds the whole
                mesh = tensor.device_mesh  # its twin on the CPU, of the same groups: no collective
                on_host = DeviceMesh.from_group(mesh.get_all_groups(), "cpu", mesh.mesh,
                                                mesh_dim_names=mesh.mesh_dim_names)
                value = distribute_tensor(value, on_host, tensor.placements, src_data_rank=None)
                tensor, value = tensor.to_local(), value.to_local()
            tensor.copy_(value)

class SkippingSampler(Sampler):
    """Another sampler's order from index `start`: a resumed run skips what its epoch trained on."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, 0

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.start, None)


# -- metrics and stop signals -------------------------------------------------

def count_flops(args, data_info, sample):
    """Training FLOPs per sample, as torch counts them on a copy of the model on the meta device."""
    with torch.device("meta"):
        model, _ = build_model(args, data_info)
    with FlopCounterMode(display=False) as counter:
        inputs, targets = (value.to("meta").unsqueeze(0) for value in sample)
        loss_fn(model(inputs), targets).backward()
    return counter.get_total_flops()

# Dense 16-bit peaks from NVIDIA's datasheets (half their "with sparsity" figures); TF32's is half.
PEAK_FLOPS = {"A100": 312e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
              "H200 NVL": 835e12, "H200": 989e12, "B200": 2250e12}

class Meter:
    """The step line and its scalars: loss, lr and, since the last, all processes' speed and MFU."""

    def __init__(self, args, data_info, step, sample, world_size, device, precision):
        gpu = torch.cuda.get_device_name(device).replace("-", " ") if device.type == "cuda" else ""
        peak = next((peak for name, peak in PEAK_FLOPS.items() if f" {name} " in f" {gpu} "), None)
        self.peak = peak and world_size * peak / (2 if precision == "fp32" else 1)  # fp32's: TF32
        self.tokens = sample[1].numel()  # a sample's predictions: for the GPT, its tokens
        self.batch_size, self.flops = args.batch_size, count_flops(args, data_info, sample)
        self.restart(step)

    def restart(self, step):  # after an evaluation or a save: the speed is training's alone
        self.step, self.time = step, time.perf_counter()

    def log(self, step, loss, lr):
        if not math.isfinite(loss):
            fail(f"the loss is {loss} at step {step}: training diverged; try a lower --lr")
        samples_per_sec = (step - self.step) * self.batch_size / (time.perf_counter() - self.time)
        tokens_per_sec, flops = samples_per_sec * self.tokens, samples_per_sec * self.flops
        self.restart(step)
        mfu = f" | {flops / self.peak:.1%} MFU" if self.peak else ""
        log.info(f"step {step:>5} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_sec:,.0f} tokens/s"
                 f" | {flops / 1e12:.3g} TFLOP/s{mfu}")
        return {"train/loss": loss, "train/lr": lr, "train/tokens_per_sec": tokens_per_sec,
                "train/tflops": flops / 1e12}

def write_scalars(writer, scalars, step):
    if writer is None:  # every rank but 0
        return
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, step)

def start_profiler(args, rank):
    """With --profile, a profiler that traces steps 7 to 9, once warm: ui.perfetto.dev opens it."""
    if not args.profile:
        return contextlib.nullcontext()
    trace = os.path.join(args.log_dir, f"trace_rank{rank}.json")
    schedule = torch.profiler.schedule(wait=5, warmup=1, active=3, repeat=1)  # else every 9 steps
    return torch.profiler.profile(schedule=schedule,
                                  on_trace_ready=lambda prof: prof.export_chrome_trace(trace))

def stop_vote(signals_received):
    """The stop signal any rank has received (the largest), or 0: every rank stops at one step. On
    the CPU (gloo), at logging steps alone: a round through every rank costs more as they grow."""
    signum = torch.tensor(signals_received[0] if signals_received else 0)
    dist.all_reduce(signum, dist.ReduceOp.MAX)
    return signum.item()

def catch_stop_signals():
    """From here on, a stop signal is noted in the list returned: the loop saves, then stops."""
    signals_received = []
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: signals_received.append(signum))
    return signals_received

def ignore_stop_signals(worker_id):
    """A spawned loader worker ignores stop signals (3.14's forkserver would die of them)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)  # the training process saves, then stops


# -- training step ------------------------------------------------------------

def configure_optimizer(model, args):
    """AdamW with decay on matrices only; each group's "initial_lr" is --lr, the schedule's peak."""
    params = list(model.parameters())
    matrices, vectors = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": args.weight_decay, "initial_lr": args.lr},
              {"params": vectors, "weight_decay": 0.0, "initial_lr": args.lr}]  # biases, norms
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)

def lr_factor(step, args):
    """Step `step`'s share of --lr: linear warmup, then cosine decay to a tenth."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    decay_steps = max(1, (args.lr_decay_steps or args.max_steps) - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / decay_steps)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

def train_step(model, optimizer, step, scaler, micro_batches, args, device):
    """Optimizer step `step` over --grad-accum micro-batches: the mean loss (a tensor), the lr."""
    total_loss = torch.zeros((), device=device)  # .item() waits for the GPU: logging steps alone
    for micro_step in range(args.grad_accum):
        inputs, targets = (t.to(device, non_blocking=True) for t in next(micro_batches))
        model.set_requires_all_reduce(micro_step == args.grad_accum - 1)  # replicas: once a step
        loss = loss_fn(model(inputs), targets) / args.grad_accum
        scaler.scale(loss).backward()  # reduce-scatters: each rank keeps its gradients' shard
        total_loss += loss.detach()
    scaler.unscale_(optimizer)  # the true gradients, to clip; an inf on any rank's shard counts
    if args.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    for group in optimizer.param_groups:  # from the step and the flags: a resume follows its own
        group["lr"] = group["initial_lr"] * lr_factor(step, args)
    scaler.step(optimizer)  # fp16: skipped if a gradient is inf or NaN
    scaler.update()  # fp16: halves the scale after a skip, doubles it after 2000 steps without
    optimizer.zero_grad(set_to_none=True)
    return total_loss, optimizer.param_groups[0]["lr"]

def weights_are_finite(model):
    finite = torch.stack([p.to_local().isfinite().all() for p in model.parameters()]).all().int()
    dist.all_reduce(finite, dist.ReduceOp.MIN)  # this rank's shards, then every rank's
    return bool(finite)


# -- evaluation ---------------------------------------------------------------

@torch.no_grad()
def evaluate(model, loader, device):
    """Mean loss and accuracy over every prediction in the loader's samples."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, predictions
    for inputs, targets in loader:
        inputs, targets = (t.to(device, non_blocking=True) for t in (inputs, targets))
        outputs = model(inputs)
        totals[0] += loss_fn(outputs, targets, reduction="sum")
        totals[1] += (outputs.argmax(-1) == targets).sum()
        totals[2] += targets.numel()
    model.train()
    dist.all_reduce(totals)  # each rank evaluated its share: add up the sums
    return (totals[:2] / totals[2]).tolist()  # the mean loss, and accuracy


# -- checkpointing ------------------------------------------------------------

warnings.filterwarnings("ignore", "torch.distributed is disabled")  # DCP in one process: as meant
BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)  # AdamW's state by name: any split
@functools.cache  # a save's host copy, kept for the next (async_save's own is made anew each time)
def host_copy(cuda):  # from a GPU pinned, which the copy fills at the link's full speed
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=cuda))

def save_checkpoint(model, optimizer, extras, step, config, args, last_save, group=None):
    """Once `last_save` is written, copy the state to host memory; return a future writing it."""
    if not weights_are_finite(model):
        fail(f"the weights are not finite at step {step}: diverged, and not saved")
    wait_for_checkpoint(last_save, args)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=BY_NAME)
    state = {"model": model_state, "optimizer": optimizer_state, "step": step, "config": config,
             **{name: value.state_dict() for name, value in extras.items()}}
    path = os.path.join(args.ckpt_dir, f"step-{step:06d}")
    log.info(f"step {step:>5} | saving {path}")
    writer = dcp.FileSystemWriter(path, per_thread_copy_ahead=0)  # on the host: no CUDA stream
    return dcp.async_save(state, storage_writer=writer, process_group=group,
                          async_stager=host_copy(torch.cuda.is_initialized()))

def wait_for_checkpoint(last_save, args):
    """Wait for `last_save` (or None) to be written, then keep the newest --keep-checkpoints."""
    if last_save is not None:
        last_save.result()
        for old in complete_checkpoints(args.ckpt_dir)[:-args.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

def complete_checkpoints(ckpt_dir):
    """ckpt_dir's step-N (not step-N.bak) with .metadata, by step: a crash mid-save leaves none."""
    with contextlib.suppress(OSError):  # main() asks before any step: a bad path fails there
        os.makedirs(ckpt_dir, exist_ok=True)
    if not (os.path.isdir(ckpt_dir) and os.access(ckpt_dir, os.W_OK | os.X_OK)):
        fail(f"cannot write in --ckpt-dir {ckpt_dir}")
    done = glob.glob(os.path.join(glob.escape(ckpt_dir), "step-*", ".metadata"))
    done = [os.path.dirname(path) for path in done if path.split(os.sep)[-2][5:].isdecimal()]
    return sorted(done, key=lambda path: (len(path), path))  # step-1000000 after step-999999

def load_checkpoint(path, model, optimizer, extras, config):
    """Load the state at `path` in place, keeping this run's optimizer settings; return its step."""
    model_state, optimizer_state = get_state_dict(model, optimizer, options=BY_NAME)
    settings = {k: v for k, v in optimizer_state.items() if k.startswith("param_groups.")}  # ours
    state = {"model": model_state, "optimizer": optimizer_state, "step": 0,
             "config": dict.fromkeys(config), **{k: v.state_dict() for k, v in extras.items()}}
    try:
        dcp.load({"config": state["config"]}, checkpoint_id=path)  # first: a model's tensors misfit
        if state["config"] != config:
            raise ValueError(f"it holds a model {state['config']}, this run builds {config}")
        dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.CheckpointException) as error:  # noqa: BLE001  DCP's: each process's
        error = next(iter(error.failures.values()))[0] if hasattr(error, "failures") else error
        fail(f"cannot resume from {path}: {str(error).strip().splitlines()[0]}")
    changed = {key.rpartition(".")[2]: (value, optimizer_state[key]) for key, value in
               settings.items() if optimizer_state[key] != value and not key.endswith(".lr")}
    for name, (mine, theirs) in changed.items():  # not "lr": train_step sets the rate each step
        log.info(f"{name} {mine}, from this run's flags; the checkpoint's run had {theirs}")
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={**optimizer_state, **settings}, options=BY_NAME)
    for name, value in extras.items():
        value.load_state_dict(state[name])
    log.info(f"resumed from {path} at step {state['step']}")
    return state["step"]


# -- main ---------------------------------------------------------------------

def main(args):
    device, rank, world_size = setup(args)
    context_size, context = context_parallel_group(args, world_size)  # a row: one batch
    data_rank, data_size = rank // context_size, world_size // context_size
    if args.batch_size % (data_size * args.grad_accum):
        fail(f"--batch-size {args.batch_size} does not divide into {data_size} rows x "
             f"--grad-accum {args.grad_accum}")
    per_process_batch_size = args.batch_size // (data_size * args.grad_accum)  # one forward pass
    train_set, val_set, data_info = build_datasets(args)
    steps_per_epoch = len(train_set) // args.batch_size  # full batches only
    if steps_per_epoch == 0 or len(val_set) < args.batch_size:
        fail(f"{len(train_set)} training and {len(val_set)} validation samples are too few")
    val_batches = min(len(val_set) // args.batch_size, args.eval_batches)  # one shape, one compile
    val_set = Subset(val_set, range(val_batches * args.batch_size))
    with torch.device("meta"):  # shapes, no memory: no process ever holds the whole model
        model, config = build_model(args, data_info)
    if not hasattr(model, "init_tensor"):  # its values come from its constructor: whole, then shard
        model, config = build_model(args, data_info)
    attention, on = ContextParallel(context, args.seq_len), next(model.parameters()).device
    positions = attention.positions  # this rank's share of every sequence
    for block in getattr(model, "blocks", {}).values():  # each attends across the row
        block.forward = functools.partial(attention, block.forward)
    try:  # a forward pass: the model takes a share of positions, and its blocks call SDPA
        model(train_set[0][0][None, positions].to(on), positions=positions.to(on))
    except TypeError as error:  # a forward() without positions
        fail(f"--context-parallel needs the model's forward(tokens, positions=...): {error}")
    if not attention.reached:
        fail("--context-parallel splits F.scaled_dot_product_attention: the blocks call none")
    wrapped_model = prepare_model(model, args, device)  # evaluation and checkpoints use `model`
    model.forward = functools.partial(model.forward, positions=positions.to(device))  # the share
    optimizer = configure_optimizer(model, args)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    extras = {"scaler": scaler}  # checkpointed beside the model and the optimizer
    log.info(f"{sum(p.numel() for p in model.parameters()):,} parameters on {device} | global "
             f"batch {args.batch_size} = {per_process_batch_size} x {args.grad_accum} micro-batches"
             f" x {data_size} rows of {context_size}")
    from_rank_0 = [args.ckpt_dir and complete_checkpoints(args.ckpt_dir)]  # the newest resumes
    dist.broadcast_object_list(from_rank_0)  # rank 0's list for all: another node's view can lag
    checkpoints = from_rank_0[0]
    step = load_checkpoint(checkpoints[-1], model, optimizer, extras, config) if checkpoints else 0
    torch.manual_seed(args.seed + step * world_size + rank)  # dropout: each rank its own masks
    sampler = DistributedSampler(train_set, data_size, data_rank, seed=args.seed, drop_last=True)
    val_set = Subset(val_set, range(data_rank, len(val_set), data_size))  # exact: no padding
    loader = functools.partial(DataLoader, batch_size=per_process_batch_size,
                               num_workers=args.workers, persistent_workers=args.workers > 0,
                               multiprocessing_context="spawn" if args.workers else None,
                               pin_memory=device.type == "cuda", worker_init_fn=ignore_stop_signals,
                               collate_fn=functools.partial(share, positions))  # a row's samples
    train_loader, val_loader = loader(train_set, sampler=SkippingSampler(sampler)), loader(val_set)
    meter = Meter(args, data_info, step, train_set[0], world_size, device, args.precision)
    profiler, signals_received = start_profiler(args, rank), catch_stop_signals()
    last_save = micro_batches = None
    timeout = datetime.timedelta(seconds=args.timeout)
    save_group = dist.new_group(backend="gloo", timeout=timeout)  # saves: own group, own --timeout
    with SummaryWriter(args.log_dir) if rank == 0 else contextlib.nullcontext() as writer, profiler:
        while True:
            if step % args.eval_every == 0 or step == args.max_steps:
                val_loss, val_accuracy = evaluate(model, val_loader, device)
                log.info(f"step {step:>5} | val loss {val_loss:.4f} | accuracy {val_accuracy:.4f}")
                write_scalars(writer, {"val/loss": val_loss, "val/accuracy": val_accuracy}, step)
                meter.restart(step)
            if step >= args.max_steps:
                break
            if micro_batches is None or step % steps_per_epoch == 0:
                sampler.set_epoch(step // steps_per_epoch)  # epoch's order, the same on every rank
                train_loader.sampler.start = step % steps_per_epoch * args.batch_size // data_size
                micro_batches = iter(train_loader)
            loss, lr = train_step(wrapped_model, optimizer, step, scaler, micro_batches, args,
                              device)
            step += 1
            if args.profile:
                profiler.step()
            voting = step % args.log_every == 0 and step < args.max_steps  # at logging steps alone
            stop = stop_vote(signals_received) if voting else 0
            if step % args.log_every == 0 or step == args.max_steps:
                dist.all_reduce(loss)  # the sum of every rank's
                write_scalars(writer, meter.log(step, loss.item() / world_size, lr), step)
            if args.ckpt_dir and (step % args.ckpt_every == 0 or step == args.max_steps or stop):
                last_save = save_checkpoint(model, optimizer, extras, step, config, args, last_save,
                                            save_group)
                meter.restart(step)
            if stop:
                wait_for_checkpoint(last_save, args)
                log.info(f"step {step:>5} | stopped by {signal.Signals(stop).name}: "
                         + ("run again to resume" if args.ckpt_dir else "no --ckpt-dir, not saved"))
                return 75  # EX_TEMPFAIL: not a failure, a job to run again
    wait_for_checkpoint(last_save, args)


if __name__ == "__main__":
    exit_code = main(parse_args())
    dist.destroy_process_group()  # a clean end, which every rank reached
    sys.exit(exit_code)
