"""Process launch and the (data parallel x pipeline) grid of processes with its process groups.

`launch` runs a worker in `world_size` processes: directly when already under `torchrun` (which sets
RANK/WORLD_SIZE), in this process when one is enough, and otherwise by starting them on this machine.
"""
from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import forkserver
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Topology", "WorkerFailed", "Interrupted", "launch", "end_process_group", "init_topology",
           "single_process_topology", "under_torchrun", "resolve_device_kind", "prepare_to_launch"]


@dataclass
class Topology:
    """Where this process sits: rank r = replica_rank * pp_size + pp_rank, replica_rank = dp_rank * sp_size + sp_rank.

    A stage's replicas (`dp_group`) are every process holding that stage: its data-parallel replicas, each of which
    may split every sample's tokens over sp_size processes (`sp_mesh`: pipeline/sequence.py). They all average
    their gradients; only the data-parallel ones read different samples."""

    rank: int
    world_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup  # the stage's replicas (data x sequence parallel): the gradients' average
    send_group: dist.ProcessGroup | None = None  # the pipeline's processes again, for its sends alone
    sp_rank: int = 0
    sp_size: int = 1
    sp_mesh: Any = None  # a DeviceMesh ("place", "ring", "ulysses"): its "ulysses" dimension is this sample's processes

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def replicas(self) -> int:
        """Processes holding this process's stage (data parallel x sequence parallel)."""
        return self.dp_size * self.sp_size

    @property
    def replica_rank(self) -> int:
        return self.dp_rank * self.sp_size + self.sp_rank


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def resolve_device_kind(preference: str, local_processes: int | None = None) -> str:
    """"cuda" or "cpu" for `train.device`. NCCL needs a GPU per process: "auto" takes CUDA only where this machine
    has a GPU for each of its `local_processes` (default: this launch's LOCAL_WORLD_SIZE), and "cuda" without them is
    refused (two processes on one GPU failed inside NCCL: "Duplicate GPU detected")."""
    local = local_processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if preference == "auto":
        return "cuda" if 0 < local <= gpus else "cpu"
    if preference == "cuda" and gpus == 0:
        raise RuntimeError("train.device='cuda' but no CUDA device is visible; set train.device = \"cpu\" or \"auto\"")
    if preference == "cuda" and local > gpus:
        raise RuntimeError(f"train.device='cuda' with {local} processes on this machine (pipeline.stages x "
                           f"pipeline.data_parallel) but {gpus} GPU(s): NCCL needs one GPU per process. Use at most "
                           f"{gpus} processes here, more GPUs, or train.device = \"cpu\"")
    return preference


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_place(index: int, world_size: int, port: int) -> None:
    """This process's place among `world_size` on this host, in the variables torchrun would set."""
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def single_process_topology(device_kind: str) -> "Topology":
    """This process alone as a world of one stage and one replica (benchmarks that run a Trainer in-process)."""
    _set_place(0, 1, _free_port())
    return init_topology(1, 1, device_kind)


class WorkerFailed(RuntimeError):
    """A started process failed; the message is the first failure's own error, not the others' lost connections."""


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM reached the launcher before training began: the processes were stopped, nothing was saved."""


# errors that a process meets because another one failed first: never the cause worth naming
_KNOCK_ON = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
             "Socket Timeout", "Connection refused")


# imported once by the fork server instead of by every process it starts: the training worker's module brings
# torch, diffusers, transformers, peft and bitsandbytes (about 7 s a process on a 2-core machine)
_IMPORTED_ONCE = ("diffpipe.train.worker",)  # and through it the trainer


def _forks() -> bool:
    """Whether `launch` forks its processes from multiprocessing's fork server: on a machine without a GPU. The
    server imports the worker's modules once (`spawn` imports them again in every process: most of a short CPU
    run's time, and of the test suite's). On a machine with one they are spawned: bitsandbytes, which diffusers
    imports, initialises CUDA as it is imported (`cuda_specs.get_compute_capabilities`, 0.50.2), and a process
    forked from one that did cannot use CUDA."""
    return torch.cuda.device_count() == 0


def prepare_to_launch(world_size: int) -> None:
    """Start the fork server now where `launch` will fork `world_size` processes from it, so that its imports
    (about 7 s on a 2-core machine) run while this process does its own work before launching (`diffpipe train`'s
    checks and plan)."""
    if world_size > 1 and not under_torchrun() and _forks():
        mp.get_context("forkserver").set_forkserver_preload(list(_IMPORTED_ONCE))
        forkserver.ensure_running()


def _start(world_size: int, port: int, fn: Callable, args: tuple, errors: str):
    """Start the processes (forked or spawned: `_forks`). A forked process starts in the fork server's environment
    and folder, so each takes the launcher's, as a spawned one has."""
    place = (os.getcwd(), dict(os.environ))
    method = "forkserver" if _forks() else "spawn"
    if method == "forkserver":  # no effect where the server runs already (prepare_to_launch)
        mp.get_context(method).set_forkserver_preload([*_IMPORTED_ONCE, fn.__module__])
    return mp.start_processes(_started_entry, args=(world_size, port, fn, args, errors, place), nprocs=world_size,
                              start_method=method, join=False)


