"""What every config section shares: the strict model, the error a bad config raises, and the values
that reach a shell (environment names, addresses) checked where they are read."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from eyas.config.base import Address, ConfigError, EnvName, StrictModel
from eyas.errors import EyasError


class _Section(StrictModel):
    name: EnvName = "A"
    host: Address = "127.0.0.1"
    count: int = 1


def test_a_strict_section_refuses_unknown_keys_and_bad_assignments():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        _Section(cuont=2)
    s = _Section()
    with pytest.raises(ValidationError):
        s.count = "many"  # assignments are validated too


@pytest.mark.parametrize(
    "field, value",
    [("name", "A;rm"), ("name", "1A"), ("host", "gpu-1; touch x"), ("host", "$(id)")],
)
def test_values_a_shell_would_read_as_more_are_refused(field, value):
    with pytest.raises(ValidationError):
        _Section(**{field: value})
    assert _Section(name="HF_HOME", host="gpu-node-1.example").host == "gpu-node-1.example"


def test_config_error_is_an_eyas_error_and_a_value_error():
    assert issubclass(ConfigError, EyasError) and issubclass(ConfigError, ValueError)
