"""TorchServe's ``--log-config``: a log4j2 XML file, mapped onto Python logging.

TorchServe's users (and SageMaker's toolkit, which always passes its own file) configure its
Java logging with log4j2. ``read`` parses such a file into appenders and loggers (no side
effect: a bad file is a ``ConfigError`` before anything starts); ``configure`` makes the
Python handlers and loggers from them. What maps:

* Loggers, by TorchServe's names: ``Root`` is Python's root logger; ``org.pytorch.serve``
  (TorchServe's own code) is ours, ``batchserve`` and ``frontend``; ``ACCESS_LOG``,
  ``MODEL_LOG``, ``TS_METRICS`` and ``MODEL_METRICS`` are the Python loggers of those names,
  through which the server then writes its access log, its workers' output and its two metric
  logs (``ServerLogs``, ``MetricLog``) instead of into ``log_location``. Any other name sets
  the Python logger of that name. Levels (``off`` and ``all`` too), ``additivity`` (Python's
  ``propagate``: as in log4j, an appender named by a logger and by its parent writes an
  event twice; TorchServe's default file names ts_log under both ``org.pytorch.serve`` and
  ``Root``, so its ts_log.log holds each server line twice, in TorchServe too), an
  ``AppenderRef``'s level. ``AsyncLogger`` and ``AsyncRoot`` are taken as the others.
* Appenders: ``Console`` (``SYSTEM_OUT``, ``SYSTEM_ERR``), ``File``, ``RollingFile`` (its
  ``SizeBasedTriggeringPolicy`` and ``DefaultRolloverStrategy max`` as a
  ``RotatingFileHandler``'s ``maxBytes`` and ``backupCount``), their ``RandomAccess`` twins,
  ``Null``; a ``ThresholdFilter`` on one. File names are relative to the working directory, as
  log4j's, with ``${env:NAME:-default}``, ``${sys:NAME:-default}`` and ``<Properties>``
  substituted; their folders are made.
* ``PatternLayout``: ``log4j_pattern``.

What does not map is said once, in one log line each, after the logging is set up: another
appender (``Routing``, ``Async``, ``Socket``, ...) is skipped; rolling by time and
``filePattern``'s names and compression are not done (backups are ``<file>.1`` ...); another
layout, or a pattern with a conversion not translated, writes the server's own format.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from frontend.errors import ConfigError
from frontend.observe.log4j_pattern import Translation, Untranslatable, translate
from frontend.observe.logs import TS_ACCESS_LOGGER, TS_MODEL_LOGGER
from frontend.observe.metric_log import TS_METRICS_LOGGER, TS_MODEL_METRICS_LOGGER

logger = logging.getLogger(__name__)

#: Above every level: log4j's ``off``.
OFF = logging.CRITICAL + 10
LEVELS = {"off": OFF, "fatal": logging.CRITICAL, "error": logging.ERROR,
          "warn": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG, "trace": 5,
          "all": 1}
#: TorchServe's loggers -> the Python loggers that do their work here ("" is the root).
TORCHSERVE_LOGGERS: dict[str, tuple[str, ...]] = {
    "": ("",),
    "org.pytorch.serve": ("batchserve", "frontend"),
    "ACCESS_LOG": (TS_ACCESS_LOGGER,),
    "MODEL_LOG": (TS_MODEL_LOGGER,),
    "TS_METRICS": (TS_METRICS_LOGGER,),
    "MODEL_METRICS": (TS_MODEL_METRICS_LOGGER,),
}
#: log4j2's root logger when a configuration has none: level error, to the console.
_DEFAULT_ROOT_PATTERN = "%d{HH:mm:ss.SSS} [%t] %-5level %logger{36} - %msg%n"
#: The Java system properties TorchServe sets for its log4j2 file (ConfigManager): the
#: environment's LOG_LOCATION and METRICS_LOCATION, else logs.
_SYSTEM_PROPERTIES = ("LOG_LOCATION", "METRICS_LOCATION")


@dataclass(frozen=True)
class Appender:
    """One appender, as it will be written here."""

    name: str
    #: console, file (File, RollingFile and their RandomAccess twins) or null
    kind: str
    #: console: SYSTEM_OUT or SYSTEM_ERR
    target: str = "SYSTEM_OUT"
    path: Path | None = None
    append: bool = True
    #: Rolled when it would pass this size (0: never): RollingFile's SizeBasedTriggeringPolicy
    max_bytes: int = 0
    #: How many rolled files are kept: DefaultRolloverStrategy's max.
    backup_count: int = 0
    #: createOnDemand: the file is made at its first line.
    delay: bool = False
    #: Its PatternLayout; None: the server's own format.
    layout: Translation | None = None
    #: Its ThresholdFilter's level.
    level: int | None = None


@dataclass(frozen=True)
class LoggerConfig:
    """One ``<Logger>`` (or ``<Root>``, named "")."""

    name: str
    level: int | None
    additive: bool
    #: (appender name, the reference's own level)
    refs: tuple[tuple[str, int | None], ...]


@dataclass(frozen=True)
class Log4jConfig:
    path: Path
    appenders: Mapping[str, Appender]
    loggers: tuple[LoggerConfig, ...]
    #: What does not map, one line each (logged by ``configure``).
    notes: tuple[str, ...] = field(default=())


def is_log4j_xml(path: Path) -> bool:
    """Whether ``--log-config`` is an XML file (log4j2's; ours is Python's ini format)."""
    return _head(path).lstrip().startswith("<")


def is_log4j_properties(path: Path) -> bool:
    """Whether ``--log-config`` is a log4j (1 or 2) properties file: no ``[section]`` of
    Python's ini format, and log4j's keys."""
    head = _head(path)
    return not re.search(r"^\s*\[", head, re.M) and bool(re.search(
        r"^\s*(log4j\.|appenders?\s*[.=]|loggers?\s*[.=]|rootLogger|status\s*=)", head, re.M))


def _head(path: Path) -> str:
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            return fh.read(4096)
    except OSError:
        return ""  # whoever reads it next says what is wrong with it


# ---- reading ----------------------------------------------------------------------------

def read(path: Path, environ: Mapping[str, str] | None = None) -> Log4jConfig:
    """Parse a log4j2 XML file; a file that cannot be read, is not XML or not log4j2's
    configuration is a ``ConfigError`` naming it."""
    environ = os.environ if environ is None else environ
    try:
        # The standard library's parser: the file is the operator's own configuration, named
        # on the command line (trusted input, as config.properties is); and ElementTree
        # fetches no external entity.
        root = ElementTree.parse(path).getroot()
    except OSError as exc:
        raise ConfigError(f"--log-config {path}: cannot read it: {exc.strerror}") from exc
    except ElementTree.ParseError as exc:
        raise ConfigError(f"--log-config {path}: not well-formed XML: {exc}") from exc
    namespace = str(root.tag).partition("}")[0].lstrip("{") if "}" in str(root.tag) else ""
    if _tag(root) != "configuration" or (namespace and "log4j/2" not in namespace):
        raise ConfigError(f"--log-config {path}: not a log4j2 configuration (its root element "
                          f"is <{root.tag}>, log4j2's is <Configuration>)")
    return _Reader(path, environ).read(root)


class _Reader:
    def __init__(self, path: Path, environ: Mapping[str, str]) -> None:
        self.path = path
        self.environ = environ
        self.properties: dict[str, str] = {}
        self.system = {name: environ.get(name) or "logs" for name in _SYSTEM_PROPERTIES}
        self.system.update({"user.dir": os.getcwd(), "user.home": str(Path.home()),
                            "java.io.tmpdir": environ.get("TEMP") or "/tmp"})
        #: note -> the names it is about, in order (one log line per note)
        self.notes: dict[str, list[str]] = {}
        #: The appenders not supported (a reference to one is not an error).
        self.skipped: set[str] = set()

    def note(self, text: str, name: str = "") -> None:
        names = self.notes.setdefault(text, [])
        if name and name not in names:
            names.append(name)

    def read(self, root: ElementTree.Element) -> Log4jConfig:
        if _attributes(root).get("monitorinterval"):
            self.note("monitorInterval: the file is read once, at start")
        appenders: dict[str, Appender] = {}
        loggers: list[LoggerConfig] = []
        for section in root:
            kind = _tag(section)
            if kind == "properties":
                for prop in section:
                    attrs = _attributes(prop)
                    if _tag(prop) == "property" and "name" in attrs:
                        value = attrs.get("value", prop.text or "")
                        self.properties[attrs["name"]] = self.substitute(value.strip())
            elif kind == "appenders":
                for element in section:
                    appender = self.appender(element)
                    if appender is not None:
                        appenders[appender.name] = appender
            elif kind == "loggers":
                loggers.extend(self.logger(element, appenders) for element in section
                               if _tag(element) in ("logger", "asynclogger", "root",
                                                    "asyncroot"))
            else:
                self.note("log4j2 configuration elements not applied here", section.tag)
        if not any(config.name == "" for config in loggers):
            # log4j2's own default then: level error, to the console.
            appenders["DefaultConsole"] = Appender(
                "DefaultConsole", "console", layout=translate(_DEFAULT_ROOT_PATTERN))
            loggers.append(LoggerConfig("", logging.ERROR, True, (("DefaultConsole", None),)))
            self.note("no <Root> logger: log4j2's default root (level error, to the console)")
        notes = tuple(f"{text}: {', '.join(names)}" if names else text
                      for text, names in self.notes.items())
        return Log4jConfig(self.path, appenders, tuple(loggers), notes)

    # -- appenders --

    def appender(self, element: ElementTree.Element) -> Appender | None:
        attrs = self.attributes(element)
        kind = _tag(element)
        if kind == "appender":  # log4j2's strict format: <Appender type="Console" ...>
            kind = attrs.get("type", "").lower()
        name = attrs.get("name", "")
        if not name:
            raise ConfigError(f"--log-config {self.path}: an appender <{element.tag}> has no "
                              "name")
        if kind == "null":
            return Appender(name, "null")
        supported = ("console", "file", "randomaccessfile", "rollingfile",
                     "rollingrandomaccessfile")
        if kind not in supported:
            self.note("appenders not supported here, skipped (their loggers write to their "
                      "other appenders)", f"{name} ({element.tag})")
            self.skipped.add(name)
            return None
        layout = self.layout(element, name)
        level = self.threshold(element, name)
        if kind == "console":
            target = attrs.get("target", "SYSTEM_OUT").upper()
            if target not in ("SYSTEM_OUT", "SYSTEM_ERR"):
                raise ConfigError(f"--log-config {self.path}: appender {name}: target "
                                  f"{attrs['target']!r}: expected SYSTEM_OUT or SYSTEM_ERR")
            return Appender(name, "console", target=target, layout=layout, level=level)
        if not attrs.get("filename"):
            raise ConfigError(f"--log-config {self.path}: appender {name} ({element.tag}) has "
                              "no fileName")
        rolling = kind.startswith("rolling")
        max_bytes, backups = self.rolling(element, name) if rolling else (0, 0)
        if rolling and attrs.get("filepattern"):
            self.note("rolled files are named <fileName>.1, .2, ... (newest first) and not "
                      "compressed, not by filePattern", name)
        return Appender(name, "file", path=Path(attrs["filename"]),
                        append=_flag(attrs.get("append"), True), max_bytes=max_bytes,
                        backup_count=backups,
                        delay=_flag(attrs.get("createondemand"), False), layout=layout,
                        level=level)

    def rolling(self, element: ElementTree.Element, name: str) -> tuple[int, int]:
        """A RollingFile's (maxBytes, backupCount)."""
        max_bytes, backups = 0, 7  # log4j2's DefaultRolloverStrategy keeps 7
        policies = [child for part in element for child in
                    (list(part) if _tag(part) == "policies" else [part])]
        for policy in policies:
            kind = _tag(policy)
            attrs = self.attributes(policy)
            if kind == "sizebasedtriggeringpolicy":
                max_bytes = self.size(attrs.get("size", "10 MB"), name)
            elif kind in ("timebasedtriggeringpolicy", "crontriggeringpolicy"):
                self.note("rolling by time is not done (by size only, where a size is given)",
                          name)
            elif kind == "onstartuptriggeringpolicy":
                self.note("rolling at start is not done", name)
            elif kind == "defaultrolloverstrategy":
                if "max" in attrs:
                    backups = self.number(attrs["max"], f"{name}'s DefaultRolloverStrategy max")
                if any(True for _ in policy):
                    self.note("DefaultRolloverStrategy actions (Delete, ...) are not done",
                              name)
            elif kind.endswith("layout") or kind.endswith("filter") or kind == "filters":
                continue
            else:
                self.note("rolling settings not applied here", f"{name}: {policy.tag}")
        return max_bytes, backups

    def layout(self, element: ElementTree.Element, name: str) -> Translation | None:
        layouts = [child for child in element
                   if _tag(child).endswith("layout") or _tag(child) == "layout"]
        if not layouts:
            return translate("%m%n")  # log4j2's default layout for these appenders
        layout = layouts[0]
        attrs = self.attributes(layout)
        kind = attrs.get("type", "").lower() if _tag(layout) == "layout" else _tag(layout)
        if kind != "patternlayout":
            self.note("layouts not translated: these appenders write the server's own format",
                      f"{name} ({attrs.get('type') or layout.tag})")
            return None
        pattern = attrs.get("pattern")
        if pattern is None:
            nested = [child for child in layout if _tag(child) == "pattern"]
            pattern = self.substitute(nested[0].text or "") if nested else "%m%n"
        try:
            return translate(pattern)
        except Untranslatable as exc:
            self.note("PatternLayout conversions not translated: these appenders write the "
                      "server's own format", f"{name} ({exc.args[0]})")
            return None

    def threshold(self, element: ElementTree.Element, name: str) -> int | None:
        """The level of an appender's ThresholdFilter (others are noted, not applied)."""
        filters = [child for part in element for child in
                   (list(part) if _tag(part) == "filters" else [part])
                   if _tag(child).endswith("filter")]
        level = None
        for one in filters:
            attrs = self.attributes(one)
            if (_tag(one) == "thresholdfilter" and attrs.get("onmatch", "NEUTRAL").upper()
                    in ("ACCEPT", "NEUTRAL") and attrs.get("onmismatch", "DENY").upper()
                    == "DENY"):
                level = self.level(attrs.get("level", "error"), f"{name}'s ThresholdFilter")
            else:
                self.note("filters not applied here", f"{name} ({one.tag})")
        return level

    # -- loggers --

    def logger(self, element: ElementTree.Element, appenders: Mapping[str, Appender]
               ) -> LoggerConfig:
        attrs = self.attributes(element)
        is_root = _tag(element) in ("root", "asyncroot")
        name = "" if is_root else attrs.get("name", "")
        if not is_root and not name:
            raise ConfigError(f"--log-config {self.path}: a <{element.tag}> has no name")
        shown = name or "Root"
        level = self.level(attrs["level"], f"logger {shown}") if "level" in attrs else (
            logging.ERROR if is_root else None)  # log4j2's root defaults to error
        refs: list[tuple[str, int | None]] = []
        for child in element:
            child_attrs = self.attributes(child)
            if _tag(child) == "appenderref":
                ref = child_attrs.get("ref", "")
                if ref in appenders:
                    ref_level = child_attrs.get("level")
                    refs.append((ref, None if ref_level is None else self.level(
                        ref_level, f"logger {shown}'s AppenderRef {ref}")))
                elif ref not in self.skipped:
                    self.note("AppenderRef to no appender of that name (ignored, as log4j2 "
                              "does)", f"{shown} -> {ref}")
            elif _tag(child).endswith("filter") or _tag(child) == "filters":
                self.note("filters not applied here", f"logger {shown} ({child.tag})")
        if name not in TORCHSERVE_LOGGERS:
            self.note("loggers that are none of TorchServe's (Root, org.pytorch.serve, "
                      "ACCESS_LOG, MODEL_LOG, TS_METRICS, MODEL_METRICS) set the Python "
                      "loggers of their names", name)
        return LoggerConfig(name, level, _flag(attrs.get("additivity"), True), tuple(refs))

    # -- values --

    def attributes(self, element: ElementTree.Element) -> dict[str, str]:
        return {key: self.substitute(value) for key, value in _attributes(element).items()}

    def level(self, text: str, what: str) -> int:
        try:
            return LEVELS[text.strip().lower()]
        except KeyError:
            raise ConfigError(f"--log-config {self.path}: {what}: level {text!r}: expected "
                              f"one of {', '.join(LEVELS)}") from None

    def size(self, text: str, name: str) -> int:
        """log4j2's file size: ``100 MB``, ``10MB``, ``1.5 GB``, ``512 KB``, ``4096``."""
        match = re.fullmatch(r"\s*(\d+(?:[.,]\d+)?)\s*([KMGT]?)B?\s*", text, re.I)
        if match is None:
            raise ConfigError(f"--log-config {self.path}: appender {name}: size {text!r}: "
                              "expected a number of bytes, KB, MB or GB")
        scale = 1024 ** " KMGT".index(match.group(2).upper() or " ")
        return int(float(match.group(1).replace(",", ".")) * scale)

    def number(self, text: str, what: str) -> int:
        if not text.strip().isdigit():
            raise ConfigError(f"--log-config {self.path}: {what} {text!r}: expected a whole "
                              "number")
        return int(text)

    def substitute(self, text: str) -> str:
        """log4j2's lookups in a value: ``${name}`` (a <Property>), ``${env:NAME}``,
        ``${sys:NAME}``, each with an optional ``:-default``; ``$${`` is a literal ``${``.
        Any other lookup, or one with no value and no default, stays as written (log4j2)."""
        out: list[str] = []
        at = 0
        while True:
            start = text.find("${", at)
            if start < 0:
                out.append(text[at:])
                return "".join(out)
            if start > 0 and text[start - 1] == "$":
                out.append(text[at:start - 1] + "${")
                at = start + 2
                continue
            end, depth = start + 2, 1
            while end < len(text) and depth:
                if text.startswith("${", end):
                    depth, end = depth + 1, end + 2
                    continue
                depth -= text[end] == "}"
                end += 1
            if depth:  # unclosed: kept as written
                out.append(text[at:])
                return "".join(out)
            value = self.lookup(text[start + 2:end - 1])
            out.append(text[at:start])
            out.append(text[start:end] if value is None else value)
            at = end

    def lookup(self, inner: str) -> str | None:
        key, has_default, default = inner.partition(":-")
        prefix, colon, name = key.partition(":")
        if not colon:
            value = self.properties.get(key)
        elif prefix == "env":
            value = self.environ.get(name)
        elif prefix == "sys":
            value = self.system.get(name)
        else:
            value = None
        if value is None and has_default:
            return self.substitute(default)
        return value


