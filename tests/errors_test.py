"""Tests for jaxamp/_src/errors.py: the one 'valid choices' error shape."""

from jaxamp._src.errors import invalid_choice


def test_invalid_choice_lists_the_choices_in_order():
    error = invalid_choice("form", "x", ("b", "a"), quote=True)
    assert isinstance(error, ValueError)
    assert str(error) == "Unknown form 'x'. Valid choices: 'b', 'a'."
