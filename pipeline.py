"""Train a small GPT with pipeline parallelism: its blocks split into stages, one or more on each torchrun process.

    torchrun --standalone --nproc_per_node=2 pipeline.py      # two stages; plain `python` runs one stage
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=JOB pipeline.py \
        --n-layers 16 --grad-accum 16     # 16 stages: a block and a micro-batch for each at least
    tensorboard --logdir runs            # loss, accuracy, learning rate and throughput

--data FILE trains a byte-level model of any text file, --ckpt-dir DIR checkpoints (run again to
resume), --d-model, --n-layers, --n-heads and --seq-len scale the model; --help lists every flag.
"""

import argparse
import atexit
import contextlib
import datetime
import functools
import gc
import itertools
import logging
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

MIN_TORCH = "2.10"  # the oldest release this script has run on
if torch.__version__ < MIN_TORCH:  # compared as versions; checked before the imports below, which an older torch may lack
    sys.exit(f"{os.path.basename(__file__)}: error: this script needs torch {MIN_TORCH} or newer, found {torch.__version__}")

import torch.distributed as dist
import torch.distributed.nn  # before any group exists: its functions bind the default group when imported, and keep it
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                         ScheduleInterleavedZeroBubble, ScheduleLoopedBFS)
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, Subset
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)
# The signals that make a run save a checkpoint, then stop (catch_stop_signals). Windows has no SIGUSR1.
STOP_SIGNALS = [getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)]


# -- configuration ------------------------------------------------------------


def fail(message):
    """Exit with a one-line error and no traceback: bad input is for the user to fix. Such a failure would recur, so
    under torchrun with restarts left it also stops torchrun, which then ends the job instead of restarting it."""
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))  # torchrun sets both in each process it starts
    restarts_left -= int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts_left > 0 and os.getppid() != 1:  # torchrun is this process's parent, unless it has died
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun passes its stop on to every process: this one ends anyway
        os.kill(os.getppid(), signal.SIGTERM)  # torchrun restarts failed processes, but a signal to it ends the job
    sys.exit(f"{os.path.basename(__file__)}: error: {message}")


def causes(error):
    """`error`, then the errors it was raised from or while handling: torch often reports a failure as another."""
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def one_line(error):
    """The first line of what went wrong: of the first failing rank's error, where DCP gathers every rank's into one."""
    error = next(iter(error.failures.values()))[0] if isinstance(error, dcp.CheckpointException) else error
    return (str(error).strip() or type(error).__name__).splitlines()[0]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch: samples per optimizer step")
    parser.add_argument("--grad-accum", type=int, default=8,
                        help="micro-batches per optimizer step: what flows through the pipeline")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "zero-bubble"], default="1f1b",
                        help="the order of the micro-batches' forward and backward passes on each stage (zero-bubble: "
                        "1f1b with each backward split, the weights' gradients computed in the bubble)")
    parser.add_argument("--stages-per-process", type=int, default=1, metavar="V",
                        help="split the blocks into V x N stages, stage s on process s mod N: V times the messages, "
                        "1/V of the bubble")
    parser.add_argument("--max-steps", type=int, default=300, help="optimizer steps to train for")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=30, help="steps of linear learning-rate warmup")
    parser.add_argument("--lr-decay-steps", type=int, help="cosine decay ends here (default: --max-steps)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm; 0 turns clipping off")
    parser.add_argument("--log-every", type=int, default=10, help="steps between console and TensorBoard logs")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation passes")
    parser.add_argument("--eval-batches", type=int, default=20,
                        help="validation batches of --batch-size samples per pass, the first of the split")
    parser.add_argument("--log-dir", default=os.path.join("runs", os.path.basename(__file__)[:-3]),
                        help="TensorBoard directory")
    parser.add_argument("--ckpt-dir", help="keep DIR/checkpoint here, a directory of each stage's tensors, and resume "
                        "from it (or from DIR/checkpoint.pt, the whole model in one file; default: off)")
    parser.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--keep-checkpoints", type=int, default=1, metavar="K",
                        help="keep the last K checkpoints, numbered by step (default 1: the latest alone)")
    parser.add_argument("--sync-checkpoints", action="store_true",
                        help="write each checkpoint before training goes on (default: in the background, from a copy)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for a missing or stuck rank, then fail")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model: slower start, faster steps")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="keep each block's input alone and rerun its forward in backward: less memory, more compute")
    parser.add_argument("--profile", action="store_true",
                        help="trace steps 7 to 9 of this run with torch.profiler: a Chrome trace per process in --log-dir")
    own_flags = vars(parser.parse_known_args([])[0])  # checked below; the data and model sections check theirs
    # The data and model sections define their own flags: replace a section, and its flags go with it.
    add_data_args(parser.add_argument_group("data (the data section's flags)"))
    add_model_args(parser.add_argument_group("model (the model section's flags)"))
    args = parser.parse_args()
    zero_or_more = ["warmup_steps", "weight_decay", "grad_clip"]  # 0 turns each off; every other number must be positive
    for name, value in vars(args).items():  # the seed may be any integer: the rest would fail later, or train nothing
        if name not in own_flags or type(value) not in (int, float) or name == "seed":
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and name not in zero_or_more):
            fail(f"--{name.replace('_', '-')} must be {'zero or more' if name in zero_or_more else 'positive'}, got {value}")
    if args.batch_size % args.grad_accum:
        fail(f"--batch-size {args.batch_size} is not divisible by --grad-accum {args.grad_accum}")
    if args.schedule == "zero-bubble" and args.compile:  # seen: a compiled backward's buffers are freed after its first half
        fail("--schedule zero-bubble runs each backward in two halves, which a compiled graph's backward cannot: "
             "drop --compile or choose another schedule")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but no CUDA device is available")
    for flag, path in [("--log-dir", args.log_dir), ("--ckpt-dir", args.ckpt_dir)]:
        if path:  # checked now, not at the first checkpoint: the training until then would be lost
            try:
                os.makedirs(path, exist_ok=True)
                tempfile.TemporaryFile(dir=path).close()
            except OSError as e:
                fail(f"{flag} {path} is not a directory this process can write to: {e.strerror}")
    args.lr_decay_steps = args.lr_decay_steps or args.max_steps
    args.memory_snapshot = None  # start_profiler() names one where --profile records a GPU's allocations
    return args


# -- data ---------------------------------------------------------------------


def add_data_args(parser):
    parser.add_argument("--data", help="train a byte-level model on this text file (default: built-in data)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per training sequence")
    parser.add_argument("--workers", type=int, default=0,
                        help="processes that load batches beside each training process (default 0: this data is in memory)")


