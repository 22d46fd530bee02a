"""How many learners the integrations wait for at train start, and the settings' checks."""

from __future__ import annotations

import pytest

from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.errors import ConfigError
from gradientmail.integration import check_wait, learners_to_await


def test_a_barrier_waits_for_its_quorum_and_a_decoupled_run_for_nobody() -> None:
    assert learners_to_await(None, DiLoCo.standard(10, 3)) == 3
    # Decoupled learners never wait for a commit: nobody to wait for at start either,
    # whatever the quorum (learners come and go).
    assert learners_to_await(None, DiLoCo(sync_every=10, fragments=2, quorum_size=2)) == 1
    # A quorum behind a barrier, however it is spelled.
    assert learners_to_await(None, DiLoCo(sync_every=10, fragments=2, quorum_size=2,
                                          overlap_steps=0)) == 2
    # The setting wins: 0 starts at once, n waits for n.
    assert learners_to_await(0, DiLoCo.standard(10, 3)) == 0
    assert learners_to_await(5, DiLoCo(sync_every=10, fragments=2)) == 5


@pytest.mark.parametrize(("count", "timeout", "message"), [
    (-1, 600.0, "wait_for_learners=-1 must be an int >= 0 (0 starts at once) or None"),
    (True, 600.0, "wait_for_learners=True must be an int >= 0"),
    (2.0, 600.0, "wait_for_learners=2.0 must be an int >= 0"),
    (2, 0.0, "wait_timeout=0.0 must be a finite number of seconds > 0"),
    (2, float("inf"), "wait_timeout=inf must be a finite number of seconds > 0"),
])
def test_settings_no_wait_can_honour_are_refused(count: object, timeout: object,
                                                 message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_wait(count, timeout)  # type: ignore[arg-type]
    check_wait(None, 600.0)
    check_wait(0, 1)