def _started_entry(index: int, world_size: int, port: int, fn: Callable, args: tuple, errors: str,
                   place: tuple[str, dict]) -> None:
    folder, environment = place
    os.chdir(folder)
    os.environ.clear()
    os.environ.update(environment)
    _set_place(index, world_size, port)
    try:
        fn(*args)
    except BaseException as exc:
        # the launcher reads these to name the first real failure (torch's join names whichever it sees first)
        line = _what_failed(exc)
        path = os.path.join(errors, f"rank-{index}.txt")
        with open(path + ".part", "w") as f:  # renamed when whole: a process stopped mid-write leaves no .txt
            f.write(f"{time.time()}\n{line[-1] if line else type(exc).__name__}")
        os.replace(path + ".part", path)
        raise  # without destroying the process group: see end_process_group
    end_process_group()


def _what_failed(exc: BaseException) -> list[str]:
    """The lines of the error that started it: torch's pipelining wraps a failure inside a stage (CUDA out of
    memory, a diffpipe check) in a RuntimeError that lists the stage's inputs, and chains the cause."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}".strip().splitlines()


def end_process_group() -> None:
    """Destroy the process group after this process's work succeeded. A process that failed leaves it to its exit,
    which aborts the communicators: NCCL's destroy waits for the peers' pending operations, and a peer blocked on
    this process's next send never finishes them (two H200s hung there, issue 15). Destroying it after success
    matters for gloo, whose threads could abort the interpreter's exit ("terminate called without an active
    exception") after the work itself succeeded."""
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], args: tuple, world_size: int) -> None:
    """Run fn(*args) on every rank; each rank reads its place from the environment (as under torchrun)."""
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise RuntimeError(f"torchrun started {os.environ['WORLD_SIZE']} processes but the config needs "
                               f"pipeline.stages x pipeline.data_parallel = {world_size}; "
                               f"use --nnodes x --nproc-per-node = {world_size}")
        fn(*args)
        return
    port = _free_port()
    if world_size == 1:
        _set_place(0, 1, port)
        fn(*args)
        end_process_group()
        return
    with tempfile.TemporaryDirectory(prefix="diffpipe-errors-") as errors:
        interrupted = []
        try:
            _run_passing_on_signals(lambda: _start(world_size, port, fn, args, errors), interrupted)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            cause = _first_failure(errors)
            if cause is None and interrupted:  # stopped while building: a process in training writes why it stopped
                raise Interrupted("interrupted before training began; nothing was saved. Run the same command "
                                  "to start again") from exc
            if cause is None:
                raise
            raise WorkerFailed(cause) from exc


def _first_failure(errors: str) -> str | None:
    """The earliest error written by a process that is not a knock-on of another's failure; None when there is
    none (a process killed from outside writes nothing: torch's own message names it)."""
    found = []
    for name in sorted(n for n in os.listdir(errors) if n.endswith(".txt")):
        with open(os.path.join(errors, name)) as f:
            stamp, _, line = f.read().partition("\n")
        found.append((float(stamp), line, name.removesuffix(".txt").replace("-", " ")))
    found.sort()
    real = [f for f in found if not any(k in f[1] for k in _KNOCK_ON)]
    return f"{real[0][1]} (process {real[0][2].removeprefix('rank ')})" if real else None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run_passing_on_signals(start: Callable[[], Any], interrupted: list, grace_s: float = 300.0) -> None:
    """Start the processes and wait for them. Ctrl-C or SIGTERM to this launcher is passed on to each as SIGTERM (a
    training process then checkpoints the step it is at and exits; one still building just ends) and noted in
    `interrupted`; any still running `grace_s` later are killed. One that arrives while they are being started is
    held until all have started: a start stopped half done left the started ones running, holding this terminal's
    output open (seen once in three Ctrl-Cs in tests/train/test_interrupt.py). If one process fails, torch's join
    ends the others and raises, naming it."""
    held = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            context = start()
        finally:
            signal.signal(signal.SIGINT, previous[signal.SIGINT])
            signal.signal(signal.SIGTERM, _interrupt)
        deadline = None
        while True:
            try:
                if held:
                    held.clear()
                    raise KeyboardInterrupt
                if context.join(timeout=1.0):
                    return
                if deadline is not None and time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
            except KeyboardInterrupt:
                interrupted.append(True)
                if deadline is None:
                    for process in context.processes:
                        if process.is_alive():
                            os.kill(process.pid, signal.SIGTERM)
                    deadline = time.monotonic() + grace_s
    finally:
        signal.signal(signal.SIGTERM, previous[signal.SIGTERM])


