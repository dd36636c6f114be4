"""`tlt-stream purge`: delete a finished run's state from the shared servers, so its name can be used again.

A run leaves its Redis keys (streams, mirror, registry, lease, dispatch cursor) and one retained MQTT message
per control kind behind on servers it did not start. A new run under the same name would resume that state
(`run` refuses to start in a used name), and a fresh subscriber is greeted with the old run's retained
versions, so deleting the keys alone is not enough. The run's directory (checkpoints, metrics, ledger) is
never touched. Without `--yes` it only says what it would delete; a run whose workers still beat in its
registry is refused unless `--force`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG, add_config_args, load

__all__ = ["handle", "register"]


def register(commands: Any) -> None:
    purge = commands.add_parser(
        "purge",
        help="delete a finished run's Redis keys and retained MQTT messages from shared servers (its run "
        "directory stays), so its name can be used again",
        description=__doc__.split("\n\n", 1)[1].replace("`", "").replace("%", "%%"),
    )
    purge.add_argument("--yes", action="store_true", help="delete; without it, only say what would be deleted")
    purge.add_argument(
        "--force", action="store_true", help="delete even while workers of the run still beat in its registry"
    )
    add_config_args(purge)
    purge.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    from tlt_stream.basics.config import redact_text

    if not args.run and not os.environ.get("TLT_RUN"):
        print("tlt-stream purge: name the run to delete: --run NAME (or TLT_RUN)", file=sys.stderr)
        return EXIT_CONFIG
    config = load(args)
    if config.bus.redis_url is None or config.bus.mqtt_url is None:
        print(
            "tlt-stream purge: give the run's --redis-url and --mqtt-url (or TLT_REDIS_URL, TLT_MQTT_URL): the state "
            "of a run on embedded servers went with them",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    try:
        return asyncio.run(_purge(config, yes=args.yes, force=args.force))
    except (RedisError, OSError) as exc:
        print(f"tlt-stream purge: {redact_text(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return 1


async def _purge(config: Any, *, yes: bool, force: bool) -> int:
    from tlt_stream.basics.config import redact_url
    from tlt_stream.basics.messages import WorkerStatus
    from tlt_stream.bus.connect import connect_redis, purge_run
    from tlt_stream.bus.registry import list_workers
    from tlt_stream.bus.streams import Keys, run_glob

    keys = Keys(config.run)
    redis = connect_redis(config.bus.redis_url, retries=3)
    try:
        live = [w for w in await list_workers(redis, keys, config.bus) if w.get("state") != str(WorkerStatus.STOPPED)]
    finally:
        await redis.aclose()
    where = f"{redact_url(config.bus.redis_url)} and {redact_url(config.bus.mqtt_url)}"
    if live and not force:
        names = ", ".join(sorted(w["worker_id"] for w in live)[:5])
        print(
            f"tlt-stream purge: run {config.run!r} is still going ({len(live)} live worker(s): {names}); stop it "
            "first, or give --force if those entries are from processes that are gone",
            file=sys.stderr,
        )
        return 1
    if not yes:  # a dry run counts the keys; with --yes `purge_run` scans them once, as it deletes them
        redis = connect_redis(config.bus.redis_url, retries=3)
        try:
            found = sum([1 async for _ in redis.scan_iter(match=run_glob(config.run), count=1000)])
        finally:
            await redis.aclose()
        print(
            f"run {config.run!r}: {found} Redis key(s) and its retained control messages on {where} would be "
            "deleted; run again with --yes to delete them (its run directory stays)"
        )
        return 0
    deleted = await purge_run(config)
    print(f"run {config.run!r}: deleted {deleted} Redis key(s) and cleared its retained control messages on {where}")
    return 0
