"""The scaffolding every service entry point shares: endpoints, Redis, the control plane, stop signals.

`serve(config, role, owns, body)` resolves the endpoints (embedded servers when no URL is configured),
connects Redis, runs the control plane as a task, installs SIGTERM/SIGINT handlers that set the stop event,
and awaits `body(config, redis, control, stop)` on uvloop. Errors a user can fix (a missing checkpoint
directory, a bad argument) print one line and exit 2.

Once the body has returned, the teardown (the control plane's MQTT disconnect, closing Redis) is bounded
(`TEARDOWN_S` each): a close that never completes (a TLS peer that never answers the closing handshake) is
left behind with every pending task's stack in the log. What comes after it is bounded too (`exit_watchdog`,
`EXIT_GRACE_S`): the loop's own shutdown waits for every cancelled task and joins the default executor's
threads, so a task that ignores its cancellation or an executor job that never returns would hold a stopped
service alive; past the grace the service logs every thread's stack and exits.
So a stopped service always exits, within the grace a supervisor gives it, and the log says what hung.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable

import redis.asyncio as aioredis

from tlt_stream.basics.aio import as_task
from tlt_stream.basics.config import Config, redact_text, redact_url
from tlt_stream.basics.errors import CheckpointError
from tlt_stream.bus.control import ControlPlane

__all__ = [
    "EXIT_GRACE_S",
    "LAUNCHER_PID_ENV",
    "TEARDOWN_S",
    "Body",
    "device_or_refuse",
    "exit_watchdog",
    "refuse",
    "serve",
    "watch_launcher",
]

Body = Callable[[Config, aioredis.Redis, ControlPlane, asyncio.Event], Awaitable[None]]

TEARDOWN_S = 4.0
"""Seconds each teardown step (the control plane's end, closing Redis) may take after the body returned."""

EXIT_GRACE_S = 5.0
"""Seconds a service's loop may take to close once its teardown is done (its tasks, its executor, the servers)."""

log = logging.getLogger(__name__)


async def bounded(step: Awaitable[None], what: str, seconds: float = TEARDOWN_S) -> None:
    """Await a teardown step for at most `seconds`; its error, if any, is raised. Past that, log an error
    with the stack of every pending task (what hung, for whoever reads the log), cancel it and go on."""
    task = as_task(step, what)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if done:
        task.result()
        return
    log.error("%s did not finish within %.0f s of the stop; left behind. Pending tasks:\n%s", what, seconds,
              pending_stacks())  # fmt: skip
    task.cancel()


def exit_watchdog(role: str, code: int, seconds: float = EXIT_GRACE_S) -> threading.Timer:
    """Arm a daemon timer that ends the process with `code` if it is still alive `seconds` from now, after
    logging every thread's stack: what the loop's shutdown waits on (a task that ignores its cancellation, an
    executor job that never returns). `serve` arms it once the teardown is done,
    when the service's state is durable (entries acked, checkpoints written atomically) and only its exit can
    be held up, and cancels it once the loop and the embedded servers are closed."""

    def fire() -> None:
        log.error("%s: still alive %.0f s after its teardown; exiting with code %d. Every thread's stack:",
                  role, seconds, code)  # fmt: skip
        for handler in logging.getLogger().handlers:
            handler.flush()
        try:
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, AttributeError):  # a stderr without a file descriptor: the line above stays
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.name = f"{role}-exit-watchdog"
    timer.start()
    return timer


