"""The command line explains itself: help per flag, bare booleans, YAML numbers, choices,
"did you mean", torchrun's gpu/auto, --version."""

import argparse
import ast
import dataclasses
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

import raggedvl
from raggedvl import __version__
from raggedvl.app.cli import build_parser, main
from raggedvl.app.command_options import EvalOptions, options_from
from raggedvl.data.columns import Columns
from raggedvl.app.options import field_specs
from raggedvl.app.config import TrainConfig, config_from_args
from raggedvl.app.launch import TORCHRUN_OPTIONS, check_world_fits, local_world_size, strip_torchrun_arguments, torchrun_command


def _train_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _config(*argv: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_train_help_describes_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    shown = [a for a in _train_parser()._actions if a.option_strings and a.help != argparse.SUPPRESS]
    assert len(shown) == len(dataclasses.fields(TrainConfig)) + len(TORCHRUN_OPTIONS) + 2  # + --help, --config
    for action in shown:
        flag = action.option_strings[-1]
        assert flag in text, flag
        help_text = action.help.split("(default:")[0].strip()
        assert len(help_text.split()) >= 3, f"{flag} has no description: {action.help!r}"
    for spec in field_specs(TrainConfig).values():
        if spec.choices:  # allowed values are listed next to the flag
            entry = text[text.index("\n  " + spec.flag + " "):]
            entry = " ".join(entry[: entry.index("(default:")].split())
            assert "one of " + ", ".join(spec.choices) in entry, spec.flag


def test_top_level_help_and_version_speak_to_users(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(word in text for word in ("train", "eval", "data", "examples:", "retriever"))
    assert "test" not in text.lower()
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"raggedvl {__version__} (torch {torch.__version__}")


def test_data_help_names_the_cache_the_build_goes_to(capsys, monkeypatch, tmp_path):
    """``raggedvl data --help`` says where the data is built without --cache-dir, and it is so:
    under $RAGGEDVL_CACHE when set."""
    with pytest.raises(SystemExit):
        main(["data", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--cache-dir, else $RAGGEDVL_CACHE when set, else ~/.cache/raggedvl, and print the folder's path" in text
    monkeypatch.setenv("RAGGEDVL_CACHE", str(tmp_path / "cache"))
    assert main(["data", "rdocs", "--train-limit", "1", "--dev-limit", "1"]) == 0
    built = Path(capsys.readouterr().out.strip())
    assert built.parent == tmp_path / "cache" and built.name.startswith("rdocs-") and built.is_dir()


def test_every_example_of_the_top_level_help_parses():
    """Each ``raggedvl ...`` example line of ``raggedvl --help`` names a command and flags that
    exist, with values they accept (the help once showed flags and metrics the CLI no longer had)."""
    from raggedvl.app.cli import EPILOG

    examples = [re.split(r"\s{3,}", line.strip())[0] for line in EPILOG.splitlines() if line.startswith("  raggedvl ")]
    commands = {shlex.split(example)[1] for example in examples}
    assert commands == {"train", "eval", "encode", "mine", "search", "export", "data"}  # one example per command at least
    for example in examples:
        tokens = shlex.split(example)[1:]
        args = build_parser().parse_args(tokens)  # an unknown command, flag or choice exits here
        if args.command == "train" and args.config is None:
            config_from_args(args)  # values of the right type and range
    for mentioned in re.findall(r"raggedvl (\w+) --help", EPILOG):
        assert mentioned in commands


def test_yaml_numbers_in_any_notation_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-4\nhead_lr: 5E-3\ntemperature: +2.5e-2\nweight_decay: .1e-1\nmax_pixels: 1_003_520\n")
    cfg = TrainConfig.from_yaml(path)
    assert (cfg.lr, cfg.head_lr, cfg.temperature, cfg.weight_decay, cfg.max_pixels) == (1e-4, 5e-3, 2.5e-2, 0.01, 1003520)
    path.write_text('lr: "1e-4"\n')  # quoted: a string, as a quoted "false" is
    with pytest.raises(ValueError, match="config key 'lr' must be float"):
        TrainConfig.from_yaml(path)
    path.write_text("max_steps: 1e3\n")  # a float is not an int
    with pytest.raises(ValueError, match="config key 'max_steps' must be int"):
        TrainConfig.from_yaml(path)


def test_bare_boolean_flags():
    cfg = _config("--lora", "--resume", "--no-eval-before", "--grad-cache")
    assert (cfg.lora, cfg.resume, cfg.eval_before, cfg.grad_cache) == (True, True, False, True)
    cfg = _config("--no-lora", "--eval-before", "false", "--resume", "yes")
    assert (cfg.lora, cfg.eval_before, cfg.resume) == (False, False, True)
    assert _config("--lora", "none").lora is None
    assert _config("--resume", "--lr", "1e-4").lr == 1e-4  # a bare flag does not swallow the next one
    assert (_config().lora, _config().resume, _config().eval_before) == (None, False, True)


def test_choices_are_checked(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["train", "--head", "colbert"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'colbert'" in err and "'bi_encoder'" in err and err.count("\n") == 1
    with pytest.raises(SystemExit):  # an optional choice offers 'none', what one types, not Python's None
        build_parser().parse_args(["train", "--save-best", "ndcg@7"])
    err = capsys.readouterr().err
    assert "'map@10', 'none')" in err and "None" not in err, err
    assert _config("--save-best", "none").save_best is None and _config("--save-best", "ndcg@5").save_best == "ndcg@5"
    with pytest.raises(ValueError, match=r"sampler='random' is not one of \('balanced', 'equal'\)"):
        TrainConfig(sampler="random")
    with pytest.raises(ValueError, match="lora_r must be >= 1, got 0"):
        TrainConfig(lora_r=0)


def test_a_bad_value_names_the_flag_typed_or_the_yaml_key(tmp_path, capsys):
    """One line, exit code 2: a flag's value out of range names the flag, a YAML value its key
    (a flag given with the YAML overrides the key, and its own bad value names the flag)."""
    out = ["--output-dir", str(tmp_path / "run")]
    for flags, message in ((["--lr", "-1"], "raggedvl: error: --lr must be > 0, got -1.0\n"),
                           (["--global-batch-size", "0"], "raggedvl: error: --global-batch-size must be >= 1, got 0\n"),
                           (["--eval-fraction", "1"], "raggedvl: error: --eval-fraction must be < 1, got 1.0\n")):
        assert main(["train", *flags, *out]) == 2
        assert capsys.readouterr().err == message, flags
    path = tmp_path / "c.yaml"
    path.write_text("lr: -1\nglobal_batch_size: 0\n")
    assert main(["train", "--config", str(path), "--lr", "1e-4", *out]) == 2
    assert capsys.readouterr().err == "raggedvl: error: global_batch_size must be >= 1, got 0\n"
    assert main(["train", "--config", str(path), "--global-batch-size", "4", *out]) == 2
    assert capsys.readouterr().err == "raggedvl: error: lr must be > 0, got -1\n"
    assert main(["train", "--config", str(path), "--lr", "0", *out]) == 2
    assert capsys.readouterr().err == "raggedvl: error: --lr must be > 0, got 0.0\n"


def test_a_float_option_refuses_nan_and_infinity_before_any_process_starts(tmp_path, capsys):
    """NaN passes every ``>``/``>=`` bound (each comparison is false) and infinity passes ``> 0``:
    both are refused in one line naming the flag, or the key when they come from YAML."""
    out = ["--output-dir", str(tmp_path / "run")]
    for flags, shown in ((["--lr", "nan"], "--lr must be a finite number, got nan"),
                         (["--lr", "inf"], "--lr must be a finite number, got inf"),
                         (["--temperature=-inf"], "--temperature must be a finite number, got -inf"),
                         (["--dataset-weights", "0.5,nan"], "--dataset-weights must be a finite number, got nan")):
        assert main(["train", *flags, *out]) == 2
        assert capsys.readouterr().err == f"raggedvl: error: {shown}\n", flags
    for text, shown in (("lr: .nan\n", "lr must be a finite number, got nan"),
                        ("max_grad_norm: .inf\n", "max_grad_norm must be a finite number, got inf")):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        assert main(["train", "--config", str(path), *out]) == 2
        assert capsys.readouterr().err == f"raggedvl: error: {shown}\n", text


def test_resize_limits_and_lora_dropout_are_checked_before_any_process_starts(tmp_path, capsys):
    """The smallest resized image is 2 * 28**2 = 1568 pixels (Qwen2-VL's patch 14 * merge 2, the
    finest grid); the tiny model's min_pixels is 56**2 = 3136. LoRA dropout is checked with or
    without --lora."""
    out = ["--output-dir", str(tmp_path / "run")]
    for flags, shown in (
            (["--max-pixels", "1"], "--max-pixels must be >= 1568 (2 * 28**2: the smallest resized image of any "
                                    "supported model), got 1"),
            (["--max-pixels", "2000"], "--max-pixels 2000 is below the tiny model's min_pixels 3136: no image fits; "
                                       "raise --max-pixels to at least 3136 or lower --min-pixels"),
            (["--min-pixels", "5000", "--max-pixels", "4000"], "--max-pixels 4000 is below --min-pixels 5000: no image "
                                                               "fits; raise --max-pixels to at least 5000 or lower --min-pixels"),
            (["--lora-dropout", "2"], "--lora-dropout must be < 1, got 2.0")):
        assert main(["train", *flags, *out]) == 2
        assert capsys.readouterr().err == f"raggedvl: error: {shown}\n", flags
    path = tmp_path / "c.yaml"
    path.write_text("min_pixels: 5000\nmax_pixels: 4000\n")
    assert main(["train", "--config", str(path), *out]) == 2
    assert capsys.readouterr().err == ("raggedvl: error: max_pixels 4000 is below min_pixels 5000: no image fits; "
                                       "raise max_pixels to at least 5000 or lower min_pixels\n")
    assert TrainConfig(max_pixels=3136).max_pixels == 3136  # the tiny model's smallest page still fits
    from raggedvl.app.config import FINEST_RESIZE_FACTOR
    from raggedvl.families import FAMILIES

    assert FINEST_RESIZE_FACTOR == min(family.patch_size * family.merge_size for family in FAMILIES.values())
    assert TrainConfig(model="Qwen/Qwen2-VL-2B-Instruct", max_pixels=2000).max_pixels == 2000  # its min: not known yet


def test_unknown_flags_and_keys_suggest_the_closest(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--global-batch-sise", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --global-batch-sise 4; did you mean '--global-batch-size'?" in err
    assert err.count("\n") == 1  # one line, no usage dump
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1e-3\nwarmup_step: 3\n")
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'warmup_step': did you mean 'warmup_steps'?" in err
    assert "max_eval_samples" not in err  # not a list of all keys


@pytest.mark.parametrize("argv, hint", [
    (["--lr-rate", "1e-4"], "unrecognized arguments: --lr-rate 1e-4; did you mean '--lr'?"),  # not --lora-r
    (["--batchsize", "4"], "unrecognized arguments: --batchsize 4; did you mean '--global-batch-size'?"),  # not eval's
    (["--los", "infonce"], "unrecognized arguments: --los infonce; did you mean '--loss'?"),
    (["--temp", "0.02"], "unrecognized arguments: --temp 0.02; did you mean '--temperature'?"),  # not --help
    (["--strategy", "fsdp"], "argument --strategy: invalid choice: 'fsdp' (choose from 'ddp', 'fsdp2', 'hsdp'); "
                             "did you mean 'fsdp2'?"),
    (["--head", "bi"], "did you mean 'bi_encoder'?"),
    (["--learnig-rate", "1e-4"], "did you mean '--lr'? (--learning-rate is transformers' name)"),
    # nothing close: the message alone, no unrelated flag or value
    (["--wandb"], "unrecognized arguments: --wandb (see"),  # not --head
    (["--eval-every", "5"], "unrecognized arguments: --eval-every 5 (see"),  # not --log-every
    (["--strategy", "zero3"], "(choose from 'ddp', 'fsdp2', 'hsdp') (see"),
])
def test_mistyped_flags_and_values_suggest_only_what_is_close(capsys, argv, hint):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert hint in err and err.count("\n") == 1, err


def test_a_config_value_off_its_choices_suggests_the_closest(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("strategy: FSDP\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "strategy='FSDP' is not one of ('ddp', 'fsdp2', 'hsdp'); did you mean 'fsdp2'?" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["gpu", "auto", "cpu"])
def test_nproc_per_node_words_reach_torchrun(value):
    argv = ["--nproc-per-node", value, "--lr", "0.1"]
    cmd = torchrun_command(build_parser().parse_args(["train", *argv]), strip_torchrun_arguments(argv))
    assert cmd[cmd.index("--nproc-per-node") + 1] == value and cmd[-2:] == ["--lr", "0.1"]
    if value == "gpu" and not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--nproc-per-node gpu: no CUDA device is visible"):
            check_world_fits(TrainConfig(), cmd)
        return
    on_cuda = value != "cpu" and torch.cuda.is_available()
    expected = torch.cuda.device_count() if on_cuda else len(os.sched_getaffinity(0))
    assert local_world_size(value) == expected
    check_world_fits(TrainConfig(global_batch_size=expected), cmd)
    if expected > 1:
        with pytest.raises(ValueError, match=re.escape(f"global_batch_size {expected - 1} < {expected} processes")):
            check_world_fits(TrainConfig(global_batch_size=expected - 1), cmd)


def test_hsdp_shard_degree_is_checked_before_any_process(tmp_path, capsys):
    argv = ["--nproc-per-node", "4"]
    cmd = torchrun_command(build_parser().parse_args(["train", *argv]), strip_torchrun_arguments(argv))
    assert check_world_fits(TrainConfig(strategy="hsdp", shard_degree=2), cmd) == (4, False)
    with pytest.raises(ValueError, match=re.escape("--shard-degree 3 does not divide the 4 processes: HSDP needs "
                                                   "groups of equal size; use one of [1, 2, 4]")):
        check_world_fits(TrainConfig(strategy="hsdp", shard_degree=3), cmd)
    for flags, message in ((["--strategy", "hsdp", "--shard-degree", "0"], "--shard-degree must be >= 1, got 0"),
                           (["--strategy", "hsdp"], "strategy 'hsdp' needs shard_degree (--shard-degree K"),
                           (["--shard-degree", "2"], "shard_degree 2 applies to strategy 'hsdp' only, got strategy "
                                                     "'ddp'"),
                           (["--strategy", "hsdp", "--shard-degree", "3", "--nproc-per-node", "4"],
                            "--shard-degree 3 does not divide the 4 processes")):
        assert main(["train", *flags, "--output-dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (flags, err)


def test_nproc_per_node_rejects_what_torchrun_would():
    for value, message in (("0", "must be >= 1"), ("two", "a number, gpu, auto or cpu")):
        with pytest.raises(ValueError, match=message):
            local_world_size(value)


def test_transformers_spellings_name_raggedvls_flag_and_key(tmp_path, capsys):
    """A colpali-engine / HF Trainer user's habits (``--learning-rate``, ``num_train_epochs:``)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--learning-rate", "1e-4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean '--lr'? (--learning-rate is transformers' name)" in err
    path = tmp_path / "c.yaml"
    path.write_text("num_train_epochs: 2\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "did you mean 'epochs'? (num_train_epochs is transformers' name)" in capsys.readouterr().err


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_no_flag_may_be_abbreviated(capsys):
    """``--max-train 4`` once meant ``--max-train-samples 4``: a shortened flag would silently
    change meaning the day a longer flag shares its start."""
    assert not build_parser().allow_abbrev
    assert all(not sub.allow_abbrev for sub in _subparsers().values())
    for argv, full in ((["train", "--max-train", "4"], "--max-train-samples"),
                       (["eval", "runs/a", "--batch", "4"], "--batch-size"),
                       (["encode", "runs/a", "--dataset", "d", "--output", "o", "--on-bad", "skip"], "--on-bad-image")):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"unrecognized arguments: {argv[-2]} {argv[-1]}; did you mean '{full}'?" in err and err.count("\n") == 1
    assert _config("--lr", "1e-4", "--head", "bi_encoder", "--loss", "infonce").lr == 1e-4  # exact names still match


def test_config_file_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "recipe.yaml").write_text("lr: 1e-4\n")
    (tmp_path / "broken.yaml").write_text("lr: 1e-4\nseed: [1, 2\nhead: late_interaction\n")
    cases = [(tmp_path / "recipe.yml", f"config file '{tmp_path / 'recipe.yml'}': no such file; "
                                       f"did you mean '{tmp_path / 'recipe.yaml'}'?"),
             (tmp_path / "nowhere" / "a.yaml", f"no such file (no folder '{tmp_path / 'nowhere'}' either)"),
             (tmp_path / "broken.yaml", f"config file '{tmp_path / 'broken.yaml'}' is not valid YAML at line 3, column 5: "),
             (tmp_path, "cannot be read")]
    for path, expected in cases:
        assert main(["train", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("raggedvl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert expected in err, err


def test_eval_columns_have_their_own_keys_defaulting_to_the_training_ones(tmp_path):
    cfg = _config("--query-column", "question", "--id-column", "doc_id")
    assert cfg.eval_columns == Columns(query="question", image="image", id="doc_id")
    cfg = _config("--query-column", "question", "--eval-query-column", "q", "--eval-image-column", "page")
    assert cfg.eval_columns == Columns(query="q", image="page", id=None)
    path = tmp_path / "c.yaml"
    path.write_text("eval_id_column: pid\nimage_column: img\n")
    assert TrainConfig.from_yaml(path).eval_columns == Columns(query="query", image="img", id="pid")
    eval_parser = _subparsers()["eval"]
    args = eval_parser.parse_args(["runs/a", "--query-column", "question", "--image-column", "page"])
    opts = options_from(args, EvalOptions)
    assert (opts.query_column, opts.image_column, opts.id_column) == ("question", "page", None)
    assert options_from(eval_parser.parse_args(["runs/a"]), EvalOptions).columns() == Columns()


def _message_strings():
    """(file, line, text) of every string literal under src/raggedvl that is not a docstring:
    the messages, help texts and examples a user reads."""
    root = Path(raggedvl.__file__).parent
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                yield path.relative_to(root), node.lineno, node.value


def test_every_flag_a_message_names_exists_with_that_value():
    """A message that tells the user to pass ``--flag value`` names a flag of some raggedvl command,
    and a value among its choices (an error once suggested a value the CLI refused)."""
    parser = build_parser()
    actions: dict[str, list[argparse.Action]] = {}
    for p in (parser, *_subparsers().values()):
        for action in p._actions:
            for flag in action.option_strings:
                actions.setdefault(flag, []).append(action)
    outside = {"--no-", "--standalone"}  # the negation prefix; torchrun's own flag, which raggedvl passes to it
    found, wrong = 0, []
    for path, line, text in _message_strings():
        for match in re.finditer(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?:[ =]([\w.@-]+))?", text):
            flag, value = match.groups()
            found += 1
            if flag in outside:
                continue
            if flag not in actions:
                wrong.append(f"{path}:{line}: {flag} is no flag of raggedvl")
                continue
            choices = [a.choices for a in actions[flag] if a.choices]
            if value and choices and not any(value in map(str, c) for c in choices):
                wrong.append(f"{path}:{line}: {flag} {value}: not one of {choices[0]}")
    assert found > 50  # the scan sees the messages
    assert not wrong, wrong


def test_run_ends_without_teardown_after_atexit_and_flushed_output():
    """``raggedvl.app.cli.run`` (the console script and ``python -m raggedvl.app.cli``): the exit code of
    ``main``, atexit handlers run, buffered stdout (a pipe) and stderr reach the reader."""
    import subprocess
    import sys

    code = ("import atexit, sys\n"
            "atexit.register(print, 'atexit ran')\n"
            "print('buffered line')\n"
            "sys.argv = ['raggedvl', 'search', '/nonexistent-ckpt', '--index', '/nonexistent', '--query', 'q']\n"
            "from raggedvl.app.cli import run\n"
            "run()\n"
            "print('not reached')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stdout.splitlines() == ["buffered line", "atexit ran"]
    assert out.stderr.strip().splitlines() == ["raggedvl: error: checkpoint '/nonexistent-ckpt': no such folder (the folder '/' exists)"]


def test_resume_takes_the_runs_own_settings_and_flags_override_them(tmp_path):
    run = tmp_path / "moved-run"
    run.mkdir()
    TrainConfig(lr=5e-4, global_batch_size=4, output_dir="somewhere/else").save(run / "train_config.json")
    cfg = _config("--output-dir", str(run), "--resume")
    assert (cfg.lr, cfg.global_batch_size, cfg.output_dir, cfg.resume) == (5e-4, 4, str(run), True)
    cfg = _config("--output-dir", str(run), "--resume", "--lr", "1e-4")
    assert (cfg.lr, cfg.global_batch_size) == (1e-4, 4)
    assert _config("--output-dir", str(run)).lr == TrainConfig().lr  # a new run: the defaults


def test_an_empty_output_dir_is_refused():
    with pytest.raises(ValueError, match="output_dir is empty"):
        TrainConfig(output_dir="  ")
