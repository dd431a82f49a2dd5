"""One-process checks of the failure-handling pieces behind the fault matrix
(tests/dist/test_fault_matrix.py runs them across real ranks)."""

import threading
import time

import pytest

from raggedvl.app.fault_injection import inject_fault
from raggedvl.parallel.faults import StallWatchdog, report_failure


@pytest.mark.parametrize("spec", ["boom:1:2", "raise:1", "raise:one:2", "raise:1:2:3", "raise:-1:2"])
def test_a_malformed_fault_spec_is_refused(monkeypatch, spec):
    monkeypatch.setenv("RAGGEDVL_FAULT", spec)
    with pytest.raises(ValueError, match="KIND:RANK:STEP"):
        inject_fault(0, 0)


def test_a_fault_fires_only_on_its_rank_and_step(monkeypatch, capfd):
    monkeypatch.setenv("RAGGEDVL_FAULT", "raise:1:2")
    inject_fault(0, 2)  # other rank
    inject_fault(1, 1)  # other step
    with pytest.raises(RuntimeError, match="injected fault on rank 1 in step 3"):
        inject_fault(1, 2)
    assert "rank 1 will raise in step 3 at unix time" in capfd.readouterr().err


def test_report_failure_without_a_group_prints_and_annotates(capfd):
    exc = ValueError("bad thing\nsecond line")
    text = report_failure(3, "in step 7", exc)
    assert text == "raggedvl: rank 3 failed in step 7: ValueError: bad thing second line"
    assert exc.__notes__ == [text]
    assert text in capfd.readouterr().err


def test_report_failure_never_raises(monkeypatch):
    class Unprintable(RuntimeError):
        def __str__(self):
            raise TypeError("no text")

    class ClosedStream:
        def write(self, _):
            raise ValueError("I/O operation on closed file")

        flush = write

    monkeypatch.setattr("sys.stderr", ClosedStream())
    exc = Unprintable()
    text = report_failure(0, "in step 1", exc)
    assert text == "raggedvl: rank 0 failed in step 1: Unprintable: <str() failed>"
    assert exc.__notes__ == [text]


def _stalled_phase(watchdog, phase, seconds, watch=True):
    watchdog.enter(phase, watch=watch)
    time.sleep(seconds)


def test_the_watchdog_warns_once_with_the_stack_of_a_watched_phase_past_half_the_timeout(capfd):
    dog = StallWatchdog(rank=1, timeout_s=0.4)  # warns after 0.2 s
    try:
        _stalled_phase(dog, "in evaluation", 0.5, watch=False)
        assert capfd.readouterr().err == ""  # unwatched phase: silent however long
        _stalled_phase(dog, "in step 3", 0.6)
        err = capfd.readouterr().err
        _stalled_phase(dog, "in step 4", 0.05)  # a fast phase: no warning
        assert capfd.readouterr().err == ""
    finally:
        dog.stop()
    assert err.count("raggedvl: rank 1 has spent") == 1 and "in step 3 without finishing" in err
    assert "in _stalled_phase" in err  # the stack of the thread that entered the phase


def test_a_disabled_watchdog_only_records_the_phase():
    dog = StallWatchdog(rank=0, timeout_s=0.1, enabled=False)
    dog.enter("in step 1")
    assert dog.phase == "in step 1"
    assert not any(t.name == "raggedvl-stall-watchdog" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        StallWatchdog(rank=0, timeout_s=0)


def test_a_long_error_keeps_its_fix_on_one_line():
    """A corrupt JPEG's message is long and ends with the flag that fixes it: the rank's line
    (what the agent prints for the job) keeps all of it."""
    message = ("rdocs row 17 (id 'p17'): cannot decode the image " + "x" * 400
               + "\n(raggedvl: --on-bad-image skip leaves such rows out)")
    text = report_failure(0, "in step 2", RuntimeError(message))
    assert "\n" not in text and text.endswith("(raggedvl: --on-bad-image skip leaves such rows out)")
    assert len(text) > 450


def test_only_a_huge_message_is_cut_and_says_so():
    text = report_failure(0, "in step 2", RuntimeError("y" * 10_000))
    assert "... (6000 more characters in the traceback)" in text


def test_silent_peers_are_those_whose_heartbeat_stopped_and_that_left_no_note(monkeypatch):
    """A store as the ranks see it: rank 1 beats, rank 2 (node 1) stopped beating, rank 3 never
    started one (not judged), rank 4 stopped but reported its own failure (not silent), rank 5
    stopped on this rank's node 0 (left to this node's agent when only other nodes are asked about)."""
    from torch.distributed import HashStore

    from raggedvl.parallel.failures import describe_rank, silent_peers

    store = HashStore()
    for rank in (1, 2, 4, 5):
        store.add(f"raggedvl/heartbeat/{rank}", 1)
        node = 0 if rank == 5 else 1
        store.set(f"raggedvl/identity/{rank}", f'{{"node": "{node}", "host": "n{node}", "pid": {40 + rank}}}')
    monkeypatch.setenv("GROUP_RANK", "0")
    store.set("raggedvl/failure-note/4", '{"time": 0, "text": "rank 4 failed in step 3: boom"}')
    done = threading.Event()

    def beat():
        while not done.wait(0.1):
            store.add("raggedvl/heartbeat/1", 1)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        assert silent_peers(0, store=store, world_size=6, silence_s=1.0) == [2, 5]
        assert silent_peers(0, store=store, world_size=6, silence_s=1.0, other_nodes=True) == [2]
    finally:
        done.set()
        thread.join()
    assert describe_rank(2, store) == "rank 2 (node 1, host n1, pid 42)"
    assert describe_rank(3, store) == "rank 3"  # no identity left: the rank alone


def test_a_rank_waiting_for_a_silent_peer_says_so_instead_of_warning_that_it_stalls(monkeypatch, capfd):
    notes = {}
    monkeypatch.setattr("raggedvl.parallel.faults.silent_peers", lambda rank: [1])
    monkeypatch.setattr("raggedvl.parallel.faults.describe_rank", lambda rank, store=None: f"rank {rank} (node 1)")
    monkeypatch.setattr("raggedvl.parallel.faults.post_note", lambda rank, text: notes.update({rank: text}))
    monkeypatch.setattr("raggedvl.parallel.faults.clear_note", lambda rank: notes.pop(rank, None))
    dog = StallWatchdog(rank=0, timeout_s=0.4)
    try:
        _stalled_phase(dog, "in step 3", 0.6)
        err = capfd.readouterr().err
        assert notes == {1: "rank 1 (node 1) stopped responding: no heartbeat for 5 s (killed, frozen, or its node lost)"}
        dog.enter("in step 4")  # the phase finished after all: the note left for rank 1 goes
        assert notes == {}
    finally:
        dog.stop()
    assert "raggedvl: rank 0 has waited" in err and "in step 3 for rank 1 (node 1), which stopped responding" in err
    assert "has spent" not in err and "in _stalled_phase" not in err  # no stall warning, no stack of the waiting rank
