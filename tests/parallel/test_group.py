"""The collectives a manager calls: on one process (:class:`SingleProcess`) each background read is agreed
as it ends here, exactly as a group of one rank would agree it (:func:`fetch_agreements`)."""

from __future__ import annotations

from lora_pin.errors import AdapterLoadError, CapacityError
from lora_pin.parallel import SingleProcess
from lora_pin.parallel.collective import READ, RUNNING, fetch_agreements, fetch_status


def test_one_process_agrees_each_read_as_it_ends() -> None:
    failure = AdapterLoadError("broken")
    running, read, failed = SingleProcess().agree_fetches([RUNNING, READ, failure])
    assert running is None
    assert read is not None and read.failed == [] and read.error("read", None) is None
    assert failed is not None and failed.failed == [0] and failed.error("read", failure) is failure


def test_a_read_over_ranks_waits_for_every_rank_and_fails_where_any_failed() -> None:
    refused = fetch_status(CapacityError("full"))
    read_here, running_there = fetch_status(READ), fetch_status(RUNNING)
    waiting, done, failed = fetch_agreements(
        [[read_here, running_there], [read_here, read_here], [refused, running_there]]
    )
    assert waiting is None
    assert done is not None and done.failed == []
    assert failed is not None and failed.failed == [0]
    error = failed.error("background read of 'a'", None)
    assert isinstance(error, CapacityError) and "rank(s) [0]" in str(error)
