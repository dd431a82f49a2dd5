"""raggedvl.app.signals: a Ctrl-C held while SIGINT is blocked is acted on by exit_on_sigint (one
line, exit code 130), and a closed stdout pipe does not end the process (each case in a child
interpreter, whose signal state and file descriptors the test may change)."""

import subprocess
import sys
import textwrap


def _child(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stderr=subprocess.PIPE, text=True, **kwargs)


def test_a_sigint_held_while_blocked_ends_the_process_with_its_line_and_130():
    proc = _child("""
        import os, signal
        from raggedvl.app.signals import exit_on_sigint, sigint_blocked
        with sigint_blocked():
            os.kill(os.getpid(), signal.SIGINT)  # pending, not lost
            print("still running", flush=True)
            exit_on_sigint("raggedvl: interrupted")
        print("not reached", flush=True)
    """, stdout=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and out == "still running\n" and err == "raggedvl: interrupted\n", (out, err)


def test_output_to_a_closed_pipe_goes_to_devnull_and_the_process_carries_on():
    proc = _child("""
        import sys
        from raggedvl.app.signals import tolerate_closed_output
        tolerate_closed_output()
        print("first", flush=True)
        sys.stdin.read()  # until the test closed its end of stdout
        for i in range(10_000):
            print(f"line {i}", flush=i % 1000 == 0)
        print("done", file=sys.stderr, flush=True)
    """, stdout=subprocess.PIPE, stdin=subprocess.PIPE)
    assert proc.stdout.readline() == "first\n"
    proc.stdout.close()  # the reader goes away, as head does
    proc.stdin.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0 and err == "done\n", err