def _tag(element: ElementTree.Element) -> str:
    """An element's name, lower case and without a namespace (log4j2 matches any case)."""
    return str(element.tag).rpartition("}")[2].lower()


def _attributes(element: ElementTree.Element) -> dict[str, str]:
    return {key.lower(): value for key, value in element.attrib.items()}


def _flag(text: str | None, default: bool) -> bool:
    return default if text is None else text.strip().lower() == "true"


# ---- configuring ------------------------------------------------------------------------

def python_loggers(name: str) -> tuple[str, ...]:
    """The Python loggers a log4j2 logger of this name sets."""
    return TORCHSERVE_LOGGERS.get(name, (name,))


def configure(config: Log4jConfig, stdout: TextIO, stderr: TextIO,
              fallback: logging.Formatter) -> None:
    """Set Python's logging as ``config`` says: handlers for its appenders (its files made
    now, as log4j2 makes them at start), its loggers' levels, handlers and propagation. Then
    log, once, what did not map. ``fallback`` formats for a layout not translated."""
    handlers = {name: _handler(appender, stdout, stderr, fallback, config.path)
                for name, appender in config.appenders.items()}
    for spec in config.loggers:
        chosen: list[logging.Handler] = []
        for ref, level in spec.refs:
            chosen.append(handlers[ref] if level is None else _LevelGate(handlers[ref], level))
        if spec.name == "" and not chosen:
            # Nothing at all, as log4j2 writes; not Python's last resort (warnings to stderr).
            chosen.append(logging.NullHandler())
        for python_name in python_loggers(spec.name):
            target = logging.getLogger(python_name or None)
            target.handlers[:] = chosen
            target.setLevel(spec.level if spec.level is not None else logging.NOTSET)
            target.propagate = spec.additive
    logger.info("--log-config %s: log4j2's configuration, mapped onto Python logging",
                config.path)
    for note in config.notes:
        logger.info("--log-config %s: not mapped: %s", config.path, note)


