"""Progress of long work: a redrawn bar on a terminal, plain lines otherwise."""

import io

from irdmafs.progress import Progress


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_plain_lines_with_sizes_and_rate():
    out = io.StringIO()
    p = Progress("rebalance", 4 << 20, unit="B", stream=out)
    p.update(1 << 20)
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("rebalance: 1.0 MiB/4.0 MiB (25%, ") and lines[-1].endswith("/s)")
    assert "\r" not in out.getvalue()


def test_a_terminal_gets_one_bar_redrawn_in_place():
    out = Tty()
    p = Progress("resync", 10, stream=out, width=10)
    p._last = -1e9
    p.update(5)
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n")
    assert "[#####.....] resync: 5/10 (50%)" in text