def _store_of_this_attempt(world_size: int) -> dist.Store | None:
    """Workers that `torchrun --max-restarts` started again share its store with the failed attempt, whose
    process addresses are still in it: gloo then connects to dead processes ("connectFullMesh failed: Connection
    refused", seen here). Each attempt gets keys of its own; None (the usual env:// rendezvous) otherwise."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    return dist.PrefixStore(f"diffpipe/attempt-{attempt}", store)


def init_topology(pp_size: int, dp_size: int, device_kind: str, timeout_minutes: float | None = None,
                  sp_size: int = 1) -> Topology:
    """This process's place in a (data parallel x sequence parallel x pipeline) grid of processes, and the process
    groups of its pipeline, of its stage's replicas, of its pipeline's sends and of its sample's tokens.
    `timeout_minutes`: how long any collective or send may wait for the other processes before it fails (torch's
    default, 10 minutes for NCCL and 30 for gloo, when None)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
        if os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") in ("0", "2") and rank == 0:
            # torch's default (3) ends a process whose NCCL operation failed or timed out, which the launcher then
            # reports; 0 ignores the error and 2 only aborts the communicator, so the others would wait on
            print("warning: TORCH_NCCL_ASYNC_ERROR_HANDLING="
                  f"{os.environ['TORCH_NCCL_ASYNC_ERROR_HANDLING']}: a failed or timed-out NCCL operation will not "
                  "end its process, so a fault can hang the run; unset it (torch's default, 3)", flush=True)
    else:
        device = torch.device("cpu")
        backend = "gloo"
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    timeout = timedelta(minutes=timeout_minutes) if timeout_minutes else None
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=_store_of_this_attempt(world_size),
                                device_id=device if device_kind == "cuda" else None, timeout=timeout)
    pp_rank, replica_rank = rank % pp_size, rank // pp_size
    dp_rank, sp_rank = divmod(replica_rank, sp_size)
    replicas = dp_size * sp_size

    def groups(member_lists: list[list[int]]) -> dist.ProcessGroup:
        mine = None
        for members in member_lists:  # every process takes part in creating every group
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                mine = group
        return mine

    pipelines = [[replica * pp_size + i for i in range(pp_size)] for replica in range(replicas)]
    pp_group = groups(pipelines)
    dp_group = groups([[replica * pp_size + i for replica in range(replicas)] for i in range(pp_size)])
    # the pipeline's own group for its sends and receives: on the collectives' group NCCL serialises unbatched P2P
    # with every other operation (its start-up warning); torch's pipelining docs advise a group of its own
    send_group = groups(pipelines) if pp_size > 1 else None
    sp_mesh = None
    if sp_size > 1:  # the last dimension: the processes of one sample (same data replica and stage), as diffusers'
        # attention reads a mesh ("ring" of one: Ulysses alone)
        places = torch.arange(world_size).view(dp_size, sp_size, pp_size).permute(0, 2, 1).reshape(-1, 1, sp_size)
        sp_mesh = DeviceMesh(device.type, places, mesh_dim_names=("place", "ring", "ulysses"))
    return Topology(rank=rank, world_size=world_size, pp_rank=pp_rank, pp_size=pp_size, dp_rank=dp_rank,
                    dp_size=dp_size, device=device, pp_group=pp_group, dp_group=dp_group, send_group=send_group,
                    sp_rank=sp_rank, sp_size=sp_size, sp_mesh=sp_mesh)
