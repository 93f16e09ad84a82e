"""A mount's whole-directory listings (fs/listings.py): listed after a few lookups, dropped by
every invalidation that touches them, never kept from a fetch that began before a drop."""

from irdmafs.fs.listings import LIST_AFTER, MAX_ASKED, MAX_DIRS, Listings


def attr(ino, size=0):
    return {"ino": ino, "mode": 0o100644, "size": size}


def listed(n=3, base=100):
    return [(f"f{i}", attr(base + i)) for i in range(n)]


def test_a_directory_is_listed_after_a_few_lookups_and_answers_names_and_inodes():
    ls = Listings()
    assert [ls.asked(7) for _ in range(LIST_AFTER)] == [False] * (LIST_AFTER - 1) + [True]
    ls.keep(7, listed(), ls.begin())
    assert ls.entry(7, "f1") == attr(101) and ls.attr(102) == attr(102)
    assert ls.entry(7, "missing") is None and ls.entry(8, "f1") is None  # asked of the primary
    assert not ls.asked(7)  # listed already
    assert ls.hits == 2


def test_what_an_invalidation_touches_goes():
    ls = Listings()
    ls.keep(7, listed(), ls.begin())
    ls.keep(8, [("g", attr(101))], ls.begin())  # a hard link: inode 101 in two directories
    ls.drop([(9, "x")], [])
    assert ls.entry(7, "f0") is not None  # another directory's name: kept
    ls.drop([], [101])  # an inode listed in both: both go
    assert ls.entry(7, "f0") is None and ls.entry(8, "g") is None and ls.attr(101) is None
    ls.keep(7, listed(), ls.begin())
    ls.drop([(7, "new")], [])  # a name made in it
    assert ls.entry(7, "f0") is None
    ls.keep(7, listed(), ls.begin())
    ls.drop([], [7])  # the directory's own attributes (a rename in it, a chmod)
    assert ls.entry(7, "f0") is None
    ls.keep(7, listed(), ls.begin())
    ls.drop([], [], everything=True)
    assert ls.entry(7, "f0") is None


def test_a_listing_fetched_across_a_drop_is_not_kept_c3():
    ls = Listings()
    begun = ls.begin()
    ls.drop([(7, "f1")], [])  # the listing may predate this change
    ls.keep(7, listed(), begun)
    assert ls.entry(7, "f0") is None
    begun = ls.begin()
    ls.clear()  # a change of the mount's own
    ls.keep(7, listed(), begun)
    assert ls.entry(7, "f0") is None


def test_listings_are_bounded():
    ls = Listings()
    for d in range(MAX_DIRS + 5):
        ls.keep(d, listed(2, base=1000 * (d + 1)), ls.begin())
    assert ls.entry(0, "f0") is None and ls.entry(MAX_DIRS + 4, "f0") is not None
    assert len(ls._dirs) == MAX_DIRS


def test_lookups_counted_in_many_directories_stay_bounded():
    ls = Listings()
    for d in range(3 * MAX_ASKED):
        ls.asked(d)
    assert len(ls._asked) <= MAX_ASKED
