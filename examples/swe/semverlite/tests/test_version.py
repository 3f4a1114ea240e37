import pytest
from semverlite import Version, parse


def test_parse_release():
    assert parse("1.4.2") == Version(1, 4, 2)


def test_parse_prerelease_with_v_prefix():
    assert parse("v2.0.0-rc.1") == Version(2, 0, 0, "rc.1")


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse("1.2")