def markov_sequences(seq_len, num_tokens=2**18, vocab_size=64, seed=1234):
    """Sequences from a fixed random Markov chain, num_tokens in all: learnable, and its entropy rate
    is the lowest loss any model can reach, so the log can show how close training gets."""
    num_seqs = num_tokens // seq_len
    if num_seqs < 10:
        fail(f"--seq-len {seq_len} cuts the built-in data's {num_tokens:,} tokens into fewer than 10 sequences: use --data")
    gen = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(3 * torch.randn(vocab_size, vocab_size, generator=gen, dtype=torch.float64), 1)
    stationary = torch.full((vocab_size,), 1 / vocab_size, dtype=torch.float64)
    for _ in range(200):
        stationary = stationary @ transitions
    entropy_rate = -(stationary[:, None] * transitions * transitions.log()).sum().item()
    log.info(f"built-in data: a random Markov chain over {vocab_size} tokens; its entropy rate, {entropy_rate:.4f}, "
             f"is the lowest loss any model can reach")
    tokens = torch.empty(num_seqs, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(stationary, num_seqs, replacement=True, generator=gen)
    for t in range(seq_len):
        tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=gen)[:, 0]
    return tokens, vocab_size


def text_file_sequences(path, seq_len):
    """Consecutive chunks of a file's bytes: a byte-level language model with a vocabulary of 256.
    The file is memory-mapped, not read: its bytes stay in the page cache, one copy for every
    process on the machine."""
    if not os.path.isfile(path):
        fail(f"--data {path}: no such file")
    size = os.path.getsize(path)
    num_seqs = (size - 1) // seq_len
    if num_seqs < 10:
        fail(f"--data {path} has {size} bytes; --seq-len {seq_len} needs at least {10 * seq_len + 1}")
    tokens = torch.from_file(path, size=num_seqs * seq_len + 1, dtype=torch.uint8)  # copy-on-write: never changes the file
    # Chunk i is tokens[i*seq_len : (i+1)*seq_len + 1]: neighbours share one token, the next target.
    return tokens.as_strided((num_seqs, seq_len + 1), (seq_len, 1)), 256


class TokenSequences(Dataset):
    """Row i of a (sequences, seq_len + 1) tensor of tokens as an (input, target) pair, the target
    shifted by one token. Rows become int64 only when fetched: a file's bytes stay bytes in memory."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :-1].long(), self.tokens[i, 1:].long()


def build_datasets(args):
    """Train and validation sets of (input, target) pairs, the last tenth held out, and what the model
    section needs to know of the data: here the vocabulary size."""
    if args.seq_len <= 0:
        fail(f"--seq-len must be positive, got {args.seq_len}")
    if args.data:
        tokens, vocab_size = text_file_sequences(args.data, args.seq_len)
    else:
        tokens, vocab_size = markov_sequences(args.seq_len)
    dataset = TokenSequences(tokens)
    num_train = len(dataset) - len(dataset) // 10
    train_set, val_set = Subset(dataset, range(num_train)), Subset(dataset, range(num_train, len(dataset)))
    return train_set, val_set, {"vocab_size": vocab_size}


def make_loader(dataset, batch_size, args, **options):
    """A DataLoader of the dataset, as this data needs it. With --workers N, N processes fetch and prefetch batches
    while the training process computes, and stay alive from one epoch to the next: for data that is decoded or
    read from disk. The built-in data and --data are tensors in memory already, so the default is 0: the training
    process fetches each batch itself, and nothing is copied between processes."""
    if args.workers < 0:
        fail(f"--workers must be zero or more, got {args.workers}")
    return DataLoader(dataset, batch_size, num_workers=args.workers, persistent_workers=args.workers > 0, **options)


# -- model --------------------------------------------------------------------


def add_model_args(parser):
    parser.add_argument("--d-model", type=int, default=64, help="width of the model")
    parser.add_argument("--n-layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--n-heads", type=int, default=4, help="attention heads; must divide --d-model")


@dataclass
class ModelConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each added to the residual."""

    def __init__(self, config):
        super().__init__()
        self.n_heads = config.n_heads
        self.attn_norm = nn.LayerNorm(config.d_model)
        # No bias: a key bias shifts a query's scores all alike, which softmax ignores, so its gradient
        # is rounding noise that Adam would amplify into steps of full size.
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.attn_out = nn.Linear(config.d_model, config.d_model)
        self.mlp_norm = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(), nn.Linear(4 * config.d_model, config.d_model)
        )

    def forward(self, x):
        batch, seq_len, d_model = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d_model, dim=-1)
        q, k, v = (t.view(batch, seq_len, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attn.transpose(1, 2).reshape(batch, seq_len, d_model))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        # Blocks by name ("0", "1", ...): FSDP shards them one at a time, a pipeline stage keeps some.
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layers)})
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def init_tensor(self, name, value, generator):
        """Fill `value`, a CPU tensor shaped as the parameter or buffer `name`, with its initial values, drawn from
        `generator`: weights of Linear and Embedding layers from N(0, 0.02) as in GPT-2, biases 0, LayerNorm's scales
        1. The scripts call this once per tensor (init_weights): no process need ever hold the whole model."""
        if isinstance(self.get_submodule(name.rpartition(".")[0]), nn.LayerNorm):
            value.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            value.zero_()
        else:
            value.normal_(0.0, 0.02, generator=generator)

    # forward() in three parts, the modules registered in the same order: the layers before the blocks, the
    # blocks, the layers after them. A stage of a pipeline-parallel run calls only the parts it holds.
    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks.values():
            x = block(x)
        return self.output(x)

    def embed(self, tokens):
        return self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))

    def output(self, x):
        return self.head(self.norm(x))

    def flops_per_token(self):
        """Training FLOPs per token as the PaLM paper (appendix B) counts them: 6 per weight of a matmul (forward and
        backward; embeddings are lookups, biases and LayerNorm's scales no matmuls), plus attention's 12 x layers x
        d_model x seq_len. torch's FlopCounterMode counts the same."""
        matrices = sum(p.numel() for p in self.parameters() if p.dim() == 2)
        matmul_weights = matrices - self.tok_emb.weight.numel() - self.pos_emb.weight.numel()
        return 6 * matmul_weights + 12 * self.config.n_layers * self.config.d_model * self.config.seq_len


def build_model(args, data_info):
    """The model to train, and its configuration: a dict that checkpoints keep and a resumed run must match."""
    for name in "d_model", "n_layers", "n_heads":
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.d_model % args.n_heads:
        fail(f"--n-heads {args.n_heads} does not divide --d-model {args.d_model}")
    config = ModelConfig(data_info["vocab_size"], args.seq_len, args.d_model, args.n_layers, args.n_heads)
    log.info(f"a uniform guess over {config.vocab_size} tokens scores a loss of {math.log(config.vocab_size):.4f}")
    return GPT(config), asdict(config)


