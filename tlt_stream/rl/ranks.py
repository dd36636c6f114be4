"""Rank 0 speaks, the other learner ranks follow: the process group and the few things said over it.

Under `torchrun` every learner rank runs the same command line, but only rank 0 talks to the bus (reads
groups, acks, checkpoints the ledger, publishes). The other ranks hold a shard of the policy and do what
rank 0 tells them, in the order it tells them: a command is a fixed-size int64 header broadcast from rank 0
(`Command` and three integer arguments), an update's micro-batches go point to point as tensors behind a
small shape header. Nothing crosses as a pickle (`broadcast_object_list` would unpickle whatever arrives).

The ranks write their optimizer pieces in the background, where rank 0 cannot see them fail; each rank's
failures so far (`WriteFailures`) ride on collectives the ranks make anyway (a save's first agreement, and
the last one after STOP: `agree_reporting`), so rank 0 learns of them without a round trip of its own.

With no `WORLD_SIZE` in the environment (or `WORLD_SIZE=1`) there is no process group and `join_ranks`
returns None: the single-process learner is unchanged.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from enum import IntEnum

import torch
import torch.distributed as dist

__all__ = ["Command", "RankLink", "RanksOutOfStep", "WriteFailures", "join_ranks", "leave_ranks"]

_ARGS = 3
"""Integer arguments of a command header."""
_MAX_DIMS = 4
"""Tensors handed out have at most this many dimensions (micro-batches are 1-D or 2-D)."""
_DTYPES = [torch.int64, torch.float32, torch.float64, torch.bool, torch.bfloat16, torch.int32, torch.uint8]
"""Wire codes of the dtypes a tensor header may name (its index); bool crosses as uint8."""
_MESSAGE_BYTES = 240
"""A reported write failure's message is cut to this many UTF-8 bytes."""
_REPORT = 4 + _MESSAGE_BYTES
"""A rank's row in `agree_reporting`: (ok, failures, the newest failure's step, message length, message)."""


class Command(IntEnum):
    """What rank 0 tells the other ranks to do next (the header's first slot)."""

    STOP = 0
    """Leave the loop: rank 0 is done."""
    STEP = 1
    """An update: (response tokens of the whole update, micro-batch rounds every rank runs)."""
    BUILD = 2
    """Build and shard the policy: (checkpoint step whose master weights to load, -1: the initial policy)."""
    RESTORE = 3
    """Resume from a checkpoint: (its step, the step whose optimizer state each rank loads its piece of; -1:
    none, fresh moments)."""
    SAVE = 4
    """Write a checkpoint: (step, nonce naming the save, recorded in every rank's optimizer piece)."""
    ACCUMULATE = 5
    """One group of an accumulated update: (micro-batch rounds every rank runs); its losses are not divided,
    the gradients add to the step's so far."""
    APPLY = 6
    """Finish the accumulated update: (its response tokens, which scale the summed gradient)."""
    DISCARD = 7
    """Void the accumulated update: clear the gradients it left."""


@dataclass(frozen=True)
class WriteFailures:
    """A rank's failed background writes so far (since it started), as it reports them to rank 0."""

    count: int = 0
    step: int = -1
    """The checkpoint step of the newest failed write (-1: none)."""
    error: str = ""
    """Its error, `ExceptionType: message` (no traceback), cut to `_MESSAGE_BYTES` bytes."""


class RanksOutOfStep(RuntimeError):
    """A collective failed or the ranks disagree (a rank died, a rank's step differs): the ranks can no longer
    be trusted to be in step, so the learner exits and a restart resumes from the last checkpoint."""


