"""raggedvl.app: the application. The ``raggedvl`` command (``cli``), its launcher and torchrun
agent, interrupts and preemption, the training loop and its config, checkpoints, run
directory, report and tracking, and the eval / encode / search / export commands. It is built
on the library packages (``batch``, ``parallel``, ``losses``, ``sampling``, ``gradcache``,
``models``, ``data``, ``evaluation``, ``hf``), none of which imports it."""
