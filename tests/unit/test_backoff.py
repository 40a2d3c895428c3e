from driver.backoff import Backoff, Retry


def test_backoff_grows_to_its_ceiling_with_bounded_jitter() -> None:
    b = Backoff(initial=1, factor=2, maximum=30, jitter=0.2)
    assert [b.base_delay(n) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert b.base_delay(10_000) == 30
    delays = [b.delay(3) for _ in range(200)]
    assert all(6.4 <= d <= 9.6 for d in delays)
    assert len(set(delays)) > 1, "jitter must spread retries"


def test_a_retry_waits_at_least_what_the_other_side_asked() -> None:
    """An API server's Retry-After outweighs a shorter backoff, never a longer one; either way
    the attempt counts, so the backoff goes on growing."""
    retry = Retry(Backoff(initial=1, factor=2, maximum=30, jitter=0))
    assert retry.next(at_least=5.0) == 5.0
    assert retry.next(at_least=0.5) == 2.0
    assert retry.next() == 4.0
