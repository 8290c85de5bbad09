"""Prefix-cache isolation (ingest/parsers/cache_salt.py): the salt each policy gives a request."""

from __future__ import annotations

import pytest

from ingest.http.auth import ANONYMOUS
from ingest.parsers.cache_salt import cache_salt
from shared.errors import ApiError


def test_per_key_salts_each_caller_apart_and_a_requests_own_salt_on_top() -> None:
    assert cache_salt({}, "key-a", "per-key") != cache_salt({}, "key-b", "per-key") != ""
    assert cache_salt({"cache_salt": "s"}, "key-a", "per-key") not in ("", cache_salt({}, "key-a", "per-key"))


def test_auto_is_per_key_only_when_there_are_keys_and_none_shares() -> None:
    assert cache_salt({}, ANONYMOUS, "auto") == ""  # no keys: one caller, one cache
    assert cache_salt({}, "key-a", "auto") == cache_salt({}, "key-a", "per-key")
    assert cache_salt({}, "key-a", "none") == cache_salt({}, "key-b", "none") == ""
    assert cache_salt({"cache_salt": "tenant-1"}, ANONYMOUS, "none") != ""  # vLLM's field alone isolates too


@pytest.mark.parametrize("bad", ["", 7, "x" * 257])
def test_a_bad_cache_salt_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ApiError) as refused:
        cache_salt({"cache_salt": bad}, "key-a", "auto")
    assert refused.value.param == "cache_salt" and refused.value.status == 400
