"""Validation of checkpoint ids, job ids and file names: short names inside the store, never paths."""

from __future__ import annotations

import os
import re

MAX_ID_LENGTH = 128
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_RULE = (
    "letters, digits, '.', '_' and '-', starting with a letter or digit, at most "
    f"{MAX_ID_LENGTH} characters, no path separators and no '..'"
)


def validate_name(value: object, what: str = "checkpoint id") -> str:
    """Return ``value`` as a str if it is a valid store name, else raise ``ValueError`` saying why."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a str such as 'step-100', got {type(value).__name__}: {value!r}")
    if not value:
        reason = "it is empty"
    elif len(value) > MAX_ID_LENGTH:
        reason = f"it is {len(value)} characters long"
    elif "/" in value or "\\" in value or os.sep in value:
        reason = f"it contains a path separator (a {what} is a name inside the store, not a path)"
    elif ".." in value:
        reason = "it contains '..'"
    elif value[0] in "._-":
        reason = "it does not start with a letter or digit"
    elif not _ID_RE.fullmatch(value):
        reason = "it contains characters outside the allowed set"
    else:
        return value
    raise ValueError(f"invalid {what} {value!r}: {reason}. Use {_RULE}, e.g. 'step-100'.")


def is_valid_name(value: object) -> bool:
    """Whether ``value`` is a valid checkpoint id (``validate_name`` without the error)."""
    try:
        validate_name(value)
    except ValueError:
        return False
    return True


_FILE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def validate_file_name(value: object) -> str:
    """``value`` if it is a valid name of a file in a checkpoint directory, else ValueError saying why.

    The rules of ``validate_name``, except that a file name may also start with '_' (shard files are named
    ``__<rank>_<n>.shard``). Never a path, never '..', never hidden (names starting with '.' are reserved
    for temporary files)."""
    try:
        return validate_name(value, "file name")
    except ValueError:
        if (
            isinstance(value, str)
            and len(value) <= MAX_ID_LENGTH
            and ".." not in value
            and _FILE_RE.fullmatch(value)
        ):
            return value
        raise