@dataclass
class RankLink:
    """This process's place in the learner's process group and the messages between rank 0 and the rest."""

    rank: int
    world: int
    device: torch.device
    """Where the exchanged tensors live: CPU under gloo, this rank's GPU under NCCL."""
    group: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)
    """The link's own process group (every rank), which only these messages use, so that `leave_ranks` can
    end it for certain; None: the default group (a link made by hand, one process)."""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # --- commands (rank 0 -> every rank) ------------------------------------------------------------------

    def command(self, kind: Command, *args: int) -> None:
        """Rank 0: broadcast the next command to every rank."""
        if not self.leader or len(args) > _ARGS:
            raise ValueError("only rank 0 commands, with at most three arguments")
        header = torch.tensor([int(kind), *args, *[0] * (_ARGS - len(args))], dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0, group=self.group)

    def next_command(self) -> tuple[Command, list[int]]:
        """Another rank: wait for rank 0's next command."""
        header = torch.zeros(1 + _ARGS, dtype=torch.int64, device=self.device)
        dist.broadcast(header, src=0, group=self.group)
        kind, *args = header.tolist()
        return Command(kind), args

    # --- an update's micro-batches (rank 0 -> rank r) ---------------------------------------------------------

    def hand_out(
        self, shares: list[list[list[torch.Tensor]]], total: int | None
    ) -> tuple[list[list[torch.Tensor]], int]:
        """Rank 0: send rank r its micro-batches `shares[r]` (each a list of tensors) after the STEP command
        (an update of `total` response tokens), or, with `total` None, after ACCUMULATE (one group of an
        accumulated update); returns rank 0's own share and the number of rounds every rank runs (the longest
        share: a rank with fewer batches runs empty ones, since each forward and backward is a collective under
        FSDP)."""
        if len(shares) != self.world:
            raise ValueError(f"{len(shares)} shares for {self.world} ranks")
        rounds = max(len(share) for share in shares)
        if total is None:
            self.command(Command.ACCUMULATE, rounds)
        else:
            self.command(Command.STEP, total, rounds)
        for rank in range(1, self.world):
            count = torch.tensor([len(shares[rank])], dtype=torch.int64, device=self.device)
            dist.send(count, dst=rank, group=self.group)
            for batch in shares[rank]:
                self._send(batch, rank)
        return shares[0], rounds

    def receive_share(self) -> list[list[torch.Tensor]]:
        """Another rank, after a STEP command: its micro-batches."""
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.recv(count, src=0, group=self.group)
        return [self._receive(0) for _ in range(int(count))]

    def _send(self, tensors: list[torch.Tensor], dst: int) -> None:
        header = torch.zeros(len(tensors), 2 + _MAX_DIMS, dtype=torch.int64)  # [K, (dtype, ndim, *dims)]
        for i, t in enumerate(tensors):
            if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
                raise ValueError(f"cannot hand out a {t.dtype} tensor of shape {tuple(t.shape)}")
            header[i, 0], header[i, 1] = _DTYPES.index(t.dtype), t.dim()
            header[i, 2 : 2 + t.dim()] = torch.tensor(t.shape)
        dist.send(torch.tensor([len(tensors)], dtype=torch.int64, device=self.device), dst=dst, group=self.group)
        dist.send(header.to(self.device), dst=dst, group=self.group)
        for t in tensors:
            dist.send(_wire(t).contiguous().to(self.device), dst=dst, group=self.group)

    def _receive(self, src: int) -> list[torch.Tensor]:
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        dist.recv(count, src=src, group=self.group)
        header = torch.zeros(int(count), 2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        dist.recv(header, src=src, group=self.group)
        out = []
        for code, ndim, *dims in header.tolist():
            dtype = _DTYPES[code]
            t = torch.empty(dims[:ndim], dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device)
            dist.recv(t, src=src, group=self.group)
            out.append(t.bool() if dtype == torch.bool else t)
        return out

    # --- agreement (every rank) ---------------------------------------------------------------------------

    def sum(self, values: list[float]) -> list[float]:
        """Every rank's `values` summed elementwise (float64), on every rank."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.tolist()

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t)

    def agree(self, ok: bool) -> bool:
        """True on every rank when every rank says True (a barrier that also carries success)."""
        t = torch.tensor([int(ok)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t)

    def agree_reporting(self, ok: bool, failures: WriteFailures) -> tuple[bool, list[WriteFailures]]:
        """`agree`, with every rank's write failures carried in the same collective (one all-gather of a
        small row per rank): (whether every rank said True, each rank's `WriteFailures`, by rank)."""
        message = failures.error.encode()[:_MESSAGE_BYTES]
        row = torch.zeros(_REPORT, dtype=torch.int64)
        row[:4] = torch.tensor([int(ok), failures.count, failures.step, len(message)])
        row[4 : 4 + len(message)] = torch.tensor(list(message), dtype=torch.int64)
        rows = [torch.zeros(_REPORT, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        dist.all_gather(rows, row.to(self.device), group=self.group)
        agreed, reports = True, []
        for said in rows:
            said_ok, count, step, length, *data = said.tolist()
            agreed = agreed and bool(said_ok)
            text = bytes(data[: max(0, min(length, _MESSAGE_BYTES))]).decode(errors="ignore")
            reports.append(WriteFailures(count=count, step=step, error=text))
        return agreed, reports


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def join_ranks(device: str, *, timeout_s: float) -> RankLink | None:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT): gloo on
    CPU, NCCL on CUDA, where each rank takes GPU LOCAL_RANK. None when there is no group to join (no
    WORLD_SIZE, or 1): one process, as without torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank = int(os.environ["RANK"])
    if torch.device(device).type == "cuda":
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        backend, link_device = "nccl", local
    else:
        backend, link_device = "gloo", torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    if dist.get_world_size() != world or dist.get_rank() != rank:
        raise RuntimeError(
            f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, env says {rank}/{world}"
        )
    return RankLink(rank=rank, world=world, device=link_device, group=dist.new_group())


def leave_ranks(link: RankLink | None) -> None:
    """End the link's process group, then the default one. Ending the link's for certain is what lets the
    process exit cleanly: a gloo worker thread lets go of a finished collective's tensors a moment after the
    caller has its result, and letting go of a tensor Python also holds takes the GIL; if the interpreter is
    already shutting down then, that thread is stopped mid-destructor and the process aborts ("terminate
    called without an active exception"). The last collectives before an exit are the link's (STOP and the
    reports after it), and the link's group has no other owner: once it is destroyed and dropped here, its
    worker threads are joined (torch joins them without holding the GIL), so nothing of it outlives the
    interpreter. The default group cannot be ended so surely (FSDP and `torch.distributed.nn` keep
    references to it), but its last collectives finished well before."""
    if link is not None and link.group is not None:
        group, link.group = link.group, None
        dist.destroy_process_group(group)
        del group  # the last reference: its threads are joined here
    if dist.is_initialized():
        dist.destroy_process_group()
