"""raggedvl.app.interrupts and the CLI's Ctrl-C path, in one process: rank 0's line, the
peer note that tells an interruption from a failure, SIGINT ignored while shutting down, exit
code 130 without a traceback. (End to end, 1 and 2 processes: tests/dist/test_ctrl_c.py.)"""

import signal
from pathlib import Path

import pytest

from raggedvl.app import cli
from raggedvl.app import interrupts
from raggedvl.parallel.failures import FailureNote
from raggedvl.app.interrupts import TrainingInterrupted, interrupted_line, stop_interrupted


@pytest.fixture(autouse=True)
def _restore_sigint():
    previous = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_line_names_the_step_and_suggests_resume_only_with_a_checkpoint():
    assert interrupted_line(7, None) == "interrupted at step 7; last checkpoint: none"
    assert interrupted_line(7, Path("runs/a/checkpoints/step-000006")) == (
        "interrupted at step 7; last checkpoint: runs/a/checkpoints/step-000006; resume with --resume")
    assert interrupted_line(None, None) == "interrupted during setup; last checkpoint: none"


def test_rank_0_prints_the_line_and_every_rank_leaves_a_note(capsys, monkeypatch):
    notes = []
    monkeypatch.setattr(interrupts, "post_note", lambda rank, text: notes.append((rank, text)))
    aborted = []
    monkeypatch.setattr(interrupts, "abort", lambda: aborted.append(True))
    exc = stop_interrupted(0, 3, Path("run/checkpoints/step-000003"))
    assert isinstance(exc, KeyboardInterrupt) and (exc.step, exc.checkpoint) == (3, Path("run/checkpoints/step-000003"))
    assert capsys.readouterr().err == (
        "raggedvl: interrupted at step 3; last checkpoint: run/checkpoints/step-000003; resume with --resume\n")
    stop_interrupted(1, 3, None)
    assert capsys.readouterr().err == ""  # only rank 0 speaks
    assert notes == [(0, "rank 0 interrupted at step 3"), (1, "rank 1 interrupted at step 3")] and aborted == [True, True]


def test_a_peer_interruption_note_is_told_from_a_failure_note(monkeypatch):
    def notes(*texts):
        monkeypatch.setattr(interrupts, "peer_notes", lambda rank: [FailureNote(1, 0.0, t) for t in texts])

    notes("rank 1 interrupted at step 12")
    assert interrupts.peer_interrupted(0)
    notes("rank 1 interrupted during setup")
    assert interrupts.peer_interrupted(0)
    notes("rank 1 failed in step 3: RuntimeError: interrupted at step 3 by something", "rank 1 has spent 10 s in step 3")
    assert not interrupts.peer_interrupted(0)
    notes()
    assert not interrupts.peer_interrupted(0)


def test_sigint_is_ignored_until_restored():
    previous = interrupts.ignore_sigint()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    interrupts.restore_sigint(previous)
    assert signal.getsignal(signal.SIGINT) is previous


@pytest.mark.parametrize("raised, line", [
    (KeyboardInterrupt(), "raggedvl: interrupted\n"),  # anywhere else: one line of the CLI's own
    (TrainingInterrupted("interrupted at step 2; last checkpoint: none", 2, None), ""),  # the loop printed it
])
def test_the_cli_returns_130_without_a_traceback_and_ignores_further_sigints(capsys, monkeypatch, raised, line):
    def interrupted(args):
        raise raised

    monkeypatch.setattr(cli, "_data", interrupted)
    monkeypatch.delenv("RANK", raising=False)
    assert cli.main(["data", "rdocs"]) == 130
    assert capsys.readouterr().err == line
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the process is on its way out


def test_a_second_ctrl_c_during_a_failure_report_is_still_an_interruption(capsys, monkeypatch):
    def failing(args):
        raise RuntimeError("boom")

    def report(exc):
        raise KeyboardInterrupt  # Ctrl-C while the failure is being reported

    monkeypatch.setattr(cli, "_data", failing)
    monkeypatch.setattr(cli, "_failed", report)
    assert cli.main(["data", "rdocs"]) == 130
    assert capsys.readouterr().err == "raggedvl: interrupted\n"
