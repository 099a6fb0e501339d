"""`reviewer loop`: watch repositories, review each new commit once, one review at a time per machine, with as many
worker machines as you like on one shared database.

One pass: ask every repository for its default branch's head (`git ls-remote`, with a timeout); a head that has not
been reviewed becomes a row of the `reviewqueue` table (one row per commit, however many loops see it: a unique index
and INSERT ... ON CONFLICT DO NOTHING); then the queued rows of the watched repositories are reviewed oldest first. A
repository that cannot be read is logged and backed off (doubling delays up to MAX_BACKOFF); the others go on.

Every review happens while this process holds the machine-wide review lock (reviewer/run/lock.py), from claiming the queue
row to writing the verification, so a box runs one review at a time however many loops it runs. Claiming is atomic
(`SELECT ... FOR UPDATE SKIP LOCKED` on PostgreSQL, and a compare-and-set UPDATE everywhere). A claimed row carries a
lease in database time that a heartbeat thread renews every third of its length while the review runs: a slow worker
keeps its job, and the job of a worker that died (kill -9, power loss, cut off) is queued again by whichever worker
polls once the lease has run out. Quicker paths for one box: a run of this machine left `running` by a dead process is
marked `interrupted` at once (its persona rows too; everything it recorded stays), and a loop restarted under the same
worker name takes its own dead job back without waiting for the lease. SIGINT and SIGTERM stop a review cleanly
(reviewer/run/review.py marks the persona and run interrupted), put its queue row back, and end the loop.

Worker name and lease: the `worker` and `lease_seconds` settings (REVIEWER_WORKER, REVIEWER_LEASE_SECONDS); by default
the host name and DEFAULT_LEASE.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.markup import escape
from sqlalchemy import update
from sqlalchemy.exc import DBAPIError
from sqlmodel import select

from reviewer.store import db
from reviewer.run.review import sigterm_as_interrupt, stop_requested
from reviewer.store.db import PersonaRun, Repository, ReviewQueue, ReviewRun
from reviewer.run.lock import lock_path, review_lock
from reviewer.sandbox.workspace import (KEPT_MARKER, WorkspaceError, is_url, list_remote, local_repository_url,
                                remove_workspace, resolve_target)

MAX_BACKOFF = 3600.0
DEFAULT_LEASE = 300.0  # seconds a claimed job stays a worker's without a heartbeat
MIN_LEASE = 3.0
KEPT_SECONDS = 86400.0  # a failed persona's workspace, kept for a look, is swept this long after
# Folders a review makes, named with their owner's pid: workspaces (reviewer/sandbox/workspace.py, including the verifier's
# and the ref probe's), the doctor's, and the sandbox's scratch folder (reviewer/sandbox/isolation.py).
OWNED_FOLDER = re.compile(r"^(?:reviewer-.+|rvsb)-pid(\d+)-[A-Za-z0-9_]+$")
MAX_ATTEMPTS = 3  # a commit whose review was started this often without finishing is given up (status failed)
REVIEWED = ("completed", "failed")  # run statuses that count as "this commit was reviewed"
EXIT_OK, EXIT_SOME_FAILED, EXIT_INTERRUPTED = 0, 1, 130


class LoopError(Exception):
    """Bad loop options (repos file, interval, personas, database); one line (or one line per bad file line)."""


class ReviewInterrupted(KeyboardInterrupt):
    """A signal landed during a review: its rows are marked interrupted and its queue row is queued again."""


@dataclass
class Watched:
    url: str  # as stored in the database: a URL, or file:// + absolute path for a local repository
    origin: str  # where it came from, for messages: "--repo" or "repos.txt:3"
    failures: int = 0
    next_poll: float = 0.0  # time.monotonic() when it may be polled again
    last_error: str | None = None


def now_text() -> str:
    return datetime.now().strftime("%H:%M:%S")


def log(console: Console, message: str, style: str = "") -> None:
    text = f"[dim]{now_text()}[/dim] " + (f"[{style}]{escape(message)}[/]" if style else escape(message))
    console.print(text, highlight=False, soft_wrap=True)


# --- which repositories ------------------------------------------------------------------------------------------------

def repository_url(text: str, base: Path | None = None) -> str:
    """A URL as given, or a local repository's file:// URL (the same one `reviewer run PATH` stores)."""
    if is_url(text):
        scheme = text.split("://", 1)[0].lower() if "://" in text else "ssh"
        if scheme not in ("https", "http", "ssh", "git", "file"):
            raise WorkspaceError(f"unsupported URL scheme '{scheme}://' (use https, ssh, git or file)")
        return text
    path = Path(text).expanduser()
    if base is not None and not path.is_absolute():
        path = base / path
    return local_repository_url(str(path))


