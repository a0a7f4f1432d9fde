"""h2jax.runtime.hostmem: the heap keeps the large buffers a step frees, once per process,
unless the user turns it off, and only where the C library is glibc."""

import sys

import pytest

from h2jax.runtime import hostmem


class FakeLibc:
    def __init__(self, result=1):
        self.calls, self.result = [], result

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.result


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(hostmem, "_applied", False)
    monkeypatch.delenv(hostmem.ENV, raising=False)


def test_sets_both_thresholds_once():
    libc = FakeLibc()
    assert hostmem.keep_freed_memory(libc) is True
    assert libc.calls == [(hostmem.M_MMAP_THRESHOLD, 32 << 20), (hostmem.M_TRIM_THRESHOLD, 1 << 30)]
    assert hostmem.keep_freed_memory(libc) is True
    assert len(libc.calls) == 2  # once per process


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_the_environment_turns_it_off(monkeypatch, value):
    monkeypatch.setenv(hostmem.ENV, value)
    libc = FakeLibc()
    assert hostmem.keep_freed_memory(libc) is False
    assert libc.calls == []


def test_a_refused_setting_is_not_in_effect():
    libc = FakeLibc(result=0)
    assert hostmem.keep_freed_memory(libc) is False
    assert hostmem.keep_freed_memory(FakeLibc()) is True  # tried again, not remembered as done


def test_only_glibc_is_used():
    libc = hostmem._glibc()
    if sys.platform.startswith("linux") and libc is not None:
        assert libc.gnu_get_libc_version() is not None
    else:
        assert libc is None
