"""The real parts the campaign's cells share within a test module (made on first use)."""
import pytest


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from tests.campaign import launchers  # torch and the sandboxes: only for real cells
    reason = launchers.missing()
    if reason:
        pytest.skip(reason)
    made = launchers.Parts(tmp_path_factory.mktemp("campaign"))
    yield made
    made.close()
