"""What a request whose pieces failed concurrently answers (fs/errnos.py ``errno_for``): the most
telling error of the group, not EIO for "a group" (issue 41: a 1 GiB pull that met a timeout
and a node's loss reported "Exceptions from Trio nursery (18 sub-exceptions)")."""

import errno
import logging

import trio

from irdmafs.fs.errnos import errno_for, most_telling
from irdmafs.errors import FsError, NodeDown, RemoteError


def test_a_single_error_is_answered_as_itself():
    assert errno_for(FsError(errno.ENOENT), "read") == errno.ENOENT
    assert errno_for(ExceptionGroup("g", [RemoteError("ENOSPC", "full")]), "write") == errno.ENOSPC


def test_a_group_answers_with_its_most_telling_error(caplog):
    caplog.set_level(logging.INFO)
    slow = trio.TooSlowError()
    down = NodeDown("n2", "counted down")
    nested = ExceptionGroup("outer", [slow, ExceptionGroup("inner", [down, slow])])
    assert errno_for(nested, "door pull") == errno.EIO  # the node's loss, not the timeout it caused
    assert "3 concurrent errors" in caplog.text
    assert "n2" in caplog.text  # the cause is named
    assert errno_for(ExceptionGroup("g", [slow, RemoteError("ENOSPC", "full"), down]), "write") == errno.ENOSPC
    assert errno_for(ExceptionGroup("g", [slow, trio.TooSlowError()]), "read") == errno.ETIMEDOUT


def test_a_bug_in_a_group_is_logged_with_its_traceback(caplog):
    try:
        {}["missing"]
    except KeyError as exc:
        bug = exc
    assert errno_for(ExceptionGroup("g", [NodeDown("n1", "x"), bug]), "read") == errno.EIO
    assert "unexpected error" in caplog.text and "KeyError" in caplog.text


def test_the_message_a_door_answers_is_the_most_telling_errors():
    down = NodeDown("n2", "counted down")
    group = ExceptionGroup("Exceptions from Trio nursery", [trio.TooSlowError(), down])
    assert most_telling(group) is down
    assert "n2" in str(most_telling(group))
    plain = FsError(errno.ENOENT)
    assert most_telling(plain) is plain
