"""The search-space schema: which ``vllm serve`` flags a study tunes, over which values.

A search space is a small YAML document (or an inline mapping) validated by pydantic with
``extra="forbid"`` at every level, so a misspelled key fails at load time with a message that
names the key, its location and the closest valid spelling. ``fixed`` flags are passed to every
trial; ``params`` are suggested define-by-run, in the order they are written, through Optuna's
``suggest_int`` / ``suggest_float`` / ``suggest_categorical`` with the flag name as the Optuna
parameter name. A param with ``when`` is conditional: it is suggested only when the params and
fixed flags it names (which must come before it) hold one of the listed values.

Flag names are ``vllm serve`` flags without ``--`` in kebab-case (``max_num_seqs`` is accepted and
normalized). A *dotted* name such as ``speculative-config.method`` addresses one key of a flag
that takes a JSON object: the values suggested for ``speculative-config.method``,
``speculative-config.num_speculative_tokens``, ... are assembled into one dict passed as
``--speculative-config '{"method": ..., "num_speculative_tokens": ...}'``. Keys after the dot are
snake_case, as in vLLM's config classes; a fixed dotted key (``speculative-config.prompt_lookup_min:
2``) joins the same dict. A nested object whose ``method`` is null, or whose tuned ``method`` was
not suggested (its ``when`` failed; the baseline), is left out entirely: speculation off, vLLM's
default. Other null values are left out too, so ``null`` always means "vLLM's default" for that
flag or key. For example::

    params:
      speculative-config.method: {type: categorical, choices: [null, ngram]}
      speculative-config.num_speculative_tokens:
        {type: int, low: 1, high: 8, when: {speculative-config.method: ngram}}

suggests either no ``speculative-config`` at all or
``{"method": "ngram", "num_speculative_tokens": 3}``.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Final, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from optimizer.errors import SearchSpaceError

if TYPE_CHECKING:
    from optuna.trial import BaseTrial

__all__ = [
    "CategoricalParam",
    "FloatParam",
    "IntParam",
    "Param",
    "Scalar",
    "SearchSpace",
    "SearchSpaceError",
    "is_preset_name",
    "list_presets",
    "load_space",
    "normalize_flag",
]

Scalar = bool | int | float | str | None
"""A value a categorical param may take (what Optuna's ``suggest_categorical`` accepts)."""

# The tuner sets these itself for every server; a search space may not.
_RESERVED_FLAGS: Final[frozenset[str]] = frozenset({"host", "port", "model"})
_FLAG_RE: Final[re.Pattern[str]] = re.compile(r"^[a-z0-9][a-z0-9-]*(\.[A-Za-z0-9_]+)?$")
_PARAM_TYPES: Final[tuple[str, ...]] = ("int", "float", "categorical")
# Nested objects are dropped whole when this key is null (e.g. speculation off).
_SWITCH_KEY: Final[str] = "method"
_FLOAT_TOLERANCE: Final[float] = 1e-9
_GRID_DECIMALS: Final[int] = 12


def normalize_flag(name: str) -> str:
    """Normalize a flag name: ``--max_num_seqs`` -> ``max-num-seqs``.

    For a dotted name the flag part becomes kebab-case and the key part snake_case, the way
    vLLM spells them: ``speculative_config.num-speculative-tokens`` ->
    ``speculative-config.num_speculative_tokens``.

    Args:
        name: A flag name as written.

    Returns:
        The normalized name.
    """
    flag, dot, key = name.strip().lstrip("-").partition(".")
    flag = flag.replace("_", "-")
    return f"{flag}.{key.replace('-', '_')}" if dot else flag


def _hint(word: str, valid: Iterable[str]) -> str:
    options = sorted(valid)
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    did_you_mean = f"did you mean {close[0]!r}? " if close else ""
    return f"{did_you_mean}valid: {', '.join(options) if options else '(none)'}"


def _same(a: Any, b: Any) -> bool:
    # YAML's `true` must not match a param whose value is 1 (Python says True == 1).
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def _contains(values: Iterable[Any], value: Any) -> bool:
    return any(_same(v, value) for v in values)


def _key(value: Any) -> Any:
    """A hashable key under which two scalars have equal keys exactly when :func:`_same` says
    they are the same value, so a set finds a duplicate in one pass (a list of 10,000 choices:
    10,000 look-ups, not 50 million comparisons). Python's ``==`` and ``hash`` agree (``1``,
    ``1.0`` and ``-0.0 == 0.0`` are one value, ``"1"`` another); a boolean is only ever itself
    (``True`` is not ``1``); NaN equals nothing, itself included, so each NaN gets a key of its
    own."""
    if isinstance(value, bool):
        return (bool, value)
    if isinstance(value, float) and math.isnan(value):
        return object()
    return value


def _keys(values: Iterable[Any]) -> set[Any]:
    return {_key(v) for v in values}


class _Strict(BaseModel):
    """Base of every schema model: frozen, unknown keys rejected with the closest valid one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            valid = set(cls.model_fields)
            for key in data:
                if key not in valid:
                    raise ValueError(f"unknown key {key!r}; {_hint(str(key), valid)}")
        return data


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got the boolean {value!r}")
    return value


class _ParamBase(_Strict):
    when: dict[str, Scalar | list[Scalar]] | None = Field(
        default=None,
        description="Condition on earlier params / fixed flags: {name: value or [values]}.",
    )

    @field_validator("when", mode="before")
    @classmethod
    def _normalize_when(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {normalize_flag(str(k)): v for k, v in value.items()}
        return value

    def condition(self) -> dict[str, list[Scalar]]:
        """The ``when`` condition with every expected value as a list (empty: always)."""
        if not self.when:
            return {}
        return {k: list(v) if isinstance(v, list) else [v] for k, v in self.when.items()}

    def domain(self) -> list[Any]:
        """Representative values: every choice, or the bounds."""
        raise NotImplementedError

    def admits(self, value: Any) -> bool:
        """Tell whether ``value`` lies in this param's domain."""
        raise NotImplementedError

    def outside(self, values: Iterable[Any]) -> list[Any]:
        """The ``values`` that do not lie in this param's domain, in order."""
        return [v for v in values if not self.admits(v)]

    def suggest(self, trial: BaseTrial, name: str) -> Any:
        """Ask ``trial`` for a value under the Optuna parameter name ``name``."""
        raise NotImplementedError


class IntParam(_ParamBase):
    """An integer in ``[low, high]``, optionally on a ``step`` grid or log-scaled.

    Attributes:
        low: Smallest value.
        high: Largest value (> low; ``high - low`` a multiple of ``step``).
        step: Grid spacing (default 1). Optuna forbids a step other than 1 with ``log``.
        log: Sample on a log scale (requires ``low > 0``).
        when: Optional condition, see the module docstring.
    """

    type: Literal["int"]
    low: Annotated[int, Field(strict=True)]
    high: Annotated[int, Field(strict=True)]
    step: Annotated[int, Field(strict=True, ge=1)] | None = None
    log: bool = False

    @model_validator(mode="after")
    def _check_range(self) -> IntParam:
        if self.low >= self.high:
            raise ValueError(
                f"low ({self.low}) must be < high ({self.high}); a single value belongs in `fixed`"
            )
        if self.log and self.low <= 0:
            raise ValueError(f"log: true needs low > 0, got low={self.low}")
        step = self.step or 1
        if self.log and step != 1:
            raise ValueError("log: true cannot be combined with a step other than 1 (Optuna)")
        if (self.high - self.low) % step:
            raise ValueError(
                f"step {step} does not divide high - low = {self.high - self.low}; "
                f"e.g. use high: {self.low + (self.high - self.low) // step * step}"
            )
        return self

    def domain(self) -> list[Any]:
        """The bounds ``[low, high]``."""
        return [self.low, self.high]

    def admits(self, value: Any) -> bool:
        """True for an integer in range and on the step grid."""
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        return self.low <= value <= self.high and (value - self.low) % (self.step or 1) == 0

    def suggest(self, trial: BaseTrial, name: str) -> int:
        """``trial.suggest_int(name, low, high, step=step, log=log)``."""
        return trial.suggest_int(name, self.low, self.high, step=self.step or 1, log=self.log)


class FloatParam(_ParamBase):
    """A float in ``[low, high]``, optionally on a ``step`` grid or log-scaled.

    Attributes:
        low: Smallest value.
        high: Largest value (> low; ``high - low`` a multiple of ``step``).
        step: Grid spacing (optional, not with ``log``).
        log: Sample on a log scale (requires ``low > 0``).
        when: Optional condition, see the module docstring.
    """

    type: Literal["float"]
    low: float
    high: float
    step: float | None = Field(default=None, gt=0)
    log: bool = False

    @field_validator("low", "high", "step", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        return _not_bool(value)

    @model_validator(mode="after")
    def _check_range(self) -> FloatParam:
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            raise ValueError("low and high must be finite")
        if self.low >= self.high:
            raise ValueError(
                f"low ({self.low}) must be < high ({self.high}); a single value belongs in `fixed`"
            )
        if self.log and self.low <= 0:
            raise ValueError(f"log: true needs low > 0, got low={self.low}")
        if self.step is not None:
            if self.log:
                raise ValueError("log: true cannot be combined with step (Optuna)")
            ratio = (self.high - self.low) / self.step
            if abs(ratio - round(ratio)) > _FLOAT_TOLERANCE * max(1.0, ratio):
                raise ValueError(
                    f"step {self.step} does not divide high - low = {self.high - self.low}"
                )
        return self

    def domain(self) -> list[Any]:
        """The bounds ``[low, high]``."""
        return [self.low, self.high]

    def admits(self, value: Any) -> bool:
        """True for a number in range."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        return self.low <= value <= self.high

    def suggest(self, trial: BaseTrial, name: str) -> float:
        """``trial.suggest_float(name, low, high, step=step, log=log)``.

        On a step grid the value is rounded to 12 decimals, so engine arguments read ``0.86``
        rather than Optuna's ``0.8600000000000001``.
        """
        value = trial.suggest_float(name, self.low, self.high, step=self.step, log=self.log)
        return round(value, _GRID_DECIMALS) if self.step is not None else value


class CategoricalParam(_ParamBase):
    """One of a list of scalar ``choices`` (booleans, numbers, strings, null).

    ``null`` means "leave the flag (or nested key) out": vLLM's default.

    Attributes:
        choices: The distinct values, in order.
        when: Optional condition, see the module docstring.
    """

    type: Literal["categorical"]
    choices: list[Scalar] = Field(min_length=1)

    @field_validator("choices")
    @classmethod
    def _distinct(cls, choices: list[Scalar]) -> list[Scalar]:
        # One pass over a set of keys (linear): a search space is a submitter's document.
        seen: set[Any] = set()
        for choice in choices:
            key = _key(choice)
            if key in seen:
                raise ValueError(f"choice {choice!r} is listed twice")
            seen.add(key)
        return choices

    def domain(self) -> list[Any]:
        """Every choice."""
        return list(self.choices)

    def admits(self, value: Any) -> bool:
        """True for one of the choices."""
        return _contains(self.choices, value)

    def outside(self, values: Iterable[Any]) -> list[Any]:
        """The ``values`` that are none of the choices (one pass over a set of them)."""
        keys = _keys(self.choices)
        return [v for v in values if _key(v) not in keys]

    def suggest(self, trial: BaseTrial, name: str) -> Scalar:
        """``trial.suggest_categorical(name, choices)``."""
        return trial.suggest_categorical(name, self.choices)


Param = Annotated[IntParam | FloatParam | CategoricalParam, Field(discriminator="type")]
"""One tunable flag: ``type`` is ``int``, ``float`` or ``categorical``."""


class SearchSpace(_Strict):
    """A declarative search space over ``vllm serve`` flags.

    Attributes:
        name: Short name (the preset's name for presets).
        description: One line for reports.
        fixed: Flags passed to every trial, baseline included.
        params: Tunable flags, in suggestion order.
    """

    name: str = "custom"
    description: str = ""
    fixed: dict[str, Any] = Field(default_factory=dict)
    params: dict[str, Param] = Field(default_factory=dict)

    _SECTIONS: ClassVar[tuple[str, ...]] = ("fixed", "params")

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for section in cls._SECTIONS:
            entries = data.get(section)
            if entries is None:
                data.pop(section, None)
                continue
            if not isinstance(entries, Mapping):
                raise ValueError(f"`{section}` must be a mapping of flag name to value")
            normalized: dict[str, Any] = {}
            for raw, value in entries.items():
                flag = normalize_flag(str(raw))
                if flag in normalized:
                    raise ValueError(f"{section}: {raw!r} repeats the flag {flag!r}")
                if section == "params" and isinstance(value, Mapping):
                    value = cls._checked_type(flag, value)
                normalized[flag] = value
            data[section] = normalized
        return data

    @staticmethod
    def _checked_type(flag: str, param: Mapping[str, Any]) -> Mapping[str, Any]:
        kind = param.get("type")
        if kind is None:
            raise ValueError(f"params.{flag}: missing `type`; one of {', '.join(_PARAM_TYPES)}")
        if kind not in _PARAM_TYPES:
            raise ValueError(
                f"params.{flag}: unknown type {kind!r}; {_hint(str(kind), _PARAM_TYPES)}"
            )
        return param

    @model_validator(mode="after")
    def _check_flags(self) -> SearchSpace:
        for section, names in (("fixed", self.fixed), ("params", self.params)):
            for flag in names:
                if not _FLAG_RE.match(flag):
                    raise ValueError(
                        f"{section}: {flag!r} is not a vllm serve flag name (kebab-case, "
                        "optionally one `.key` for a JSON-object flag)"
                    )
                if flag.partition(".")[0] in _RESERVED_FLAGS:
                    raise ValueError(
                        f"{section}: {flag!r} is set by the tuner itself (model, host, port); "
                        "remove it (the model goes in the job's `model`)"
                    )
        both = set(self.fixed) & set(self.params)
        if both:
            raise ValueError(
                f"{', '.join(sorted(both))} is both fixed and a param; keep one of the two"
            )
        self._check_nesting()
        self._check_conditions()
        return self

    def _check_nesting(self) -> None:
        dotted = {name.partition(".")[0] for name in (*self.fixed, *self.params) if "." in name}
        for top in sorted(dotted):
            if top in self.params:
                raise ValueError(
                    f"params: {top!r} is a param and also has dotted keys ({top}.…); tune its "
                    "keys as dotted params instead"
                )
            if top in self.fixed and not isinstance(self.fixed[top], Mapping):
                raise ValueError(
                    f"fixed: {top!r} must be a mapping when dotted {top}.… keys are used"
                )

    def _check_conditions(self) -> None:
        earlier: list[str] = []
        for name, param in self.params.items():
            for ref, expected in param.condition().items():
                where = f"params.{name}.when.{ref}"
                if ref == name:
                    raise ValueError(f"{where}: a param cannot depend on itself")
                if ref in self.params and ref not in earlier:
                    raise ValueError(
                        f"{where}: {ref!r} is defined after {name!r}; params are suggested in "
                        f"the order written, so move {ref!r} before {name!r}"
                    )
                if ref in self.params:
                    ref_param = self.params[ref]
                    for value in ref_param.outside(expected)[:1]:
                        raise ValueError(
                            f"{where}: {value!r} is not a value {ref!r} can take "
                            f"({ref_param.domain()})"
                        )
                elif ref in self.fixed:
                    if not _contains(expected, self.fixed[ref]):
                        raise ValueError(
                            f"{where}: fixed {ref!r} is {self.fixed[ref]!r}, never {expected!r}, "
                            f"so {name!r} would never be suggested"
                        )
                else:
                    raise ValueError(
                        f"{where}: {ref!r} is neither a param defined before {name!r} nor a "
                        f"fixed flag; {_hint(ref, [*earlier, *self.fixed])}"
                    )
            earlier.append(name)

    # --- use ---------------------------------------------------------------------------------

    def fixed_args(self) -> dict[str, Any]:
        """The fixed flags as engine arguments (dotted flags assembled, as :meth:`suggest` does)."""
        return _assemble(dict(self.fixed), self._switched())

    def suggest(self, trial: BaseTrial) -> dict[str, Any]:
        """Suggest one configuration, define-by-run.

        Params are asked of ``trial`` in the order written, each under its flag name; a
        conditional param is asked only when its ``when`` holds for the values fixed or
        suggested before it.

        Args:
            trial: An Optuna trial (``study.ask()`` or a ``FixedTrial``).

        Returns:
            Engine arguments: the fixed flags plus the suggested ones, dotted flags assembled
            into one dict per flag, null values left out.
        """
        values: dict[str, Any] = dict(self.fixed)
        for name, param in self.params.items():
            if self._active(param, values):
                values[name] = param.suggest(trial, name)
        return _assemble(values, self._switched())

    def grid(self, max_points: int = 10_000) -> dict[str, list[Any]]:
        """Every param's values, for Optuna's ``GridSampler`` (every combination is a trial).

        A categorical param gives its choices, an int or float param on a ``step`` grid every
        step from ``low`` to ``high``.

        Raises:
            SearchSpaceError: A param that is conditional (a grid sets every param in every
                trial) or continuous (no ``step``), or a grid of over ``max_points`` points.
        """
        out: dict[str, list[Any]] = {}
        for name, param in self.params.items():
            where = f"search space {self.name!r}, params.{name}"
            if param.condition():
                raise SearchSpaceError(
                    f"{where}: the grid sampler sets every param in every trial; drop its "
                    "`when` (or use another sampler)"
                )
            if isinstance(param, CategoricalParam):
                out[name] = list(param.choices)
            elif param.step is None:
                raise SearchSpaceError(
                    f"{where}: a grid needs the values to try; make it categorical (choices: "
                    "[...]) or give it a step"
                )
            else:
                count = math.floor((param.high - param.low) / param.step + _FLOAT_TOLERANCE)
                values = [param.low + i * param.step for i in range(count + 1)]
                out[name] = [
                    round(v, _GRID_DECIMALS) if isinstance(v, float) else v for v in values
                ]
        points = math.prod(len(v) for v in out.values())
        if points > max_points:
            raise SearchSpaceError(
                f"search space {self.name!r}: a grid of {points} configurations (over "
                f"{max_points}); use fewer choices or another sampler"
            )
        return out

    def flag_values(self) -> dict[str, list[Any]]:
        """Representative values of every top-level flag, for validation against vLLM.

        A fixed flag gives its value, a param its choices or its bounds; a dotted flag gives
        a few assembled dicts (its keys' first values, then their last, ...), without the
        ones a null ``method`` leaves out. Conditions are ignored.

        Returns:
            ``{flag: [value, ...]}`` in definition order.
        """
        per_name: dict[str, list[Any]] = {name: [value] for name, value in self.fixed.items()}
        per_name.update({name: param.domain() for name, param in self.params.items()})
        dotted_tops = {name.partition(".")[0] for name in per_name if "." in name}
        out: dict[str, list[Any]] = {}
        groups: dict[str, dict[str, list[Any]]] = {}
        for name, values in per_name.items():
            top, dot, key = name.partition(".")
            if top in dotted_tops:
                out.setdefault(top, [])
                if not dot:
                    continue  # a fixed base dict of a dotted flag: merged below
                if key == _SWITCH_KEY and any(v is not None for v in values):
                    values = [v for v in values if v is not None]
                groups.setdefault(top, {})[key] = values
            else:
                out[top] = list(values)
        for top, keys in groups.items():
            base = self.fixed.get(top)
            rows = max(len(values) for values in keys.values())
            for row in range(rows):
                nested: dict[str, Any] = dict(base) if isinstance(base, Mapping) else {}
                nested.update({k: v[min(row, len(v) - 1)] for k, v in keys.items()})
                assembled = _assemble_nested(nested, switched=top in self._switched())
                if assembled is not None and assembled not in out[top]:
                    out[top].append(assembled)
        return out

    def enqueue_params(self, engine_args: Mapping[str, Any]) -> dict[str, Any]:
        """Turn engine arguments into Optuna params, for ``study.enqueue_trial``.

        The inverse of :meth:`suggest`: dict-valued flags are split into their dotted keys,
        only keys that are params (and active under their ``when``) are kept, and an absent
        param whose choices include null maps to null (that is how :meth:`suggest` left it out).

        Args:
            engine_args: Engine arguments keyed by flag name (any spelling).

        Returns:
            ``{optuna param name: value}``.

        Raises:
            SearchSpaceError: A value lies outside its param's domain.
        """
        flat: dict[str, Any] = {}
        for raw, value in engine_args.items():
            flag = normalize_flag(str(raw))
            if isinstance(value, Mapping):
                for key, nested in value.items():
                    flat[normalize_flag(f"{flag}.{key}")] = nested
            else:
                flat[flag] = value
        values: dict[str, Any] = dict(self.fixed)
        params: dict[str, Any] = {}
        for name, param in self.params.items():
            if not self._active(param, values):
                continue
            if name in flat:
                value = flat[name]
                if isinstance(param, IntParam) and isinstance(value, float) and value.is_integer():
                    value = int(value)
                if not param.admits(value):
                    raise SearchSpaceError(
                        f"search space {self.name!r}: {name} = {value!r} is outside the param's "
                        f"domain {param.domain()}"
                    )
            elif isinstance(param, CategoricalParam) and _contains(param.choices, None):
                value = None
            else:
                continue
            values[name] = params[name] = value
        return params

    def _switched(self) -> frozenset[str]:
        # Flags whose `method` is tuned: without a method value they are left out whole.
        return frozenset(
            name.partition(".")[0] for name in self.params if name.endswith(f".{_SWITCH_KEY}")
        )

    @staticmethod
    def _active(param: _ParamBase, values: Mapping[str, Any]) -> bool:
        return all(
            ref in values and _contains(expected, values[ref])
            for ref, expected in param.condition().items()
        )


def _assemble_nested(nested: Mapping[str, Any], *, switched: bool) -> dict[str, Any] | None:
    if nested.get(_SWITCH_KEY) is None and (switched or _SWITCH_KEY in nested):
        return None
    kept = {k: v for k, v in nested.items() if v is not None}
    return kept or None


def _assemble(values: Mapping[str, Any], switched: frozenset[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        top, dot, key = name.partition(".")
        if dot:
            group = groups.setdefault(top, {})
            group[key] = value
            out.setdefault(top, None)  # keeps the flag's first position
        elif isinstance(value, Mapping):
            groups.setdefault(top, {}).update(value)
            out.setdefault(top, None)
        else:
            out[top] = value
    for top, nested in groups.items():
        out[top] = _assemble_nested(nested, switched=top in switched)
    return {flag: value for flag, value in out.items() if value is not None}


# --- loading -------------------------------------------------------------------------------------


def list_presets() -> list[str]:
    """Names of the search spaces shipped in ``search_spaces/presets/``.

    Returns:
        Sorted preset names (file names without ``.yaml``).
    """
    folder = resources.files("search_spaces") / "presets"
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in folder.iterdir()
        if entry.name.endswith(".yaml")
    )


def load_space(ref: str | Path | Mapping[str, Any]) -> SearchSpace:
    """Load a search space from a preset name, a YAML file or an inline mapping.

    A string without a path separator or YAML suffix is a preset name; anything else is a
    file path.

    Args:
        ref: ``"default"``, ``"spaces/mine.yaml"``, a :class:`~pathlib.Path`, or a mapping
            with the YAML's structure.

    Returns:
        The validated space.

    Raises:
        SearchSpaceError: Unknown preset, unreadable file, or a schema violation; the message
            names the source, the key at fault and the fix.
    """
    if isinstance(ref, Mapping):
        return _validate(ref, "inline search space")
    if isinstance(ref, str) and is_preset_name(ref):
        presets = list_presets()
        if ref not in presets:
            raise SearchSpaceError(
                f"unknown search-space preset {ref!r}; {_hint(ref, presets)} "
                "(or give the path of a YAML file)"
            )
        text = (resources.files("search_spaces") / "presets" / f"{ref}.yaml").read_text("utf-8")
        return _validate(_parse_yaml(text, f"preset {ref!r}"), f"preset {ref!r}")
    path = Path(ref)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SearchSpaceError(f"cannot read search space {str(path)!r}: {error}") from None
    return _validate(_parse_yaml(text, str(path)), str(path))


def is_preset_name(ref: str) -> bool:
    """``ref`` names a preset, not a file: no path separator and no YAML suffix (any other
    string is a file path, whatever its suffix)."""
    return not any(sep in ref for sep in ("/", "\\")) and not ref.endswith((".yaml", ".yml"))


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise SearchSpaceError(f"{source}: not valid YAML: {error}") from None


def _validate(data: Any, source: str) -> SearchSpace:
    if not isinstance(data, Mapping):
        raise SearchSpaceError(
            f"{source}: a search space is a mapping with keys name, description, fixed, params; "
            f"got {type(data).__name__}"
        )
    try:
        return SearchSpace.model_validate(dict(data))
    except ValidationError as error:
        problems = "; ".join(_describe(e) for e in error.errors())
        raise SearchSpaceError(f"{source}: {problems}") from None


def _describe(error: Mapping[str, Any]) -> str:
    parts: list[str] = []
    loc: Sequence[Any] = error.get("loc", ())
    for i, item in enumerate(loc):
        # Drop the discriminator tag pydantic inserts after a param's name.
        if i == 2 and loc[0] == "params" and item in _PARAM_TYPES:
            continue
        parts.append(f"[{item}]" if isinstance(item, int) else str(item))
    where = ".".join(parts).replace(".[", "[")
    message = str(error.get("msg", "invalid"))
    message = message.removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