def _handler(appender: Appender, stdout: TextIO, stderr: TextIO,
             fallback: logging.Formatter, source: Path) -> logging.Handler:
    handler: logging.Handler
    if appender.kind == "null":
        return logging.NullHandler()
    if appender.kind == "console":
        handler = logging.StreamHandler(stdout if appender.target == "SYSTEM_OUT" else stderr)
    else:
        assert appender.path is not None
        try:
            appender.path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.handlers.RotatingFileHandler(
                appender.path, mode="a" if appender.append else "w",
                maxBytes=appender.max_bytes, backupCount=appender.backup_count,
                encoding="utf-8", delay=appender.delay)
        except OSError as exc:
            raise ConfigError(f"--log-config {source}: appender {appender.name}: cannot write "
                              f"{appender.path}: {exc.strerror}") from exc
    if appender.layout is not None:
        handler.setFormatter(appender.layout.formatter)
        handler.terminator = appender.layout.terminator
    else:
        handler.setFormatter(fallback)
    if appender.level is not None:
        handler.setLevel(appender.level)
    return handler


class _LevelGate(logging.Handler):
    """An ``AppenderRef`` with a level: passes a logger's records at or above it on to the
    appender's handler (which other loggers share)."""

    def __init__(self, target: logging.Handler, level: int) -> None:
        super().__init__(level)
        self.target = target

    def handle(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level:
            self.target.handle(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:  # pragma: no cover - handle() passes
        self.target.handle(record)
