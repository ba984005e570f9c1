"""validate_name: which checkpoint ids and job ids are accepted, and the errors for the rest."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest

from dcp_memstore import MemoryStorageReader, MemoryStorageWriter
from dcp_memstore.store.ids import MAX_ID_LENGTH, is_valid_name, validate_name


@pytest.mark.parametrize("name", ["step-100", "a", "run_42.final", "0", "A" * MAX_ID_LENGTH, "x.y"])
def test_valid_names_are_returned_unchanged(name):
    assert validate_name(name) == name


def test_pathlike_is_accepted_as_its_string():
    assert validate_name(PurePosixPath("step-7")) == "step-7"


def test_pathlike_with_a_directory_is_rejected():
    with pytest.raises(ValueError, match="path separator"):
        validate_name(PurePosixPath("ckpts/step-7"))


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "it is empty"),
        ("a/b", "path separator"),
        ("/abs", "path separator"),
        ("a\\b", "path separator"),
        ("..", "'..'"),
        ("a..b", "'..'"),
        ("x" * (MAX_ID_LENGTH + 1), f"{MAX_ID_LENGTH + 1} characters long"),
        ("x" * 200, "200 characters long"),
        ("has space", "outside the allowed set"),
        ("-leading-dash", "it does not start with a letter or digit"),
        (".hidden", "it does not start with a letter or digit"),
        ("_under", "it does not start with a letter or digit"),
        ("semi;colon", "outside the allowed set"),
        ("nul\0byte", "outside the allowed set"),
        ("ünïcode", "outside the allowed set"),
    ],
)
def test_invalid_names_raise_valueerror_naming_value_and_reason(name, reason):
    with pytest.raises(ValueError) as ei:
        validate_name(name)
    msg = str(ei.value)
    assert repr(name) in msg
    assert reason in msg
    assert "e.g. 'step-100'" in msg


@pytest.mark.parametrize("value", [None, 5, b"step-1", ["step-1"]])
def test_non_strings_are_rejected_with_their_type(value):
    with pytest.raises(ValueError, match=type(value).__name__):
        validate_name(value)


def test_what_names_the_kind_of_name_in_the_error():
    with pytest.raises(ValueError, match="invalid job id") as ei:
        validate_name("a/b", "job id")
    assert "(a job id is a name inside the store, not a path)" in str(ei.value)
    assert "checkpoint id" not in str(ei.value)


@pytest.mark.parametrize(("name", "valid"), [("step-100", True), ("../step", False), ("", False), (7, False)])
def test_dcp_asks_the_writer_and_reader_which_checkpoint_ids_they_take(name, valid):
    """DCP calls ``validate_checkpoint_id`` to pick a storage plugin for a checkpoint id."""
    assert is_valid_name(name) is valid
    assert MemoryStorageWriter.validate_checkpoint_id(name) is valid
    assert MemoryStorageReader.validate_checkpoint_id(name) is valid
