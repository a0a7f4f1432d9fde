"""Launched by tests/test_hardening_runtime.py as the child of a short-lived parent: arms
ranks.die_with_parent(), says so, then sleeps as a rank waiting on dead peers would."""

import time

from h2jax.runtime import ranks

ranks.die_with_parent()
print("armed", flush=True)
time.sleep(600)  # without the parent-death signal this outlives its parent by ten minutes
