"""Storage: the review database (SQLite by default) through SQLModel.

One module owns the schema, its version and its upgrades, so every command sees the same tables. Rows are written in
short transactions: a crash leaves whole rows or none.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Index, event, inspect, text
from sqlalchemy.engine import Engine, make_url
from sqlmodel import Field, Session, SQLModel, create_engine, select

SCHEMA_VERSION = 4

RUN_STATUSES = ("queued", "running", "completed", "failed", "interrupted")
PERSONA_STATUSES = ("running", "completed", "failed", "interrupted", "step_budget", "token_budget", "timeout")
SEVERITIES = ("critical", "high", "medium", "low", "info")
FINDING_STATES = ("new", "persisting", "fixed", "regressed")
QUEUE_STATUSES = ("queued", "running", "done", "failed")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Meta(SQLModel, table=True):
    key: str = Field(primary_key=True)
    value: str


class Repository(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    url: str = Field(index=True, unique=True)
    created_at: datetime = Field(default_factory=utcnow)


class ReviewRun(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    repository_id: int = Field(foreign_key="repository.id", index=True)
    ref: str | None = None
    commit_sha: str | None = Field(default=None, index=True)
    status: str = Field(default="running", index=True)
    started_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None
    llm: str | None = None
    model: str | None = None
    machine: str | None = None  # fingerprint of the worker box: hostname, CPU, cores, memory
    pid: int | None = None  # process that owns a running review (crash recovery)
    error: str | None = None
    worker: str | None = None  # name of the `reviewer loop` worker that ran it (v3; None for `reviewer run`)


class PersonaRun(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="reviewrun.id", index=True)
    persona: str
    status: str = "running"
    steps: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    llm_seconds: float = 0.0
    # True: the server reported no usage, so the token counts (and a tok/s made from them) are estimates; None in
    # rows written before v4, which did not say.
    tokens_estimated: bool | None = None
    started_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None
    summary: str | None = None
    error: str | None = None
    transcript: str = "[]"  # JSON list of messages, rewritten after every step


class Finding(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="reviewrun.id", index=True)
    persona_run_id: int | None = Field(default=None, foreign_key="personarun.id")
    persona: str
    title: str
    severity: str
    category: str
    details: str = ""
    evidence: str | None = None
    repro_command: str | None = None
    file: str | None = None
    line: int | None = None
    fingerprint: str | None = Field(default=None, index=True)
    state: str | None = None
    verified: bool | None = None
    verification: str | None = None  # what re-running repro_command gave: exit code, seconds, output tail (v2)
    duplicate_of: int | None = None  # id of the finding this near-duplicate was merged into; reports hide it (v2)
    created_at: datetime = Field(default_factory=utcnow)


class Measurement(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="reviewrun.id", index=True)
    persona_run_id: int | None = Field(default=None, foreign_key="personarun.id")
    persona: str
    name: str
    value: float
    unit: str
    command: str | None = None
    repeats: int | None = None
    spread: float | None = None  # e.g. (max - min) / median of the repeats
    samples: str | None = None  # JSON list of the raw values when repeats > 1
    created_at: datetime = Field(default_factory=utcnow)


class SandboxEvent(SQLModel, table=True):
    """Something the sandbox blocked or contained while a persona's command ran (a refused connection, a limit that
    bit, a process left behind, isolation turned off). A new table: create_all makes it, no version bump needed."""

    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="reviewrun.id", index=True)
    persona_run_id: int | None = Field(default=None, foreign_key="personarun.id", index=True)
    persona: str
    kind: str = Field(index=True)  # reviewer.sandbox.limits.KINDS: network_refused, timeout, pids_limit, disk_limit, ...
    detail: str
    command: str | None = None  # the command it happened in (first 2000 characters)
    inferred: bool = False  # read from the command's output (a kernel refusal) rather than observed by the sandbox
    created_at: datetime = Field(default_factory=utcnow)


class ReviewQueue(SQLModel, table=True):
    """Commits `reviewer loop` has seen and must review, one row per (repository, commit) (v2): the unique index makes
    several loops enqueue a commit once (v3). A claimed row carries a lease its worker renews while it reviews (v3)."""

    __table_args__ = (Index("uq_reviewqueue_repo_commit", "repository_id", "commit_sha", unique=True),)

    id: int | None = Field(default=None, primary_key=True)
    repository_id: int = Field(foreign_key="repository.id", index=True)
    commit_sha: str = Field(index=True)
    ref: str | None = None
    status: str = Field(default="queued", index=True)  # QUEUE_STATUSES
    attempts: int = 0
    run_id: int | None = None  # the latest ReviewRun made for this row
    claimed_by: str | None = None  # "host:pid" of the loop reviewing it (crash recovery)
    worker: str | None = None  # the claiming worker's name (v3)
    lease_expires_at: datetime | None = None  # database time after which another worker may queue it again (v3)
    heartbeat_at: datetime | None = None  # last lease renewal (v3)
    enqueued_at: datetime = Field(default_factory=utcnow)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None


# version -> function that upgrades a database from version-1 to version. Tables that do not exist are created by
# create_all before these run; a migration only adds what create_all cannot (columns, data fixes). Never drop data.
MIGRATIONS: dict[int, Callable[[Any], None]] = {}


def _v2_lifecycle_columns(conn) -> None:
    # v2 (`reviewer loop` / `reviewer report`): verification output and near-duplicate merging on findings; the
    # reviewqueue table is new, so create_all makes it.
    add_column(conn, "finding", "verification", "TEXT")
    add_column(conn, "finding", "duplicate_of", "INTEGER")


MIGRATIONS[2] = _v2_lifecycle_columns


def _v3_shared_queue(conn) -> None:
    # v3 (scale-out): leases on queue rows, worker names, and one queue row per (repository, commit). Two loops that
    # polled at once before v3 may have queued a commit twice: the younger rows are bookkeeping only (the runs stay),
    # so they go, and the unique index can be made.
    add_column(conn, "reviewqueue", "worker", "TEXT")
    add_column(conn, "reviewqueue", "lease_expires_at", "TIMESTAMP")
    add_column(conn, "reviewqueue", "heartbeat_at", "TIMESTAMP")
    add_column(conn, "reviewrun", "worker", "TEXT")
    conn.execute(text("DELETE FROM reviewqueue WHERE id NOT IN "
                      "(SELECT MIN(id) FROM reviewqueue GROUP BY repository_id, commit_sha)"))
    conn.execute(text("CREATE UNIQUE INDEX IF NOT EXISTS uq_reviewqueue_repo_commit "
                      "ON reviewqueue (repository_id, commit_sha)"))


MIGRATIONS[3] = _v3_shared_queue


def _v4_estimated_tokens(conn) -> None:
    # v4 (peer backends): whether a persona run's token counts are the server's or estimates. Old rows stay NULL:
    # nobody knows any more.
    add_column(conn, "personarun", "tokens_estimated", "BOOLEAN")


MIGRATIONS[4] = _v4_estimated_tokens


def add_column(conn, table: str, column: str, ddl_type: str) -> None:
    """Idempotent ALTER TABLE ADD COLUMN for migrations."""
    if column not in {c["name"] for c in inspect(conn).get_columns(table)}:
        conn.execute(text(f'ALTER TABLE "{table}" ADD COLUMN "{column}" {ddl_type}'))


def database_url(db: str) -> str:
    """A path is a SQLite file; postgresql:// (or postgres://) URLs go through psycopg 3 (`reviewer[postgres]`)."""
    if "://" not in db:
        return f"sqlite:///{Path(db).expanduser()}"
    for plain in ("postgresql://", "postgres://"):
        if db.startswith(plain):
            return "postgresql+psycopg://" + db.removeprefix(plain)
    return db


