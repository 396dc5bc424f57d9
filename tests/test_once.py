"""``_warnings.Once``: the one record of what a holder has warned about."""

from monitored_optim._warnings import Once


def test_each_key_is_new_once_in_order_without_repeats():
    told = Once()
    assert told.new(["b", "a", "b"]) == ["b", "a"]
    assert told.new(["a", "c", ("kind", "a")]) == ["c", ("kind", "a")]
    assert len(told) == 4
    assert told.first() and not told.first(None)  # a holder's one warning
    assert not told.first("c") and told.first("d")
    assert len(Once()) == 0 and not Once()
