"""The attention backends the CLI offers are the ones the registry builds."""

from pdserve.attention.registry import BACKENDS
from pdserve.config import ATTENTION_BACKENDS


def test_the_cli_names_every_registered_backend():
    assert set(ATTENTION_BACKENDS) == set(BACKENDS)
