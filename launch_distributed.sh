#!/usr/bin/env bash
#SBATCH --job-name=train
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
# The lines above are sbatch's directives: one task per node, which runs one torchrun, which starts
# that node's workers. Ask for GPUs and CPUs on sbatch's command line, where clusters differ:
# --gpus-per-node=8 --cpus-per-task=64 (the task's CPUs are shared by all workers of its node).
# 120 s before the time limit SLURM sends this script SIGUSR1: the workers save a checkpoint and stop,
# and the job goes back in the queue (--requeue), to resume from it; its log goes on in the same file.
# The 120 s must hold the step under way, the next (where the ranks stop) and a save: raise it for a larger
# model.

usage() {
    cat <<'EOF'
Launch a training script of this collection on one node, on several, or in a SLURM allocation.

usage: launch_distributed.sh [--check] [--dry-run] SCRIPT [SCRIPT'S FLAGS...]
       launch_distributed.sh --check [--dry-run]

The mode comes from the environment:
  one node (default)  ./launch_distributed.sh ddp_torchrun.py --batch-size 64
                      = torchrun --standalone --nproc-per-node=<GPUs here, or 2 on a CPU> ddp_torchrun.py ...
  several nodes       NNODES=2 MASTER_ADDR=node1 ./launch_distributed.sh ddp_torchrun.py   (the same on every node)
                      = torchrun --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=node1:29500 --rdzv-id=... ...
  SLURM (SLURM_JOB_ID is set)
                      sbatch launch_distributed.sh ddp_torchrun.py, or inside salloc
                      = srun --ntasks-per-node=1 --cpus-per-task=<the job's> torchrun --rdzv-endpoint=<first host>:PORT
                        --rdzv-id=$SLURM_JOB_ID ... (one torchrun per node); stopped by SLURM (SIGUSR1
                        before the time limit, SIGTERM), the workers save and the job requeues itself
single_gpu.py and dataparallel.py (one process) and ddp_spawn.py (starts its own) run with python;
every other script (ddp_torchrun.py, ddp_amp.py, fsdp.py, pipeline.py) with torchrun, in any mode.

options:
  --check      run a communication check across every rank (all_reduce, broadcast, bandwidth, and a
               gloo group as the scripts make beside NCCL) with the same launch; then SCRIPT, if one is
               given and the check passed
  --dry-run    print the commands, run nothing
  -h, --help   this text

environment:
  NPROC_PER_NODE  processes per node (default: the node's GPUs; in SLURM, the allocation's; 2 on a CPU)
  NNODES          nodes taking part (default 1); more than 1 needs MASTER_ADDR
  MASTER_ADDR     host of the rendezvous, reachable from every node (SLURM: the allocation's first host)
  MASTER_PORT     its port, one per job on a host (default 29500; SLURM: 20000 + job id % 10000)
  NODE_RANK       0 on the node at MASTER_ADDR: it then hosts the rendezvous without guessing from its name
                  (torchrun numbers the ranks itself: rank 0, which logs and checkpoints, may be on any node)
  RDZV_ID         name of the job, the same on every node (default: the script's name)
  JOIN_TIMEOUT    seconds to wait for every node to join (default 300)
  MAX_RESTARTS    times to restart the workers after one fails (default 3); with --ckpt-dir the restarted
                  run resumes from its last checkpoint
  SHUTDOWN_TIMEOUT
                  seconds torchrun gives its workers, once sent a stop signal, to save and exit before it
                  kills them (default 120; torch's own is 30, and torch 2.10 knows no other)
  PYTHON          interpreter for single-process scripts and the check (default: python)
EOF
}

set -euo pipefail

die() {
    echo "launch_distributed.sh: error: $*" >&2
    exit 1
}

# Every rank checks an all_reduce and a broadcast, the results are gathered, and rank 0 names any rank
# that got a wrong answer and times a fixed-size all_reduce. Passed to python -c: no file to ship to nodes.
CHECK_PROGRAM='
import datetime, os, socket, sys, time
import torch
import torch.distributed as dist

cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                        timeout=datetime.timedelta(seconds=60))
rank, world_size, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
errors = []
summed = torch.full((1024,), float(rank + 1), device=device)
dist.all_reduce(summed)
expected = world_size * (world_size + 1) / 2
if not torch.all(summed == expected):
    errors.append(f"all_reduce gave {summed[0].item():g}, expected {expected:g}")
sent = torch.arange(1024, dtype=torch.float32, device=device) * (1 if rank == 0 else -1)
dist.broadcast(sent, src=0)
if not torch.equal(sent.cpu(), torch.arange(1024, dtype=torch.float32)):
    errors.append("broadcast from rank 0 arrived changed")
# The scripts agree on stops through gloo beside NCCL on GPUs, and save through gloo: it must reach every node too.
counted = torch.ones(1)
dist.all_reduce(counted, group=dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60)))
if counted.item() != world_size:
    errors.append(f"all_reduce over a gloo group gave {counted.item():g}, expected {world_size}")
reports = [None] * world_size
dist.all_gather_object(reports, (socket.gethostname(), errors))
failed = [f"rank {r} on {host}: " + "; ".join(errs) for r, (host, errs) in enumerate(reports) if errs]
if failed:
    if rank == 0:
        print("check failed on " + ", ".join(f"rank {r}" for r, (_, errs) in enumerate(reports) if errs) + ":\n  "
              + "\n  ".join(failed), file=sys.stderr)
    dist.barrier()  # rank 0 has printed before an exit of any rank ends the job
    dist.destroy_process_group()
    sys.exit(1)

size_mib, repeats = 32, 5
buffer = torch.ones(size_mib * 2**20 // 4, device=device)
for i in range(repeats + 1):  # the first is a warm-up: it sets up connections and buffers
    if i == 1:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
    dist.all_reduce(buffer)
if cuda:
    torch.cuda.synchronize()
seconds = (time.perf_counter() - start) / repeats
dist.destroy_process_group()
if rank == 0:
    nodes, per_node = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    noun = ("node" if nodes == 1 else "nodes") + " x " + str(per_node) + (" process" if per_node == 1 else " processes")
    bus_bandwidth = size_mib * 2**20 * 2 * (world_size - 1) / world_size / seconds / 1e9  # as nccl-tests count it
    print(f"check passed: world size {world_size} ({nodes} {noun}), backend {backend}: "
          "all_reduce and broadcast correct on every rank, and all_reduce over a gloo group")
    bus = f"bus bandwidth {bus_bandwidth:.2f} GB/s" if world_size > 1 else "one process: no link to measure"
    print(f"all_reduce of {size_mib} MiB: {seconds * 1e3:.1f} ms, {bus}")
'

check=0
dry_run=0
while (($#)); do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --check) check=1; shift ;;
        --dry-run) dry_run=1; shift ;;
        --) shift; break ;;
        -*) die "unknown option $1 (options come before the script; --help lists them)" ;;
        *) break ;;
    esac