def read_repos_file(path: Path) -> list[Watched]:
    """One repository per line; blank lines and `#` comments are skipped; relative paths are relative to the file.
    Every bad line is named with its number, all at once."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise LoopError(f"cannot read repos file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise LoopError(f"repos file {path} is not text") from None
    watched, bad = [], []
    for number, raw in enumerate(lines, start=1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if len(line.split()) > 1:
            bad.append(f"line {number}: '{line}' has spaces; put one repository URL or path per line")
            continue
        try:
            watched.append(Watched(repository_url(line, base=path.parent), origin=f"{path.name}:{number}"))
        except WorkspaceError as e:
            bad.append(f"line {number}: {e}")
    if bad:
        raise LoopError(f"repos file {path} has {len(bad)} bad line(s): " + "; ".join(bad))
    if not watched:
        raise LoopError(f"repos file {path} names no repository")
    return watched


def watched_repositories(repos: list[str], repos_file: Path | None) -> list[Watched]:
    found: list[Watched] = []
    for text in repos:
        try:
            found.append(Watched(repository_url(text.strip()), origin="--repo"))
        except WorkspaceError as e:
            raise LoopError(f"--repo {text}: {e}") from None
    if repos_file is not None:
        found += read_repos_file(repos_file)
    if not found:
        raise LoopError("no repository to watch: give --repo URL (repeatable) or --repos-file FILE")
    unique = {}
    for w in found:
        unique.setdefault(w.url, w)
    return list(unique.values())


# --- the queue ---------------------------------------------------------------------------------------------------------

def me() -> str:
    """This process, as a queue row's `claimed_by`: unique among live processes of every box."""
    return f"{socket.gethostname()}:{os.getpid()}"


def worker_name(settings=None) -> str:
    """The worker's name in the queue and the report: `worker` setting, REVIEWER_WORKER, else the host name (so a loop
    restarted on the same box is the same worker and takes back its own dead job at once)."""
    return getattr(settings, "worker", None) or os.environ.get("REVIEWER_WORKER") or socket.gethostname()


def lease_seconds(settings=None) -> float:
    """How long a claimed job stays ours without a heartbeat: `lease_seconds` setting, REVIEWER_LEASE_SECONDS, else
    DEFAULT_LEASE. The heartbeat renews it every third of that."""
    value = getattr(settings, "lease_seconds", None) or os.environ.get("REVIEWER_LEASE_SECONDS") or DEFAULT_LEASE
    try:
        value = float(value)
    except ValueError:
        raise LoopError(f"REVIEWER_LEASE_SECONDS must be a number of seconds, got {value!r}") from None
    if not value >= MIN_LEASE:
        raise LoopError(f"the lease must be at least {MIN_LEASE:g} s (it is renewed every third of it), got {value:g}")
    return value


def already_reviewed(s, repository_id: int, commit: str) -> bool:
    if s.exec(select(ReviewQueue).where(ReviewQueue.repository_id == repository_id,
                                        ReviewQueue.commit_sha == commit)).first():
        return True  # queued, running, done or given up: nothing new to add
    return s.exec(select(ReviewRun).where(ReviewRun.repository_id == repository_id, ReviewRun.commit_sha == commit,
                                          ReviewRun.status.in_(REVIEWED))).first() is not None  # type: ignore[attr-defined]


def enqueue(s, repository_id: int, commit: str, ref: str | None, **values) -> bool:
    """One queue row per (repository, commit), however many loops see the commit at once (a unique index and
    INSERT ... ON CONFLICT DO NOTHING). True when this call added it."""
    row = {"repository_id": repository_id, "commit_sha": commit, "ref": ref, "status": "queued", "attempts": 0,
           "enqueued_at": db.utcnow(), **values}
    return db.insert_ignore(s, ReviewQueue, row, ["repository_id", "commit_sha"])


