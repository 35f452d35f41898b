"""Interleaved 1F1B as programs, one per pipeline rank, for the planner's simulator.

The runtime runs PyTorch's :class:`ScheduleInterleaved1F1B` (Narayanan et al., SC 2021):
each of the ``ranks`` pipeline ranks holds ``chunks`` model chunks, stage ``s`` on rank
``s % ranks``, and the micro-batches go through in rounds of ``ranks``. This module writes
what each rank does in one step in the actions of :mod:`thinwire.parallel.schedule_programs`
(posts, waits, computes; a compute names its stage as a fifth element), in the order the
runtime does them:

1. **The compute order per rank.** Rank ``r`` first runs ``(chunks - 1) * per_round +
   2 (ranks - 1 - r)`` forwards (its warm-up, capped at all of them), chunk after chunk
   ``per_round`` micro-batches at a time; it then idles for as many slots as the first
   backward needs to come back, alternates one forward and one backward (the backwards
   walk the chunks in reverse), and ends with the backwards left, one slot apart.
2. **The messages.** The runtime drops the idle slots, adds its bookkeeping ones (a
   chunk's unshard, reshard and gradient reduction, which FSDP needs and which take their
   turn here too), and lowers the lists into one per rank by sweeping the ranks in
   order, one slot each, a compute going in only once its input's receive is in the
   rank's list (or needs none): a compute whose output goes to another rank is followed
   by its send, and the receive is put at that moment at the end of the receiving rank's
   list. A receive is posted where it stands and waited for right before the compute
   that needs it; sends are waited for at the end of the step.

``tests/test_interleaved_program.py`` checks the lowered lists against PyTorch's own for
several shapes.
"""

from __future__ import annotations

from collections import defaultdict

from thinwire.parallel.schedule_programs import BWD, FWD, IN_BACKWARD, Action

#: the schedule's name in a :class:`~thinwire.ParallelPlan`
INTERLEAVED = "interleaved-1f1b"
#: a compute slot: ("F" | "B", stage, micro-batch), or None (an idle slot)
Slot = tuple[str, int, int] | None