done
if (($# == 0)) && ((!check)); then
    usage >&2
    exit 2
fi
script=${1:-}
(($#)) && shift
if [[ -n "$script" && ! -f "$script" ]]; then
    die "no such script: $script"
fi

PYTHON=${PYTHON:-python}
type -P "$PYTHON" >/dev/null || PYTHON=python3  # some systems have only python3
MAX_RESTARTS=${MAX_RESTARTS:-3}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-120}
JOIN_TIMEOUT=${JOIN_TIMEOUT:-300}
NNODES=${NNODES:-1}
for name in MAX_RESTARTS SHUTDOWN_TIMEOUT JOIN_TIMEOUT NNODES ${NPROC_PER_NODE:+NPROC_PER_NODE} ${NODE_RANK:+NODE_RANK} ${MASTER_PORT:+MASTER_PORT}; do
    [[ "${!name}" =~ ^(0|[1-9][0-9]*)$ ]] || die "$name must be a whole number, got '${!name}'"
done
((NNODES >= 1)) || die "NNODES must be at least 1"
((${NPROC_PER_NODE:-1} >= 1)) || die "NPROC_PER_NODE must be at least 1"
# One process (single_gpu.py, dataparallel.py) or its own processes (ddp_spawn.py): python, one node.
case "$(basename -- "$script")" in
    single_gpu.py | dataparallel.py | ddp_spawn.py) runner=python ;;
    *) runner=torchrun ;;
esac

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    mode=slurm
elif [[ -n "${SLURM_JOB_NODELIST:-}${SLURM_NNODES:-}${SLURM_NODELIST:-}" ]]; then
    # Outside an allocation --rdzv-id=$SLURM_JOB_ID would be empty: each torchrun would make up its own
    # id and wait for the others until the join timeout.
    die "SLURM variables are set but SLURM_JOB_ID is empty: run this through sbatch or inside salloc"
elif ((NNODES > 1)); then
    mode=multi
else
    mode=single
fi

# Fail now, not after the join timeout: the rendezvous host must resolve, and unless it is this machine,
# gloo needs this node's own name to resolve to an address of this node that other nodes can reach. Every
# distributed script uses gloo, on GPU nodes too: beside NCCL, its stop check (a signal to save and stop).
CHECK_ADDRESSES='
import ipaddress, os, socket, sys

def addresses(host):
    return {ipaddress.ip_address(info[4][0].split("%")[0]) for info in socket.getaddrinfo(host, None)}

error = "launch_distributed.sh: error: "
try:
    rendezvous = addresses(sys.argv[1])
except OSError:
    sys.exit(f"{error}MASTER_ADDR {sys.argv[1]} does not resolve to an address from {socket.gethostname()}: "
             "use a name or IP every node can reach")
host = socket.gethostname()  # gloo listens on the first of its addresses that this node can bind, else on loopback
if os.environ.get("GLOO_SOCKET_IFNAME") or all(a.is_loopback for a in rendezvous):
    sys.exit(0)  # gloo uses the interface named; or this job is on one machine
try:
    found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
except OSError:
    found = []
fix = ("map it to the node\x27s network address in /etc/hosts, or set GLOO_SOCKET_IFNAME to its network interface "
       "(NCCL_SOCKET_IFNAME too, if NCCL picks a wrong one)")
for family, _, _, _, address in found:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(address)
    except OSError:
        continue
    if ipaddress.ip_address(address[0].split("%")[0]).is_loopback:
        sys.exit(f"{error}this node\x27s name {host} resolves to {address[0]}, which other nodes cannot reach (a "
                 f"loopback address): {fix}")
    sys.exit(0)
shown = ", ".join(sorted({info[4][0] for info in found})) or "no address"
sys.exit(f"{error}this node\x27s name {host} resolves to {shown}, not an address of this node, so gloo would listen on "
         f"loopback, which other nodes cannot reach: {fix}")
'

gpus_here() {
    "$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0
}

case "$mode" in
    single)
        gpus=$(gpus_here)
        rendezvous=(--standalone)
        ;;
    multi)
        [[ -n "${MASTER_ADDR:-}" ]] || die "NNODES=$NNODES needs MASTER_ADDR, the host of the rendezvous"
        [[ "$runner" == torchrun ]] || die "$(basename -- "$script") runs on one node; use ddp_torchrun.py for NNODES > 1"
        gpus=$(gpus_here)
        "$PYTHON" -c "$CHECK_ADDRESSES" "$MASTER_ADDR" || exit
        conf="join_timeout=$JOIN_TIMEOUT"
        if [[ -n "${NODE_RANK:-}" ]]; then
            conf+=",is_host=$( ((NODE_RANK == 0)) && echo true || echo false)"
        fi
        nodes=$NNODES
        endpoint=$MASTER_ADDR:${MASTER_PORT:-29500}
        rendezvous=(--nnodes="$nodes" --rdzv-backend=c10d --rdzv-endpoint="$endpoint"
                    --rdzv-id="${RDZV_ID:-$(basename -- "${script:-check}" .py)}" --rdzv-conf="$conf")
        ;;
    slurm)
        nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
        head=${MASTER_ADDR:-}
        if [[ -z "$head" ]]; then
            hosts=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}") ||
                die "scontrol cannot list the hosts of job $SLURM_JOB_ID; set MASTER_ADDR to the first one"
            head=${hosts%%$'\n'*}
        fi
        # GPUs of the allocation; with --gres=gpu:N neither variable is set, but this node's GPUs are its own.
        gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-$(gpus_here)}}
        gpus=${gpus##*:}  # SLURM_GPUS_PER_NODE may read "a100:4"
        "$PYTHON" -c "$CHECK_ADDRESSES" "$head" || exit
        endpoint=$head:${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}
        rendezvous=(--nnodes="$nodes" --rdzv-backend=c10d --rdzv-endpoint="$endpoint"
                    --rdzv-id="$SLURM_JOB_ID" --rdzv-conf="join_timeout=$JOIN_TIMEOUT")
        # CPUs for each node's task, torchrun and all its workers: sbatch's --cpus-per-task, else all the job
        # holds on its smallest node. srun is told explicitly: since Slurm 22.05 it no longer inherits
        # --cpus-per-task, and where the cluster binds tasks to CPUs a node's workers would all share one core.
        if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
            cpus=$SLURM_CPUS_PER_TASK
        else  # SLURM_JOB_CPUS_PER_NODE reads like "72(x2),36": the smallest count
            # shellcheck disable=SC2001  # a regular expression, which ${var//...} is not
            cpus=$(sed 's/([^)]*)//g' <<<"${SLURM_JOB_CPUS_PER_NODE:-1}" | tr , '\n' | sort -n | head -n 1)
        fi
        [[ "$cpus" =~ ^[1-9][0-9]*$ ]] ||
            die "cannot tell the job's CPUs per node from SLURM_CPUS_PER_TASK or SLURM_JOB_CPUS_PER_NODE (got '$cpus')"
        ;;
esac
nproc=${NPROC_PER_NODE:-$gpus}
((nproc > 0)) || nproc=2  # no GPU: two CPU processes, enough to see DDP at work
if [[ "$mode" == slurm ]] && [[ "$runner" == torchrun || $check == 1 || "$(basename -- "$script")" == ddp_spawn.py ]] &&
    ((cpus < nproc)); then
    echo "launch_distributed.sh: note: this job holds $cpus CPU(s) per node for $nproc processes each;" \
         "ask sbatch for more with --cpus-per-task=N (or --exclusive)" >&2
fi

run() {  # [exec] COMMAND...: print the command, copyable as it stands, and run it unless --dry-run
    local arg quoted=() replace=
    if [[ "$1" == exec ]]; then
        # The launcher becomes the command, so that signals (Ctrl-C, kill) reach it directly; in a SLURM job
        # it stays, to requeue the job after a stop (in_job).
        replace=exec
        [[ "$mode" != slurm ]] || replace=in_job
        shift
    fi
    for arg in "$@"; do
        if [[ "$arg" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then quoted+=("$arg"); else quoted+=("$(printf '%q' "$arg")"); fi
    done
    echo "${quoted[*]}"
    if ((dry_run)); then
        [[ -z "$replace" ]] || exit 0  # nothing after an exec would run either
        return 0
    fi
    $replace "$@"
}

in_job() {  # COMMAND...: run a SLURM job's training step; after a stop signal, requeue the job, then exit
    # SLURM signals this script: SIGUSR1 ahead of the time limit (the #SBATCH --signal line), SIGTERM at the
    # limit or on preemption (then also every process of the step, which has KillWait, 30 s by default, until
    # SIGKILL). A SIGUSR1 goes on to the step as SIGTERM, which torchrun passes on to its workers (and gives them
    # SHUTDOWN_TIMEOUT to exit) instead of dying of it. The workers save at the next step and exit; the job is
    # requeued.
    local stop= status=0 child
    trap 'stop=SIGUSR1; scancel --signal=TERM "$SLURM_JOB_ID" || true' USR1
    trap 'stop=SIGTERM' TERM
    trap : INT  # Ctrl-C is srun's (twice in a second ends the step): this script waits for it to end
    "$@" &
    child=$!
    while :; do  # a trapped signal ends `wait` early: wait again, until the step has ended
        wait "$child" && status=0 || status=$?
        kill -0 "$child" 2>/dev/null || break
    done
    if [[ -n "$stop" ]] && ((status != 0)); then
        if [[ " $* " == *" --ckpt-dir"* ]]; then
            echo "launch_distributed.sh: stopped by $stop: job $SLURM_JOB_ID goes back in the queue and resumes" \
                 "from its checkpoint" >&2
            scontrol requeue "$SLURM_JOB_ID" || true  # SLURM ends this script now, and starts it again later
        else
            echo "launch_distributed.sh: stopped by $stop: job $SLURM_JOB_ID is not requeued: without --ckpt-dir" \
                 "it would start again from step 0" >&2
        fi
    fi
    exit "$status"
}

torchrun_on_each_node() {  # [exec] ARGS...: torchrun, under srun in SLURM mode: one torchrun per node
    local replace=
    if [[ "$1" == exec ]]; then
        replace="exec"
        shift
    fi
    # A restarted worker must not find its predecessors' addresses in the store it would share with
    # the agent: with it shared, gloo workers failed to restart (pytorch/pytorch#135712). A stop's save
    # of a large model can outlast torchrun's 30 s before it kills the workers.
    local command=(env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 TORCH_ELASTIC_SHUTDOWN_TIMEOUT="$SHUTDOWN_TIMEOUT"
                   torchrun "${rendezvous[@]}" --nproc-per-node="$nproc" "$@")
    if [[ "$mode" == slurm ]]; then
        # --ntasks too: srun would otherwise take the job's task count (sbatch --ntasks=16) over --ntasks-per-node.
        command=(srun --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 --cpus-per-task="$cpus" --kill-on-bad-exit=1
                 "${command[@]}")
    fi
    if [[ "$mode" != single ]] && ((!dry_run)); then
        echo "launch_distributed.sh: waiting up to ${JOIN_TIMEOUT}s (JOIN_TIMEOUT) for $nodes nodes to join" \
             "the rendezvous at $endpoint; a RendezvousTimeoutError means some did not" >&2
    fi
    run $replace "${command[@]}"
}

if ((check)); then
    # No restarts: a check that fails should say so, not try again.
    torchrun_on_each_node --max-restarts=0 --no-python "$PYTHON" -c "$CHECK_PROGRAM" || exit
fi
[[ -n "$script" ]] || exit 0

if [[ "$runner" == python ]]; then
    if [[ "$(basename -- "$script")" == ddp_spawn.py && -n "${NPROC_PER_NODE:-}" ]]; then
        set -- --nproc "$NPROC_PER_NODE" "$@"
    fi
    if [[ "$mode" == slurm ]]; then
        run exec srun --nodes=1 --ntasks=1 --cpus-per-task="$cpus" --kill-on-bad-exit=1 "$PYTHON" "$script" "$@"
    fi
    run exec "$PYTHON" "$script" "$@"
fi
if ((MAX_RESTARTS > 0)) && [[ " $* " != *" --ckpt-dir"* ]]; then
    echo "launch_distributed.sh: note: without --ckpt-dir a restarted run starts again from step 0" >&2
fi
torchrun_on_each_node exec --max-restarts="$MAX_RESTARTS" "$script" "$@"
