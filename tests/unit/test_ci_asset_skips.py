"""tests/conftest.py's rule: in CI a skip for a missing set-up asset fails; elsewhere it stays a skip, and skips for
what no CI machine has (a CUDA device) stay skips everywhere."""
import pytest

SUITE = '''
import pytest
from tests.conftest import pytest_runtest_makereport  # noqa: F401  (the rule under test, as the suite loads it)

def test_tokenizer():
    pytest.skip("tokenizer source /x missing: run launch/setup_env.sh")

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_cuda():
    pass

def test_plain():
    assert 1 + 1 == 2
'''


@pytest.mark.parametrize("ci,failed,skipped", [("true", 1, 1), ("", 0, 2), ("false", 0, 2)])
def test_missing_asset_fails_only_in_ci(pytester, monkeypatch, ci, failed, skipped):
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest(SUITE.split("def test_tokenizer")[0])
    pytester.makepyfile(test_assets=SUITE)
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    res.assert_outcomes(passed=1, failed=failed, skipped=skipped)
    if failed:
        res.stdout.fnmatch_lines(["*CI: a set-up asset is missing*setup_env.sh*"])