def compute_order(rank: int, ranks: int, microbatches: int, chunks: int = 2) -> list[Slot]:
    """Rank ``rank``'s computes, with its idle slots, before the messages are added."""
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        raise ValueError(
            f"interleaved 1F1B needs the micro-batches ({microbatches}) to be a multiple of "
            f"their rounds ({rounds}): use a multiple of pp={ranks}, or fewer than pp"
        )
    per_round = microbatches // rounds
    total = chunks * microbatches
    warmup = min((chunks - 1) * per_round + 2 * (ranks - 1 - rank), total)

    def forward_stage(op: int) -> int:
        return (op // per_round) % chunks * ranks + rank

    def backward_stage(op: int) -> int:
        return (chunks - 1 - (op - warmup) // per_round % chunks) * ranks + rank

    taken: dict[tuple[str, int], int] = defaultdict(int)

    def next_of(kind: str, stage: int) -> tuple[str, int, int]:
        microbatch = taken[(kind, stage)]
        taken[(kind, stage)] += 1
        return (kind, stage, microbatch)

    order: list[Slot] = [None] * rank
    for op in range(warmup):
        order.append(next_of("F", forward_stage(op)))
    order += [None] * (chunks * ranks + 2 * (ranks - 1 - rank) - warmup - rank)
    for op in range(warmup, total):
        order += [next_of("F", forward_stage(op)), next_of("B", backward_stage(op))]
    for op in range(total, total + warmup):
        order += [None, next_of("B", backward_stage(op))]
    return order


def held_in_turn(rank: int, ranks: int, microbatches: int, chunks: int = 2) -> list[dict[int, int]]:
    """After each of rank ``rank``'s computes, how many micro-batches each of its stages
    holds (forwards run, backwards not yet): the rank's activations at that point are
    these counts' bytes together, whose peak is not the sum of each stage's own peak."""
    held: dict[int, int] = defaultdict(int)
    counts = []
    for slot in compute_order(rank, ranks, microbatches, chunks):
        if slot is not None:
            held[slot[1]] += 1 if slot[0] == "F" else -1
            counts.append(dict(held))
    return counts


#: a slot the runtime's lowering spends on bookkeeping (FSDP's unshard and reshard of a
#: chunk, the reduction of its gradients): no work here, but it takes its turn
BOOKKEEPING = ("bookkeeping",)


def runtime_slots(rank: int, ranks: int, microbatches: int, chunks: int = 2) -> list[tuple]:
    """Rank ``rank``'s list as PyTorch (2.13) hands it to the lowering: the compute order
    without its idle slots, a bookkeeping slot per chunk before the first compute
    (unshard), one after each chunk's last backward (its gradients' reduction) and one
    before the compute after its last (reshard), and one per chunk still held at the end."""
    if chunks > 3:  # PyTorch then unshards ahead by three chunks at most: not written here
        raise ValueError(f"the runtime's lowering is written here for 1-3 chunks, not {chunks}")
    computes = [slot for slot in compute_order(rank, ranks, microbatches, chunks) if slot]
    last_use = {stage: i for i, (_, stage, _) in enumerate(computes)}
    held = list(dict.fromkeys(stage for _, stage, _ in computes))
    slots: list[tuple] = [BOOKKEEPING] * len(held)
    backwards: dict[int, int] = defaultdict(int)
    for i, slot in enumerate(computes):
        for stage in [s for s in held if last_use[s] < i]:
            held.remove(stage)
            slots.append(BOOKKEEPING)
        slots.append(slot)
        if slot[0] == "B":
            backwards[slot[1]] += 1
            if backwards[slot[1]] == microbatches:
                slots.append(BOOKKEEPING)
    return slots + [BOOKKEEPING] * len(held)


def lowered(ranks: int, microbatches: int, chunks: int = 2) -> dict[int, list[tuple]]:
    """Every rank's list with its messages, as the runtime lowers it: ``("F" | "B",
    stage, mb)``, ``("send" | "recv", "F" | "B", stage, mb)`` (the stage whose output is
    sent, or whose input is received). The ranks take turns, one slot each, in order; a
    compute waits for its turn until its input's receive is in its rank's list."""
    last = chunks * ranks - 1
    pending = {r: runtime_slots(r, ranks, microbatches, chunks) for r in range(ranks)}
    lists: dict[int, list[tuple]] = {r: [] for r in range(ranks)}
    received: dict[int, set[tuple]] = {r: set() for r in range(ranks)}
    while any(pending.values()):
        progress = False
        for rank in range(ranks):
            if not pending[rank]:
                continue
            slot = pending[rank][0]
            if slot is not BOOKKEEPING:
                kind, stage, mb = slot
                needs = (kind == "F" and stage > 0) or (kind == "B" and stage < last)
                if needs and (kind, stage, mb) not in received[rank]:
                    continue
                lists[rank].append(slot)
                if (kind == "F" and stage < last) or (kind == "B" and stage > 0):
                    to = stage + 1 if kind == "F" else stage - 1
                    lists[rank].append(("send", kind, stage, mb))
                    lists[to % ranks].append(("recv", kind, to, mb))
                    received[to % ranks].add((kind, to, mb))
            pending[rank].pop(0)
            progress = True
        if not progress:
            raise RuntimeError("interleaved 1F1B's compute orders cannot be lowered")
    return lists


def interleaved_programs(
    ranks: int, microbatches: int, recompute: tuple[bool, ...] = (), chunks: int = 2
) -> dict[int, list[Action]]:
    """Each rank's program for one step (``recompute[s]``: stage ``s`` has checkpointed
    blocks, which its backward recomputes)."""
    programs: dict[int, list[Action]] = {}
    for rank, actions in lowered(ranks, microbatches, chunks).items():
        program: list[Action] = []
        sends: list[tuple] = []
        receives = {action[1:] for action in actions if action[0] == "recv"}
        for action in actions:
            if action[0] in ("send", "recv"):
                _, kind, stage, mb = action
                if kind == "F":  # stage's output forward, or its input from stage - 1
                    key = (FWD, stage if action[0] == "send" else stage - 1, mb)
                else:  # the gradient of stage's input back, or of its output from stage + 1
                    key = (BWD, stage - 1 if action[0] == "send" else stage, mb)
                program.append(("post", key, action[0]))
                if action[0] == "send":
                    sends.append(key)
                continue
            kind, stage, mb = action
            incoming = (FWD, stage - 1, mb) if kind == "F" else (BWD, stage, mb)
            if (kind, stage, mb) in receives:  # waited for right before it is needed
                program.append(("wait", [incoming]))
            if kind == "B" and stage < len(recompute) and recompute[stage]:
                program.append(("compute", "R", mb, IN_BACKWARD, stage))
            program.append(("compute", kind, mb, None, stage))
        program.append(("wait", sends))
        programs[rank] = program
    return programs
