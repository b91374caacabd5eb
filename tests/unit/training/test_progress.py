"""What a step reports: the acceptance length its held-out accuracies predict."""

import pytest

from eyas.training.progress import simulated_acceptance_length


def test_simulated_acceptance_length_counts_the_bonus_token():
    assert simulated_acceptance_length([]) == 1.0
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    assert simulated_acceptance_length([0.0, 1.0]) == 1.0
