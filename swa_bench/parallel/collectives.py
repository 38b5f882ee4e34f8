"""Process groups and the collectives the sharded model runs inside its forward.

The forward's all-reduce is the functional collective (``_c10d_functional.all_reduce_`` and its
``wait_tensor``): it dispatches as ops, so a CUDA graph captures it with NCCL and the CPU stand-in
records and replays it with gloo, like every other op of a captured segment.

The DP route agreement's collectives are watched (``enter``): every rank posts its arrival and
values on the job's store and waits for the others', within a deadline, before the collective
starts. A rank that skips one, or fails before it, then fails the others' checks in bounded time
with a message naming it and the collective, where the bare collective would wait forever.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from swa_bench.parallel.layout import ParallelLayout


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sums ``x`` over ``group`` in place; returns ``x``."""
    torch.ops._c10d_functional.all_reduce_(x, "sum", group.group_name)
    return torch.ops._c10d_functional.wait_tensor(x)


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the layout: the TP group it shards the model over, the DP group whose
    routes it agrees with. Ranks ``[d * tp, (d + 1) * tp)`` form DP replica d's TP group."""

    layout: ParallelLayout
    rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.layout.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.layout.tp


def make_groups(layout: ParallelLayout) -> ParallelGroups:
    """Every rank creates every group (torch.distributed's rule); each keeps its own."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(
            f"the layout dp={layout.dp} x tp={layout.tp} needs {layout.world_size} "
            f"processes, got {world}"
        )
    tp_group = dp_group = None
    if layout.tp > 1:
        for d in range(layout.dp):
            ranks = list(range(d * layout.tp, (d + 1) * layout.tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                tp_group = group
    if layout.dp > 1:
        for t in range(layout.tp):
            ranks = list(range(t, world, layout.tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                dp_group = group
    return ParallelGroups(layout, rank, tp_group, dp_group)


def init_from_env() -> torch.device:
    """Joins the job torchrun started (NCCL on GPUs, gloo on CPU); this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
        return device
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return torch.device("cpu")


# --- the watchdog: a collective every rank reaches within a deadline, or a named failure ---

DEFAULT_DEADLINE_S = 600.0  # no longer than the process groups' own timeout (init_from_env)
_POLL_MAX_S = 0.05
_calls: dict[str, int] = {}  # group -> watched collectives entered so far on this rank
_failed: dict[str, str] = {}  # group -> the failure this rank saw or was told of


class CollectiveFailure(RuntimeError):
    """A watched collective did not happen alike on every rank of its group; the message names
    the rank(s) and the collective. The group's ranks may now stand at different collectives, so
    every later watched collective on the group fails at once, on every rank."""


@dataclass(frozen=True)
class Entry:
    """One rank's entry to a watched collective: its place in the group's sequence of watched
    collectives, and the values every rank posted on the way in (group rank order)."""

    name: str
    call: int
    posted: list[tuple[int, ...]]

    def describe(self) -> str:
        return f"{self.name} (watched collective #{self.call} of the group)"


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _failed_key(group: str) -> str:
    return f"swa_bench/watch/{group}/failed"


def report_failure(group: dist.ProcessGroup, message: str) -> CollectiveFailure:
    """Records ``message`` as the group's failure, for this rank and (through the job's store)
    every other rank waiting at or coming to a watched collective; returns the error to raise."""
    name = group.group_name
    _failed.setdefault(name, message)
    store = _store()
    if not store.check([_failed_key(name)]):
        store.set(_failed_key(name), message)
    return CollectiveFailure(message)


def enter(
    name: str, group: dist.ProcessGroup, values: tuple[int, ...] = (),
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> Entry:
    """Waits until every rank of ``group`` has reached its next watched collective, posting its
    ``name`` and ``values`` on the job's store; only then may the collective start, so a rank
    that never comes leaves no collective half-run on the others.

    Raises ``CollectiveFailure`` when the ranks reached different collectives at this place of
    the group's sequence (one skipped or added one: named at once, with each rank's), when a rank
    did not arrive within ``deadline_s`` (named), when another rank of the group reported a
    failure (within a poll), or at once when the group failed before: a job with a rank gone
    astray fails in bounded time instead of hanging."""
    gname = group.group_name
    if gname in _failed:
        raise CollectiveFailure(f"{name}: not run, the group failed before: {_failed[gname]}")
    call = _calls[gname] = _calls.get(gname, 0) + 1
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group)
    keys = [f"swa_bench/watch/{gname}/{call}/{r}" for r in ranks]
    store = _store()
    store.set(keys[ranks.index(me)], name + "|" + ",".join(str(int(v)) for v in values))
    start, pause = time.monotonic(), 1e-4
    while not store.check(keys):
        if store.check([_failed_key(gname)]):
            told = store.get(_failed_key(gname)).decode()
            _failed.setdefault(gname, told)
            raise CollectiveFailure(f"rank {me}: {name} abandoned: {told}")
        if time.monotonic() - start > deadline_s:
            missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
            raise report_failure(group, (
                f"rank {me}: {name} (watched collective #{call} of the group {ranks}) timed out "
                f"after {deadline_s:g} s: rank{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} never reached it"))
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)
    names, posted = [], []
    for raw in store.multi_get(keys):
        theirs, _, numbers = raw.decode().partition("|")
        names.append(theirs)
        posted.append(tuple(int(v) for v in numbers.split(",") if v))
    if any(n != name for n in names):
        at = "; ".join(f"rank {r}: {n}" for r, n in zip(ranks, names, strict=True))
        odd = [r for r, n in zip(ranks, names, strict=True) if n != name]
        raise report_failure(group, (
            f"rank {me}: watched collective #{call} of the group {ranks} differs between ranks "
            f"({at}): rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} skipped "
            f"or added a collective before {name}, or rank {me} did"))
    return Entry(name, call, posted)
