"""The deadline sender's stop rule, Python (``scheduling.threaded.stop_rule``, what
``ThreadedSender._send_until`` runs) and native (``frames.cc``, what
``CapricornSendWindow`` runs) side by side on the same inputs: the same
decision and the same bytes ahead, wherever the inputs are not within
rounding of a threshold (the native rule counts in ns, the Python one in
seconds). A table of the rule's cases first, then hypothesis's inputs."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from capricorn_jax._src.native import frames as native_frames
from capricorn_jax._src.scheduling.threaded import stop_rule

pytestmark = pytest.mark.skipif(not native_frames.available(),
                                reason="no C++ compiler: only the Python rule runs")


def _both(started, now_ns, link_bytes, link_ns, kernel, nbytes, rate, close_ns, bound):
    py = stop_rule.decide(started, now_ns / 1e9, (link_bytes, link_ns / 1e9), kernel, nbytes,
                          rate, close_ns / 1e9, bound)
    c = native_frames.stop_rule(started, now_ns, (link_bytes, link_ns), kernel, nbytes, rate,
                                close_ns, bound)
    return py, c


@pytest.mark.parametrize("case, want", [
    ((True, 10**9, 0.0, 0, None, 100, 1e6, 2 * 10**9, 1000), stop_rule.STARTED),
    ((False, 10**9, 0.0, 0, None, 100, 1e6, 2 * 10**9, 1000), stop_rule.SEND),
    ((False, 10**9, 0.0, 0, None, 10**7, 1e6, 2 * 10**9, 1000), stop_rule.CLOSE),
    ((False, 10**9, 5e5, 10**9, None, 100, 1e6, 2 * 10**9, 1000), stop_rule.WAIT),
    ((False, 10**9, 5e5, 10**9, 500, 100, 1e6, 2 * 10**9, 1000), stop_rule.SEND),  # kernel caps
    ((False, 2 * 10**9, 5e5, 10**9, None, 100, 1e6, 3 * 10**9, 1000), stop_rule.SEND),  # drained
])
def test_the_rules_cases_decide_alike(case, want):
    (py_decision, py_ahead), (c_decision, c_ahead) = _both(*case)
    assert py_decision == c_decision == want
    assert py_ahead == pytest.approx(c_ahead, rel=1e-9, abs=1e-6)


@given(started=st.booleans(), now_ns=st.integers(0, 10**13), since_ns=st.integers(0, 10**10),
       link_bytes=st.floats(0, 1e9), kernel=st.one_of(st.none(), st.integers(0, 1 << 30)),
       nbytes=st.integers(1, 1 << 24), rate=st.floats(1e3, 1e11),
       close_in_ns=st.integers(-10**10, 10**10), bound=st.integers(0, 1 << 24))
@settings(max_examples=400, deadline=None)
def test_python_and_native_rules_decide_alike_on_the_same_inputs(
        started, now_ns, since_ns, link_bytes, kernel, nbytes, rate, close_in_ns, bound):
    link_ns = max(0, now_ns - since_ns)
    close_ns = now_ns + close_in_ns
    ahead = stop_rule.ahead(now_ns / 1e9, (link_bytes, link_ns / 1e9), kernel, rate)
    # Off the thresholds by more than rounding (ns vs seconds, doubles).
    finish_ns = now_ns + (ahead + nbytes) / rate * 1e9
    assume(abs(finish_ns - close_ns) > 1e-6 * max(1.0, abs(close_ns)))
    assume(abs(ahead - bound) > 1e-6 * max(1.0, bound))
    (py_decision, py_ahead), (c_decision, c_ahead) = _both(
        started, now_ns, link_bytes, link_ns, kernel, nbytes, rate, close_ns, bound)
    assert py_decision == c_decision
    if not started:
        assert py_ahead == pytest.approx(c_ahead, rel=1e-6, abs=1e-3)