def loss_fn(logits, targets, reduction="mean"):
    """Cross-entropy of each next-token prediction: logits (batch, seq_len, vocab), targets (batch, seq_len)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def count_correct(logits, targets):
    """Correct next-token predictions, and predictions made (the terms loss_fn adds up)."""
    return (logits.argmax(-1) == targets).sum(), targets.numel()


def throughput_unit(model, args):
    """What the step line counts per second: tokens, --seq-len of them per sample, each worth flops_per_token."""
    return "tokens", args.seq_len, model.flops_per_token()


# -- setup --------------------------------------------------------------------


def leave_process_group():
    """Run by atexit at every exit Python runs (not SIGKILL, not os._exit): after an error, abort the groups, which
    destroying would leave waiting for a failed peer."""
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()  # a private name, the same from torch 2.8 to 2.15
    gc.collect()  # frees what reference cycles hold while Python is whole: a gloo thread left running aborts the exit


def exit_if_another_process_failed(error):
    """Exit in one line if `error` says another process failed or stopped responding: its own line says why."""
    lost = re.compile("by peer|Broken pipe|Connection refused|Timed out waiting")
    seen = next((e for e in causes(error) if isinstance(e, dist.DistError) or lost.search(str(e))), None)
    if seen is not None and dist.is_initialized():
        first = re.sub(r"^\[.*?\] ", "", (str(seen).strip() or type(seen).__name__).splitlines()[0]).split(". ")[0]
        sys.exit(f"{os.path.basename(__file__)}: error: rank {dist.get_rank()} stops: another process failed or stopped "
                 f"responding (seen here as: {first})")


def setup(args):
    """Prepare this process to train: pick its device and seed the model's initialisation."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()  # local rank r uses GPU r
        if gpus == 1 and os.environ.get("CUDA_VISIBLE_DEVICES") and "TORCHELASTIC_RUN_ID" not in os.environ:
            local_rank = 0  # not a torchrun worker, whose GPUs all workers see: a scheduler gave it a GPU of its own
        if local_rank >= gpus:
            fail(f"local rank {local_rank} has no GPU: this node has {gpus}; start at most that many per node (--nproc_per_node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init_process_group, so NCCL uses this process's GPU alone
    # The launcher sets these; plain `python` makes a world of one, whose store may take any free port ("0").
    for name, default in [("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "localhost"), ("MASTER_PORT", "0")]:
        os.environ.setdefault(name, default)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None,
                            timeout=datetime.timedelta(seconds=args.timeout))
    atexit.register(leave_process_group)  # at every exit Python runs, errors included
    # fp32 matmuls on TF32 tensor cores, on GPUs from Ampere on: 495 instead of 67 TFLOP/s on an H100 (its datasheet),
    # for a 10-bit mantissa that training does not notice. Nothing changes on a CPU.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    return device


def log_placement(device):
    """Log one line per host: its ranks and their devices. A GPU is named by the start of its UUID too, which
    `nvidia-smi -L` prints: CUDA_VISIBLE_DEVICES renumbers the GPUs, it does not."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None) if device.type == "cuda" else None  # not in 2.4
    gpu = f" (GPU-{str(uuid)[:8]})" if uuid else ""
    placements = [None] * dist.get_world_size()  # every rank's, for rank 0 to log
    dist.all_gather_object(placements, (socket.gethostname(), f"rank {dist.get_rank()} on {device}{gpu}"))
    for host in dict.fromkeys(host for host, _ in placements):  # hosts in the order of their first rank
        log.info(f"{host}: {', '.join(where for on, where in placements if on == host)}")


class SkippingSampler(Sampler):
    """Another sampler's order, from its `start`-th index on: a resumed run skips what its epoch has already trained on
    by index, fetching none of it."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, 0

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self):
        return len(self.sampler) - self.start


def peak_flops(device, precision):
    """The dense peak FLOP/s of a GPU's matrix products in `precision` ("bf16", "fp16", or "tf32": how fp32 products
    run here, setup turns it on), from NVIDIA's datasheets: what MFU is measured against. None for any other GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    # (16 bits, TF32): half the datasheets' figures "with sparsity": NVIDIA's A100, H100 (SXM, PCIe, NVL), H200, GH200
    # (an H100 SXM's compute) and HGX B200 (a B200 at 1,000 W) datasheets. H800 and others: no datasheet figure, no MFU.
    peaks = {"NVIDIA H100 80GB HBM3": (989e12, 494.5e12), "NVIDIA H100 PCIe": (756e12, 378e12),
             "NVIDIA H100 NVL": (835e12, 417.5e12), "NVIDIA H200": (989e12, 494.5e12), "NVIDIA B200": (2.25e15, 1.1e15)}
    families = {"NVIDIA A100": (312e12, 156e12), "NVIDIA GH200": (989e12, 494.5e12)}  # "NVIDIA A100-SXM4-80GB", ...
    figures = next((figures for prefix, figures in families.items() if name.startswith(prefix)), peaks.get(name))
    if figures is None:
        return None
    peak = figures[{"bf16": 0, "fp16": 0, "tf32": 1}[precision]]
    log.info(f"MFU: model FLOP/s over the {name}'s dense {precision} peak, {peak / 1e12:g} TFLOP/s")
    return peak


def split_model(model, stage_indices, num_stages, inputs):
    """Keep these stages' parts of the model (runs of blocks; embed()'s modules first, output()'s last), delete the rest.
    Returns each stage's module names, and these stages' example inputs and outputs for `inputs` on the meta device."""
    if not (isinstance(getattr(model, "blocks", None), nn.ModuleDict) and hasattr(model, "embed") and hasattr(model, "output")):
        fail("pipeline.py runs a model as embed(), the modules of a ModuleDict named blocks, then output(): "
             f"{type(model).__name__} lacks some of them")
    blocks = list(model.blocks)
    if num_stages > len(blocks):
        fail(f"{num_stages} pipeline stages (processes x --stages-per-process), but the model has {len(blocks)} blocks: "
             f"make at most {len(blocks)}")
    if any(True for _ in model.named_parameters(recurse=False)):
        fail("pipeline.py splits the model by its modules: a parameter of the model itself would belong to no stage")
    if len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters())):
        fail("pipeline.py cannot split modules that share a parameter (tied weights): two stages would train two copies")
    # Stage s holds blocks ceil(s * n / S) up to ceil((s + 1) * n / S): any left over go to the first stages.
    bounds = [math.ceil(s * len(blocks) / num_stages) for s in range(num_stages + 1)]
    runs = [blocks[start:end] for start, end in itertools.pairwise(bounds)]
    # The forward on the meta device, piece by piece: each stage's shapes without memory (PipelineStage would run it
    # on uninitialised inputs, which BatchNorm would count), and the same modules, in order, as forward() calls.
    children = [name for name, _ in model.named_children()]
    called = []  # the modules that run, by name, in order
    hooks = [module.register_forward_pre_hook(lambda *_, name=name: called.append(name))
             for name, module in model.named_modules() if name]
    with torch.no_grad():
        whole = model(inputs)
        forward_called, called[:] = called[:], []
        x, activations = model.embed(inputs), [inputs]
        for s, run in enumerate(runs):
            for name in run:
                x = model.blocks[name](x)
                if not isinstance(x, torch.Tensor):  # a stage sends one tensor on to the next
                    fail(f"block {name} returns a {type(x).__name__}: pipeline.py needs blocks that map a tensor to a tensor")
            activations.append(model.output(x) if s == num_stages - 1 else x)
    for hook in hooks:
        hook.remove()
    # Each module's side of the blocks: -1 before (the first stage's), 0 in them, 1 after (the last stage's).
    side = {name: (i > children.index("blocks")) - (i < children.index("blocks")) for i, name in enumerate(children)}
    if [side[name.split(".")[0]] for name in called] != sorted(side[name.split(".")[0]] for name in called):
        fail("embed() must run only modules registered before blocks, output() only those after: the first stage holds the "
             "former, the last the latter")
    if called != forward_called or activations[-1].shape != getattr(whole, "shape", None):
        fail("forward() does not run as embed(), the blocks in order, then output(): pipeline.py, which runs those, "
             "would train another model")
    activations[1:] = [x.requires_grad_() for x in activations[1:]]  # in training, gradients flow back through these
    before, after = children[:children.index("blocks")], children[children.index("blocks") + 1:]
    parts = [[f"blocks.{name}" for name in run] for run in runs]
    parts[0] = before + parts[0]
    parts[-1] = parts[-1] + after  # the same list as parts[0] in a world of one
    for name in [name for s, part in enumerate(parts) if s not in stage_indices for name in part]:
        parent, child = name.split(".") if name.startswith("blocks.") else ("", name)
        # The others keep their names ("blocks.2" stays "blocks.2"): checkpoints have the unsplit model's keys.
        delattr(model.get_submodule(parent), child)
    return parts, [(activations[s], activations[s + 1]) for s in stage_indices]


class Stage(nn.Module):
    """What one stage runs of the model's forward(): embed() on the first stage, its blocks, output() on the last.
    It registers its own modules alone: the schedule scales, and may compute, the gradients of each stage apart."""

    def __init__(self, model, part, is_first, is_last):
        super().__init__()
        self.held = nn.ModuleList(model.get_submodule(name) for name in part)
        self.blocks = [model.get_submodule(name) for name in part if name.startswith("blocks.")]  # a list: not registered twice
        self.embed, self.output = model.embed if is_first else None, model.output if is_last else None

    def forward(self, x):
        x = self.embed(x) if self.embed else x
        for block in self.blocks:
            x = block(x)
        return self.output(x) if self.output else x


@torch.no_grad()
def init_weights(model, seed):
    """Give every parameter and buffer its initial values, one whole tensor at a time on the CPU, drawn by the model's
    init_tensor() from a generator seeded by `seed` and the tensor's name: a tensor starts with the same values
    however the model is split across processes, whole or in shards. A model without init_tensor() keeps the values
    its constructor gave it."""
    if not hasattr(model, "init_tensor"):
        return
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        value = torch.empty(tensor.shape, dtype=tensor.dtype)
        model.init_tensor(name, value, torch.Generator().manual_seed(zlib.crc32(f"{seed} {name}".encode())))
        tensor.copy_(value)


def measure_flops(args, data_info, sample):
    """The training FLOPs of one sample as torch counts them (FlopCounterMode: matmuls, convolutions, attention): one
    forward and backward of the model built anew on the meta device, which takes no memory and next to no time."""
    logging.disable(logging.INFO)  # build_model's log lines were printed when it first ran
    with torch.device("meta"):
        model, _ = build_model(args, data_info)
    logging.disable(logging.NOTSET)
    inputs, targets = (value.to("meta").unsqueeze(0) for value in sample)  # a batch of one
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(inputs), targets).backward()
    return counter.get_total_flops()


def write_scalars(writer, scalars, step):
    """Add each of `scalars`, {tag: number}, to TensorBoard at `step`."""
    if writer is None:  # every rank but 0, which alone writes
        return
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, step)


def peak_memory(device):
    """The most memory this process has held so far, in bytes: on a GPU what torch's allocator gave its tensors, on
    a CPU all the process had resident, torch itself included, as the OS counts it (None on Windows: no `resource`)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        import resource  # Unix only
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # KiB on Linux


def catch_stop_signals():
    """From here on SIGTERM and SIGUSR1 do not end this process: each is noted in the list returned, and the training
    loop saves a checkpoint at the next step and stops. Schedulers send SIGTERM before they take a machine back (SLURM
    at the time limit or on preemption, Kubernetes, spot instances), torchrun passes it on to its workers, and SLURM
    sends SIGUSR1 ahead of the time limit when asked to (#SBATCH --signal=B:USR1@120 asks)."""
    received = []
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, lambda signum, frame: received.append(signum))
    return received


