"""Typed option dataclasses: one field declaration gives the flag, its help, its checks.

A config dataclass declares each field once, with :func:`option`::

    lr: float = option(2e-4, "AdamW peak learning rate", above=0)
    head: Literal["late_interaction", "bi_encoder"] = option("late_interaction", "embedding head")

and everything else is derived from that declaration:

- :func:`check_fields` (call it from ``__post_init__``): types (``bool`` / ``int`` / ``float`` /
  ``str``, ``X | None`` allows null; an ``int`` is a valid ``float``; a boolean is never a number),
  ``Literal`` choices, finite floats (no NaN or infinity), and bounds (``at_least=``, ``above=``, ``below=``). Raises ``ValueError`` naming the key
  (:func:`check_given`: naming the flag, for the values given on the command line).
  A list field (``list[float] | None``, or ``str | list[str]`` for one value or several) holds a
  non-empty YAML list whose every item is checked like a scalar of that type.
- :func:`add_arguments`: one ``--flag`` per field for argparse, with the help text, the choices
  and the default in ``--help``; boolean fields are also bare flags (``--lora`` sets true,
  ``--no-lora`` false; ``--lora false`` still works); ``none`` sets a nullable field to null.
  A list field's flag may be repeated (``--dataset a --dataset b``); a list of numbers is also
  written comma-separated (``--dataset-weights 0.7,0.3``).
- :func:`values_from`: the fields given on the command line, for the dataclass constructor.
- :func:`load_yaml`: YAML with numbers in any notation read as numbers (PyYAML follows YAML 1.1,
  where ``1e-4`` without a dot is a string).
- :func:`check_known_keys`: unknown keys are refused with a "did you mean" suggestion.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from raggedvl.suggest import closest

_SCALARS = (bool, int, float, str)


def option(default: Any, help: str, *, at_least: float | None = None, above: float | None = None,
           below: float | None = None, required: bool = False, short: str | None = None) -> Any:
    """A dataclass field with its one-line ``help`` (units and meaning) and optional bounds:
    ``at_least`` (value >= bound) or ``above`` (value > bound), ``below`` (value < bound); null
    values skip the bounds.
    ``required``: the flag must be given (its ``default`` is what a constructor without it
    gets); ``short``: a one-letter alias such as ``-k``."""
    return field(default=default, metadata={"help": help, "at_least": at_least, "above": above, "below": below,
                                            "required": required, "short": short})


@dataclass(frozen=True)
class FieldSpec:
    """What a field's type hint and :func:`option` metadata say about its values."""

    name: str
    kind: type  # bool, int, float or str
    nullable: bool
    choices: tuple | None
    default: Any
    help: str
    at_least: float | None
    above: float | None
    many: bool = False  # a list of values of ``kind`` (a plain ``kind`` value too when ``one`` is set)
    one: bool = False  # ``X | list[X]``: one value or a list
    required: bool = False  # the flag must be given
    short: str | None = None  # a one-letter alias, e.g. "-k"
    below: float | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def describe(self) -> str:
        """The ``--help`` text: meaning and units, allowed values, default."""
        parts = [self.help.rstrip(".")]
        if self.choices:
            parts.append("one of " + ", ".join(map(str, self.choices)) + (", none" if self.nullable else ""))
        elif self.kind is bool:
            parts.append(f"bare {self.flag} sets true, --no-{self.flag[2:]} false")
        if self.many:
            parts.append(f"repeat {self.flag} for several" + (", or separate them with commas"
                                                              if self.kind in (int, float) else ""))
        if self.required:
            return ("; ".join(parts) + " (required)").replace("%", "%%")
        default = "none" if self.default is None else str(self.default).lower() if self.kind is bool else self.default
        return ("; ".join(parts) + f" (default: {default})").replace("%", "%%")

    def check(self, value: Any, flag: str | None = None) -> None:
        """Raise ``ValueError`` when ``value`` is not allowed for this field, naming ``flag`` (the
        option the user typed, e.g. ``--lr`` or ``-k``) when given, else the config key."""
        who = self._who(flag)
        if value is None:
            if not self.nullable:
                raise ValueError(f"{who} may not be null")
            return
        if self.many and isinstance(value, (list, tuple)):
            if not value:
                raise ValueError(f"{who} is an empty list; give at least one value (or leave it out)")
            for item in value:
                self._check_one(item, flag)
            return
        if self.many and not self.one:
            raise ValueError(f"{who} must be a list of {self.kind.__name__}, got {value!r} "
                             f"({type(value).__name__}); in YAML write [a, b], on the command line repeat {self.flag}"
                             + (" or separate the values with commas" if self.kind in (int, float) else ""))
        self._check_one(value, flag)

    def _who(self, flag: str | None) -> str:
        return flag or f"config key {self.name!r}"

    def _check_one(self, value: Any, flag: str | None) -> None:
        name = flag or self.name
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, str)
        if not ok:
            want = self.kind.__name__ + (" or null" if self.nullable else "")
            raise ValueError(f"{self._who(flag)} must be {want}, got {value!r} ({type(value).__name__})")
        if self.kind is float and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name}={value!r} is not one of {self.choices}{choice_hint(value, self.choices)}")
        if self.at_least is not None and value < self.at_least:
            raise ValueError(f"{name} must be >= {self.at_least}, got {value}")
        if self.above is not None and value <= self.above:
            raise ValueError(f"{name} must be > {self.above}, got {value}")
        if self.below is not None and value >= self.below:
            raise ValueError(f"{name} must be < {self.below}, got {value}")

    def parse(self, text: str) -> Any:
        """A command-line string as a value of this field (``ValueError`` when it is none); a list
        field's value is a list (numbers: comma-separated)."""
        if self.nullable and text.lower() in ("none", "null"):
            return None
        if self.many:
            if self.kind in (int, float):
                return [self._parse_one(part.strip()) for part in text.split(",")]
            return [self._parse_one(text)]
        return self._parse_one(text)

    def _parse_one(self, text: str) -> Any:
        if self.kind is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected a boolean (true/false), got {text!r}")
        return self.kind(text)


