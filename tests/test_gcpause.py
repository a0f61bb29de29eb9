"""The cyclic collector is off while reshard works, and back as it was afterwards, however the work ends."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import reshard.store as rs
from reshard.store.io.gcpause import gc_paused


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_and_restored_after_nesting():
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner exit leaves it to the outer one
    assert gc.isenabled()


def test_left_off_when_the_caller_had_it_off():
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_opt_out(monkeypatch):
    monkeypatch.setenv("RESHARD_GC_PAUSE", "0")
    with gc_paused():
        assert gc.isenabled()


def test_threads_share_one_pause():
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            assert leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_save_and_load_restore_it_on_success_and_on_error(tmp_path):
    url = str(tmp_path / "ck")
    rs.save({"w": np.arange(6.0)}, url)
    assert gc.isenabled()
    np.testing.assert_array_equal(rs.open(url).read("w"), np.arange(6.0))
    assert gc.isenabled()
    with pytest.raises(rs.CheckpointExistsError, match="already holds"):
        rs.save({"w": np.arange(6.0)}, url)  # no overwrite: refused
    assert gc.isenabled()
    with pytest.raises(Exception, match="nope"):
        rs.open(url).read("nope")
    assert gc.isenabled()


def test_a_child_forked_during_a_pause_has_the_collector_on():
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with gc_paused():
        assert not gc.isenabled()
        child = ctx.Process(target=_exit_with_gc_state)
        child.start()
        child.join(30)
    assert child.exitcode == 1  # the child saw the collector on
    assert gc.isenabled()


def _exit_with_gc_state() -> None:
    import os

    os._exit(1 if gc.isenabled() else 2)