def ignore_stop_signals(worker_id):
    """How a loader worker starts: it leaves stop signals to the training process, which saves, then ends it. torch's
    workers die of a SIGTERM, and torchrun sends one to every process in each worker's group."""
    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, signal.SIG_IGN)


def stop_requested(received, group):
    """The stop signal that any rank has received (the largest number), or 0 if none: all ranks stop at one step."""
    signum = torch.tensor(received[0] if received else 0)
    dist.all_reduce(signum, dist.ReduceOp.MAX, group=group)  # through gloo, on the CPU: the GPU never waits for it
    return signum.item()


def exit_stopped(signum, step, ckpt_path):
    """End a run that a stop signal ended, saying where it resumes. Exit status 75 (EX_TEMPFAIL in sysexits.h): not
    a failure, a job to run again."""
    log.info(f"step {step:>5} | stopped by {signal.Signals(signum).name}: " +
             (f"run again to resume from {ckpt_path}" if ckpt_path else "nothing was saved (no --ckpt-dir)"))
    dist.destroy_process_group()  # a clean end, which every rank agreed on: nothing is left in flight
    sys.exit(75)


# -- training step ------------------------------------------------------------


def configure_optimizer(model, args, device):
    """AdamW with decay on matrices only, and a schedule of linear warmup then cosine decay to lr/10."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # biases and norms
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")

    def lr_factor(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.lr_decay_steps - args.warmup_steps))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def param_names(model, optimizer):
    """The names of the parameters this process's stage holds, group by group."""
    name_of = {param: name for name, param in model.named_parameters()}
    return [[name_of[param] for param in group["params"]] for group in optimizer.param_groups]


