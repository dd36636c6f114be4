"""The compose check's auditor (.ci/compose-check.sh): runs in a client container on the compose network (the
project's image, the `audit` service of .ci/compose-check.yaml), outside every service of the stack. It reads
what the services did not write for themselves where it can: Redis's own count of the entries ever added to a
stream, the checkpoints' ledgers on the data volume, the control plane as a subscriber sees it, the servers'
refusals of what a role's ACL forbids.

    python compose_audit.py wait-version N [KIND]  blocks until the retained KIND (policy) version is >= N
    python compose_audit.py watch               prints every control message (JSON lines) until SIGTERM
    python compose_audit.py hold-samples        before the services start: a consumer group `audit` on `samples`, so
                                                the services' trimming keeps every entry for the audit to read
    python compose_audit.py fill-disk           fills the run volume (TLT_CHECK_RUNS, a tmpfs of the check)
    python compose_audit.py free-disk SAID      once the learner reports a failing save, frees it: one audit row
    python compose_audit.py audit < watch.jsonl  the audit: a table, exit 1 when a row failed

Settings from the environment: TLT_CHECK_RUN, TLT_CHECK_STEPS, TLT_CHECK_PROMPTS, TLT_CHECK_GROUP, the eight
TLT_{REDIS,MQTT}_PASSWORD_<ROLE> and TLT_CHECK_REDIS_PASSWORD_BOGUS (a password no user has). Nothing printed
holds a password.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import queue
import signal
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

import paho.mqtt.client as mqtt
import redis

RUN = os.environ.get("TLT_CHECK_RUN", "default")
RUNS = Path(os.environ.get("TLT_CHECK_RUNS", "/data/runs"))
"""Where the run directories are (the check mounts their volume at /runs in its client containers)."""
ROLES = ("policy", "rollout", "learner", "monitor")
ROWS: list[tuple[str, bool, str]] = []


def row(check: str, ok: bool, evidence: str) -> None:
    ROWS.append((check, ok, evidence))
    print(f"{'PASS' if ok else 'FAIL'}  {check}: {evidence}", flush=True)


def redis_as(user: str) -> redis.Redis:
    password = os.environ[f"TLT_REDIS_PASSWORD_{user.upper()}"]
    return redis.Redis(host="redis", port=6379, username=user, password=password, socket_timeout=10)


def mqtt_as(user: str, client_id: str) -> mqtt.Client:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311)
    client.username_pw_set(user, os.environ[f"TLT_MQTT_PASSWORD_{user.upper()}"])
    return client


class Subscriber:
    """A monitor-user subscriber to the run's control topics; messages go to a queue as (topic, retained, body)."""

    def __init__(self, topics: list[str]) -> None:
        self.messages: queue.Queue[tuple[str, bool, bytes]] = queue.Queue()
        self.ready = threading.Event()
        self.client = mqtt_as("monitor", f"audit-sub-{uuid.uuid4().hex[:8]}")
        self.client.on_connect = lambda c, *_: c.subscribe([(t, 1) for t in topics])
        self.client.on_subscribe = lambda *_: self.ready.set()
        self.client.on_message = lambda _c, _u, m: self.messages.put((m.topic, bool(m.retain), m.payload))
        self.client.connect("mosquitto", 1883)
        self.client.loop_start()
        if not self.ready.wait(30):
            raise SystemExit("audit: no SUBACK from mosquitto in 30 s")

    def next(self, timeout: float) -> tuple[str, bool, bytes] | None:
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def version_of(body: bytes) -> int:
    return int(json.loads(body)["version"])


def retained(topic: str) -> bytes | None:
    """The retained message of a topic as a new subscriber receives it (None when there is none): a second
    topic that rollout may publish to is the fence, so the wait ends on a condition, not a time."""
    fence = f"tlt/audit-{uuid.uuid4().hex[:8]}/drafter"
    sub = Subscriber([topic, fence])
    found = None
    try:
        publish_as("rollout", fence, b"fence")
        while (message := sub.next(60)) is not None:
            if message[0] == fence:
                return found
            if message[0] == topic and message[1]:
                found = message[2]
        raise SystemExit(f"audit: the fence on {fence} never arrived")
    finally:
        sub.close()


def publish_as(user: str, topic: str, body: bytes, retain: bool = False) -> None:
    client = mqtt_as(user, f"audit-pub-{uuid.uuid4().hex[:8]}")
    client.connect("mosquitto", 1883)
    client.loop_start()
    try:
        client.publish(topic, body, qos=1, retain=retain).wait_for_publish(30)
    finally:
        client.loop_stop()
        client.disconnect()