def poll(w: Watched, db_path: str, interval: float, console: Console) -> bool:
    """Ask one repository for its head; queue it if new. False (and the repository backed off) when it cannot be read."""
    try:
        refs, branch = list_remote(w.url)
        if "HEAD" not in refs:
            raise WorkspaceError(f"{w.url} has no commits on its default branch")
    except WorkspaceError as e:
        w.failures += 1
        delay = min(max(interval, 1.0) * 2 ** w.failures, MAX_BACKOFF)
        w.next_poll = time.monotonic() + delay
        w.last_error = str(e)
        log(console, f"{w.url} ({w.origin}): {e}; failure {w.failures}, next try in {delay:.0f} s", "red")
        return False
    if w.failures:
        log(console, f"{w.url} is reachable again after {w.failures} failure(s)", "green")
    w.failures, w.last_error = 0, None
    w.next_poll = time.monotonic() + interval
    commit = refs["HEAD"]
    with db.session(db_path) as s:
        repo = db.get_or_create_repository(s, w.url)
        added = not already_reviewed(s, repo.id, commit) and enqueue(s, repo.id, commit, branch)
        s.commit()
    if added:
        log(console, f"{w.url}: new commit {commit[:12]}" + (f" on {branch}" if branch else "") + " queued", "bold")
    return True


def claim(s, urls: list[str], worker: str, lease: float) -> ReviewQueue | None:
    """Take the oldest queued row of the watched repositories, atomically: on PostgreSQL `SELECT ... FOR UPDATE SKIP
    LOCKED` (workers of other boxes skip the row one of them is taking), and everywhere a compare-and-set UPDATE
    (`WHERE status = 'queued'`), so that two workers never both think they own a row. The claimed row carries a
    lease of `lease` seconds of database time."""
    repo_ids = s.exec(select(Repository.id).where(Repository.url.in_(urls))).all()  # type: ignore[attr-defined]
    for _ in range(10):  # each miss means another worker won that row: try the next one
        row = s.exec(select(ReviewQueue).where(ReviewQueue.status == "queued",
                                               ReviewQueue.repository_id.in_(repo_ids))  # type: ignore[attr-defined]
                     .order_by(ReviewQueue.id).limit(1).with_for_update(skip_locked=True)).first()
        if row is None:
            s.rollback()
            return None
        now = db.db_now(s)
        won = s.execute(update(ReviewQueue).where(ReviewQueue.id == row.id, ReviewQueue.status == "queued").values(
            status="running", claimed_by=me(), worker=worker, started_at=now, heartbeat_at=now,
            lease_expires_at=now + timedelta(seconds=lease), attempts=ReviewQueue.attempts + 1)).rowcount == 1
        s.commit()
        if won:
            s.refresh(row)
            return row
    return None


def release(db_path: str, row_id: int, **values) -> bool:
    """Update a row this process claimed, and drop the claim; False (nothing written) when the row is no longer ours
    (our lease lapsed and another worker took it over)."""
    with db.session(db_path) as s:
        done = s.execute(update(ReviewQueue).where(ReviewQueue.id == row_id, ReviewQueue.claimed_by == me()).values(
            claimed_by=None, lease_expires_at=None, **values)).rowcount == 1
        s.commit()
    return done


class Heartbeat:
    """Renews a claimed row's lease every lease/3 seconds on a thread, for as long as the review (and its
    verification) runs: a live worker's job is never taken from it, however slow it is; a dead one's lease runs out
    and another worker queues the job again (`requeue_expired`)."""

    def __init__(self, db_path: str, row_id: int, lease: float, console: Console):
        self.db_path, self.row_id, self.lease, self.console = db_path, row_id, lease, console
        self.lost = False
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, name=f"lease-{row_id}", daemon=True)

    def renew(self) -> bool:
        with db.session(self.db_path) as s:
            now = db.db_now(s)
            renewed = s.execute(update(ReviewQueue).where(
                ReviewQueue.id == self.row_id, ReviewQueue.claimed_by == me(), ReviewQueue.status == "running").values(
                heartbeat_at=now, lease_expires_at=now + timedelta(seconds=self.lease))).rowcount == 1
            s.commit()
        return renewed

    def run(self) -> None:
        while not self.stop_event.wait(self.lease / 3):
            try:
                if not self.renew():
                    self.lost = True
                    log(self.console, f"queue item {self.row_id}: our lease lapsed and another worker took the job "
                                      "over; this review goes on, its result stays beside theirs", "red")
                    return
            except Exception as e:  # noqa: BLE001 - a database hiccup: try again next beat (the lease has slack)
                log(self.console, f"queue item {self.row_id}: could not renew the lease: {first_line(e)}",
                    "yellow")

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join(timeout=30)


