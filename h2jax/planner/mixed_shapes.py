"""Two shapes per chip type: a local search from the exact search's best plans (`refine`).

The exact search gives every stage of one chip type one shape (mesh and recompute policy).
A type's stages can do better on two: under 1F1B a stage nearer the front keeps more
micro-batches in flight, so the front of a type's block may need a larger tensor size (more
memory per chip) than its back, and chips a shape leaves over may hold a smaller stage. From
each of the best plans with one shape per type, `refine` walks stage lists one move away (`moves`),
each type's stages in at most two blocks anywhere in the pipeline (a move may put a block, or
part of one, on the other side of its neighbours: a type may run at both ends) and each new
block on a shape no other shape of its chip beats on every count (`undominated`; a block put
whole on another shape of its chip leaves the chips it frees to its type's other block in the
same move, `_grown`), solves each list's layer split exactly (`split.solve`, which skips a list its bounds show cannot win)
and moves to the best until no move improves it (`climb`; on a small space the first start
at each micro-batch size climbs against its own time, not the best so far, and a climb
no move improves tries once more with each new block at any place in the pipeline, not
only beside its kept stages or its neighbour, and then looks two moves ahead from the best
list it found: `refine`'s `wide`, `_look_ahead`). The result is at least as fast as
the one-shape optimum; it is not proved optimal among two-shape plans (chip_split.prove
proves that, in minutes on hundreds of chips; `--exhaustive` enumerates them: docs/planner.md, "Two
shapes per chip type").
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from h2jax.planner.memory_model import StageMemoryTerms
from h2jax.planner.positions import run_lengths
from h2jax.planner.space import Candidate, Context, Option, SearchStats
from h2jax.planner.split import Beside, NewShapes, TopK, solve

MAX_BLOCKS_PER_TYPE = 2


def merged(options: Sequence[Option]) -> tuple[Option, ...]:
    """Adjacent blocks of one chip type and shape as one block."""
    out: list[Option] = []
    for o in options:
        if out and out[-1].chip == o.chip and out[-1].shape == o.shape:
            out[-1] = dataclasses.replace(out[-1], stages=out[-1].stages + o.stages)
        else:
            out.append(o)
    return tuple(out)


def in_space(options: Sequence[Option], counts: Mapping[str, int]) -> bool:
    """At most MAX_BLOCKS_PER_TYPE blocks per type (anywhere in the pipeline), within its chips."""
    blocks: dict[str, int] = {}
    chips: dict[str, int] = {}
    for o in options:
        blocks[o.chip] = blocks.get(o.chip, 0) + 1
        chips[o.chip] = chips.get(o.chip, 0) + o.chips
    return all(n <= MAX_BLOCKS_PER_TYPE and chips[name] <= counts[name] for name, n in blocks.items())


def moves(options: tuple[Option, ...], shapes: Mapping[str, Sequence[Option]],
          counts: Mapping[str, int], n_layers: int,
          hopeless: Callable[[Beside, NewShapes, np.ndarray], np.ndarray] | None = None,
          anywhere: bool = False) -> Iterator[tuple[Option, ...]]:
    """Stage lists one move from `options` (`in_space` may still reject some): a block one
    stage longer or shorter, or dropped; one of a type's two blocks shorter and the other
    longer by the chips that frees (`_reshared`); a block's stages but `keep` of them (0 to all, on
    their mesh with their recompute policy or another) given to k stages of another shape of
    its chip, or of a neighbouring block's chip, placed next to the kept ones or to that
    neighbour (with `anywhere`, at any place in the pipeline: e.g. a type's new block at the
    front, its kept one at the back) (the chips permitting, at most `n_layers` stages); or the block, or some of its
    stages on its shape, taken out and put in any other place of the pipeline (a type's two
    blocks may then sit apart, e.g. at both ends, another type between); and where the block
    goes whole to another shape of its chip and its type has a second block, that block grown
    by the chips the new one leaves over (`_grown`). A split is not made when
    `hopeless(beside, new, ks)` says so: asked once per list of the other blocks
    (`split.Beside`), of every shape and number of stages the new block may take at once (a
    column each: the shapes `split.NewShapes`, the numbers the array ks), it answers per
    column (`split.Beside.cannot_beat`: the bounds `split.solve` asks first)."""
    used: dict[str, int] = {}
    blocks: dict[str, int] = {}
    for o in options:
        used[o.chip] = used.get(o.chip, 0) + o.chips
        blocks[o.chip] = blocks.get(o.chip, 0) + 1
    shapes = {chip: opts for chip, opts in shapes.items() if opts}
    columns = {chip: NewShapes.of(opts) for chip, opts in shapes.items()}  # a new block's shapes, `hopeless` weighs
    per_stage_of = {chip: np.array([s.data * s.tensor for s in opts]) for chip, opts in shapes.items()}
    for i, o in enumerate(options):
        head, tail = options[:i], options[i + 1:]
        per_stage = o.data * o.tensor
        rest = head + tail
        if o.stages > 1:
            yield head + (dataclasses.replace(o, stages=o.stages - 1),) + tail
        if per_stage <= counts[o.chip] - used[o.chip]:
            yield head + (dataclasses.replace(o, stages=o.stages + 1),) + tail
        if blocks[o.chip] == MAX_BLOCKS_PER_TYPE:
            yield from _reshared(options, i, counts[o.chip] - used[o.chip], n_layers)
        if len(options) > 1:
            yield rest
            # the block elsewhere in the pipeline (a type may run at both ends)
            for j in range(len(rest) + 1):
                if j != i:
                    yield rest[:j] + (o,) + rest[j:]
            # some of its stages elsewhere, on its shape: the type's second block, apart from the first
            if blocks[o.chip] < MAX_BLOCKS_PER_TYPE:
                for k in range(1, o.stages):
                    shorter = head + (dataclasses.replace(o, stages=o.stages - k),) + tail
                    moved = (dataclasses.replace(o, stages=k),)
                    for j in range(len(shorter) + 1):
                        if j not in (i, i + 1):  # (beside the kept stages: the same list)
                            yield shorter[:j] + moved + shorter[j:]
        # the chips a new block may come from: this block's, then its neighbours' (beside them)
        sources = [(o.chip, 0)] + [(options[j].chip, j - i) for j in (i - 1, i + 1)
                                   if 0 <= j < len(options) and options[j].chip != o.chip]
        for chip, side in sources:
            if chip not in shapes or (blocks[chip] >= MAX_BLOCKS_PER_TYPE and side):
                continue
            for keep in range(o.stages + 1):
                if chip == o.chip and keep and blocks[chip] >= MAX_BLOCKS_PER_TYPE:
                    break  # a third block of the type
                room = counts[chip] - used[chip] + (o.stages - keep) * per_stage * (chip == o.chip)
                # the kept stages on their own mesh, with their recompute policy or another
                for r in ([o] + [s for s in shapes.get(o.chip, ()) if s.data == o.data and s.tensor == o.tensor
                                 and s.recompute != o.recompute]) if keep else [o]:
                    kept = (dataclasses.replace(r, stages=keep),) if keep else ()
                    others = Beside(rest + kept)  # the stages beside the new block's
                    # every shape of the chip at every number of stages it may take, one column each
                    most = np.minimum(room // per_stage_of[chip], n_layers - others.sums.stages).clip(min=0)
                    if chip == o.chip:
                        most[[s.shape in (o.shape, r.shape) for s in shapes[chip]]] = 0
                    which = np.repeat(np.arange(len(most)), most)
                    ks = np.arange(len(which)) - np.repeat(np.cumsum(most) - most, most) + 1
                    alive = slice(None)
                    if hopeless is not None and len(ks):  # (all at once)
                        alive = ~hopeless(others, columns[chip].take(which), ks)
                    base = head + kept + tail
                    for j, k in zip(which[alive].tolist(), ks[alive].tolist()):
                        extra = (dataclasses.replace(shapes[chip][j], stages=k),)
                        if anywhere:
                            yield from (base[:at] + extra + base[at:] for at in range(len(base) + 1))
                            continue
                        if side >= 0:
                            yield head + kept + extra + tail
                        if side <= 0 and kept:
                            yield head + extra + kept + tail
                    if chip == o.chip and not keep and blocks[chip] == MAX_BLOCKS_PER_TYPE:
                        # the type's other block takes the chips the new one leaves over
                        other = next(n for n, b in enumerate(rest) if b.chip == chip)
                        yield from _grown(head, tail, other, room, n_layers, shapes[chip], which, ks,
                                          columns[chip], hopeless)


def _reshared(options: tuple[Option, ...], i: int, free: int, n_layers: int) -> Iterator[tuple[Option, ...]]:
    """The lists with `give` of block i's stages (1 to all; for each number the other block
    grows by, the fewest) taken off and its type's other block grown by the stages their chips
    and the type's `free` chips make (at most `n_layers` stages in all): one block of a type
    shorter and the other longer at once, which no pair
    of moves reaches one at a time where the chips are all in use (a random small cluster of
    `benchmarks/planner.py --random-two-shapes`' kind: its H100s' 4 stages of (4, 1) and 2 of
    (4, 2), apart, 0.054 % slower than 2 and 3)."""
    o = options[i]
    j = next(n for n, x in enumerate(options) if x.chip == o.chip and n != i)
    other, p, grown = options[j], sum(x.stages for x in options), 0
    for give in range(1, o.stages + 1):
        grow = min((free + give * o.data * o.tensor) // (other.data * other.tensor), n_layers - p + give)
        if grow <= grown:
            continue  # (the fewest stages given for each number grown: more only leave chips idle)
        grown = grow
        out = list(options)
        out[i] = dataclasses.replace(o, stages=o.stages - give)
        out[j] = dataclasses.replace(other, stages=other.stages + grow)
        yield tuple(x for x in out if x.stages)


def _grown(head: tuple[Option, ...], tail: tuple[Option, ...], other: int, room: int, n_layers: int,
           opts: Sequence[Option], which: np.ndarray, ks: np.ndarray, column: NewShapes,
           hopeless: Callable[[Beside, NewShapes, np.ndarray], np.ndarray] | None) -> Iterator[tuple[Option, ...]]:
    """The lists head + (ks[i] stages of opts[which[i]]) + tail with the block `other` of head
    + tail (of the new block's chip) grown by the stages the chips the new block leaves over
    of `room` make (at most `n_layers` stages in all), where it grows: a block put on a shape
    of fewer chips per stage leaves chips its type's other block can take in the same move,
    a list that may be faster where neither move alone is (the 64-chip cluster's two-shape
    optimum, micro-batch 2, is one such move from the local search's best list there)."""
    rest = head + tail
    block = rest[other]
    per_new = np.array([opts[j].data * opts[j].tensor for j in which.tolist()], dtype=np.int64)
    more = np.minimum((room - ks * per_new) // (block.data * block.tensor),
                      n_layers - sum(o.stages for o in rest) - ks)
    for grow in np.unique(more[more > 0]).tolist():
        grown = rest[:other] + (dataclasses.replace(block, stages=block.stages + grow),) + rest[other + 1:]
        sel = np.flatnonzero(more == grow)
        w, k = which[sel], ks[sel]
        if hopeless is not None:
            alive = ~hopeless(Beside(grown), column.take(w), k)
            w, k = w[alive], k[alive]
        for j, n in zip(w.tolist(), k.tolist()):
            yield grown[:len(head)] + (dataclasses.replace(opts[j], stages=n),) + grown[len(head):]


def undominated(shapes: Sequence[Option], m: int, n_layers: int) -> list[Option]:
    """The shapes of one chip type no other beats on every count the local search weighs:
    as few chips per stage or fewer, a per-layer time, fill and tail no larger, and as many
    layers held or more at every number of micro-batches in flight a stage may keep (1 to
    min(m, 2 * n_layers), and m). (Sends, which depend on the neighbours, are not weighed: the
    search is local, not exact.)"""
    if len(shapes) < 2:
        return list(shapes)
    in_flight = np.unique(np.r_[np.arange(1, min(m, 2 * n_layers) + 1), m])
    # every shape at every count at once: the fit test on the shapes' memory terms stacked
    caps = StageMemoryTerms.stacked([s.mem for s in shapes]).max_layers(in_flight[None, :]).astype(float)  # (S, F)
    keys = np.array([(s.data * s.tensor, s.layer_s, s.fill, s.tail1) for s in shapes], dtype=float)  # (S, 4)
    # beats[i, j]: shape i no worse than j on every count, and better on one (or equal and first)
    no_worse = (keys[:, None] <= keys[None]).all(-1) & (caps[:, None] >= caps[None]).all(-1)
    better = (keys[:, None] != keys[None]).any(-1) | (caps[:, None] > caps[None]).any(-1)
    first = np.arange(len(shapes))[:, None] < np.arange(len(shapes))[None]
    beats = no_worse & (better | first)
    np.fill_diagonal(beats, False)
    return [s for s, gone in zip(shapes, beats.any(axis=0).tolist()) if not gone]


def refine(ctx: Context, starts: Sequence[Candidate], micro_batches: Sequence[int], stats: SearchStats,
           deadline: float = float("inf"), wide: bool = False) -> Candidate:
    """The best plan reached from each of `starts` in turn by improving moves: `moves` at its
    micro-batch size, or its stage list at another of `micro_batches` (each shape's data size
    dividing it); the best start itself when no move improves on it. A start at the same
    micro-batch size as an earlier one climbs only through lists faster than the best so far;
    with `wide` (a small space), the first start at a micro-batch size climbs against its own
    time (its part of the space differs: other memory caps and in-flight counts, so its climb
    may pass through lists slower than the best so far to a faster one); without, it climbs
    through faster lists only too (on 2,432 chips the climb from the best one-shape list at
    micro-batch 16, 1.7 % slower than the best plan then, took 0.23 s against its own time,
    0.05 s against the best so far, and found nothing faster either way; on the 84 random
    clusters of `benchmarks/planner.py --random-shipped` (seeds 42 and 8) and the shipped
    ones every plan was the same; exploratory, 2026-12-07).
    A list is solved again only against a time to beat
    above the one it was solved against (a start's own climb may need it). With `wide`, a
    climb that no move improves tries once more with a new block at any place (`moves`'
    `anywhere`), and goes on from there where that improves; where that does not improve
    either, it looks two moves ahead (`_look_ahead`) from the best list it found, once per
    list (`looked`, shared by the climbs). Where
    `stats` says the exact search proved the best of `starts` optimal among one-shape lists,
    lists with one shape per type are not solved: none can beat it. Stops at `deadline`
    (perf_counter seconds) with the best found so far."""
    shapes, top = Shapes(ctx), TopK(1)
    for c in starts:
        top.push(c)
    seen: dict = {}  # list -> the time it was shown not to beat (0: it did)
    looked: set = set()  # the lists a climb looked two moves ahead from
    sizes: set[int] = set()
    for start in starts:
        if time.perf_counter() > deadline:
            break
        own = top if start.micro_batch in sizes or not wide else TopK(1)
        own.push(start)
        sizes.add(start.micro_batch)
        climb(ctx, start, micro_batches, shapes, own, seen, stats, deadline, wide, looked, top)
        top.push(own.sorted()[0])
    return top.sorted()[0]


def one_shape(options: Sequence[Option]) -> bool:
    """Every chip type in one block (of a merged list): a list of the exact search's space."""
    return len({o.chip for o in options}) == len(options)


class Shapes:
    """Per micro-batch size and chip, its shapes: every one that holds a layer (`every`), and
    those a new block may take (`for_moves`: `undominated`); each made when first asked for."""

    def __init__(self, ctx: Context) -> None:
        self.ctx, self._every, self._moves, self._runs = ctx, {}, {}, {}

    def runs(self, b: int) -> np.ndarray:
        """(L+2,) bool: whether the schedule runs a pipeline of p stages at micro-batch b
        (index L+1: any longer one, never)."""
        if b not in self._runs:
            self._runs[b] = np.append(run_lengths(self.ctx, self.ctx.global_batch // b), False)
        return self._runs[b]

    def every(self, b: int) -> dict[str, list[Option]]:
        if b not in self._every:
            self._every[b] = {opts[0].chip: opts for opts in self.ctx.type_shapes(b, prune_unfit=True) if opts}
        return self._every[b]

    def for_moves(self, b: int) -> dict[str, list[Option]]:
        if b not in self._moves:
            m, L = self.ctx.global_batch // b, self.ctx.model.n_layers
            self._moves[b] = {chip: undominated(opts, m, L) for chip, opts in self.every(b).items()}
        return self._moves[b]


# Two moves ahead (`_look_ahead`, on a space of at most search.WIDE_SPACE lists): from the
# best list a climb found, where no move improves it, the LOOKAHEAD_LISTS best lists one move
# away within LOOKAHEAD_GAP of it, and every list one move from each of them. A climb stuck
# more than LOOKAHEAD_GAP above the best list of the climbs before it does not look ahead.
# On 59 random small clusters of shipped chips whose two-shape optimum the exact search
# proved (`benchmarks/planner.py --random-two-shapes`' kind, seeds 42, 8 and 5, exploratory,
# 2026-12-06), the local search then missed 12 optima against 20, its whole search (the exact
# one-shape search first) taking about 1.7 times as long. Looking ahead from every list a
# climb is stuck at (a later start's too, stuck at its start) missed 10, at about 2.2 times;
# once per micro-batch size, 14 at 1.5 times; 4 lists instead of 6 reached fewer, 8 or 16 no
# more, dearer.
LOOKAHEAD_LISTS = 6
LOOKAHEAD_GAP = 0.05


def _neighbours(ctx: Context, b: int, options: tuple[Option, ...], micro_batches: Sequence[int], shapes: Shapes,
                top: TopK, anywhere: bool) -> Iterator[tuple[int, tuple[Option, ...]]]:
    """(micro-batch size, stage list) one move from `options` at b: the same list at another
    of `micro_batches`, then `moves` at b (new blocks `top` cannot take left out)."""
    L = ctx.model.n_layers
    weight = ctx.sched.closed_form.steady_weight(ctx.global_batch // b, ctx.v)
    runs = shapes.runs(b)

    def hopeless(beside: Beside, new: NewShapes, ks: np.ndarray) -> np.ndarray:
        out = ~runs[np.minimum(beside.sums.stages + ks, L + 1)]  # (a length the schedule does not run)
        if not out.all():
            out[~out] = beside.cannot_beat(weight, L, new.take(~out), ks[~out], top.bound)
        return out

    yield from ((b2, x) for b2 in micro_batches if b2 != b for x in [at_micro_batch(options, shapes.every(b2))] if x)
    yield from ((b, x) for x in moves(options, shapes.for_moves(b), ctx.counts, L, hopeless, anywhere))


def _solve_round(ctx: Context, b: int, options: tuple[Option, ...], micro_batches: Sequence[int], shapes: Shapes,
                 top: TopK, seen: dict, stats: SearchStats, deadline: float, anywhere: bool) -> bool:
    """Solve every list one move from `options` (`_neighbours`) into `top`, but those `seen`
    shows cannot beat it; False once `deadline` has passed."""
    L = ctx.model.n_layers
    for n, (b2, x) in enumerate(_neighbours(ctx, b, options, micro_batches, shapes, top, anywhere)):
        if n % 256 == 0 and time.perf_counter() > deadline:
            return False
        if not shapes.runs(b2)[min(sum(o.stages for o in x), L + 1)]:
            continue  # (the schedule does not run that many stages there: interleaved 1F1B's p divides m)
        x = merged(x)
        if not x or seen.get((b2, x), -math.inf) >= top.bound or (stats.proved_optimal and one_shape(x)) \
                or not in_space(x, ctx.counts):
            continue
        bound = top.bound
        seen[(b2, x)] = 0.0 if solve(ctx, b2, x, top, stats) else bound
    return True


def _look_ahead(ctx: Context, b: int, options: tuple[Option, ...], micro_batches: Sequence[int], shapes: Shapes,
                top: TopK, seen: dict, stats: SearchStats, deadline: float) -> None:
    """From a list no move improves (`top`'s best): its LOOKAHEAD_LISTS best neighbours within
    LOOKAHEAD_GAP of it, slower than it, and each one's neighbours solved into `top` (new
    blocks anywhere): a list two moves away that beats it where neither move alone does
    (e.g. a block's stages re-shared with the type's other block and that block moved)."""
    near = TopK(LOOKAHEAD_LISTS, top.bound * (1 + LOOKAHEAD_GAP))
    if not _solve_round(ctx, b, options, micro_batches, shapes, near, seen, stats, deadline, True):
        return
    for c in near.sorted():
        if not _solve_round(ctx, *_key(c), micro_batches, shapes, top, seen, stats, deadline, True):
            return


def climb(ctx: Context, start: Candidate, micro_batches: Sequence[int], shapes: Shapes, top: TopK, seen: dict,
          stats: SearchStats, deadline: float, wide: bool = False, looked: set | None = None,
          overall: TopK | None = None) -> None:
    """Hill-climbing from `start`: each round solves every list one move from the current one
    (but those `seen` shows cannot beat `top`) into `top`, and moves to `top`'s best while that
    improves on the best before the round; with `wide`, a round that does not improve is
    followed by one with new blocks at any place (`moves`' `anywhere`), and one that does not
    improve either by a look two moves ahead (`_look_ahead`) where the list it is stuck at is
    `top`'s best (a later start at a micro-batch size, which climbs in the best so far, may
    be stuck at its start, a slower list), is not in `looked` (lists looked ahead from, which
    it adds to) and is within LOOKAHEAD_GAP of `overall`'s best (the best of the climbs
    before it)."""
    looked = set() if looked is None else looked
    current = _key(start)
    anywhere = False
    while True:
        b, options = current
        best = top.bound
        if not _solve_round(ctx, b, options, micro_batches, shapes, top, seen, stats, deadline, anywhere):
            return
        if top.bound >= best and wide and not anywhere:
            anywhere = True  # stuck: once more, new blocks anywhere
            continue
        # (where it stands is `top`'s best but for a later start at a micro-batch size, stuck at its own)
        if top.bound >= best and wide and current not in looked and top.heap and current == _key(top.sorted()[0]) \
                and (overall is None or best <= overall.bound * (1 + LOOKAHEAD_GAP)):
            looked.add(current)  # stuck again, at the best list found: two moves ahead
            _look_ahead(ctx, b, options, micro_batches, shapes, top, seen, stats, deadline)
        if top.bound >= best:
            return
        anywhere = False
        current = _key(top.sorted()[0])


def _key(cand: Candidate) -> tuple[int, tuple[Option, ...]]:
    """A plan's (micro-batch size, merged stage list): what `climb` stands on."""
    return cand.micro_batch, merged(cand.options)


def at_micro_batch(options: Sequence[Option], shapes: Mapping[str, Sequence[Option]]) -> tuple[Option, ...] | None:
    """The same stage list at another micro-batch size (its shapes' options there), or None
    where a shape has none (its data size does not divide it, or it holds no layer)."""
    out = []
    for o in options:
        same = next((s for s in shapes.get(o.chip, ()) if s.shape == o.shape), None)
        if same is None:
            return None
        out.append(dataclasses.replace(same, stages=o.stages))
    return tuple(out)
