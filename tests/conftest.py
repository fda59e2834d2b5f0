import os
import sys

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (bf16 math, real-size shapes)")


# Hypothesis profiles for the property tests (tests/test_properties.py), picked by
# TANDEM_HYPOTHESIS_PROFILE. "ci" (the default): a bounded number of examples, so all
# property tests together stay within ~90 s on a 2-core CPU under Triton's
# interpreter (the CI budget: the whole suite under 15 minutes). "gpu", which
# scripts/gpu.sh selects: more examples (and, in the tests, larger shapes). Both
# are derandomized with no example database: the same examples on every run.
try:
    from hypothesis import HealthCheck, settings as _hyp_settings
except ImportError:  # pinned in requirements/*.txt; without it only the property tests fail
    _hyp_settings = None
if _hyp_settings is not None:
    _common = dict(derandomize=True, database=None, deadline=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.filter_too_much])
    _hyp_settings.register_profile("ci", max_examples=16, **_common)
    _hyp_settings.register_profile("gpu", max_examples=50, **_common)
    _hyp_settings.load_profile(os.environ.get("TANDEM_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seeded_inputs(request):
    """Every test's random inputs (harness.rng(), torch's global generator) derive
    from its id and TANDEM_TEST_SEED: the same inputs on every run of that test."""
    import harness
    import torch
    seed = harness.seed_for(request.node.nodeid)
    harness.start_test(seed)
    torch.manual_seed(seed)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.when == "call":
        import harness
        rep.sections.append(("random inputs", (
            f"seed {harness.seed_for(item.nodeid)} (TANDEM_TEST_SEED={harness.base_seed()}): "
            f"rerun with TANDEM_TEST_SEED={harness.base_seed()} bash scripts/test.sh '{item.nodeid}'")))
