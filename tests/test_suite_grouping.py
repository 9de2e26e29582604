"""`make test` runs `pytest -n 2 --dist loadgroup`: tests that share an expensive module
fixture carry one `xdist_group` so they run on one worker and compute it once. With pytest 9.2
and pytest-xdist 3.8 the grouping silently stopped (pytest-dev/pytest-xdist#1386); everything
still passed, only slower. This test notices when the grouping is lost again."""
import os

import pytest


@pytest.mark.xdist_group("suite_grouping")
def test_xdist_groups_reach_the_scheduler(request):
    if os.environ.get("PYTEST_XDIST_WORKER") is None or not request.config.getvalue("loadgroup"):
        pytest.skip("checks a `-n N --dist loadgroup` run (make test)")
    assert request.node.nodeid.endswith("@suite_grouping"), (
        f"pytest-xdist did not add the group to {request.node.nodeid!r}: --dist loadgroup is not grouping, "
        f"so grouped tests each compute their shared fixtures (pytest {pytest.__version__}); install the "
        "pytest and pytest-xdist of constraints.txt (pip install -c constraints.txt -e '.[test]')")
