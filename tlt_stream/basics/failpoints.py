"""Failpoints: named places in the code where a fault test can make a process die or freeze, exactly there.

A fault harness that kills a process from outside hits it wherever it happens to be; a window of a few
milliseconds (re-verifying a batch of rows under a new policy, say) is caught by chance or not at all.
A failpoint is that window made addressable: the code calls `failpoint("rollout.reverify")` at the place,
and the environment says what happens there.

    TLT_FAILPOINTS="rollout.reverify=kill"                  every process that gets there dies (SIGKILL)
    TLT_FAILPOINTS="rollout.reverify=kill:once=/tmp/d/tok"  only the first one (the one that creates tok),
                                                            and only once /tmp/d exists (the harness arms it)
    TLT_FAILPOINTS="a=stop,b=kill"                          `stop`: SIGSTOP itself (the harness decides what next)

A line `failpoint <name>: <action>` goes to stderr, flushed, before the action, so the harness can tell
that the process died where it was meant to. Unset (always, outside fault tests) a failpoint is a dict
lookup. Actions are the two a real fault is: death without a word (`kill`, as the OOM killer or a lost
node) and a freeze (`stop`, as a long GC pause or a partitioned VM).
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["failpoint", "parse_failpoints"]

ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def parse_failpoints(spec: str) -> dict[str, tuple[str, str | None]]:
    """`name=action[:once=PATH],...` as {name: (action, once_path)}; ValueError naming what is wrong."""
    points: dict[str, tuple[str, str | None]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, rest = item.partition("=")
        action, _, option = rest.partition(":")
        if not sep or not name or action not in ACTIONS:
            raise ValueError(f"TLT_FAILPOINTS: {item!r} is not name=kill|stop[:once=PATH]")
        once = None
        if option:
            key, _, once = option.partition("=")
            if key != "once" or not once:
                raise ValueError(f"TLT_FAILPOINTS: {item!r}: the only option is once=PATH")
        points[name] = (action, once)
    return points


_POINTS = parse_failpoints(os.environ.get("TLT_FAILPOINTS", ""))


def failpoint(name: str) -> None:
    """Do what TLT_FAILPOINTS says for `name` (nothing when it says nothing)."""
    if not _POINTS or name not in _POINTS:
        return
    action, once = _POINTS[name]
    if once is not None:
        try:  # the first process to create the token takes the fault; the others go on
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except (FileExistsError, FileNotFoundError):  # taken, or not armed yet (no directory)
            return
    print(f"failpoint {name}: {action}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), ACTIONS[action])
