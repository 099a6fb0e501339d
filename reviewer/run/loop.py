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
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from sqlalchemy import update
from sqlalchemy.exc import DBAPIError
from sqlmodel import select

from reviewer.llm.embedded import EmbeddedBackend
from reviewer.llm.errors import LLMError
from reviewer.persona.files import PersonaError, select_personas
from reviewer.run.lock import lock_path, review_lock
from reviewer.run.queue import Heartbeat, already_reviewed, claim, enqueue, release, worker_name
from reviewer.run.recovery import recover
from reviewer.run.review import EXIT_INTERRUPTED as REVIEW_INTERRUPTED
from reviewer.run.review import run_command
from reviewer.run.signals import sigterm_as_interrupt, stop_requested
from reviewer.run.verify import verify_findings
from reviewer.run.view import log
from reviewer.sandbox.workspace import WorkspaceError, is_url, list_remote, local_repository_url, resolve_target
from reviewer.store import db
from reviewer.store.db import Repository, ReviewQueue, ReviewRun
from reviewer.text import first_line

MAX_BACKOFF = 3600.0
DEFAULT_LEASE = 300.0  # seconds a claimed job stays a worker's without a heartbeat
MIN_LEASE = 3.0
MAX_ATTEMPTS = 3  # a commit whose review was started this often without finishing is given up (status failed)
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


# --- one review ----------------------------------------------------------------------------------------------------


def needs_llm(settings) -> bool:
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
            if stop_requested():  # not a bug: a SIGTERM that came out as an error (reviewer.run.signals.stop_requested)
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
    library as an ordinary error: reviewer.run.signals.stop_requested); retrying or polling on would ignore the signal."""
    if stop_requested():
        raise KeyboardInterrupt


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
    backend = EmbeddedBackend(settings, console, needed="embedded" in settings.llm and needs_llm(settings),
                              log=lambda message, style="": log(console, message, style))
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
