"""``freeze_startup_heap``: what serve and worker call at the end of start-up."""

from __future__ import annotations

import gc

from elesium.cli.heap import freeze_startup_heap


class _Held:
    """An object that outlives start-up."""


def test_objects_alive_at_start_up_leave_the_collectors_walk() -> None:
    held = _Held()
    try:
        # Not compared with gc.get_freeze_count() afterwards: a frozen object that dies (on any thread of
        # the test process) leaves the permanent generation, so the count only holds at the call.
        assert freeze_startup_heap() > 0
        assert not any(o is held for o in gc.get_objects())  # no later collection walks it
        later = _Held()
        assert any(o is later for o in gc.get_objects())  # what comes after start-up still is walked
    finally:
        gc.unfreeze()
    assert any(o is held for o in gc.get_objects())
