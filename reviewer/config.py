"""Configuration: defaults < ~/.config/reviewer/config.toml < ./reviewer.toml < REVIEWER_* variables < command line.

pydantic-settings does the layering and the validation; this module only names the files and turns a validation
error into one line that names the key.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

DEFAULT_PERSONAS = ["smoke", "performance", "correctness", "docs"]


class ConfigError(Exception):
    """A bad configuration value; the message is one line meant for the user."""


def config_files() -> list[Path]:
    """Lowest precedence first."""
    home = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "reviewer" / "config.toml"
    return [home, Path("reviewer.toml")]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REVIEWER_", extra="forbid", validate_default=True)

    db: str = Field("reviews.db", description="database path or URL (sqlite file by default)")
    llm: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["embedded"],
        description="embedded | openai | anthropic | http(s)://host:port/v1 | unix:///path.sock (a list fails over)",
    )
    model: str | None = Field(None, description="model name to ask the LLM for")
    api_key: str | None = Field(None, description="key sent to a `reviewer serve` backend that requires one")
    context_window: int | None = Field(None, ge=512, description="the model's context window in tokens, when the server does not say")
    personas: Annotated[list[str], NoDecode] = Field(default_factory=lambda: list(DEFAULT_PERSONAS))
    personas_dir: Annotated[list[Path], NoDecode] = Field(default_factory=list, description="extra folders of persona .md files")
    max_steps: int | None = Field(None, ge=1, le=1000, description="override every persona's step budget")
    timeout: float = Field(1800.0, gt=0, description="wall-clock limit per persona, seconds")
    probes: bool = Field(True, description="run the deterministic probes (reviewer/persona/probes) after the smoke install")
    command_timeout: int = Field(600, gt=0, description="upper bound for one sandboxed command, seconds")
    isolation: Literal["auto", "bwrap", "none"] = "auto"
    network_allow: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["auto"],
        description="hosts the sandbox's proxy lets through ('auto': pip's and npm's configured registries)",
    )
    sandbox_memory_mb: int = Field(4096, ge=64, description="memory limit of one sandboxed command")
    sandbox_max_processes: int = Field(1024, ge=8, description="process limit of one sandboxed command")
    sandbox_disk_mb: int = Field(10240, ge=16, description="workspace disk limit; the command is stopped past it")
    sandbox_output_mb: int = Field(64, ge=1, description="output limit of one sandboxed command")
    sandbox_cpu_seconds: int | None = Field(None, ge=1, description="CPU-time limit (default: 2 x command_timeout)")
    embedded_model: str = Field("embedded", description="what `--llm embedded` serves (a path or 'embedded')")
    workdir: Path | None = Field(None, description="where review workspaces are made (default: a temp dir)")
    worker: str | None = Field(None, description="this worker's name in a shared queue (default: the host name)")
    lease_seconds: float = Field(300.0, ge=3, description="how long a claimed review stays claimed without a heartbeat")
    lock_file: Path | None = Field(None, description="the machine-wide review lock (default: /tmp/reviewer-review.lock)")

    @field_validator("llm", "personas", "personas_dir", "network_allow", mode="before")
    @classmethod
    def _split_commas(cls, value):
        # REVIEWER_LLM="http://a/v1,http://b/v1" and llm = "embedded" in TOML both work.
        return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        files = [TomlConfigSettingsSource(settings_cls, toml_file=p) for p in reversed(config_files()) if p.is_file()]
        return (init_settings, env_settings, *files)


def load_settings(**overrides) -> Settings:
    """Settings with command-line overrides (None means 'not given'); raises ConfigError with a one-line message."""
    given = {k: v for k, v in overrides.items() if v is not None and v != [] and v != ()}
    for path in config_files():
        if path.is_file():
            try:
                tomllib.loads(path.read_text())
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: not valid TOML: {e}") from None
    try:
        return Settings(**given)
    except SettingsError as e:
        raise ConfigError(f"bad configuration: {e}") from None
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "config"
        where = "command line" if key in given else f"config ({', '.join(str(p) for p in config_files())}) or REVIEWER_{key.upper()}"
        raise ConfigError(f"bad value for '{key}' ({where}): {err['msg']}") from None
