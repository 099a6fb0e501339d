"""The only way out of the sandbox: an allowlisting HTTP(S) proxy on a unix socket.

The sandbox has its own network namespace with nothing but a loopback, so a command cannot reach anything directly.
The reviewer starts this proxy outside (one per command, in a thread with its own asyncio loop), binds its unix socket
into the sandbox, and the sandbox's init forwards 127.0.0.1:3128 there; HTTP_PROXY / HTTPS_PROXY / npm's proxy
settings point at it. It lets through `CONNECT host:443` and plain `GET http://host/...` only to hosts on the
allowlist — by default the package registries pip and npm are configured with — and refuses the rest with a 403 that
says why, recording each refusal as a `network_refused` sandbox event. TLS is not intercepted: the proxy sees host
names, never content.

Why not a library: proxy.py (the maintained pure-Python proxy) runs its acceptors in worker processes configured by
global flags, so reporting refusals back to the command that made them would need IPC of its own, and it cannot be
started and stopped cheaply per command; what is needed here — CONNECT, absolute-form HTTP/1.x forwarding, a host
check — is about 150 lines of asyncio.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

SANDBOX_PROXY_PORT = 3128  # inside the sandbox's own network namespace, so it never collides with anything
DEFAULT_REGISTRIES = ["pypi.org", "files.pythonhosted.org", "registry.npmjs.org"]
MAX_HEAD = 64 * 1024
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 20.0


# ---------------------------------------------------------------------------------------------------------- allowlist

def split_host_port(text: str, default_port: int | None = None) -> tuple[str, int | None]:
    text = text.strip()
    if text.startswith("["):  # [::1]:443
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
        return host.lower(), int(port) if port.isdigit() else default_port
    if text.count(":") == 1:
        host, port = text.split(":")
        return host.lower().rstrip("."), int(port) if port.isdigit() else default_port
    return text.lower().rstrip("."), default_port


def host_allowed(host: str, port: int, allow: list[str]) -> bool:
    """`host` (any case) and `port` against entries like 'pypi.org', 'pypi.org:8443', '*.example.com', '10.0.0.5:3141'.
    An entry without a port allows the web ports 80 and 443 only."""
    host = host.lower().rstrip(".")
    for entry in allow:
        name, entry_port = split_host_port(entry)
        if entry_port is None and port not in (80, 443):
            continue
        if entry_port is not None and entry_port != port:
            continue
        if name == host or (name.startswith("*.") and host.endswith(name[1:])):
            return True
    return False


@dataclass
class RegistrySetup:
    """What the sandbox needs to install packages the way this machine is configured to."""
    hosts: list[str] = field(default_factory=list)  # allowlist entries for the configured http(s) registries
    env: dict[str, str] = field(default_factory=dict)  # PIP_* / npm_config_* the sandbox gets (credentials stripped)
    ro_paths: list[Path] = field(default_factory=list)  # local file:// indexes and find-links folders to show read-only


def strip_credentials(url: str) -> str:
    """Index URLs with user:token@ are credentials; the sandbox never gets them (see docs/sandbox.md)."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def local_index_root(path: Path) -> Path:
    # A PEP 503 index at .../simple links its files as ../../files/x.whl: show the folder above 'simple'.
    return path.parent if path.name == "simple" else path


def add_location(setup: RegistrySetup, value: str) -> str | None:
    """One index URL or find-links entry: allow its host or show its folder. Returns the value to pass on."""
    if value.startswith(("http://", "https://")):
        parts = urlsplit(value)
        if parts.hostname:
            default = 443 if parts.scheme == "https" else 80
            setup.hosts.append(parts.hostname if (parts.port or default) in (80, 443) else f"{parts.hostname}:{parts.port}")
        return strip_credentials(value)
    path = Path(value.removeprefix("file://")) if value.startswith("file://") else Path(value)
    if path.is_absolute():
        if path.exists():
            setup.ro_paths.append(local_index_root(path))
        return value
    return None  # relative paths mean nothing inside another working directory


def pip_config_files() -> list[Path]:
    """pip's configuration files, lowest precedence first (global, user, then PIP_CONFIG_FILE), as pip documents them."""
    dirs = os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":")
    files = [Path(d) / "pip" / "pip.conf" for d in reversed(dirs) if d] + [Path("/etc/pip.conf")]
    home = Path.home()
    files += [home / ".pip" / "pip.conf",
              Path(os.environ.get("XDG_CONFIG_HOME", home / ".config")) / "pip" / "pip.conf"]
    if os.environ.get("PIP_CONFIG_FILE") and os.environ["PIP_CONFIG_FILE"] != os.devnull:
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    return files


@lru_cache(maxsize=1)
def pip_config() -> dict[str, str]:
    """pip's effective settings for `pip install` (files, then PIP_* variables): key -> value. Read, not asked for:
    `pip config list` would run `rustc --version` for its user agent, and rustup writes into the user's home."""
    config: dict[str, str] = {}
    for path in pip_config_files():
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except (configparser.Error, OSError):
            continue
        for section in ("global", "install"):
            if parser.has_section(section):
                config.update({k: " ".join(v.split()) for k, v in parser.items(section)})
    for key, value in os.environ.items():
        if key.startswith("PIP_") and value:
            config[key[4:].lower().replace("_", "-")] = " ".join(value.split())
    return config


def npm_registries() -> list[str]:
    """The npm registry URLs this user has configured (registry= and @scope:registry=), default npmjs."""
    urls = [v for k, v in os.environ.items() if k.lower() == "npm_config_registry"]
    files = [Path(os.environ.get("NPM_CONFIG_USERCONFIG", Path.home() / ".npmrc")), Path("/etc/npmrc"),
             Path("/usr/etc/npmrc")]
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip().endswith("registry"):
                urls.append(value.strip())
    return urls or ["https://registry.npmjs.org/"]


