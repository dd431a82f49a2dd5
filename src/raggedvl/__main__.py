"""``python -m raggedvl COMMAND ...``: the ``raggedvl`` command (``raggedvl.app.cli``)."""

from raggedvl.app.cli import run

if __name__ == "__main__":
    run()
