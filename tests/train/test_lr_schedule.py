"""The learning-rate schedule (raggedvl.app.lr_schedule): the default warmup of short runs, the
default job's rates equal to transformers', and a resumed run with another total continuing the
schedule without a jump (the rates every step runs at, read from the scheduler directly)."""

import json
import math

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from raggedvl.app.config import TrainConfig, default_warmup_steps
from raggedvl.app.loop import warmup_warning
from raggedvl.app.lr_schedule import load_scheduler_state, make_scheduler

PEAKS = (2e-4, 2e-3)  # the default backbone and head learning rates: two parameter groups


def _run(make, steps, start=None):
    """(rates of the first group each step runs at, rates of the second, the state a checkpoint
    saves after them: the optimizer's and the scheduler's through JSON as trainer_state.json,
    and the resume note); ``start``: such a state to resume from."""
    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in PEAKS])
    sched, note = make(opt), None
    if start is not None:
        opt.load_state_dict(start[0])
        note = load_scheduler_state(sched, start[1])
    rates = []
    for _ in range(steps):
        rates.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    saved = (opt.state_dict(), json.loads(json.dumps(sched.state_dict())))
    return [r[0] for r in rates], [r[1] for r in rates], saved, note


def _ours(total, **settings):
    return lambda opt: make_scheduler(opt, TrainConfig(**settings), total)


@pytest.mark.parametrize("kind, reference", [("cosine", get_cosine_schedule_with_warmup),
                                             ("linear", get_linear_schedule_with_warmup)])
def test_the_default_jobs_rates_are_transformers_rates_bit_for_bit(kind, reference):
    """``raggedvl train`` with no arguments: 600 steps, 10 warmup steps; every rate of both
    groups equals transformers' schedule exactly (the same float operations)."""
    assert TrainConfig().max_steps == 600 and TrainConfig().resolved_warmup_steps(600) == 10
    ours = _run(_ours(600, lr_schedule=kind), 600)
    theirs = _run(lambda opt: reference(opt, 10, 600), 600)
    assert ours[:2] == theirs[:2]
    assert ours[0][0] == 0.0 and ours[0][10] == PEAKS[0] and ours[0][-1] > 0


def test_the_default_warmup_fits_every_run_and_warns_for_none():
    """No --warmup-steps: min(10, ceil(10 %)), at most steps - 2 so that the run decays."""
    assert [default_warmup_steps(n) for n in (1, 2, 3, 4, 10, 11, 20, 21, 99, 100, 101, 600)] == \
        [0, 0, 1, 1, 1, 2, 2, 3, 10, 10, 10, 10]
    for total in range(1, 40):
        assert warmup_warning(None, total, 2e-4) is None
        backbone = _run(_ours(total), total)[0]
        assert backbone.index(max(backbone)) <= max(0, total - 2)  # the peak before the last step: it decays
    assert _run(_ours(2), 2)[0] == pytest.approx([2e-4, 1e-4])  # no warmup; cosine at progress 1/2
    assert _run(_ours(5), 5)[0] == pytest.approx([0, 2e-4, *(1e-4 * (1 + math.cos(math.pi * p)) for p in (.25, .5, .75))])
    assert "--warmup-steps 10 does not fit in this run's 4 steps" in warmup_warning(10, 4, 2e-4)  # a given value warns


def test_a_finished_run_extended_on_resume_continues_its_decay_without_a_jump():
    """A 5-step run (warmup 1) resumed with 8 steps: steps 1-5 as trained, then the rest of the
    cosine from step 5's progress (0.75) stretched to 1 at step 8: progress 0.75 + 0.25 k / 4 for
    the 0-based steps 4 + k. Float64 arithmetic of a few operations: rel 1e-12."""
    first, first_head, saved, _ = _run(_ours(5), 5)
    resumed, resumed_head, again, note = _run(_ours(8), 3, start=saved)
    expected = [2e-4 * 0.5 * (1 + math.cos(math.pi * (0.75 + 0.25 * k / 4))) for k in (1, 2, 3)]
    assert resumed == pytest.approx(expected, rel=1e-12)
    assert first[-1] > resumed[0] > resumed[1] > resumed[2] > 0  # no jump back up: down to 0 at step 8
    assert resumed_head == pytest.approx([r * 10 for r in resumed], rel=1e-12)  # the head group alike
    assert note == ("the learning-rate schedule planned 5 steps and continues to 8: the warmup (1 step) as trained, "
                    "then the cosine decay from step 5's rate (14.6 % of the peak) stretched to reach 0 at step 8")
    # resumed again with the same total: the stretched schedule continues (its knots are in the state)
    at_7 = _run(_ours(8), 2, start=saved)[2]
    last, _, _, note = _run(_ours(8), 1, start=at_7)
    assert last == pytest.approx(expected[2:], rel=1e-12) and note is None


def test_a_run_stopped_mid_way_and_resumed_longer_or_shorter_is_continuous():
    """A 20-step run (warmup 2) stopped after 10 steps, resumed with 40 or 14 steps: the rate at
    the first resumed step is below step 10's and within one stretched step of it, decreasing to
    the last step; with 20 steps it equals the uninterrupted run's exactly (the same schedule)."""
    whole = _run(_ours(20), 20)[0]
    _, _, saved, _ = _run(_ours(20), 10)
    assert _run(_ours(20), 10, start=saved)[0] == whole[10:]
    for total in (40, 14):
        resumed = _run(_ours(total), total - 10, start=saved)[0]
        assert whole[9] > resumed[0] and all(a > b for a, b in zip(resumed, resumed[1:]))
        progress_9 = (9 - 2) / 18  # 0-based step 9, the last trained one, in the 20-step decay
        step = (1 - progress_9) / (total - 9)  # one resumed step's share of the rest of the decay
        assert resumed[0] == pytest.approx(1e-4 * (1 + math.cos(math.pi * (progress_9 + step))), rel=1e-12)
        assert resumed[-1] == pytest.approx(1e-4 * (1 + math.cos(math.pi * (1 - step))), rel=1e-12)


def test_resuming_within_the_warmup_keeps_it():
    """Stopped after 3 of 200 steps (warmup 10), resumed with 100: the warmup goes on to step 10,
    then the cosine decays over the 90 steps left, as a fresh 100-step run with a 10-step warmup."""
    _, _, saved, _ = _run(_ours(200), 3)
    resumed = _run(_ours(100), 97, start=saved)[0]
    assert resumed == pytest.approx(_run(_ours(100), 100)[0][3:], rel=1e-12)
    short, _, _, note = _run(_ours(6), 3, start=saved)  # a total inside the warmup: the warmup's rates, said so
    assert short == pytest.approx([2e-4 * s / 10 for s in (3, 4, 5)], rel=1e-12)
    assert note == ("the learning-rate schedule planned 200 steps and continues to 6, within its warmup (10 steps): "
                    "the rate rises to the last step, with no decay")