def registry_setup() -> RegistrySetup:
    """The package registries this machine is configured with, for the allowlist and the sandbox's environment."""
    setup = RegistrySetup()
    config = pip_config()
    for key, env_name in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
                          ("find-links", "PIP_FIND_LINKS")):
        if key in config:
            values = [v for v in (add_location(setup, x) for x in config[key].split()) if v]
            if values:
                setup.env[env_name] = " ".join(values)
    if "trusted-host" in config:
        setup.env["PIP_TRUSTED_HOST"] = config["trusted-host"]
    for key, env_name in (("constraint", "PIP_CONSTRAINT"), ("cert", "PIP_CERT")):
        if key in config and Path(config[key]).is_file():
            setup.env[env_name] = config[key]
            setup.ro_paths.append(Path(config[key]))
    npm = npm_registries()
    for url in npm:
        add_location(setup, url)
    setup.env["npm_config_registry"] = strip_credentials(npm[0])
    setup.hosts = list(dict.fromkeys(setup.hosts))
    setup.ro_paths = list(dict.fromkeys(setup.ro_paths))
    return setup


def expand_allowlist(entries: list[str], setup: RegistrySetup | None = None) -> list[str]:
    """'auto' stands for PyPI, npm and every registry pip/npm are configured with on this machine."""
    out: list[str] = []
    for entry in entries:
        if entry.strip().lower() == "auto":
            out += DEFAULT_REGISTRIES + (setup or registry_setup()).hosts
        elif entry.strip():
            out.append(entry.strip())
    return list(dict.fromkeys(out))


# -------------------------------------------------------------------------------------------------------------- proxy

@dataclass
class Refusal:
    method: str
    host: str
    port: int
    count: int
    first: float


class EgressProxy:
    """`with EgressProxy(path, allow) as proxy:` serves on the unix socket `path` until the block ends;
    `proxy.refusals()` says what it turned away, `proxy.passed` what it let through."""

    def __init__(self, socket_path: Path, allow: list[str]):
        self.socket_path = Path(socket_path)
        self.allow = list(allow)
        self.passed: list[str] = []
        self._refused: dict[tuple[str, str, int], Refusal] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    # lifecycle
    def __enter__(self) -> "EgressProxy":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="egress-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise OSError(f"the network proxy could not start on {self.socket_path}: {self._error}")

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(5)
        try:
            self.socket_path.unlink()
        except OSError:
            pass

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_unix_server(self._handle, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self._ready.set()
        async with server:
            await self._stop.wait()
            server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

    # records
    def _refuse(self, method: str, host: str, port: int) -> None:
        with self._lock:
            key = (method, host, port)
            if key in self._refused:
                self._refused[key].count += 1
            else:
                self._refused[key] = Refusal(method, host, port, 1, time.time())

    def refusals(self) -> list[Refusal]:
        with self._lock:
            return list(self._refused.values())

    # protocol
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            writer.close()
            return
        try:
            await self._dispatch(head, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _dispatch(self, head: bytes, reader, writer) -> None:
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ")
        except ValueError:
            return await self._reply(writer, 400, "malformed request line")
        if method == "CONNECT":
            host, port = split_host_port(target, 443)
            if port is None:
                return await self._reply(writer, 400, f"bad CONNECT target {target!r}")
            headers_out = None
        else:
            parts = urlsplit(target)
            if parts.scheme != "http" or not parts.hostname:
                return await self._reply(writer, 400, "this is a forward proxy: send absolute http:// URLs or CONNECT")
            host, port = parts.hostname.lower(), parts.port or 80
            path = urlunsplit(("", "", parts.path or "/", parts.query, ""))
            kept = [h for h in lines[1:] if h and h.split(":", 1)[0].strip().lower() not in HOP_BY_HOP]
            headers_out = "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close", "", ""]).encode("latin-1")
        if not host_allowed(host, port, self.allow):
            self._refuse(method, host, port)
            return await self._reply(
                writer, 403, f"reviewer sandbox: {host}:{port} is not on the network allowlist "
                             f"(allowed: {', '.join(self.allow) or 'nothing'}); the refusal is recorded")
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as e:
            return await self._reply(writer, 502, f"cannot reach {host}:{port}: {e}")
        with self._lock:
            self.passed.append(f"{method} {host}:{port}")
        if headers_out is None:
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            up_writer.write(headers_out)
        await writer.drain()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)
        up_writer.close()

    async def _reply(self, writer, status: int, message: str) -> None:
        reason = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway"}[status]
        body = (message + "\n").encode()
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + body)
        try:
            await writer.drain()
        except ConnectionError:
            pass


HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "proxy-authenticate", "te",
              "trailer", "upgrade"}


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        if writer.can_write_eof():
            try:
                writer.write_eof()
            except OSError:
                pass


def refusal_detail(r: Refusal) -> str:
    what = f"CONNECT {r.host}:{r.port}" if r.method == "CONNECT" else f"{r.method} http://{r.host}:{r.port}/"
    times = f" ({r.count} times)" if r.count > 1 else ""
    return f"{what} refused: not on the network allowlist{times}"


if __name__ == "__main__":  # `python -m reviewer.sandbox.egress_proxy`: what this machine's registry setup looks like
    s = registry_setup()
    print(json.dumps({"allow": expand_allowlist(["auto"], s), "env": s.env, "ro_paths": [str(p) for p in s.ro_paths]},
                     indent=2))
