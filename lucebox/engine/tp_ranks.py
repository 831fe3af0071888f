"""The tensor-parallel ranks as processes: rank 0 is this process, ranks 1..N-1 are started here.

torchrun's conventions: each started rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
(the TCP store rank 0 hosts on a free port) and joins torch.distributed's default group (NCCL on GPUs,
gloo on CPUs). Rank 0 talks to the others over a gloo group (`Channel`): a header [op, int64s, bytes]
then one int64 payload, broadcast. Nothing hangs when a rank dies: rank 0 waits for the others to join
while watching their processes, gloo fails a collective whose peer is gone, a started rank exits when
its parent does (a watchdog thread), and rank 0 kills the others when a step fails.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import child_environment, rank_environment
from ..errors import LuceboxError

log = logging.getLogger("lucebox")

JOIN_TIMEOUT = datetime.timedelta(seconds=300)  # a rank importing torch on a loaded machine
# Collectives wait as long as a server idles between requests; a dead peer fails them at once (gloo)
# or is caught by the watchdogs.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
STOP, INIT, RUN, COMPACT, RECURRENT, STATE, GRAPHS, CAPTURE = range(8)


class TensorParallelError(LuceboxError):
    """A tensor-parallel rank failed or exited; the engine cannot go on."""


class Channel:
    """Rank 0 -> every rank: (op, payload) broadcasts over a gloo group."""

    def __init__(self, group):
        self.group = group

    def send(self, op: int, payload: torch.Tensor | bytes | None = None) -> None:
        if isinstance(payload, bytes):
            nbytes = len(payload)
            payload = torch.frombuffer(bytearray(payload + b"\0" * (-nbytes % 8)), dtype=torch.int64)
        else:
            nbytes = 0
        count = 0 if payload is None else payload.numel()
        dist.broadcast(torch.tensor([op, count, nbytes], dtype=torch.int64), 0, group=self.group)
        if count:
            dist.broadcast(payload, 0, group=self.group)

    def receive(self) -> tuple[int, torch.Tensor | bytes | None]:
        header = torch.empty(3, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.group)
        op, count, nbytes = header.tolist()
        if not count:
            return op, None
        payload = torch.empty(count, dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.group)
        return op, payload.numpy().tobytes()[:nbytes] if nbytes else payload


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _control_group(backend: str):
    return dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


class Ranks:
    """Rank 0's view of the group: the started processes, their logs, the channel."""

    def __init__(self, size: int, backend: str, procs: list[subprocess.Popen], logs: list[Path]):
        self.size, self.backend, self.procs, self.logs = size, backend, procs, logs
        self.channel: Channel | None = None
        self.stopped = False
        self.failure: str | None = None
        self.busy = False  # inside a step: the others may wait in a collective a STOP would be matched against

    @classmethod
    def start(cls, size: int, device: str, payload: bytes) -> Ranks:
        """Start ranks 1..size-1 (`python -m lucebox.engine.tensor_parallel`, reading `payload` -- the
        pickled engine arguments -- on stdin) and form the group with them."""
        if dist.is_initialized():
            raise TensorParallelError("a tensor-parallel engine is running in this process already (one at a time: "
                                      "shut it down first: llm.engine.shutdown())")
        backend = backend_for(device)
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=JOIN_TIMEOUT, wait_for_workers=False)
        root = Path(__file__).resolve().parents[2]
        logdir = Path(tempfile.mkdtemp(prefix="lucebox-tp-"))
        ranks = cls(size, backend, [], [logdir / f"rank{rank}.log" for rank in range(1, size)])
        try:
            for rank, log_file in enumerate(ranks.logs, 1):
                env = child_environment(root, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
                with open(log_file, "wb") as out:
                    proc = subprocess.Popen([sys.executable, "-m", "lucebox.engine.tensor_parallel"], env=env,
                                            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
                ranks.procs.append(proc)
                with contextlib.suppress(BrokenPipeError):  # it exited at once: _wait_joined reports it
                    try:
                        proc.stdin.write(payload)
                    finally:
                        proc.stdin.close()
            ranks._wait_joined(store)
            dist.init_process_group(backend, store=store, rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT)
            ranks.channel = Channel(_control_group(backend))
        except BaseException as e:
            ranks.failure = f"the ranks did not form a group: {e}"  # their logs are kept
            ranks.kill()
            raise
        ranks._watch()
        return ranks

    def _wait_joined(self, store) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        while store.add("lucebox/joined", 0) < self.size - 1:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks did not start within {JOIN_TIMEOUT.seconds} s; "
                                          f"their logs: {self.logs[0].parent}")
            time.sleep(0.05)

    def check_alive(self) -> None:
        """TensorParallelError naming a started rank that has exited, with the end of its log."""
        for rank, proc in enumerate(self.procs, 1):
            if proc.poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} exited (code {proc.returncode}):\n"
                                          f"{self.log_tail(rank)}")

    def log_tail(self, rank: int, lines: int = 20) -> str:
        try:
            text = self.logs[rank - 1].read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"

    def _watch(self) -> None:
        """NCCL may wait forever on a dead peer: if a started rank dies while running, exit this process."""
        if self.backend == "gloo":
            return  # gloo fails the collective itself

        def watch():
            while not self.stopped:
                time.sleep(1)
                if any(p.poll() is not None for p in self.procs) and not self.stopped:
                    time.sleep(30)  # the main thread's own error, if it gets one, comes first
                    if not self.stopped:
                        log.error("a tensor-parallel rank exited; stopping")
                        os._exit(1)
        threading.Thread(target=watch, daemon=True, name="lucebox-tp-watch").start()

    def fail(self, error: BaseException) -> TensorParallelError:
        """After a failed collective or step: the others are killed; the error to raise."""
        time.sleep(0.2)  # a rank that crashed first: let its exit be seen
        exited = [(r, p.returncode) for r, p in enumerate(self.procs, 1) if p.poll() is not None]
        if exited:
            rank, code = exited[0]
            self.failure = f"tensor-parallel rank {rank} exited (code {code}):\n{self.log_tail(rank)}"
        else:
            self.failure = f"a tensor-parallel step failed on rank 0: {error}"
        self.kill()
        return TensorParallelError(self.failure)

    def stop(self) -> None:
        """Tell the others to exit, wait for them (killed after 10 s), leave the group."""
        if self.stopped:
            return
        if (self.failure is None and not self.busy and self.channel is not None
                and all(p.poll() is None for p in self.procs)):
            try:
                self.channel.send(STOP)
                for proc in self.procs:
                    proc.wait(10)
            except Exception as e:  # a rank died meanwhile, or did not exit: killed below
                log.info("tensor-parallel stop: %s", e)
        self.kill()

    def kill(self) -> None:
        """End the others now (no goodbye), leave the group; their logs are kept only after a failure."""
        self.stopped = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.failure is None:
            shutil.rmtree(self.logs[0].parent, ignore_errors=True)


def join() -> tuple[int, int, dict]:
    """A started rank: (rank, size, torchrun's variables); a watchdog exits this process when its parent
    (rank 0) is gone."""
    env = rank_environment()
    if env is None:
        raise TensorParallelError("not started as a tensor-parallel rank (RANK, WORLD_SIZE, MASTER_ADDR, "
                                  "MASTER_PORT unset)")
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)
    threading.Thread(target=watch, daemon=True, name="lucebox-tp-parent").start()
    return rank, size, env


def form_group(rank: int, size: int, env: dict, device: str) -> Channel:
    """Join the group rank 0 formed (Ranks.start); the channel its messages come on."""
    backend = backend_for(device)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), size, False, timeout=JOIN_TIMEOUT)
    store.add("lucebox/joined", 1)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    return Channel(_control_group(backend))


def read_payload() -> object:
    return pickle.loads(sys.stdin.buffer.read())
