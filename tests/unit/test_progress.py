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
    p.update(5)
    p.close()
    text = out.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1  # one line, redrawn
    last = text.rstrip("\n").split("\r")[-1]  # the bar as it was left
    assert last.startswith("resync:  50%|#####     | 5/10"), last


def test_a_terminal_bar_in_bytes_learns_its_total_late():
    out = Tty()
    p = Progress("rebalance", 0, unit="B", stream=out)  # a rebalance learns its total from the nodes
    p.update(1 << 20, 4 << 20)
    p.close()
    last = out.getvalue().rstrip("\n").split("\r")[-1]
    assert last.startswith("rebalance:  25%|") and "1.00M/4.00M" in last, last
