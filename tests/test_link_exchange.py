"""launch.experiments.link_exchange's queue disciplines (the tc commands, no root needed)."""

import pytest

from launch.experiments.link_exchange import QDISCS, qdisc_commands


def test_each_discipline_shapes_at_the_rate_and_only_htb_ack_lifts_the_acks():
    for qdisc in QDISCS:
        cmds = qdisc_commands("ns", "lx0", qdisc, 0.12, 20.0)
        text = [" ".join(c) for c in cmds]
        assert all(t.startswith("tc -n ns ") for t in text)
        assert any("rate 120mbit" in t for t in text)
        assert any("u32" in t for t in text) == (qdisc == "htb_ack")
    (tbf,) = qdisc_commands("ns", "lx0", "tbf_10ms", 0.12, 20.0)
    assert tbf[-4:] == ["burst", "20000", "latency", "10ms"]
    ack = qdisc_commands("ns", "lx0", "htb_ack", 0.12, 20.0)[-1]
    # Pure ACKs (IP total length < 128) go to the high-priority class.
    assert ack[-6:] == ["u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10"][-6:]


def test_an_unknown_discipline_is_named():
    with pytest.raises(ValueError, match="qdisc 'prio'"):
        qdisc_commands("ns", "lx0", "prio", 0.12, 20.0)
