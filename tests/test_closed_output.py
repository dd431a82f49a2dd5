"""``raggedvl.app.closed_output``: writes to a pipe whose reader has gone are dropped, the
descriptor then points at ``os.devnull``; writes to a live pipe pass through unchanged."""

import io
import os
import sys

from raggedvl.app.closed_output import drop_output_when_closed, guarded


def test_a_pipe_whose_reader_went_away_is_pointed_at_devnull_and_writes_go_on():
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = open(write_end, "w", encoding="utf-8")
    out = guarded(stream)
    try:
        for i in range(3):
            print(f"line {i}", file=out, flush=True)  # no BrokenPipeError
        assert os.path.samestat(os.fstat(write_end), os.stat(os.devnull))
        out.write("x" * 200_000)  # more than a pipe buffer, through the buffered layer
        out.flush()
    finally:
        out.close()  # leaves the descriptor open (the caller's stream owns it)
        stream.close()


def test_a_live_pipe_receives_every_byte_unchanged():
    read_end, write_end = os.pipe()
    stream = open(write_end, "w", encoding="utf-8")
    out = guarded(stream)
    print("données 1", file=out)
    out.write("two\n")
    out.flush()
    out.close()
    stream.close()
    with open(read_end, "rb") as reader:
        assert reader.read() == "données 1\ntwo\n".encode()


def test_a_stream_already_replaced_is_left_alone(monkeypatch):
    """A test's capture (pytest replaces sys.stdout / sys.stderr) is not wrapped."""
    captured_out, captured_err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", captured_out)
    monkeypatch.setattr(sys, "stderr", captured_err)
    drop_output_when_closed()
    assert sys.stdout is captured_out and sys.stderr is captured_err


def test_an_unbuffered_stream_stays_unbuffered():
    """Under ``python -u`` (as the ranks run) each write reaches the descriptor at once, so stdout
    and stderr lines keep their order in a shared log file."""
    read_end, write_end = os.pipe()
    stream = io.TextIOWrapper(open(write_end, "wb", buffering=0), encoding="utf-8", write_through=True)
    out = guarded(stream)
    out.write("start line\n")  # no flush
    os.set_blocking(read_end, False)
    try:
        assert os.read(read_end, 100) == b"start line\n"
    finally:
        out.close()
        stream.close()
        os.close(read_end)
