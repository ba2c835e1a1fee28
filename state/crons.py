"""Crons of the LangGraph Platform protocol (``/runs/crons``), per tenant, in Redis, and the schedule parser.

A cron is a run request (``payload``) started on a schedule: the standard five cron fields
(minute hour day-of-month month day-of-week; ``*``, lists, ranges, ``*/n`` and ``a-b/n`` steps, month
and weekday names, ``7`` = Sunday; when both day fields are restricted either one matching is enough,
as in cron), in an IANA timezone (UTC by default), until ``end_time``.

Keys (``P = <prefix>:``)::

    P tenant:<t>     hash    cron id -> cron (JSON) of tenant t
    P due            zset    "<t>\\x1f<cron id>" of the enabled crons, score = next fire time (ms)
    P fired:<id>:<ms> string a fire slot claimed by one scheduler (any server), expires after a day

Any number of API servers run the scheduler: each fire slot is claimed with ``SET NX``, so a cron
starts one run per scheduled time whichever server sees it first.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any
from urllib.parse import quote
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from elesium.state.errors import translate_errors

DEFAULT_PREFIX = "elesium:cron"
SEP = "\x1f"
_MONTHS = {
    m: i
    for i, m in enumerate(
        ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"], start=1
    )
}
_DAYS = {d: i for i, d in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}


class ScheduleError(ValueError):
    """A schedule or timezone that cannot be parsed."""


def _field(text: str, lo: int, hi: int, names: dict[str, int] | None = None) -> set[int]:
    out: set[int] = set()
    for part in text.lower().split(","):
        base, _, step_s = part.partition("/")
        try:
            step = int(step_s) if step_s else 1
        except ValueError:
            raise ScheduleError(f"bad step in {part!r}") from None
        if step < 1:
            raise ScheduleError(f"bad step in {part!r}")

        def num(s: str) -> int:
            if names and s in names:
                return names[s]
            try:
                return int(s)
            except ValueError:
                raise ScheduleError(f"bad value {s!r}") from None

        if base == "*":
            a, b = lo, hi
        elif "-" in base:
            a_s, b_s = base.split("-", 1)
            a, b = num(a_s), num(b_s)
        else:
            a = num(base)
            b = hi if step_s else a
        if not (lo <= a <= hi and lo <= b <= hi) or a > b:
            raise ScheduleError(f"{part!r} is outside {lo}-{hi}")
        out.update(range(a, b + 1, step))
    return out


class Schedule:
    """A parsed five-field cron expression."""

    def __init__(self, expr: str) -> None:
        fields = expr.split()
        if len(fields) != 5:
            raise ScheduleError(
                f"a schedule has 5 fields (minute hour day month weekday), not {len(fields)}: {expr!r}"
            )
        self.expr = expr
        self.minutes = _field(fields[0], 0, 59)
        self.hours = _field(fields[1], 0, 23)
        self.days = _field(fields[2], 1, 31)
        self.months = _field(fields[3], 1, 12, _MONTHS)
        dow = _field(fields[4], 0, 7, _DAYS)
        self.weekdays = {d % 7 for d in dow}
        self.any_day = fields[2] == "*"
        self.any_weekday = fields[4] == "*"

    def _day_ok(self, d: datetime) -> bool:
        dom = d.day in self.days
        dow = (d.isoweekday() % 7) in self.weekdays
        if self.any_day or self.any_weekday:
            return dom and dow
        return dom or dow

    def next_after(self, after: datetime, tz: tzinfo = timezone.utc) -> datetime | None:
        """The first fire time strictly after ``after`` (aware), in UTC; None within 5 years."""
        t = after.astimezone(tz).replace(second=0, microsecond=0) + timedelta(minutes=1)
        limit = t + timedelta(days=366 * 5)
        while t < limit:
            if t.month not in self.months or not self._day_ok(t):
                t = (t + timedelta(days=1)).replace(hour=0, minute=0)
                continue
            if t.hour not in self.hours:
                t = (t + timedelta(hours=1)).replace(minute=0)
                continue
            if t.minute not in self.minutes:
                t += timedelta(minutes=1)
                continue
            return t.astimezone(timezone.utc)
        return None


def zone(name: str | None) -> tzinfo:
    if not name:
        return timezone.utc
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(f"unknown timezone {name!r}") from None


def next_fire_ms(
    schedule: str, after_ms: int, tz_name: str | None = None, end_ms: int | None = None
) -> int | None:
    at = Schedule(schedule).next_after(
        datetime.fromtimestamp(after_ms / 1000, tz=timezone.utc), zone(tz_name)
    )
    if at is None:
        return None
    ms = int(at.timestamp() * 1000)
    return None if end_ms is not None and ms > end_ms else ms


class CronStore:
    """The tenants' crons and the due index the scheduler reads (see the module docstring)."""

    def __init__(
        self, client: Any, *, prefix: str = DEFAULT_PREFIX, target: str = "the configured server"
    ) -> None:
        self.client = client
        self._p = prefix + ":"
        self._target = target

    def _tenant(self, tenant: str) -> str:
        return f"{self._p}tenant:{quote(tenant, safe='')}"

    @property
    def due_key(self) -> str:
        return self._p + "due"

    def _guard(self) -> Any:
        return translate_errors(f"the cron keys {self._p}*", self._target)

    def save(self, cron: dict[str, Any]) -> dict[str, Any]:
        """Write a cron (``tenant``, ``cron_id``, ``enabled``, ``next_ms`` among its fields) and index it."""
        member = f"{cron['tenant']}{SEP}{cron['cron_id']}"
        with self._guard():
            self.client.hset(self._tenant(cron["tenant"]), cron["cron_id"], json.dumps(cron))
            if cron.get("enabled", True) and cron.get("next_ms") is not None:
                self.client.zadd(self.due_key, {member: cron["next_ms"]})
            else:
                self.client.zrem(self.due_key, member)
        return cron

    def get(self, tenant: str, cron_id: str) -> dict[str, Any] | None:
        with self._guard():
            raw = self.client.hget(self._tenant(tenant), cron_id)
        return json.loads(raw) if raw else None

    def of_tenant(self, tenant: str) -> list[dict[str, Any]]:
        with self._guard():
            raws = self.client.hvals(self._tenant(tenant))
        return sorted((json.loads(r) for r in raws), key=lambda c: c["created_ms"])

    def delete(self, tenant: str, cron_id: str) -> bool:
        with self._guard():
            self.client.zrem(self.due_key, f"{tenant}{SEP}{cron_id}")
            return bool(self.client.hdel(self._tenant(tenant), cron_id))

    def due(self, now_ms: int, limit: int = 100) -> list[tuple[str, str, int]]:
        """(tenant, cron id, scheduled ms) of the crons due at ``now_ms``."""
        with self._guard():
            rows = self.client.zrangebyscore(
                self.due_key, "-inf", now_ms, start=0, num=limit, withscores=True
            )
        out = []
        for member, score in rows:
            tenant, _, cron_id = (member.decode() if isinstance(member, bytes) else member).partition(SEP)
            out.append((tenant, cron_id, int(score)))
        return out

    def claim(self, cron_id: str, scheduled_ms: int) -> bool:
        """Whether this caller won the fire slot (one run per cron and scheduled time, across servers)."""
        with self._guard():
            return bool(
                self.client.set(f"{self._p}fired:{cron_id}:{scheduled_ms}", "1", nx=True, px=86_400_000)
            )


def now_ms() -> int:
    return int(time.time() * 1000)