def train_step(schedule, model, optimizer, scheduler, batches, args, device):
    """One optimizer step over --grad-accum micro-batches, which the schedule cuts from the batch. Returns the mean loss
    as a tensor (zero but on the last stage): reading it with .item() would wait for the GPU, so only logging steps do."""
    total_loss = torch.zeros((), device=device)
    inputs, targets = next(batches)
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    losses = []  # filled on the last stage: loss_fn of each micro-batch, whose backward() the schedule runs
    # The first stage takes the inputs, the last the targets; the schedule divides the gradients by --grad-accum.
    schedule.step(*[inputs.to(device, non_blocking=True)] if rank == 0 else [],
                  target=targets.to(device, non_blocking=True) if rank == last else None, losses=losses,
                  return_outputs=False)
    for loss in losses:
        total_loss += loss.detach() / args.grad_accum
    if args.grad_clip:  # each stage holds some of the gradients: the whole model's norm adds their squares up
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]) ** 2
        dist.all_reduce(norm)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.grad_clip, norm.sqrt())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return total_loss


def exit_diverged(step, what):
    """Stop a run whose numbers have blown up, before it can write them over the last good checkpoint."""
    fail(f"{what} at step {step}: training diverged and stops, writing no checkpoint; try a lower --lr, or clipping "
         f"with a lower --grad-clip")


def start_profiler(args, step, rank, device):
    """With --profile, a profiler that traces three steps once the first have compiled, allocated and filled caches;
    else a context that does nothing."""
    if not args.profile:
        return contextlib.nullcontext()
    if args.max_steps - step < 9:
        fail(f"--profile traces steps {step + 7} to {step + 9}, but --max-steps {args.max_steps} stops before")
    trace_path = os.path.join(args.log_dir, f"trace_rank{rank}.json")
    # Memory too: every allocation and free, each op's input shapes and the Python lines that called it.
    profiler = torch.profiler.profile(schedule=torch.profiler.schedule(wait=5, warmup=1, active=3, repeat=1),
                                      on_trace_ready=lambda prof: write_profile(prof, trace_path, args),
                                      profile_memory=True, record_shapes=True, with_stack=True)
    log.info(f"tracing steps {step + 7} to {step + 9} into {trace_path}, one file per process: open it at "
             f"https://ui.perfetto.dev or in chrome://tracing")
    if device.type == "cuda":  # the allocator's history from here on, for a snapshot at the trace's end or out of memory
        args.memory_snapshot = os.path.join(args.log_dir, f"memory_rank{rank}.pickle")
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=100_000)  # private, 2.1 to 2.13
    return profiler


def write_profile(profiler, trace_path, args):
    """Write the trace of the profiled steps; on a GPU, also the allocator's snapshot, which
    https://pytorch.org/memory_viz draws: every block over time, each with the Python lines that allocated it."""
    profiler.export_chrome_trace(trace_path)
    if args.memory_snapshot:
        torch.cuda.memory._dump_snapshot(args.memory_snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)  # the steps after the trace run at full speed
        log.info(f"wrote {trace_path} and {args.memory_snapshot}")


def exit_if_out_of_memory(error, where, micro_batch, args, device):
    """Exit if running out of memory caused `error`, saying what to change. Nothing changes by itself: a smaller
    batch would train differently, without a word to the user."""
    if not any(isinstance(e, torch.cuda.OutOfMemoryError) for e in causes(error)):  # torch may wrap it
        return
    peak = f"{(peak_memory(device) or math.nan) / 2**30:.2f} GiB"  # nan on Windows
    if device.type == "cuda":  # reserved: what the allocator holds, in use or cached; the failed request is not in either
        total = torch.cuda.get_device_properties(device).total_memory
        peak += f" allocated, {torch.cuda.max_memory_reserved(device) / 2**30:.2f} GiB reserved"
    else:  # the machine's memory
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else math.nan
        peak += " resident"
    request = re.search(r"Tried to allocate ([\d.]+ \w+)", " ".join(map(str, causes(error))))  # CUDA's words, maybe wrapped
    factor = min((f for f in range(2, micro_batch + 1) if micro_batch % f == 0), default=None)  # 2 if it is even
    if factor:
        advice = (f"--grad-accum {args.grad_accum * factor} trains the same, {args.batch_size} samples a step, on "
                  f"micro-batches of {micro_batch // factor}")
    else:
        advice = "one sample is the smallest micro-batch: the model must take less memory"
    gpipe = args.schedule == "gpipe" and args.stages_per_process == 1  # looped, interleaved 1F1B may hold more
    if gpipe and where.startswith("step") and args.grad_accum > dist.get_world_size():
        # GPipe keeps every micro-batch's activations until the backward; 1F1B, at most as many as there are stages.
        advice = "--schedule 1f1b, which holds the activations of fewer micro-batches at once"
    if args.memory_snapshot:  # --profile on a GPU: what held the memory, and which lines allocated it, up to here
        torch.cuda.memory._dump_snapshot(args.memory_snapshot)
        advice = f"{advice}; {args.memory_snapshot} shows what held it (open it at https://pytorch.org/memory_viz)"
    fail(f"out of memory in {where}, on micro-batches of {micro_batch} samples per process" +
         (f" (tried to allocate {request[1]})" if request else "") +
         f": a peak of {peak}, of {total / 2**30:.1f} GiB on {device}: "
         f"{advice}, or --activation-checkpointing")


# -- evaluation ---------------------------------------------------------------


@torch.no_grad()
def evaluate(schedule, model, loader, device):
    """Mean loss and accuracy over every prediction the loader's samples hold: forward passes through the pipeline,
    added up on the last stage, which sends the sums to every stage."""
    model.eval()
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct predictions, predictions
    for inputs, targets in loader:
        # Every pass through the stages has the training's shapes: a short last batch is filled up with its first
        # sample, whose outputs are not counted, on the device: filled on the CPU, it would leave pinned memory.
        num_samples, missing = len(inputs), loader.batch_size - len(inputs)
        if rank == 0:
            inputs = inputs.to(device, non_blocking=True)
            inputs = torch.cat([inputs, inputs[:1].expand(missing, *inputs.shape[1:])])
        outputs = schedule.step(*[inputs] if rank == 0 else [])  # the last stage's outputs; None on the others
        if rank == last:
            outputs, targets = outputs[:num_samples], targets.to(device, non_blocking=True)
            correct, predictions = count_correct(outputs, targets)
            totals[0] += loss_fn(outputs, targets, reduction="sum")
            totals[1] += correct
            totals[2] += predictions
    model.train()
    dist.broadcast(totals, src=last)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count