# --- crash recovery ----------------------------------------------------------------------------------------------------

def process_start_time(pid: int) -> float | None:
    """When a process started (seconds since the epoch), from /proc; None where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def owner_alive(pid: int | None, since: datetime | None) -> bool:
    """Is the process that started a run still that process? (A pid can be reused after a crash or a reboot.)"""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    started = process_start_time(pid)
    if started is None or since is None:
        return True
    since_epoch = (since if since.tzinfo else since.replace(tzinfo=timezone.utc)).timestamp()
    return started <= since_epoch + 1.0


def run_host(run: ReviewRun) -> str | None:
    try:
        return json.loads(run.machine or "{}").get("hostname")
    except (ValueError, AttributeError):
        return None


def claimer(row: ReviewQueue) -> tuple[str, int | None]:
    """(host, pid) from a row's claimed_by "host:pid"."""
    host, _, pid = (row.claimed_by or "").rpartition(":")
    return host, int(pid) if pid.isdigit() else None


def interrupt_run(s, run: ReviewRun, why: str) -> None:
    """A run whose process is gone: it and its running persona rows become `interrupted`; what they recorded stays."""
    for p in s.exec(select(PersonaRun).where(PersonaRun.run_id == run.id, PersonaRun.status == "running")).all():
        p.status, p.error, p.finished_at = "interrupted", why, db.utcnow()
        s.add(p)
    run.status, run.error, run.finished_at = "interrupted", why, db.utcnow()
    s.add(run)


def recover_dead_runs(s, watched_urls: list[str], console: Console) -> int:
    """Runs of this machine left `running` by a process that is gone (kill -9, power loss) become interrupted. Runs of
    other machines are left to their leases (a shared database): a pid means nothing on another box."""
    host = socket.gethostname()
    recovered = 0
    for run in s.exec(select(ReviewRun).where(ReviewRun.status == "running")).all():
        if run.pid == os.getpid() or (run_host(run) not in (None, host)):
            continue  # ours, or another machine's
        if owner_alive(run.pid, run.started_at):
            continue  # alive: reviewing (under another box lock) or between its last row and its exit
        why = f"the reviewing process (pid {run.pid}) ended without finishing the run (killed or crashed)"
        interrupt_run(s, run, why)
        recovered += 1
        url = s.get(Repository, run.repository_id).url
        log(console, f"run {run.id} ({url} @ {(run.commit_sha or '?')[:12]}) was left running by pid {run.pid}: "
                     "marked interrupted", "yellow")
        if url in watched_urls and run.commit_sha and enqueue(s, run.repository_id, run.commit_sha, run.ref,
                                                              run_id=run.id, attempts=1):
            log(console, f"queued {run.commit_sha[:12]} of {url} again", "yellow")
    return recovered


def requeue_own_dead_jobs(s, worker: str, console: Console) -> int:
    """Jobs this worker (same name, same box) claimed in a process that is gone: queued again at once, without waiting
    for their lease. Other workers' jobs, even on this box, wait for their lease."""
    host = socket.gethostname()
    requeued = 0
    for row in s.exec(select(ReviewQueue).where(ReviewQueue.status == "running")).all():
        claimed_host, pid = claimer(row)
        if row.claimed_by == me() or claimed_host not in ("", host) or row.worker not in (None, worker):
            continue
        if claimed_host and owner_alive(pid, row.started_at):
            continue
        done = s.execute(update(ReviewQueue).where(ReviewQueue.id == row.id, ReviewQueue.claimed_by == row.claimed_by,
                                                   ReviewQueue.status == "running").values(
            status="queued", claimed_by=None, lease_expires_at=None,
            error="the loop reviewing it ended without finishing (killed or crashed); queued again")).rowcount
        if done:
            requeued += 1
            log(console, f"queue item {row.id} ({row.commit_sha[:12]}) was left running: queued again", "yellow")
    return requeued


