"""Loaded by ``benchmarks/triage_profile.py``'s server only (this folder on its PYTHONPATH): records
each thread's native id and name, so a ``perf`` profile's thread ids can be read as roles."""

import os
import sys
import threading
import time

_OUT = os.environ.get("ELESIUM_PROFILE_THREAD_NAMES")

if _OUT and "serve" in sys.argv:

    def _record() -> None:
        seen: dict[int | None, str] = {}
        while True:
            time.sleep(0.5)
            for thread in threading.enumerate():
                seen[thread.native_id] = thread.name
            with open(_OUT, "w") as fh:
                fh.writelines(f"{tid}\t{name}\n" for tid, name in seen.items())

    threading.Thread(target=_record, daemon=True, name="profile-thread-names").start()