# -- checkpointing ------------------------------------------------------------


def save_checkpoint(path, model, optimizer, scheduler, step, config, order, keep, writing, wait, save_group):
    """Copy the training state to host memory and write the copy in a thread while training goes on; or, with
    `wait`, write the state itself before training goes on. `writing`, the save still in progress, completes first:
    one at a time. Returns the new save in progress, or None once written. Python waits for the thread as it exits."""
    wait_for_checkpoint(writing, path)
    directory, name = os.path.split(path)
    new = os.path.join(directory, f"{name}-{step:06d}")  # DIR/checkpoint -> DIR/checkpoint-000100
    if dist.get_rank() == 0:
        shutil.rmtree(new, ignore_errors=True)  # left by a crash in the middle of this save
    dist.barrier()
    # Tensors under the whole model's names, AdamW's state keyed by those names, and the rest as objects, the same on
    # every rank: DCP writes one copy of each.
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
             "scheduler": scheduler.state_dict(), "step": step, "config": config}
    for group, names in zip(state["optimizer"]["param_groups"], order):  # one rank's groups: every stage's names
        group["params"] = names
    # A file per rank, then .metadata. DCP's writer copies ahead from a GPU, in a thread where the GPU is GPU 0 on
    # every rank: it copies nothing ahead, and no rank touches a GPU not its own.
    writer = dcp.FileSystemWriter(new, per_thread_copy_ahead=0)
    if wait:  # written before training goes on, from the state itself: no copy
        writing = in_background(dcp.save, state, storage_writer=writer, process_group=save_group)
    else:  # DCP copies the state to host memory, then writes the copy in a thread of its own
        writing = dcp.async_save(state, storage_writer=writer, process_group=save_group)
    if dist.get_rank() == 0:  # its save ends when every rank's has: then the link moves on
        writing = in_background(point_to_checkpoint, writing, path, new, keep)
    writing.directory = new
    return wait_for_checkpoint(writing, path) if wait else writing


def point_to_checkpoint(writing, path, new, keep):
    """Once `writing` has written every rank's part into `new`, point the link `path` at it (atomically: a crash
    leaves the previous checkpoint whole), and keep the `keep` directories written last."""
    writing.result()
    with contextlib.suppress(FileNotFoundError):
        os.remove(path + ".tmp")
    os.symlink(os.path.basename(new), path + ".tmp")
    os.replace(path + ".tmp", path)
    directory, name = os.path.split(path)
    with contextlib.suppress(OSError):  # the link has moved on: not fatal
        history = sorted((os.path.join(directory, old) for old in os.listdir(directory) if old.startswith(name + "-")),
                         key=lambda old: (os.lstat(old).st_mtime, old))
        for old in history[:-keep]:  # the oldest written
            shutil.rmtree(old, ignore_errors=True)


def in_background(function, *args, **kwargs):
    """Call function(*args, **kwargs) in a thread of its own, on this thread's GPU if any, and return its future."""
    gpu = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []  # a new thread's is GPU 0
    executor = ThreadPoolExecutor(max_workers=1, initializer=torch.cuda.set_device if gpu else None, initargs=gpu)
    future = executor.submit(function, *args, **kwargs)
    executor.shutdown(wait=False)  # the thread ends when the function returns
    return future


def wait_for_checkpoint(writing, path):
    """Wait until `writing`, a save in progress (or None), is complete, and return None. A failed write (a full disk,
    a quota, a vanished mount) ends the run in one line: the checkpoint before it is whole."""
    try:
        if writing is not None:
            writing.result()
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001  any error on any rank: all ranks stop
        exit_if_another_process_failed(e)  # not this disk's fault: a restart may go on
        reason = one_line(e)
        try:  # DCP passes on torch.save's error, which has lost the OS's: a write of this process's own asks again
            with tempfile.TemporaryFile(dir=os.path.dirname(path)) as probe:
                probe.write(bytes(2**20))
                os.fsync(probe.fileno())
        except OSError as error:
            reason = str(error)
        dist.barrier()  # every rank has stopped writing and asked, before rank 0 frees the space
        if dist.get_rank() == 0:  # the partial directory would hold the space
            shutil.rmtree(writing.directory, ignore_errors=True)
        fail(f"cannot write checkpoint {writing.directory}: {reason}")


def read_checkpoint(path, state):
    """Load the checkpoint at `path` into `state`, in place, or, for state None, return the checkpoint.pt beside it."""
    try:
        if state is None:  # every rank maps the file, rather than reading it all, and keeps its part
            return torch.load(path + ".pt", map_location="cpu", weights_only=True, mmap=True)
        dcp.load(state, checkpoint_id=path)  # each rank reads the parts of the files that its tensors need
        return state
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001  any error; DCP's (all ranks') is a BaseException
        exit_if_another_process_failed(e)
        fail(f"cannot read checkpoint {path + '.pt' if state is None else path}: {one_line(e)}")


def load_checkpoint(path, model, optimizer, scheduler, config, device):
    """Restore the training state in place and return the step to continue from."""
    whole = os.path.exists(path + ".pt")
    if whole and os.path.exists(path):  # both: a one-file run's, or converted
        whole = read_checkpoint(path, None)["step"] > read_checkpoint(path, {"step": 0})["step"]  # the later one
    if whole:
        log.info(f"reading {path}.pt, the whole model in one file")
    # The configuration first: the shards of another model would not fit this one's.
    state = read_checkpoint(path, None if whole else {"scheduler": scheduler.state_dict(), "step": 0,
                                                     "config": dict.fromkeys(config)})
    if not isinstance(state, dict) or state.get("config") != config:
        found = state.get("config") if isinstance(state, dict) else None
        fail(f"{path} holds a model {found}, this run builds {config}: match the flags or use another --ckpt-dir")
    if whole and any(isinstance(p, int) for group in state["optimizer"]["param_groups"] for p in group["params"]):
        fail(f"{path}.pt numbers its optimizer state, as the one-file scripts did before 2026-11-26: run the script "
             "that wrote it, as it is now, a step further to save it with names")  # torch's load would raise KeyError
    if not whole:
        state.update(read_checkpoint(path, {"model": get_model_state_dict(model),
                                            "optimizer": get_optimizer_state_dict(model, optimizer)}))
    options = StateDictOptions(full_state_dict=whole, strict=not whole)  # whole tensors: each rank keeps its part
    set_model_state_dict(model, state["model"], options=options)
    # The checkpoint says where training is; this run's flags say how it goes on. The saved groups hold
    # the --lr and --weight-decay of the run that wrote them, and its device's kernel (fused=False on a CPU).
    for saved, group in zip(state["optimizer"]["param_groups"], optimizer.param_groups):
        saved.update({key: value for key, value in group.items() if key != "params"})
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    scheduler.load_state_dict({**state["scheduler"], "base_lrs": scheduler.base_lrs})
    for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)  # this run's schedule where the saved one stood
    return state["step"]


