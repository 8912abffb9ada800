"""Data parallelism for traces: the ranks of torch.distributed as replicas of the model, the parts of a
trace dealt to the replicas.

A replica is ``ranks_per_replica`` consecutive ranks: one (a model on one device, or spread over several by a
device map) or more (a model whose experts are sharded over them). Part k goes to replica k % n_replicas
(a deal fixed by the part's index alone, so a resumed run with another number of replicas still traces
exactly the parts missing); the replica's first rank writes it. Rank 0 writes the manifest: its own parts
as it writes them, and the other replicas' at the end, gathered from every rank after its last part. Until
then each replica records the parts it has written in its journal, DIR/rank-RRRRR.json (replaced whole per
part, like the manifest), so that a run killed anywhere, a replica or all of them, keeps every part some
replica finished: the next run merges the journals into the manifest before it starts, and traces the
rest again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moelens.traces.manifest import FORMAT, JOURNAL, is_own_journal, write_json_atomic


@dataclass(frozen=True)
class Replicas:
    rank: int
    world: int
    data_parallel: bool
    ranks_per_replica: int = 1
    group: object = None  # the process group the trace coordinates on (gloo); None: the default group

    @classmethod
    def create(cls, data_parallel: bool, ranks_per_replica: int = 1) -> Replicas:
        """This process's place, from torch.distributed's default group (one process when there is none): a
        collective call under data parallelism (it makes the gloo group the trace coordinates on)."""
        if isinstance(ranks_per_replica, bool) or not isinstance(ranks_per_replica, int) or ranks_per_replica < 1:
            raise ValueError(f"ranks_per_replica must be a positive integer, got {ranks_per_replica!r}")
        if ranks_per_replica != 1 and not data_parallel:
            raise ValueError(f"ranks_per_replica={ranks_per_replica} says how many ranks one replica is: it needs data_parallel=True")
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if ranks_per_replica != 1:
                raise ValueError(f"ranks_per_replica={ranks_per_replica} needs torch.distributed: run under torchrun")
            return cls(0, 1, data_parallel)
        rank, world = dist.get_rank(), dist.get_world_size()
        if not data_parallel:
            return cls(rank, world, False)
        if world % ranks_per_replica:
            raise ValueError(f"data parallel: {world} ranks are not a whole number of replicas of {ranks_per_replica} ranks each")
        # object collectives over gloo whatever the default backend (nccl would need each rank's device set)
        group = dist.new_group(backend="gloo") if world > 1 else None
        return cls(rank, world, True, ranks_per_replica, group)

    @property
    def count(self) -> int:
        return self.world // self.ranks_per_replica if self.data_parallel else 1

    @property
    def index(self) -> int:
        return self.rank // self.ranks_per_replica if self.data_parallel else 0

    @property
    def writes(self) -> bool:
        """This rank writes its replica's parts (without data parallelism, rank 0 alone writes)."""
        return self.rank % self.ranks_per_replica == 0 if self.data_parallel else self.rank == 0

    def owns(self, part: int) -> bool:
        return part % self.count == self.index

    def broadcast(self, obj):
        """Rank 0's obj on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's obj, in rank order, on rank 0 (None on the others)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0, group=self.group)
        return gathered


def write_journal(out: Path, rank: int, parts: dict[str, dict]) -> None:
    """Rank's record of the parts it has written in this run (see the module's docstring)."""
    write_json_atomic(out / JOURNAL.format(rank), {"format": FORMAT, "rank": rank, "parts": parts})


def journals(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if is_own_journal(p.name) and p.is_file())


def read_journal(path: Path) -> dict[str, dict]:
    """The parts a journal records (each checked with the manifest's own check when merged into it)."""
    try:
        journal = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not a trace journal ({err}): it is damaged; move it out of the folder to trace its parts again") from None
    if not isinstance(journal, dict) or journal.get("format") != FORMAT or not isinstance(journal.get("parts"), dict):
        raise ValueError(f"{path}: not a {FORMAT} journal: it is damaged; move it out of the folder to trace its parts again")
    return journal["parts"]
