"""JSON lists of records (``--costs`` and ``--shapes`` files): checks whose errors name the entry and field."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator


def positive_int(value: object) -> bool:
    """Whether ``value`` is an int (not a bool) greater than zero."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def load_json(path: str | os.PathLike) -> object:
    """The parsed JSON of the file at ``path``.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: ``"{path}: invalid JSON: ..."``.
    """
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{os.fspath(path)}: invalid JSON: {err}") from err


def iter_records(data: object, where: str, what: str, fields: tuple[str, ...],
                 required: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """``(at, entry)`` for each entry of a JSON list of objects, ``at`` being ``"{where}: entry {i}"``.

    Args:
        data: The parsed JSON.
        where: Prefix of error messages (e.g. the file name).
        what: What the list holds, for the error when ``data`` is not a list.
        fields: The fields an entry may have, in the order the error lists them.
        required: The fields an entry must have.

    Raises:
        ValueError: If ``data`` is not a list, or an entry is not an object, has
            a field outside ``fields`` or lacks one of ``required``.
    """
    if not isinstance(data, list):
        raise ValueError(f"{where}: expected a JSON list of {what}, got {type(data).__name__}")
    for i, entry in enumerate(data):
        at = f"{where}: entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{at}: expected an object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(fields))
        if unknown:
            raise ValueError(f"{at}: unknown field {unknown[0]!r} (allowed: {', '.join(fields)})")
        for key in required:
            if key not in entry:
                raise ValueError(f"{at}: missing field {key!r}")
        yield at, entry


def check_shape(at: str, shape: object) -> tuple[int, int]:
    """``shape`` as a tuple if it is a list of two positive ints; else ``ValueError`` prefixed ``at``."""
    if not isinstance(shape, list) or len(shape) != 2 or not all(positive_int(d) for d in shape):
        raise ValueError(f"{at}: field 'shape' must be a list of two positive integers, got {shape!r}")
    return shape[0], shape[1]


def check_positive_int(at: str, field: str, value: object) -> int:
    """``value`` if it is a positive int; else ``ValueError`` prefixed ``at`` naming ``field``."""
    if not positive_int(value):
        raise ValueError(f"{at}: field {field!r} must be a positive integer, got {value!r}")
    return value  # type: ignore[return-value]