# -- main ---------------------------------------------------------------------


def main(args):
    device = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    num_stages = world_size * args.stages_per_process
    stage_indices = list(range(rank, num_stages, world_size))  # this process's stages: the first on rank 0, the last on N-1
    is_main_process = rank == 0  # console, TensorBoard and checkpoints: rank 0 alone writes
    logging.basicConfig(format="%(message)s", level=logging.INFO if is_main_process else logging.WARNING, stream=sys.stdout)
    log_placement(device)
    if args.stages_per_process > 1 and world_size == 1:
        fail(f"--stages-per-process {args.stages_per_process} shrinks the bubble of several processes: one has none")
    train_set, val_set, data_info = build_datasets(args)
    steps_per_epoch = len(train_set) // args.batch_size  # full batches only: every step sees --batch-size
    if steps_per_epoch == 0:
        fail(f"--batch-size {args.batch_size} is more than the {len(train_set)} training samples")
    if len(val_set) == 0:
        fail("the validation set is empty: the data section must hold some samples out")
    with torch.device("meta"):  # names and shapes, no memory: no process ever holds the whole model, only its stage
        model, config = build_model(args, data_info)
    unit, units_per_sample, flops_per_unit = throughput_unit(model, args)
    if flops_per_unit is None:  # the model section does not count them: torch does, once
        flops_per_unit = measure_flops(args, data_info, train_set[0]) / units_per_sample
        log.info(f"torch's FlopCounterMode counts {flops_per_unit:,.0f} training FLOPs for each of the {unit}")
    num_params = sum(p.numel() for p in model.parameters())
    sample = train_set[0][0]  # an input's shape and dtype, for a micro-batch of them on the meta device
    micro_batch = torch.empty(args.batch_size // args.grad_accum, *sample.shape, dtype=sample.dtype, device="meta")
    position = {name: i for i, (name, _) in enumerate(model.named_parameters())}  # the whole model's order
    parts, examples = split_model(model, stage_indices, num_stages, micro_batch)
    if hasattr(model, "init_tensor"):
        model.to_empty(device=device)  # allocates this stage's tensors, uninitialised
        init_weights(model, args.seed)
    else:  # its values come whole from its constructor: build it so, and keep this stage's
        log.info("the model has no init_tensor(name, value, generator): every process builds it whole, then keeps its stage")
        model.load_state_dict(build_model(args, data_info)[0].state_dict(), strict=False, assign=True)
        model.to(device)
    stage_modules = [Stage(model, parts[s], is_first=s == 0, is_last=s == num_stages - 1) for s in stage_indices]
    if args.activation_checkpointing:  # each block's input alone is kept; backward recomputes the rest from it
        for block in model.blocks.values():
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    if args.compile:  # in place: the state dict keeps its keys, and checkpoints stay interchangeable with eager runs
        for stage_module in stage_modules:
            stage_module.compile()
    optimizer, scheduler = configure_optimizer(model, args, device)
    per_process_batch_size = args.batch_size // args.grad_accum  # samples in one forward pass: a micro-batch
    every_stage_names = [None] * world_size
    dist.all_gather_object(every_stage_names, param_names(model, optimizer))
    # The whole model's parameters, group by group, in the model's order: as an unsplit model's optimizer holds them.
    order = [[name for names in every_stage_names for name in names[i]] for i in range(len(optimizer.param_groups))]
    order = [sorted(names, key=position.get) for names in order]  # interleaved, rank 0 holds stages 0 and N, ...
    num_val = len(val_set)
    val_set = Subset(val_set, range(min(num_val, args.eval_batches * args.batch_size)))  # the same for any world size
    log.info(f"device {device} | {num_params:,} parameters | {len(train_set)} train "
             f"samples | {len(val_set)} of {num_val} validation samples per evaluation")
    log.info(f"global batch {args.batch_size} = {args.grad_accum} micro-batches of {args.batch_size // args.grad_accum} | "
             f"{num_stages} stages, {args.stages_per_process} per process | schedule {args.schedule}")
    for stage_index, part in enumerate(parts):
        log.info(f"stage {stage_index} (rank {stage_index % world_size}): {', '.join(part)}")
    idle, busy = world_size - 1, args.stages_per_process * args.grad_accum  # in the time of one stage's micro-batch
    log.info(f"each process idles (processes - 1) / (stages per process x micro-batches) = {idle}/{busy} = {idle / busy:.0%} "
             f"of its compute time (the bubble): more micro-batches or stages per process shrink it, zero-bubble fills some")

    step = 0
    ckpt_path = args.ckpt_dir and os.path.join(args.ckpt_dir, "checkpoint")  # a link to a directory of tensors
    found = [None] * world_size  # loading with DCP is a collective: all ranks or none must find a checkpoint
    dist.all_gather_object(found, bool(ckpt_path) and (os.path.exists(ckpt_path) or os.path.exists(ckpt_path + ".pt")))
    if len(set(found)) > 1:
        fail("some ranks found a checkpoint and some did not: all must read one checkpoint, in a shared --ckpt-dir")
    if found[0]:
        step = load_checkpoint(ckpt_path, model, optimizer, scheduler, config, device)
        log.info(f"resumed from {ckpt_path} at step {step}")
    steps = [None] * world_size
    dist.all_gather_object(steps, step)  # ranks that resumed from different checkpoints, or none, would train apart
    if len(set(steps)) > 1:
        fail(f"ranks resumed at different steps {sorted(set(steps))}: all must read one checkpoint, in a shared --ckpt-dir")
    if step >= args.max_steps:
        log.info(f"{ckpt_path} is at step {step}: the run is finished (--max-steps {args.max_steps})")
        return

    sampler = RandomSampler(train_set, generator=torch.Generator())
    pin_memory = device.type == "cuda"  # page-locked host memory lets the copy to the GPU run async
    # Whole batches, in the same order on every stage (the same seed): the first stage uses the inputs, the last the targets.
    train_loader = make_loader(train_set, args.batch_size, args, sampler=SkippingSampler(sampler),
                               pin_memory=pin_memory, worker_init_fn=ignore_stop_signals)
    val_loader = make_loader(val_set, args.batch_size, args, pin_memory=pin_memory,
                             worker_init_fn=ignore_stop_signals)
    peak = peak_flops(device, "tf32")
    profiler = start_profiler(args, step, rank, device)
    start_step, start_time = step, time.perf_counter()
    last_step, last_time = step, start_time
    batches = None
    # The line this script is about: each stage sends activations on and gradients back, and the schedule orders the
    # micro-batches' passes (GPipe: all forwards, then all backwards; 1F1B: a backward after each forward once full).
    stages, eval_stages = [[PipelineStage(module, s, num_stages, device, input_args=inputs, output_args=outputs)
                            for module, s, (inputs, outputs) in zip(stage_modules, stage_indices, examples)]
                           for _ in range(2)]
    if args.stages_per_process == 1 and args.schedule != "zero-bubble":  # one stage per process
        schedule_class, eval_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule], ScheduleGPipe
        stages, eval_stages = stages[0], eval_stages[0]
    else:  # several: GPipe looped over them (breadth first), interleaved 1F1B; zero-bubble takes any number
        schedule_class = {"gpipe": ScheduleLoopedBFS, "1f1b": ScheduleInterleaved1F1B,
                          "zero-bubble": ScheduleInterleavedZeroBubble}[args.schedule]
        eval_class = ScheduleLoopedBFS
    try:
        schedule = schedule_class(stages, n_microbatches=args.grad_accum, loss_fn=loss_fn)
    except ValueError as error:  # a layout the schedule cannot order: torch says why
        fail(f"--schedule {args.schedule} cannot run {args.grad_accum} micro-batches on {num_stages} stages: {error}")
    # Evaluation's own stages, forward only: on torch 2.10 and 2.11 a stage's first pass fixes whether inputs need grad.
    eval_schedule = eval_class(eval_stages, n_microbatches=args.grad_accum)
    writing = None  # the checkpoint being written in the background, if any
    received = catch_stop_signals()  # a stop signal from here on saves a checkpoint first
    stop_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))  # stop_requested's, on the CPU
    save_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))  # the saves' own
    with SummaryWriter(args.log_dir) if is_main_process else contextlib.nullcontext() as writer, profiler:
        while True:
            if step % args.eval_every == 0 or step == args.max_steps:
                try:
                    val_loss, val_accuracy = evaluate(eval_schedule, model, val_loader, device)
                except RuntimeError as error:  # on a CPU the OS ends a process that runs out of memory: only a GPU's is here
                    exit_if_out_of_memory(error, f"evaluation at step {step}", per_process_batch_size, args, device)
                    raise
                log.info(f"step {step:>5} | val loss {val_loss:.4f} | val accuracy {val_accuracy:.4f}")
                write_scalars(writer, {"val/loss": val_loss, "val/accuracy": val_accuracy}, step)
            if step == args.max_steps:
                break
            if batches is None or step % steps_per_epoch == 0:
                sampler.generator.manual_seed(args.seed + step // steps_per_epoch)  # a new order each epoch
                # A resumed run skips, by index, what its epoch has already trained on: the data order stays the same.
                train_loader.sampler.start = step % steps_per_epoch * args.batch_size
                batches = iter(train_loader)
            try:
                loss = train_step(schedule, model, optimizer, scheduler, batches, args, device)
            except RuntimeError as error:
                exit_if_out_of_memory(error, f"step {step + 1}", per_process_batch_size, args, device)
                raise
            step += 1
            if args.profile:
                profiler.step()
            # Asked before the logging step's wait for the device: where processes train together, one that failed in
            # this step is seen here, on the CPU.
            stop = stop_requested(received, stop_group) if step < args.max_steps else 0  # at the last step: finish

            if step % args.log_every == 0 or step == args.max_steps:
                dist.broadcast(loss, src=world_size - 1)  # the loss exists on the last stage; a collective, on every rank
                train_loss = loss.item()  # waits for the device to finish: read before the clock
                if not math.isfinite(train_loss):
                    exit_diverged(step, f"the loss is {train_loss}")
                now = time.perf_counter()
                units_per_sec = (step - last_step) * args.batch_size * units_per_sample / (now - last_time)
                elapsed = datetime.timedelta(seconds=round(now - start_time))  # printed as h:mm:ss
                left = datetime.timedelta(seconds=round((now - start_time) / (step - start_step) * (args.max_steps - step)))
                flops = units_per_sec * flops_per_unit / world_size  # the model FLOP/s of each process
                metrics = {"train/loss": train_loss, "train/lr": scheduler.get_last_lr()[0],
                           f"train/{unit}_per_sec": units_per_sec, "train/tflops_per_process": flops / 1e12}
                if peak:
                    metrics["train/mfu"] = flops / peak
                if device.type == "cuda":  # the most that this process's tensors have taken on its GPU so far
                    metrics["train/peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                log.info(f"step {step:>5} | loss {train_loss:.4f} | lr {metrics['train/lr']:.2e} | "
                         f"{units_per_sec:,.0f} {unit}/s, {flops / 1e12:.3g} TFLOP/s" +
                         (f" ({flops / peak:.0%} MFU)" if peak else "") + f" | {elapsed} elapsed, {left} left" +
                         (f" | {metrics['train/peak_memory_gib']:.2f} GiB peak" if device.type == "cuda" else ""))
                write_scalars(writer, metrics, step)
                last_step, last_time = step, now
            if ckpt_path and (step % args.ckpt_every == 0 or step == args.max_steps or stop):
                finite = torch.stack([p.isfinite().all() for p in model.parameters()]).all().int()
                dist.all_reduce(finite, dist.ReduceOp.MIN)  # this stage's weights, then every stage's: all stop, or none
                if not finite:
                    exit_diverged(step, "the weights are no longer finite")
                wait = args.sync_checkpoints or step == args.max_steps or stop > 0  # the last is whole before the end
                writing = save_checkpoint(ckpt_path, model, optimizer, scheduler, step, config, order, args.keep_checkpoints,
                                          writing, wait, save_group)
                dist.barrier()  # no rank runs ahead of a save, or exits before the last is written
                log.info(f"step {step:>5} | " + (f"saving {ckpt_path} in the background" if writing else f"saved {ckpt_path}"))
            if stop:
                exit_stopped(stop, step, ckpt_path)
    peaks = [None] * world_size
    dist.all_gather_object(peaks, peak_memory(device))  # every process's own, for rank 0 to log; a collective
    if peaks[0] is not None:
        log.info(f"peak memory per process: {', '.join(f'{peak / 2**30:.2f}' for peak in peaks)} GiB "
                 f"({'allocated on the GPU' if device.type == 'cuda' else 'resident, torch included'})")


if __name__ == "__main__":
    try:
        main(parse_args())
    except RuntimeError as error:
        exit_if_another_process_failed(error)
        raise  # this process's own error, with its traceback
    dist.destroy_process_group()  # the end of the run: nothing is left in flight (leave_process_group)