def pending_stacks() -> str:
    """Every pending task of the running loop with its stack (the awaits it is suspended in)."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            task.print_stack(file=out)
    return out.getvalue()


def refuse(command: str, why: str) -> int:
    """One line on stderr for a setting the user can fix; the exit code of a configuration error (2)."""
    print(f"{command}: {why}", file=sys.stderr)
    return 2


def device_or_refuse(spec: str, command: str) -> str | None:
    """`--device` resolved (`model.resolve_device`), or None after one line saying why it cannot be used:
    checked before `serve`, so a bad device fails before any server is started or connected."""
    from tlt_stream.model import resolve_device

    try:
        return str(resolve_device(spec))
    except ValueError as exc:
        print(f"tlt-stream {command}: {exc}", file=sys.stderr)
        return None


def serve(config: Config, role: str, owns: Iterable[str], body: Body) -> int:
    from tlt_stream.basics.aio import install_stop_signals
    from tlt_stream.basics.aio import run as run_loop
    from tlt_stream.bus.connect import connect_redis, endpoints

    stopped_in_outage: list[BaseException] = []
    watchdogs: list[threading.Timer] = []  # armed once the teardown is done, disarmed once the loop is closed

    async def main(config: Config) -> None:
        assert config.bus.redis_url is not None
        stop = asyncio.Event()
        redis = connect_redis(
            config.bus.redis_url,
            name=role,
            block_ms=config.bus.block_ms,
            retries=config.bus.redis_retries,
            stop=stop,
        )
        control = ControlPlane(config, redis, role=role, owns=owns)
        install_stop_signals(stop)
        launcher = asyncio.create_task(watch_launcher(stop), name=f"{role}-launcher-watch")
        plane = asyncio.create_task(control.run(stop), name=f"{role}-control-plane")
        code = 1  # what the process exits with if it must be ended (`exit_watchdog`): an error unless it ends well
        try:
            await body(config, redis, control, stop)
            code = 0
        except Exception as exc:
            if not stop.is_set() or (outage := _outage(exc)) is None:
                raise
            stopped_in_outage.append(outage)  # asked to stop, and Redis is gone: nothing left to drain into
            code = 0
        finally:
            stop.set()
            launcher.cancel()
            try:
                await bounded(plane, "the control plane (MQTT)")
                await bounded(redis.aclose(), "closing Redis")
            finally:
                watchdogs.append(exit_watchdog(role, code))

    try:
        with endpoints(config) as resolved:
            run_loop(main(resolved))
    except (FileNotFoundError, ValueError, CheckpointError) as exc:
        print(f"tlt-stream {role}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        outage = _outage(exc)
        if outage is None:
            raise
        # Past the retry budget (REDIS_OUTAGE_RETRIES, about three minutes): one line, a non-zero exit for the
        # supervisor, and a restart resumes from the checkpoints and the pending entries.
        print(
            f"tlt-stream {role}: Redis {redact_url(config.bus.redis_url)} unreachable past the retry budget "
            f"({type(outage).__name__}: {redact_text(str(outage))}); restart me once it is back: I resume from "
            "my checkpoints and pending entries",
            file=sys.stderr,
        )
        return 3
    finally:
        for timer in watchdogs:  # the loop and the servers are closed: what remains is the caller's exit
            timer.cancel()
    if stopped_in_outage:
        error = stopped_in_outage[0]
        print(
            f"tlt-stream {role}: stopped while Redis {redact_url(config.bus.redis_url)} was unreachable "
            f"({type(error).__name__}: {redact_text(str(error))}); what was not acked is delivered again after a "
            "restart, which resumes from my checkpoints",
            file=sys.stderr,
        )
    return 0


LAUNCHER_PID_ENV = "TLT_LAUNCHER_PID"
"""Set by `tlt-stream run` for the services it starts: the launcher's pid (`watch_launcher`)."""
LAUNCHER_POLL_S = 1.0


async def watch_launcher(stop: asyncio.Event, poll_s: float = LAUNCHER_POLL_S) -> None:
    """For a service `tlt-stream run` started (`TLT_LAUNCHER_PID`): set `stop` once the launcher is gone, or
    the process that started this one (a launcher killed outright cannot stop its services, and the embedded
    servers die with it). Under torchrun the parent is torchrun's agent, so the launcher's pid is watched too."""
    raw = os.environ.get(LAUNCHER_PID_ENV, "")
    if not raw.isdigit():
        return
    launcher, parent = int(raw), os.getppid()
    while not stop.is_set():
        if os.getppid() != parent or not _alive(launcher):
            log.error("the launcher (pid %d) is gone: stopping; `tlt-stream run --resume RUN_DIR` resumes the run",
                      launcher)  # fmt: skip
            stop.set()
            return
        await asyncio.sleep(poll_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _outage(exc: BaseException) -> BaseException | None:
    """The Redis outage error inside `exc` (itself, or one inside an exception group), or None."""
    import redis.asyncio as aioredis

    if isinstance(exc, aioredis.ConnectionError | aioredis.TimeoutError | ConnectionError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _outage(inner)) is not None:
                return found
    return None
