"""The schedules by name: `get_schedule("1f1b")`. Adding a schedule is one module beside this
one and one line here."""

from __future__ import annotations

from h2jax.schedules import gpipe, interleaved, one_f_one_b, zb_h1
from h2jax.schedules.base import Schedule

SCHEDULES: dict[str, Schedule] = {
    s.name: s for s in (gpipe.SCHEDULE, one_f_one_b.SCHEDULE, interleaved.SCHEDULE, zb_h1.SCHEDULE)
}
NAMES = tuple(SCHEDULES)
AUTO = "auto"  # the planner's choice: search every schedule (and v for interleaved)
VIRTUAL_STAGES = (2, 4)  # the v the planner tries for a schedule with chunks


def get_schedule(name: str) -> Schedule:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"schedule {name!r} is unknown; use one of {', '.join(NAMES)}") from None


def variants(name: str = AUTO) -> list[tuple[str, int]]:
    """(schedule, v) pairs the planner searches for `name` (all of them for "auto")."""
    names = NAMES if name == AUTO else (get_schedule(name).name,)
    return [(n, v) for n in names for v in (VIRTUAL_STAGES if SCHEDULES[n].virtual else (1,))]