def requeue_expired(s, console: Console) -> int:
    """Jobs whose lease ran out (their worker stopped renewing it: killed, crashed, cut off) go back to the queue; the
    run their worker had started is marked interrupted. Whoever polls does this; the UPDATE re-checks the expiry, so a
    lease renewed a moment ago is left alone."""
    now = db.db_now(s)
    requeued = 0
    expired = s.exec(select(ReviewQueue).where(ReviewQueue.status == "running", ReviewQueue.lease_expires_at != None,  # noqa: E711
                                               ReviewQueue.lease_expires_at < now)).all()
    for row in expired:
        late = (now - as_utc(row.heartbeat_at)).total_seconds() if row.heartbeat_at else None
        why = (f"worker {row.worker or '?'} ({row.claimed_by}) stopped renewing its lease"
               + (f" (last heartbeat {late:.0f} s ago)" if late is not None else "") + "; queued again")
        done = s.execute(update(ReviewQueue).where(ReviewQueue.id == row.id, ReviewQueue.status == "running",
                                                   ReviewQueue.lease_expires_at < now).values(
            status="queued", claimed_by=None, lease_expires_at=None, error=why)).rowcount
        if not done:
            continue  # renewed or taken care of by another worker in the meantime
        requeued += 1
        host, pid = claimer(row)
        for run in s.exec(select(ReviewRun).where(ReviewRun.repository_id == row.repository_id,
                                                  ReviewRun.commit_sha == row.commit_sha,
                                                  ReviewRun.status == "running", ReviewRun.pid == pid)).all():
            if run_host(run) in (None, host):
                interrupt_run(s, run, f"its worker {row.worker or '?'} stopped renewing its lease (killed or cut off)")
        log(console, f"queue item {row.id} ({row.commit_sha[:12]}): lease expired, {why}", "yellow")
    return requeued


def remove_orphans(parents: list[Path | None], console: Console) -> int:
    """Workspaces and sandbox scratch folders whose process is gone (killed before it could remove them: 24-28 MB
    each, piling up in /tmp), from the system's temporary folder and `parents`. The pid in a folder's name is its
    owner; owner_alive compares that process's start with the folder's last change, so a reused pid does not keep
    an orphan alive. A workspace kept on purpose (KEPT_MARKER) goes a day after it was kept. Returns how many went."""
    removed = 0
    for parent in dict.fromkeys(Path(p) for p in [*parents, tempfile.gettempdir()] if p):
        try:
            entries = list(parent.iterdir())
        except OSError:
            continue
        for path in entries:
            match = OWNED_FOLDER.match(path.name)
            if not match or not path.is_dir() or path.is_symlink():
                continue
            try:
                changed = path.stat().st_mtime
                kept = (path / KEPT_MARKER).stat().st_mtime if (path / KEPT_MARKER).exists() else None
            except OSError:
                continue
            if owner_alive(int(match.group(1)), datetime.fromtimestamp(changed, timezone.utc)):
                continue
            if kept is not None and time.time() - kept < KEPT_SECONDS:
                continue
            (remove_workspace if path.name.startswith("reviewer-") else shutil.rmtree)(path)
            removed += 1
    if removed:
        log(console, f"removed {removed} workspace(s) and sandbox folder(s) left by killed reviews", "yellow")
    return removed


