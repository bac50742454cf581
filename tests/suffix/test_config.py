"""SuffixConfig: defaults as vLLM's, and errors that name the field."""

from __future__ import annotations

import math

import pytest

from hf_specdec.suffix import SuffixConfig


def test_defaults_are_vllms():
    config = SuffixConfig()
    assert (config.max_depth, config.max_cached_requests, config.max_spec_factor, config.max_spec_offset,
            config.min_token_prob) == (24, 10000, 1.0, 0.0, 0.1)
    assert SuffixConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_cached_requests": -1}, "SuffixConfig.max_cached_requests: expected an int >= 0, got -1"),
        ({"max_cached_requests": 2.0}, "SuffixConfig.max_cached_requests: expected an int >= 0, got 2.0"),
        ({"max_depth": 0}, "SuffixConfig.max_depth: expected an int >= 1, got 0"),
        ({"max_depth": True}, "SuffixConfig.max_depth: expected an int >= 1, got True"),
        ({"min_token_prob": 0.0}, r"SuffixConfig.min_token_prob: expected a probability in \(0, 1\], got 0.0"),
        ({"min_token_prob": 1.5}, r"SuffixConfig.min_token_prob: expected a probability in \(0, 1\], got 1.5"),
        ({"min_token_prob": math.nan}, "SuffixConfig.min_token_prob: expected a finite number, got nan"),
        ({"max_spec_factor": -0.5}, "SuffixConfig.max_spec_factor: expected a number >= 0, got -0.5"),
        ({"max_spec_factor": "1"}, "SuffixConfig.max_spec_factor: expected a finite number, got '1'"),
        ({"max_spec_offset": math.inf}, "SuffixConfig.max_spec_offset: expected a finite number, got inf"),
    ],
)
def test_bad_values_name_the_field(values, message):
    with pytest.raises(ValueError, match=message):
        SuffixConfig(**values)


def test_edges_of_the_valid_ranges():
    SuffixConfig(max_depth=1, max_cached_requests=0, min_token_prob=1.0, max_spec_factor=0, max_spec_offset=-3)
    with pytest.raises(ValueError, match=r"unknown settings \['depth'\]"):
        SuffixConfig.from_dict({"depth": 3})
