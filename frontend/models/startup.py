"""The startup models (``load_models`` / ``--models``): their entries read, and the fork
server started for them before anything else of the server.

A forked worker is ready once the fork server has imported what its handler needs (torch
and torchvision: seconds); started here, first thing, it imports them while the frontend
imports its own modules, binds its ports and unpacks the archives, instead of after.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from frontend.config import ServerConfig
from frontend.errors import ConfigError, ServeError
from frontend.models import archive as archives
from frontend.processes import worker_environment
from frontend.serving.forkserver import ForkUnavailable, Launch, fork_unsupported, launch

logger = logging.getLogger(__name__)

#: The startup archives whose handlers the early fork server reads, at most.
MAX_PRELOADED_ARCHIVES = 32


def startup_entries(entries: tuple[str, ...], key: str, store: Callable[[], Iterable[Path]]
                    ) -> list[tuple[str | None, str]]:
    """(name or None, url) for each of ``key``'s entries: ``all`` (every archive ``store``
    lists, by file name), ``url`` or ``name=url``."""
    found: list[tuple[str | None, str]] = []
    for entry in (entry.strip() for entry in entries):
        if entry == "all":
            found.extend((None, path.name) for path in store())
            continue
        name, sep, url = entry.partition("=")
        if not sep:
            name, url = "", entry
        if not url.strip():
            raise ConfigError(f"{key}: {entry!r} names no archive")
        found.append((name.strip() or None, url.strip()))
    return found


def model_store_lister(config: ServerConfig) -> Callable[[], list[Path]]:
    """What ``load_models=all`` lists: the model store's archives."""
    def store() -> list[Path]:
        if config.model_store is None:
            raise ConfigError("load_models=all needs a model store (--model-store)")
        return archives.list_store(config.model_store)
    return store


def startup_archives(config: ServerConfig) -> list[Path]:
    """The local archives (files or folders) of the startup models, found as their
    registration will find them (``archive.resolve_url``); what is downloaded or cannot be
    found is left to registration, which reports it."""
    try:
        entries = startup_entries(config.load_models, "load_models",
                                  model_store_lister(config))
    except (ConfigError, OSError):
        return []
    found: list[Path] = []
    for _, url in entries[:MAX_PRELOADED_ARCHIVES]:
        try:
            found.append(archives.resolve_url(url, config.model_store, archives.OPERATOR_URLS))
        except ServeError:  # an http(s) url (downloaded later), or no such archive
            continue
    return found


def early_forkserver(config: ServerConfig) -> Launch | None:
    """A fork server started now for the startup models' workers, which the server's loader
    adopts (None: no startup model, workers start fresh, or it could not be started: it
    starts on the first fork then, as without startup models)."""
    if not config.load_models or config.worker_start != "fork" or fork_unsupported():
        return None
    found = startup_archives(config)
    if not found:
        return None
    try:
        started = launch(sys.executable, worker_environment(config.blacklist_env_vars),
                         config.fork_preload, found)
    except ForkUnavailable as exc:
        logger.info("the fork server could not be started early: %s", exc)
        return None
    logger.info("fork server started early (pid %d): it imports what the startup models' "
                "handlers need while the server starts", started.process.pid)
    return started
