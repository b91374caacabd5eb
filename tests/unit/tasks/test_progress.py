"""The serve-bench stage's tally of launches and answered prompts (tasks/progress.py)."""

from eyas_prefect.tasks.progress import LaunchTally


def test_side_by_side_launches_are_named_by_their_own_place_and_the_share_only_grows():
    tally = LaunchTally(["plain", "3/1/4"])
    tally.plan = {"plain": 5, "3/1/4": 7}  # the chain also runs the speed pass's two prompts
    tally.up += ["plain", "3/1/4"]  # both up at once (benchmark.concurrent)
    assert tally.where("plain") == "launch 1 of 2" and tally.where("3/1/4") == "launch 2 of 2"
    order = ["plain", "3/1/4", "3/1/4", "plain", "3/1/4", "plain", "plain", "plain"]
    order += ["3/1/4"] * 4
    shares = []
    for key in order:
        tally.answered(key)
        shares.append(tally.share())
    assert shares == sorted(shares) and shares[-1] == 1.0
    assert shares[0] == 1 / 12


def test_before_the_plan_the_share_counts_the_launches_up():
    tally = LaunchTally(["plain", "1/1/2", "3/1/4"])
    assert tally.share() == 0.0
    tally.up += ["plain", "1/1/2"]
    assert tally.share() == 1 / 3
