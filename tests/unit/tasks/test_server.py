"""The wait-ready task's view of a data-parallel server's replicas."""

from eyas_prefect.tasks.server import replica_states


def test_replicas_the_log_has_not_named_yet_are_waiting_in_rank_order():
    seen = {"DP10": "loading", "DP0": "loaded"}
    assert list(replica_states(seen, 12).items())[:3] == [
        ("DP0", "loaded"),
        ("DP1", "waiting"),
        ("DP2", "waiting"),
    ]
    assert replica_states(seen, 12)["DP10"] == "loading" and len(replica_states(seen, 12)) == 12


def test_without_dp_size_only_the_named_replicas_show():
    assert replica_states({"DP1": "loaded", "DP0": "loading"}, None) == {
        "DP0": "loading",
        "DP1": "loaded",
    }
