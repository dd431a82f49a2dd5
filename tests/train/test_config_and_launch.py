import pytest
import torch

from raggedvl.app.cli import build_parser
from raggedvl.app.config import TrainConfig, config_from_args
from raggedvl.app.launch import strip_torchrun_arguments, torchrun_command


def test_yaml_then_flags_override(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("lr: 0.01\nglobal_batch_size: 16\nmax_train_samples: 10\n")
    args = build_parser().parse_args(["train", "--config", str(cfg_file), "--lr", "0.002", "--max-eval-samples", "none", "--resume", "true"])
    cfg = config_from_args(args)
    assert (cfg.lr, cfg.global_batch_size, cfg.max_train_samples, cfg.max_eval_samples, cfg.resume) == (0.002, 16, 10, None, True)


def test_invalid_config_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="loss='infonce'"):
        TrainConfig(head="bi_encoder", loss="late_interaction")
    with pytest.raises(ValueError, match="unknown config key 'lrr'"):
        TrainConfig.from_dict({"lrr": 1})


def test_torchrun_command_defaults_and_pass_through():
    argv = ["--lr", "0.1", "--nproc-per-node", "8", "--nnodes=2", "--rdzv-endpoint", "host:29500"]
    args = build_parser().parse_args(["train", *argv])
    cmd = torchrun_command(args, strip_torchrun_arguments(argv))
    assert "--standalone" not in cmd
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8" and cmd[cmd.index("--nnodes") + 1] == "2"
    assert cmd[-4:] == ["raggedvl.app.cli", "train", "--lr", "0.1"]
    single = torchrun_command(build_parser().parse_args(["train"]), [])
    assert "--standalone" in single and single[single.index("--nproc-per-node") + 1] in ("2", str(torch.cuda.device_count()))


def test_the_tiny_page_budget_applies_to_the_tiny_preset_only():
    from raggedvl.data.tiny_limits import TINY_TRAIN_MAX_PIXELS

    assert TrainConfig().resolved_max_pixels == TINY_TRAIN_MAX_PIXELS
    assert TrainConfig(max_pixels=50_000).resolved_max_pixels == 50_000
    assert TrainConfig(model="Qwen/Qwen2-VL-2B-Instruct").resolved_max_pixels is None  # the checkpoint's own


def test_yaml_values_are_type_checked_naming_the_key(tmp_path):
    for text, key in (('resume: "false"\n', "resume"), ("max_steps: 3.7\n", "max_steps"), ('lr: "abc"\n', "lr")):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"config key '{key}' must be"):
            TrainConfig.from_yaml(path)
    assert TrainConfig.from_dict({"lr": 1, "max_train_samples": None}).lr == 1  # ints are valid floats


def test_a_fresh_run_refuses_a_directory_with_checkpoints(tmp_path, capsys):
    from raggedvl.app.cli import main

    (tmp_path / "checkpoints" / "step-000002").mkdir(parents=True)
    assert main(["train", "--output-dir", str(tmp_path)]) == 2
    assert "pass --resume to continue" in capsys.readouterr().err
    assert main(["train", "--output-dir", str(tmp_path), "--global-batch-size", "1"]) == 2  # checked before torchrun


def test_plain_output_switches_progress_bars_off_without_importing_datasets():
    """`datasets` costs seconds to import and the default data never needs it: the launcher only
    sets the variables both libraries read when they are imported."""
    import os
    import subprocess
    import sys

    code = ("import sys; from raggedvl.app.launch import plain_output; plain_output(); "
            "print('datasets' in sys.modules); import datasets; print(datasets.is_progress_bar_enabled())")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_DISABLE_PROGRESS_BARS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]  # not imported by plain_output; off once imported


def test_every_command_outside_a_terminal_switches_loading_bars_off(tmp_path):
    """``raggedvl search`` (which starts no ranks) too: transformers' "Loading weights" bar reads
    the hub's setting when transformers is imported, so it is set before any command runs."""
    import os
    import subprocess
    import sys

    code = ("import os; from raggedvl.app.cli import main; main(['search', 'no-such-model', '--index', 'x', "
            "'--query', 'q']); print(os.environ.get('HF_HUB_DISABLE_PROGRESS_BARS'), "
            "os.environ.get('HF_DATASETS_DISABLE_PROGRESS_BARS'))")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_DISABLE_PROGRESS_BARS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["1", "1"]  # stderr is a pipe here, not a terminal


def test_every_unknown_key_gets_its_own_hint():
    with pytest.raises(ValueError) as info:
        TrainConfig.from_dict({"global_bach_size": 4, "learning_rate": 1e-4, "zzz": 1})
    text = str(info.value)
    assert "'global_bach_size': did you mean 'global_batch_size'?" in text
    assert "'learning_rate': did you mean 'lr'?" in text and "; 'zzz' (" in text  # no close key: no hint