def as_utc(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def recover(db_path: str, watched_urls: list[str], console: Console, worker: str | None = None) -> int:
    """Call with the machine lock held. Dead runs of this machine become interrupted; this worker's own dead jobs and
    every job whose lease expired are queued again. Returns how many rows were recovered."""
    with db.session(db_path) as s:
        recovered = recover_dead_runs(s, watched_urls, console)
        recovered += requeue_own_dead_jobs(s, worker or worker_name(), console)
        recovered += requeue_expired(s, console)
        s.commit()
    return recovered


# --- one review ----------------------------------------------------------------------------------------------------

class EmbeddedBackend:
    """`--llm embedded` for the loop's whole life: the local backend is started once, on the first review that needs
    it (under the machine lock, so loading the model never disturbs another review), and started again only if it
    stopped answering; each review then talks to it by URL. Remote endpoints are opened by each review as usual, so
    an inference box that comes back is used again at the next review."""

    def __init__(self, settings, console: Console):
        self.settings, self.console = settings, console
        self.stack: contextlib.ExitStack | None = None
        self.url: str | None = None
        self.needed = "embedded" in settings.llm and needs_llm(settings)

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url.removesuffix("/v1") + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def settings_for_review(self):
        """The settings a review runs with: `embedded` replaced by the running backend's URL."""
        if not self.needed:
            return self.settings
        if self.url is not None and not self.healthy():
            log(self.console, f"the embedded LLM backend at {self.url} stopped answering: starting it again", "yellow")
            self.close()
        if self.url is None:
            from reviewer.llm.embedded import start_embedded

            stack = contextlib.ExitStack()
            try:
                self.url = stack.enter_context(start_embedded(self.settings, self.console))
            except BaseException:
                stack.close()
                raise
            self.stack = stack
            log(self.console, f"embedded LLM backend ready at {self.url}; it serves every review of this loop")
        return self.settings.model_copy(update={"llm": [self.url if s == "embedded" else s for s in self.settings.llm]})

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.stack, self.url = None, None


def needs_llm(settings) -> bool:
    from reviewer.persona.files import PersonaError, select_personas

    try:
        return any(not p.deterministic for p in select_personas(list(settings.personas), settings.personas_dir))
    except PersonaError:
        return False  # check_options has said so already


class ReviewNotStarted(Exception):
    """run_command returned without making a run: the LLM, the personas or the database, not this commit, is the
    problem. The row goes back to the queue and this pass stops draining."""


def review_queued(row_id: int, settings, console: Console, worker: str,
                  backend: EmbeddedBackend) -> tuple[str, int | None, str | None]:
    """Review one claimed queue row (the lock is held). Returns (queue status, run id, error)."""
    from reviewer.run.review import EXIT_INTERRUPTED as REVIEW_INTERRUPTED
    from reviewer.run.review import run_command

    with db.session(settings.db) as s:
        row = s.get(ReviewQueue, row_id)
        url = s.get(Repository, row.repository_id).url
        commit, attempt = row.commit_sha, row.attempts
        last_run = s.exec(select(ReviewRun.id).order_by(ReviewRun.id.desc())).first() or 0  # type: ignore[union-attr]
    log(console, f"reviewing {url} @ {commit[:12]} (queue item {row_id}, attempt {attempt}, worker {worker})", "bold")
    try:
        resolve_target(url, commit)  # a commit that vanished (force-push) fails its own row, nothing else
    except WorkspaceError as e:
        log(console, f"cannot review {commit[:12]}: {e}", "red")
        return "failed", None, str(e)
    from reviewer.llm.client import LLMError

    try:
        review_settings = backend.settings_for_review()
    except LLMError as e:
        raise ReviewNotStarted(f"the embedded LLM backend did not start: {e}") from None
    code = run_command(url, review_settings, ref=commit, no_wait=True, console=console, lock_held=True, worker=worker)
    with db.session(settings.db) as s:
        run_id = s.exec(select(ReviewRun.id).where(ReviewRun.id > last_run, ReviewRun.pid == os.getpid(),
                                                   ReviewRun.worker == worker, ReviewRun.commit_sha == commit)
                        .order_by(ReviewRun.id.desc())).first()  # type: ignore[union-attr]
        if run_id is not None and backend.url:  # the run talked to our embedded backend by URL: say "embedded"
            s.execute(update(ReviewRun).where(ReviewRun.id == run_id, ReviewRun.llm == backend.url).values(
                llm="embedded"))
            s.commit()
    if code == REVIEW_INTERRUPTED:
        raise KeyboardInterrupt  # the review marked itself interrupted; the loop stops and requeues
    if run_id is None:
        raise ReviewNotStarted(f"the review could not start (exit code {code}; the reason is printed above)")
    verify_run(settings, run_id, console)
    return "done", run_id, None


def verify_run(settings, run_id: int, console: Console) -> None:
    """Re-run the repro commands of the run's findings that the review did not verify itself."""
    from reviewer.run.verify import verify_findings

    counts = verify_findings(settings.db, run_id, settings=settings, on_progress=lambda m: log(console, m, "dim"))
    if any(counts.values()):
        log(console, f"run {run_id}: {counts['reproduced']} finding(s) reproduced, {counts['not_reproduced']} did not"
                     + (f", {counts['unchecked']} not checked" if counts["unchecked"] else ""))


def review_next(watched: list[Watched], settings, console: Console, worker: str, lease: float,
                backend: EmbeddedBackend) -> str:
    """Take the machine, recover what dead workers left, claim the oldest queued row and review it while a heartbeat
    renews its lease. Returns "reviewed", "empty" (nothing queued) or "blocked" (a review could not start; try again
    next pass)."""
    machine_lock = lock_path(settings)
    urls = [w.url for w in watched]
    with review_lock(machine_lock, wait=True, holder={"target": "reviewer loop", "loop_pid": os.getpid(),
                                                      "worker": worker},
                     on_wait=lambda m: log(console, m, "dim")) as update_holder:
        recover(settings.db, urls, console, worker)
        with db.session(settings.db) as s:
            row = claim(s, urls, worker, lease)
            if row is None:
                return "empty"
            row_id, commit, attempts = row.id, row.commit_sha, row.attempts
            url = s.get(Repository, row.repository_id).url
        if attempts > MAX_ATTEMPTS:
            error = f"given up after {attempts - 1} attempts that did not finish"
            release(settings.db, row_id, status="failed", attempts=attempts - 1, finished_at=db.utcnow(), error=error)
            log(console, f"queue item {row_id} ({commit[:12]}): {error}", "red")
            return "reviewed"
        update_holder(target=url, commit=commit, queue_item=row_id)
        try:
            with Heartbeat(settings.db, row_id, lease, console):
                status, run_id, error = review_queued(row_id, settings, console, worker, backend)
        except KeyboardInterrupt:
            requeue_interrupted(settings.db, row_id)
        except ReviewNotStarted as e:
            # Not this commit's fault: it keeps its place, and its attempt is not counted.
            release(settings.db, row_id, status="queued", attempts=attempts - 1, error=str(e))
            log(console, f"queue item {row_id}: {e}; it stays queued", "red")
            return "blocked"
        except Exception as e:  # noqa: BLE001 - a bug in one review must not end the loop; the row says what
            if stop_requested():  # not a bug: a SIGTERM that came out as an error (reviewer.run.review.stop_requested)
                requeue_interrupted(settings.db, row_id)
            release(settings.db, row_id, status="failed", finished_at=db.utcnow(), error=f"{type(e).__name__}: {e}")
            log(console, f"queue item {row_id}: review crashed: {type(e).__name__}: {e}", "red")
            return "reviewed"
        if not release(settings.db, row_id, status=status, run_id=run_id, finished_at=db.utcnow(), error=error):
            log(console, f"queue item {row_id}: another worker took it over after our lease lapsed; our run {run_id} "
                         "stays in the database beside theirs", "red")
    return "reviewed"


def requeue_interrupted(db_path: str, row_id: int) -> NoReturn:
    """A signal stopped the review of a claimed row: the row goes back to the queue and the loop ends."""
    release(db_path, row_id, status="queued", error="interrupted (SIGINT/SIGTERM); queued again")
    raise ReviewInterrupted from None


# --- the loop ------------------------------------------------------------------------------------------------------

def check_options(settings, interval: float, max_reviews: int | None) -> tuple[str, float]:
    """Returns (worker name, lease seconds)."""
    from reviewer.persona.files import PersonaError, select_personas

    if interval <= 0:
        raise LoopError(f"--interval must be a positive number of seconds, got {interval:g}")
    if max_reviews is not None and max_reviews < 1:
        raise LoopError(f"--max-reviews must be at least 1, got {max_reviews}")
    try:
        if not select_personas(list(settings.personas), settings.personas_dir):
            raise LoopError("no persona selected")
    except PersonaError as e:
        raise LoopError(str(e)) from None
    worker, lease = worker_name(settings), lease_seconds(settings)
    try:
        db.get_engine(settings.db)
    except Exception as e:  # noqa: BLE001 - unwritable path, unreachable server, newer schema: one line
        raise LoopError(f"cannot open the database {db.display_url(settings.db)}: {first_line(e)}") from None
    return worker, lease


def stop_if_requested() -> None:
    """End the loop if SIGTERM arrived even though its KeyboardInterrupt did not get here (it can come out of a
    library as an ordinary error: reviewer.run.review.stop_requested); retrying or polling on would ignore the signal."""
    if stop_requested():
        raise KeyboardInterrupt


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def loop_command(settings, *, repos: list[str], repos_file: Path | None, interval: float, once: bool,
                 max_reviews: int | None, console: Console) -> int:
    """`reviewer loop`. Exit code: 0 done (or stopped by a signal while idle), 1 when, in a --once pass, a repository
    could not be read or a review could not start, 130 when a signal interrupted a review (it is queued again)."""
    worker, lease = check_options(settings, interval, max_reviews)
    watched = watched_repositories(repos, repos_file)
    urls = [w.url for w in watched]
    log(console, f"watching {len(watched)} repositor{'y' if len(watched) == 1 else 'ies'}"
                 f" ({'one pass' if once else f'every {interval:g} s'}); database {db.display_url(settings.db)}; "
                 f"worker {worker} (lease {lease:g} s)")
    reviews = 0
    backend = EmbeddedBackend(settings, console)
    try:
        with sigterm_as_interrupt(), contextlib.closing(backend):
            while True:
                due = [w for w in watched if w.next_poll <= time.monotonic()]
                blocked = False
                try:
                    unreachable = [w for w in due if not poll(w, settings.db, interval, console)]
                    while max_reviews is None or reviews < max_reviews:
                        stop_if_requested()
                        outcome = review_next(watched, settings, console, worker, lease, backend)
                        if outcome != "reviewed":
                            blocked = outcome == "blocked"
                            break
                        reviews += 1
                except DBAPIError as e:
                    stop_if_requested()  # the error may be a SIGTERM that landed in a database call: no retry then
                    # The database went away (a restart, the network): wait and try again. A job claimed meanwhile
                    # keeps its lease only while we can renew it; after that another worker may take it.
                    wait = 1.0 if once else max(interval, 5.0)
                    log(console, f"the database {db.display_url(settings.db)} failed: {first_line(e)}; "
                                 + ("giving up this pass" if once else f"trying again in {wait:g} s"), "red")
                    if once:
                        return EXIT_SOME_FAILED
                    time.sleep(wait)
                    continue
                if max_reviews is not None and reviews >= max_reviews:
                    log(console, f"stopping after {reviews} review(s) (--max-reviews)")
                    return EXIT_OK
                if once:
                    pending = queued_count(settings.db, urls)
                    log(console, f"pass done: {reviews} review(s)"
                                 + (f", {len(unreachable)} repositor{'y' if len(unreachable) == 1 else 'ies'} "
                                    "could not be read" if unreachable else "")
                                 + (f", {pending} still queued" if pending else ""))
                    return EXIT_SOME_FAILED if unreachable or blocked else EXIT_OK
                wake = min(w.next_poll for w in watched)
                time.sleep(max(0.0, wake - time.monotonic()))
    except ReviewInterrupted:
        log(console, "stopped by signal during a review; it is queued again", "yellow")
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        log(console, "stopped by signal" + (f" after {reviews} review(s)" if reviews else ""), "yellow")
        return EXIT_OK


def queued_count(db_path: str, urls: list[str]) -> int:
    with db.session(db_path) as s:
        repo_ids = s.exec(select(Repository.id).where(Repository.url.in_(urls))).all()  # type: ignore[attr-defined]
        return len(s.exec(select(ReviewQueue.id).where(ReviewQueue.status == "queued",
                                                       ReviewQueue.repository_id.in_(repo_ids))).all())  # type: ignore[attr-defined]