def field_specs(cls: type) -> dict[str, FieldSpec]:
    """``{name: FieldSpec}`` for every field of the dataclass ``cls``, in declaration order.

    Raises ``TypeError`` for a hint that is not a scalar, ``X | None``, a ``Literal``,
    ``list[X]`` or ``X | list[X]`` (either optionally ``| None``)."""
    hints = typing.get_type_hints(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        hint, nullable, choices, many, one = hints[f.name], False, None, False, False
        args = typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            nullable = type(None) in args
            rest = [a for a in args if a is not type(None)]
            lists = [a for a in rest if typing.get_origin(a) is list]
            if len(rest) == 2 and len(lists) == 1 and typing.get_args(lists[0]) == tuple(a for a in rest if a not in lists):
                rest, one = lists, True  # X | list[X]
            if len(rest) != 1:
                raise TypeError(f"{cls.__name__}.{f.name}: unsupported type {hint}")
            hint = rest[0]
        if typing.get_origin(hint) is list:
            many, hint = True, typing.get_args(hint)[0]
        if typing.get_origin(hint) is Literal:
            choices = typing.get_args(hint)
            hint = type(choices[0])
        if hint not in _SCALARS:
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported type {hint}")
        meta = f.metadata
        specs[f.name] = FieldSpec(f.name, hint, nullable, choices, f.default, meta.get("help", ""),
                                  meta.get("at_least"), meta.get("above"), many, one,
                                  meta.get("required", False), meta.get("short"), meta.get("below"))
    return specs


def check_fields(obj: Any) -> None:
    """Check every field of the dataclass instance ``obj`` against its declaration."""
    for name, spec in field_specs(type(obj)).items():
        spec.check(getattr(obj, name))


# transformers ``TrainingArguments`` / colpali-engine config names -> raggedvl's (flag or key form)
TRAINER_SYNONYMS = {
    "learning_rate": "lr",
    "num_train_epochs": "epochs",
    "gradient_checkpointing_enable": "gradient_checkpointing",
    "logging_steps": "log_every",
    "save_steps": "checkpoint_every",
    "save_total_limit": "keep_checkpoints",
    "warmup_ratio": "warmup_steps",
    "lr_scheduler_type": "lr_schedule",
    "bf16": "precision",
    "fp16": "precision",
    "resume_from_checkpoint": "resume",
    "per_device_train_batch_size": "global_batch_size",
}


# other tools' common names -> raggedvl's
OTHER_NAMES = {
    "batch_size": "global_batch_size",
    "train_batch_size": "global_batch_size",
    "num_epochs": "epochs",
}


def did_you_mean(name: str, known: typing.Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the known name ``name`` most likely meant
    (:func:`raggedvl.suggest.closest`), also through raggedvl's name for a transformers
    ``TrainingArguments`` spelling (``learning_rate`` / ``--learning-rate``, said so) or another
    tool's common name (``batch_size``), or ``""`` when none is close."""
    known = list(known)
    flag = name.startswith("--")

    def spelled(key: str) -> str:
        return "--" + key.replace("_", "-") if flag else key

    aliases = {spelled(theirs): (spelled(ours), theirs in TRAINER_SYNONYMS)
               for theirs, ours in {**OTHER_NAMES, **TRAINER_SYNONYMS}.items() if spelled(ours) in known}
    hit = closest(name, [*known, *(a for a in aliases if a not in known)])
    if hit is None:
        return ""
    if hit in known:
        return f"; did you mean {hit!r}?"
    ours, transformers = aliases[hit]
    return f"; did you mean {ours!r}?" + (f" ({hit} is transformers' name)" if transformers else "")


def choice_hint(value: Any, choices: typing.Iterable[Any]) -> str:
    """``"; did you mean 'x'?"`` for the choice a string ``value`` most likely meant
    (:func:`raggedvl.suggest.closest`), or ``""``."""
    close = closest(value, [c for c in choices if isinstance(c, str)]) if isinstance(value, str) else None
    return f"; did you mean {close!r}?" if close else ""


def check_known_keys(cls: type, keys: typing.Iterable[str]) -> None:
    """Raise ``ValueError`` for keys that are not fields of ``cls``, suggesting the closest."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(keys) - set(known))
    if unknown:
        each = "; ".join(f"{k!r}" + (f": {did_you_mean(k, known)[2:]}" if did_you_mean(k, known) else "")
                         for k in unknown)
        raise ValueError(f"unknown config key{'s' if len(unknown) > 1 else ''} {each} "
                         "(`raggedvl train --help` lists every key)")


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4``, ``5E3`` and ``+1.5e-3`` as floats (YAML 1.2)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping from ``path``. Raises ``ValueError`` (one line) for a file that is missing
    (with the closest name in its folder) or unreadable, for a YAML syntax error (with its line
    and column, 1-based) and for a file that holds something other than a mapping."""
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.load(f, Loader=_YamlLoader) or {}
    except FileNotFoundError:
        folder = Path(path).parent
        if not folder.is_dir():
            raise ValueError(f"config file {str(path)!r}: no such file (no folder {str(folder)!r} either)") from None
        close = closest(Path(path).name, sorted(p.name for p in folder.iterdir()))
        hint = f"; did you mean {str(folder / close)!r}?" if close else ""
        raise ValueError(f"config file {str(path)!r}: no such file{hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {str(path)!r} cannot be read: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        context = f" ({exc.context})" if exc.context else ""
        raise ValueError(f"config file {str(path)!r} is not valid YAML{where}: {exc.problem}{context}; "
                         "fix the YAML there") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
    return values


class _NegateAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, False)


class _ExtendAction(argparse.Action):
    """A repeated list flag adds to the list (``none`` clears it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, None if values is None else (before or []) + values)


class _NoneChoice:
    """The null choice of an optional ``Literal`` flag: equal to None (what ``parse("none")``
    gives, so argparse accepts it) but shown as ``'none'``, what the user types, in argparse's
    "invalid choice ... (choose from ...)" (a plain None showed as ``None``)."""

    def __eq__(self, other: object) -> bool:
        return other is None or isinstance(other, _NoneChoice)

    def __hash__(self) -> int:
        return hash(None)

    def __repr__(self) -> str:
        return "'none'"


def add_arguments(parser: argparse.ArgumentParser | Any, cls: type) -> None:
    """One ``--flag`` per field of ``cls`` (absent from the namespace unless given)."""
    for spec in field_specs(cls).values():
        kwargs: dict[str, Any] = dict(dest=spec.name, default=argparse.SUPPRESS, help=spec.describe())

        def convert(text: str, spec: FieldSpec = spec) -> Any:
            return spec.parse(text)

        convert.__name__ = spec.kind.__name__  # argparse names it in "invalid int value"
        if spec.kind is bool:
            parser.add_argument(spec.flag, type=convert, nargs="?", const=True, metavar="BOOL", **kwargs)
            parser.add_argument(f"--no-{spec.flag[2:]}", dest=spec.name, nargs=0, action=_NegateAction,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            continue
        kwargs["metavar"] = spec.kind.__name__.upper()
        if spec.many:
            kwargs["action"] = _ExtendAction
        elif spec.choices is not None:
            kwargs["choices"] = spec.choices + ((_NoneChoice(),) if spec.nullable else ())
        if spec.required:
            kwargs["required"] = True
        flags = (spec.short, spec.flag) if spec.short else (spec.flag,)
        parser.add_argument(*flags, type=convert, **kwargs)


def values_from(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` that were given on the command line."""
    given = vars(args)
    return {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}


def check_given(cls: type, values: dict[str, Any]) -> None:
    """Check the values given on the command line (:func:`values_from`) against their fields'
    declarations; ``ValueError`` naming the flag (its one-letter alias when it has one), e.g.
    ``--lr must be > 0, got -1.0``."""
    specs = field_specs(cls)
    for name, value in values.items():
        spec = specs[name]
        spec.check(value, spec.short or spec.flag)