def wait_version(target: int, kind: str) -> None:
    sub = Subscriber([f"tlt/{RUN}/{kind}"])
    try:
        while True:
            message = sub.next(5)
            if message is not None and version_of(message[2]) >= target:
                print(f"{kind} version {version_of(message[2])}", flush=True)
                return
    finally:
        sub.close()


def watch() -> None:
    sub = Subscriber([f"tlt/{RUN}/#"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(json.dumps({"subscribed": True}), flush=True)
    while not stop.is_set():
        message = sub.next(0.5)
        if message is not None:
            topic, was_retained, body = message
            print(json.dumps({"topic": topic, "retained": was_retained, "body": body.decode()}), flush=True)
    sub.close()


def metric(name: str) -> float | None:
    """One sample of the monitor's Prometheus endpoint (labelled with the run only), None when absent."""
    with urllib.request.urlopen("http://monitor:9100/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f'{name}{{run="{RUN}"}} '):
                return float(line.rsplit(" ", 1)[1])
    return None


def refused_write(volume: Path) -> str:
    """This client's own write of one byte to a new file on `volume`: "ENOSPC" when the file system refuses it."""
    probe = volume / f".probe-{uuid.uuid4().hex[:8]}"
    try:
        with probe.open("wb", buffering=0) as out:
            out.write(b"x")
    except OSError as error:
        return errno.errorcode.get(error.errno or 0, str(error))
    finally:
        probe.unlink(missing_ok=True)
    return "written"


def fill_disk(volume: Path) -> None:
    """Fill `volume` to the last byte (one file, `.filler`); print this client's own write of one byte after."""
    with (volume / ".filler").open("wb", buffering=0) as out:
        for chunk in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while out.write(b"\0" * chunk):
                    pass
    print(refused_write(volume), flush=True)


def policy_version() -> int:
    return version_of(retained(f"tlt/{RUN}/policy") or b'{"version": -1}')


def free_disk(volume: Path, steps: int, filled: str) -> None:
    """With `volume` full (`fill_disk` said `filled`): once the monitor exports the learner's failing save
    (`tlt_learner_disk_failing` 1) and the retained policy version has stood still for 3 s more, free it, then
    wait for the next version and the gauge back at 0. One audit row; exit 1 when it failed."""
    started = time.monotonic()
    failing, at = None, policy_version()
    while time.monotonic() - started < 300 and at < steps:
        if metric("tlt_learner_disk_failing") == 1:
            failing = time.monotonic() - started
            break
        time.sleep(1)
        at = policy_version()
    attempts = metric("tlt_learner_disk_failed_attempts")
    time.sleep(3)
    held, still = policy_version(), refused_write(volume)
    (volume / ".filler").unlink()
    freed = time.monotonic()
    after, cleared = held, None
    while time.monotonic() - freed < 300:
        after = policy_version()
        if cleared is None and metric("tlt_learner_disk_failing") == 0:
            cleared = time.monotonic() - freed
        if after > held and cleared is not None:
            break
        time.sleep(1)
    ok = filled == still == "ENOSPC" and failing is not None and held == at and after > held and cleared is not None
    said = f"1 after {failing:.0f} s ({attempts:.0f} attempts by then)" if failing is not None else "never 1"
    row(
        "a full data volume (the learner retries, reports and resumes)",
        ok,
        f"this client's write refused: {filled}, still {still} when freed; the monitor's "
        f"tlt_learner_disk_failing {said}; policy version {at} -> {held} while full, {after} after freeing "
        + (f"(gauge 0 after {cleared:.0f} s)" if cleared is not None else "(gauge never 0)"),
    )
    sys.exit(0 if ok else 1)


def hold_samples() -> None:
    """The audit's own consumer group on `samples`, created before any service writes: the learner trims only
    what every group has acked, so every entry ever added stays for `sample_copies` (the learner's Redis user
    creates it: the monitor's only reads)."""
    redis_as("learner").xgroup_create(f"tlt:{RUN}:stream:samples", "audit", id="0", mkstream=True)
    print("audit group on samples", flush=True)


def sample_copies() -> tuple[int, Counter, dict[str, list[str]]]:
    """Every entry of `samples` (kept by the audit's group): how many, copies per sample id, and for each id sent
    more than once the workers that sent it, in order."""
    from tlt_stream.basics.messages import codec_for

    codec = codec_for("samples")
    entries = redis_as("monitor").xrange(f"tlt:{RUN}:stream:samples")
    copies: Counter = Counter()
    senders: dict[str, list[str]] = {}
    for _, fields in entries:
        sample = codec.decode(fields[b"m"])
        copies[sample.sample_id] += 1
        senders.setdefault(sample.sample_id, []).append(sample.worker_id)
    return len(entries), copies, {k: v for k, v in senders.items() if copies[k] > 1}


def audit_ledgers(steps: int, prompts: int, group: int) -> None:
    monitor = redis_as("monitor")
    added = {}
    for name in ("prompts", "samples"):
        info = monitor.xinfo_stream(f"tlt:{RUN}:stream:{name}")
        added[name] = int({(k.decode() if isinstance(k, bytes) else k): v for k, v in info.items()}["entries-added"])
    row(
        "every task dispatched once",
        added["prompts"] == steps * prompts,
        f"Redis counted {added['prompts']} entries ever added to prompts; {steps} steps x {prompts} prompts",
    )
    root = RUNS / RUN / "checkpoints"
    found = sorted(root.glob("step-*"))
    names = [p.name for p in found]
    want = [f"step-{s:08d}" for s in range(steps + 1)]  # step 0: the initial policy, an empty ledger
    row("a checkpoint per step", names == want, f"{len(names)} checkpoints on the volume: {names[0]}..{names[-1]}")
    ledgers = [set(json.loads((p / "ledger.json").read_text())) for p in found]
    grows = all(a <= b for a, b in itertools.pairwise(ledgers))
    row("no ledger lost a sample", grows, "each checkpoint's ledger holds the previous one's")
    trained = [b - a for a, b in itertools.pairwise(ledgers)]  # trained[k - 1]: what update k added
    total = sum(len(update) for update in trained)
    dispatched = {f"s{s:06d}-{i:04d}" for s in range(steps) for i in range(prompts)}
    groups = Counter(sample_id.split("/")[0] for sample_id in ledgers[-1])
    read, copies, again = sample_copies()
    groups_again = sorted({sample_id.split("/")[0] for sample_id in again})
    by = Counter("the same worker" if len(set(w)) == 1 else "another worker" for w in again.values())
    row(
        "every sample reached `samples` whole: the copies are whole groups",
        read == added["samples"]
        and set(copies) == ledgers[-1]
        and all(copies[f"{t}/{i}"] == copies[f"{t}/0"] for t in groups for i in range(group)),
        f"{added['samples']} entries ever added, {read} read back through the audit's group, {len(copies)} "
        f"distinct sample ids (= the last ledger: {set(copies) == ledgers[-1]}); sent more than once: "
        f"{len(groups_again)} groups {groups_again[:12]}, each copy by {dict(by) or 'nobody'}",
    )
    row(
        "every dispatched task trained exactly once",
        grows
        and not ledgers[0]
        and total == len(ledgers[-1]) == steps * prompts * group
        and set(groups) == dispatched
        and set(groups.values()) == {group},
        f"{len(ledgers[-1])} sample ids in the last ledger, {total} over the updates, {len(groups)} tasks of "
        f"{sorted(set(groups.values()))} samples, the {len(dispatched)} dispatched; samples stream: "
        f"{added['samples']} entries ever added (a regenerated sample has the same id)",
    )
    on_policy = len(trained) == steps and all(
        {s.split("/")[0] for s in update} == {f"s{k - 1:06d}-{i:04d}" for i in range(prompts)}
        for k, update in enumerate(trained, start=1)
    )
    row("update k trains step k-1's tasks", on_policy, "the task ids of each update's new sample ids")


def audit_control(steps: int, watched: list[dict]) -> None:
    versions = [version_of(m["body"].encode()) for m in watched if m.get("topic") == f"tlt/{RUN}/policy"]
    row(
        "policy versions monotone",
        bool(versions) and all(a <= b for a, b in itertools.pairwise(versions)) and versions[-1] == steps,
        f"a subscriber saw versions {versions}",
    )
    drafters = [json.loads(m["body"]) for m in watched if m.get("topic") == f"tlt/{RUN}/drafter"]
    body = retained(f"tlt/{RUN}/drafter")
    current = json.loads(body) if body else None
    row(
        "a drafter published",
        current is not None and int(current["version"]) >= 1,
        f"retained drafter version {current and current['version']}; {len(drafters)} drafter messages seen",
    )


def audit_forged_publish() -> None:
    topic = f"tlt/{RUN}/policy"
    before = retained(topic)
    marker = f"forged-{uuid.uuid4().hex}"
    forged = json.dumps({"kind": "policy", "version": 10**6, "location": marker}).encode()
    fence = f"tlt/audit-{uuid.uuid4().hex[:8]}/drafter"
    sub = Subscriber([topic, fence])
    received = []
    try:
        while sub.next(0.5) is not None:  # the retained policy message arrives first
            pass
        client = mqtt_as("rollout", f"audit-forger-{uuid.uuid4().hex[:8]}")
        client.connect("mosquitto", 1883)
        client.loop_start()
        client.publish(topic, forged, qos=1, retain=True).wait_for_publish(30)  # dropped by the broker
        client.publish(fence, b"fence", qos=1).wait_for_publish(30)  # allowed: arrives after the forged one
        client.loop_stop()
        client.disconnect()
        while (message := sub.next(60)) is not None and message[0] != fence:
            received.append(message)
    finally:
        sub.close()
    after = retained(topic)
    row(
        "a policy publish by rollout changes nothing",
        before is not None and after == before and not any(marker.encode() in m[2] for m in received),
        f"retained policy unchanged ({version_of(after) if after else None}); the subscriber got "
        f"{len(received)} policy messages before the fence, none forged",
    )


def refused(client: redis.Redis, *command: str) -> str:
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return "NOPERM"
    except redis.exceptions.AuthenticationError:
        return "NOAUTH"
    except redis.exceptions.ResponseError as error:
        return f"error {str(error).split()[0]}"
    return "ALLOWED"


def audit_acl() -> None:
    cases = [
        ("rollout", ("CONFIG", "GET", "maxmemory")),
        ("rollout", ("FLUSHALL",)),
        ("rollout", ("KEYS", "*")),
        ("rollout", ("ACL", "LIST")),
        ("rollout", ("SET", "outside:tlt", "1")),
        ("learner", ("SHUTDOWN", "NOSAVE")),
        ("policy", ("DEBUG", "SLEEP", "0")),
        ("monitor", ("XADD", f"tlt:{RUN}:stream:samples", "*", "forged", "1")),
        ("monitor", ("SET", f"tlt:{RUN}:audit", "1")),
        ("monitor", ("DEL", f"tlt:{RUN}:stream:samples")),
    ]
    outcomes = [(user, command[0], refused(redis_as(user), *command)) for user, command in cases]
    anonymous = redis.Redis(host="redis", port=6379, socket_timeout=10)
    outcomes.append(("(no login)", "PING", refused(anonymous, "PING")))
    bogus = redis.Redis(host="redis", port=6379, username="rollout", password="not-the-password", socket_timeout=10)
    outcomes.append(("rollout, wrong password", "PING", refused(bogus, "PING")))
    allowed = [o for o in outcomes if o[2] == "ALLOWED"]
    row(
        "Redis refuses commands outside a role's ACL",
        not allowed and redis_as("rollout").ping(),
        ", ".join(f"{u} {c}: {r}" for u, c, r in outcomes),
    )


def audit_prometheus(steps: int) -> None:
    with urllib.request.urlopen("http://monitor:9100/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    label = f'{{run="{RUN}"}}'
    up = [line for line in lines if line.startswith(f"tlt_up{label} ")]
    version = [line for line in lines if line.startswith(f"tlt_learner_policy_version{label} ")]
    streams = [line for line in lines if line.startswith("tlt_stream_length{")]
    row(
        "the Prometheus endpoint answers",
        up == [f"tlt_up{label} 1.0"]
        and version == [f"tlt_learner_policy_version{label} {float(steps)}"]
        and bool(streams),
        f"{up[0] if up else 'no tlt_up'}; {version[0] if version else 'no learner version'}; "
        f"{len(streams)} tlt_stream_length series",
    )


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "audit"
    if what == "wait-version":
        wait_version(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "policy")
        return
    if what == "watch":
        watch()
        return
    if what == "hold-samples":
        hold_samples()
        return
    if what == "fill-disk":
        fill_disk(RUNS)
        return
    if what == "free-disk":
        free_disk(RUNS, int(os.environ["TLT_CHECK_STEPS"]), sys.argv[2] if len(sys.argv) > 2 else "")
        return
    steps, prompts, group = (int(os.environ[f"TLT_CHECK_{k}"]) for k in ("STEPS", "PROMPTS", "GROUP"))
    watched = [json.loads(line) for line in sys.stdin if line.startswith("{")]
    started = time.perf_counter()
    for part in (
        lambda: audit_ledgers(steps, prompts, group),
        lambda: audit_control(steps, watched),
        audit_forged_publish,
        audit_acl,
        lambda: audit_prometheus(steps),
    ):
        try:
            part()
        except Exception as error:  # a part that could not run is a failed row, and the rest still run
            row(getattr(part, "__name__", "audit"), False, f"{type(error).__name__}: {error}")
    failed = [r for r in ROWS if not r[1]]
    print(f"audit: {len(ROWS) - len(failed)}/{len(ROWS)} passed in {time.perf_counter() - started:.1f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