def display_url(db: str) -> str:
    """The database as shown in logs and errors: a URL's password is masked."""
    if "://" not in db:
        return db
    try:
        return make_url(db).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy understands; get_engine will say so
        return db.split("@", 1)[-1] if "@" in db else db


def is_postgres(s_or_conn) -> bool:
    return s_or_conn.get_bind().dialect.name == "postgresql" if isinstance(s_or_conn, Session) \
        else s_or_conn.dialect.name == "postgresql"


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    # WAL lets `reviewer report` read while a review writes; busy_timeout makes writers wait instead of failing.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


_engines: dict[str, Engine] = {}


def get_engine(db: str) -> Engine:
    """Open (creating or upgrading as needed) the database and return its engine, cached per URL."""
    url = database_url(db)
    if url in _engines:
        return _engines[url]
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
    elif url.startswith("postgresql+psycopg://"):
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise RuntimeError("PostgreSQL needs the psycopg driver: pip install 'reviewer[postgres]'") from None
        # UTC sessions: timestamps are stored without a zone and always read back as UTC (reviewer.store.db.iso).
        engine = create_engine(url, pool_pre_ping=True, connect_args={"options": "-c timezone=UTC"})
    else:
        engine = create_engine(url, pool_pre_ping=True)
    upgrade(engine)
    _engines[url] = engine
    return engine


