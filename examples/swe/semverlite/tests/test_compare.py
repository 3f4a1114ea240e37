from semverlite import compare, max_version


def test_same_version():
    assert compare("1.2.3", "v1.2.3") == 0


def test_patch_release_is_newer():
    assert compare("1.0.1", "1.0.0") == 1
    assert compare("1.0.0", "1.0.1") == -1


def test_prerelease_sorts_before_its_release():
    assert compare("1.0.0-rc.1", "1.0.0") == -1


def test_max_version():
    assert max_version(["0.9.0", "1.0.0", "1.0.0-beta"]) == "1.0.0"