def stored_version(conn) -> int:
    if not inspect(conn).has_table("meta"):
        return 0
    row = conn.execute(text("SELECT value FROM meta WHERE key = 'schema_version'")).first()
    return int(row[0]) if row else 0


def upgrade(engine: Engine) -> None:
    """Create missing tables and run pending migrations in one transaction."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Several workers starting at once against a new database: one creates and upgrades, the others wait.
            conn.execute(text("SELECT pg_advisory_xact_lock(7262657669657772)"))
        version = stored_version(conn)
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"database schema version {version} is newer than this reviewer ({SCHEMA_VERSION}); upgrade reviewer"
            )
        SQLModel.metadata.create_all(conn)
        for target in range(version + 1, SCHEMA_VERSION + 1):
            if target in MIGRATIONS:
                MIGRATIONS[target](conn)
        if version != SCHEMA_VERSION:
            conn.execute(text("DELETE FROM meta WHERE key = 'schema_version'"))
            conn.execute(
                text("INSERT INTO meta (key, value) VALUES ('schema_version', :v)"), {"v": str(SCHEMA_VERSION)}
            )


def session(db: str) -> Session:
    return Session(get_engine(db), expire_on_commit=False)


def get_or_create_repository(s: Session, url: str) -> Repository:
    repo = s.exec(select(Repository).where(Repository.url == url)).first()
    if repo is None:
        # Another worker may add the same repository at the same moment: insert-or-nothing, then read it.
        insert_ignore(s, Repository, {"url": url, "created_at": utcnow()}, ["url"])
        repo = s.exec(select(Repository).where(Repository.url == url)).one()
    return repo


def insert_ignore(s: Session, model, values: dict, conflict: list[str]) -> bool:
    """INSERT ... ON CONFLICT (conflict) DO NOTHING on SQLite and PostgreSQL; True when the row was inserted."""
    if is_postgres(s):
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    table = model.__table__
    statement = insert(table).values(**values).on_conflict_do_nothing(index_elements=conflict)
    # RETURNING, not rowcount: drivers report -1 for an INSERT whose keys come back through RETURNING.
    return s.execute(statement.returning(*table.primary_key.columns)).first() is not None


def db_now(s: Session) -> datetime:
    """The database's clock on PostgreSQL (workers' clocks need not agree for leases), this machine's on SQLite."""
    if is_postgres(s):
        return s.execute(text("SELECT now()")).scalar_one().astimezone(timezone.utc)
    return utcnow()


def iso(dt: datetime | None) -> str | None:
    """ISO 8601 in UTC; SQLite hands back naive datetimes, which we always stored as UTC."""
    if dt is None:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def loads(value: str | None, default: Any = None) -> Any:
    return json.loads(value) if value else default
