"""log4j2's ``PatternLayout`` as a Python ``logging.Formatter``.

A pattern such as TorchServe's ``%d{ISO8601} [%-5p] %t %c - %m%n`` is compiled once into a
list of parts (a literal, or a function of the record), each with log4j's format modifier
(``%-5p``: at least 5 wide, left-justified; ``%.30c``: at most 30, cut from the left). The
conversions translated are the common ones: the date (``%d``, ``%d{ISO8601}`` and log4j's
other named formats, ``%d{<SimpleDateFormat pattern>}``, an optional ``{timezone}``), the
level (``%p`` / ``%level``, in log4j's names: ``WARN``, ``FATAL``), the thread (``%t``), the
logger (``%c`` / ``%logger``, with a ``{precision}``), the message (``%m`` / ``%msg``), the
line end (``%n``), ``%%``, and the location ones (``%C %M %L %F %l``, as Python has them).
What else a pattern holds (``%highlight``, ``%replace``, ...) makes ``translate`` raise
``Untranslatable`` naming it: the caller falls back to its own format and says so.

The message is the record's ``getMessage()``: escaped (``EscapingLogRecord``) whatever the
pattern. A record's traceback is written after its line, as log4j writes a throwable it was
not told where to put (``%ex`` is accepted and placed there).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo

Part = Callable[[logging.LogRecord], str]

#: log4j's level names for Python's levels (Python says WARNING and CRITICAL).
_LEVEL_NAMES = {logging.CRITICAL: "FATAL", logging.ERROR: "ERROR", logging.WARNING: "WARN",
                logging.INFO: "INFO", logging.DEBUG: "DEBUG", 5: "TRACE"}

#: ``%d{NAME}``: log4j2's named date formats (its FixedDateFormat.FixedFormat).
NAMED_DATES = {
    "DEFAULT": "yyyy-MM-dd HH:mm:ss,SSS",
    "DEFAULT_PERIOD": "yyyy-MM-dd HH:mm:ss.SSS",
    "DEFAULT_MICROS": "yyyy-MM-dd HH:mm:ss,nnnnnn",
    "DEFAULT_NANOS": "yyyy-MM-dd HH:mm:ss,nnnnnnnnn",
    "ISO8601": "yyyy-MM-dd'T'HH:mm:ss,SSS",
    "ISO8601_PERIOD": "yyyy-MM-dd'T'HH:mm:ss.SSS",
    "ISO8601_PERIOD_MICROS": "yyyy-MM-dd'T'HH:mm:ss.nnnnnn",
    "ISO8601_BASIC": "yyyyMMdd'T'HHmmss,SSS",
    "ISO8601_BASIC_PERIOD": "yyyyMMdd'T'HHmmss.SSS",
    "ISO8601_OFFSET_DATE_TIME_HH": "yyyy-MM-dd'T'HH:mm:ss,SSSX",
    "ISO8601_OFFSET_DATE_TIME_HHMM": "yyyy-MM-dd'T'HH:mm:ss,SSSXX",
    "ISO8601_OFFSET_DATE_TIME_HHCMM": "yyyy-MM-dd'T'HH:mm:ss,SSSXXX",
    "ABSOLUTE": "HH:mm:ss,SSS",
    "ABSOLUTE_PERIOD": "HH:mm:ss.SSS",
    "ABSOLUTE_MICROS": "HH:mm:ss,nnnnnn",
    "ABSOLUTE_NANOS": "HH:mm:ss,nnnnnnnnn",
    "COMPACT": "yyyyMMddHHmmssSSS",
    "DATE": "dd MMM yyyy HH:mm:ss,SSS",
    "DATE_PERIOD": "dd MMM yyyy HH:mm:ss.SSS",
    "US_MONTH_DAY_YEAR2_TIME": "dd/MM/yy HH:mm:ss.SSS",
    "US_MONTH_DAY_YEAR4_TIME": "dd/MM/yyyy HH:mm:ss.SSS",
}


class Untranslatable(ValueError):
    """A pattern holds what this translation does not write; ``args[0]`` names it."""


@dataclass(frozen=True)
class Translation:
    """A pattern compiled: its formatter, and what ends each line (``%n`` at its end: a
    newline; none: lines run on, as log4j writes them)."""

    formatter: logging.Formatter
    terminator: str


class PatternFormatter(logging.Formatter):
    """Formats a record by a compiled log4j2 pattern (``translate``)."""

    def __init__(self, parts: tuple[Part, ...]) -> None:
        super().__init__()
        self._parts = parts

    def usesTime(self) -> bool:
        return False  # the date parts format the record's time themselves

    def formatMessage(self, record: logging.LogRecord) -> str:
        return "".join([part(record) for part in self._parts])


def translate(pattern: str) -> Translation:
    """Compile a log4j2 PatternLayout ``pattern``; raises ``Untranslatable``."""
    pieces = _compile(pattern)
    terminator = ""
    if pieces and isinstance(pieces[-1], str) and pieces[-1].endswith("\n"):
        # The handler writes the line end (and a traceback goes before it).
        pieces[-1], terminator = pieces[-1][:-1], "\n"
    parts = tuple(_constant(piece) if isinstance(piece, str) else piece
                  for piece in pieces if piece != "")
    return Translation(PatternFormatter(parts), terminator)


# ---- the pattern's grammar --------------------------------------------------------------

_MODIFIER = re.compile(r"(-)?(\d+)?(?:\.(-)?(\d+))?")


def _compile(pattern: str) -> list[str | Part]:
    """The pattern's pieces: literal text (consecutive literals joined) and conversions."""
    pieces: list[str | Part] = []
    literal: list[str] = []
    at = 0
    while at < len(pattern):
        char = pattern[at]
        if char != "%":
            literal.append(char)
            at += 1
            continue
        if pattern.startswith("%%", at):
            literal.append("%")
            at += 2
            continue
        if pattern.startswith("%n", at):
            literal.append("\n")
            at += 2
            continue
        modifier = _MODIFIER.match(pattern, at + 1)
        assert modifier is not None  # every part of it is optional
        at = modifier.end()
        name = _conversion_name(pattern, at)
        at += len(name)
        options: list[str] = []
        while at < len(pattern) and pattern[at] == "{":
            option, at = _braced(pattern, at)
            options.append(option)
        if literal:
            pieces.append("".join(literal))
            literal = []
        pieces.append(_modified(_CONVERSIONS[name](options), *modifier.groups()))
    if literal:
        pieces.append("".join(literal))
    return pieces


def _conversion_name(pattern: str, at: int) -> str:
    """The longest conversion name known at ``at`` (log4j matches the longest)."""
    word = re.match(r"[A-Za-z]*", pattern[at:])
    run = word.group() if word else ""
    for end in range(len(run), 0, -1):
        if run[:end] in _CONVERSIONS:
            return run[:end]
    raise Untranslatable(f"%{run or pattern[at:at + 1]}")


def _braced(pattern: str, at: int) -> tuple[str, int]:
    """The option in braces at ``at`` (nested braces kept) and where it ends."""
    depth = 0
    for end in range(at, len(pattern)):
        if pattern[end] == "{":
            depth += 1
        elif pattern[end] == "}":
            depth -= 1
            if depth == 0:
                return pattern[at + 1:end], end + 1
    raise Untranslatable(f"an unclosed brace in {pattern[at:at + 20]!r}")


def _modified(part: Part, left: str | None, minimum: str | None, from_end: str | None,
              maximum: str | None) -> Part:
    """``part`` with a format modifier: padded to ``minimum`` (on the right with ``-``),
    cut to ``maximum`` (its leftmost characters dropped, or its rightmost with ``.-``)."""
    if minimum is None and maximum is None:
        return part
    width = int(minimum) if minimum else 0
    limit = int(maximum) if maximum else None

    def formatted(record: logging.LogRecord) -> str:
        text = part(record)
        if limit is not None and len(text) > limit:
            text = text[:limit] if from_end else text[len(text) - limit:]
        return text.ljust(width) if left else text.rjust(width)

    return formatted


def _constant(text: str) -> Part:
    return lambda _record: text


# ---- conversions ------------------------------------------------------------------------

def _level(options: list[str]) -> Part:
    _no_options("%p", options)
    names = _LEVEL_NAMES
    return lambda record: names.get(record.levelno) or record.levelname


def _message(options: list[str]) -> Part:
    _no_options("%m", options)
    # Formatter.format set it from getMessage(): escaped (EscapingLogRecord).
    return lambda record: record.message


def _logger(options: list[str]) -> Part:
    abbreviate = _precision(options[0] if options else "")
    return lambda record: abbreviate(record.name)


def _class(options: list[str]) -> Part:
    abbreviate = _precision(options[0] if options else "")
    return lambda record: abbreviate(record.module)


def _precision(option: str) -> Callable[[str], str]:
    """log4j's ``%c{precision}``: ``N`` keeps the rightmost N dotted parts, ``-N`` drops the
    leftmost N, ``N.`` shortens every part but the last to N characters."""
    option = option.strip()
    if not option:
        return lambda name: name
    if re.fullmatch(r"-?\d+", option):
        count = int(option)
        if count > 0:
            return lambda name: ".".join(name.split(".")[-count:])
        return lambda name: ".".join(name.split(".")[-count:]) or name
    short = re.fullmatch(r"(\d+)\.", option)
    if short:
        keep = int(short.group(1))
        return lambda name: ".".join([*(p[:keep] for p in name.split(".")[:-1]),
                                      name.split(".")[-1]])
    raise Untranslatable(f"%c{{{option}}}")


def _thread(options: list[str]) -> Part:
    _no_options("%t", options)
    return lambda record: record.threadName or ""


def _thread_id(options: list[str]) -> Part:
    _no_options("%T", options)
    return lambda record: str(record.thread)


def _attribute(name: str) -> Callable[[list[str]], Part]:
    def conversion(options: list[str]) -> Part:
        _no_options(f"%{name}", options)
        return lambda record: str(getattr(record, name))

    return conversion


def _location(options: list[str]) -> Part:
    _no_options("%l", options)
    return lambda record: f"{record.module}.{record.funcName}({record.filename}:{record.lineno})"


def _relative(options: list[str]) -> Part:
    _no_options("%r", options)
    return lambda record: str(int(record.relativeCreated))


def _throwable(_options: list[str]) -> Part:
    # Python's Formatter writes the traceback after the line; log4j's options on it (depth,
    # filters) are not applied.
    return lambda _record: ""


def _context_map(options: list[str]) -> Part:
    # No thread context (MDC) here: log4j writes "" for a key it lacks, {} for the whole map.
    text = "" if options else "{}"
    return lambda _record: text


def _context_stack(_options: list[str]) -> Part:
    return lambda _record: "[]"


def _date(options: list[str]) -> Part:
    layout = NAMED_DATES["DEFAULT"]
    if options and options[0].strip():
        given = options[0].strip()
        layout = NAMED_DATES.get(given, given)
    zone = _zone(options[1].strip()) if len(options) > 1 else None
    if layout == "UNIX":
        return lambda record: str(int(record.created))
    if layout == "UNIX_MILLIS":
        return lambda record: str(int(record.created * 1000))
    fields = _date_fields(layout)

    def formatted(record: logging.LogRecord) -> str:
        moment = datetime.fromtimestamp(record.created, zone or None)
        if zone is None:
            moment = moment.astimezone()  # local time, with its offset for z, Z and X
        return "".join([field(moment) for field in fields])

    return formatted


def _zone(name: str) -> tzinfo | None:
    if name.upper() in ("UTC", "GMT", "Z"):
        return timezone.utc
    offset = re.fullmatch(r"(?:GMT|UTC)?([+-])(\d\d):?(\d\d)", name)
    if offset:
        sign = -1 if offset.group(1) == "-" else 1
        return timezone(sign * timedelta(hours=int(offset.group(2)),
                                         minutes=int(offset.group(3))))
    try:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise Untranslatable(f"the time zone {name!r} of %d") from None


DateField = Callable[[datetime], str]


def _date_fields(layout: str) -> list[DateField]:
    """A Java SimpleDateFormat layout (as log4j2's %d takes it) as functions of a time."""
    fields: list[DateField] = []
    at = 0
    while at < len(layout):
        char = layout[at]
        if char == "'":
            text, at = _quoted(layout, at)
            fields.append(_fixed(text))
            continue
        if not char.isalpha():
            fields.append(_fixed(char))
            at += 1
            continue
        run = len(layout[at:]) - len(layout[at:].lstrip(char))
        fields.append(_date_letter(char, run, layout))
        at += run
    return fields


def _quoted(layout: str, at: int) -> tuple[str, int]:
    """The text quoted at ``at`` (``''`` is a quote, within quotes too) and where it ends."""
    if layout.startswith("''", at):
        return "'", at + 2
    text: list[str] = []
    at += 1
    while True:
        end = layout.find("'", at)
        if end < 0:
            raise Untranslatable(f"an unclosed quote in %d{{{layout}}}")
        text.append(layout[at:end])
        if not layout.startswith("''", end):
            return "".join(text), end + 1
        text.append("'")
        at = end + 2


def _fixed(text: str) -> DateField:
    return lambda _moment: text


_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _date_letter(char: str, run: int, layout: str) -> DateField:
    def number(get: Callable[[datetime], int]) -> DateField:
        return lambda moment: f"{get(moment):0{run}d}"

    if char in "yu":
        if run == 2:
            return lambda moment: f"{moment.year % 100:02d}"
        return number(lambda moment: moment.year)
    if char in "ML":
        if run >= 4:
            return lambda moment: _MONTHS[moment.month - 1]
        if run == 3:
            return lambda moment: _MONTHS[moment.month - 1][:3]
        return number(lambda moment: moment.month)
    simple: dict[str, Callable[[datetime], int]] = {
        "d": lambda moment: moment.day,
        "H": lambda moment: moment.hour,
        "k": lambda moment: moment.hour or 24,
        "K": lambda moment: moment.hour % 12,
        "h": lambda moment: moment.hour % 12 or 12,
        "m": lambda moment: moment.minute,
        "s": lambda moment: moment.second,
        "D": lambda moment: moment.timetuple().tm_yday,
    }
    if char in simple:
        return number(simple[char])
    if char in "Sn":  # fractions of the second: S milliseconds, n log4j's finer digits
        digits = run

        def fraction(moment: datetime) -> str:
            micros = f"{moment.microsecond:06d}"
            return micros[:digits] if digits <= 6 else micros + "0" * (digits - 6)

        return fraction
    if char == "a":
        return lambda moment: "AM" if moment.hour < 12 else "PM"
    if char == "E":
        if run >= 4:
            return lambda moment: _DAYS[moment.weekday()]
        return lambda moment: _DAYS[moment.weekday()][:3]
    if char == "z":
        return lambda moment: moment.tzname() or ""
    if char in "ZX":
        return _offset(char, run)
    raise Untranslatable(f"the date letter {char!r} in %d{{{layout}}}")


def _offset(char: str, run: int) -> DateField:
    """``Z``: +0100; ``X``: +01, ``XX``: +0100, ``XXX``: +01:00 (``X`` writes UTC as Z)."""

    def formatted(moment: datetime) -> str:
        offset = moment.utcoffset() or timedelta(0)
        if char == "X" and not offset:
            return "Z"
        minutes = int(offset.total_seconds()) // 60
        sign = "-" if minutes < 0 else "+"
        hours, minutes = divmod(abs(minutes), 60)
        if char == "X" and run == 1:
            return f"{sign}{hours:02d}"
        separator = ":" if char == "X" and run >= 3 else ""
        return f"{sign}{hours:02d}{separator}{minutes:02d}"

    return formatted


def _no_options(name: str, options: list[str]) -> None:
    if options:
        raise Untranslatable(f"{name}{{{options[0]}}}")


_CONVERSIONS: dict[str, Callable[[list[str]], Part]] = {
    **dict.fromkeys(("d", "date"), _date),
    **dict.fromkeys(("p", "level"), _level),
    **dict.fromkeys(("m", "msg", "message"), _message),
    **dict.fromkeys(("c", "logger"), _logger),
    **dict.fromkeys(("t", "tn", "thread", "threadName"), _thread),
    **dict.fromkeys(("T", "tid", "threadId"), _thread_id),
    **dict.fromkeys(("C", "class"), _class),
    **dict.fromkeys(("M", "method"), _attribute("funcName")),
    **dict.fromkeys(("L", "line"), _attribute("lineno")),
    **dict.fromkeys(("F", "file"), _attribute("filename")),
    **dict.fromkeys(("pid", "processId"), _attribute("process")),
    **dict.fromkeys(("l", "location"), _location),
    **dict.fromkeys(("r", "relative"), _relative),
    **dict.fromkeys(("ex", "exception", "throwable", "xEx", "xException", "xThrowable",
                     "rEx", "rException", "rThrowable"), _throwable),
    **dict.fromkeys(("X", "mdc", "MDC"), _context_map),
    **dict.fromkeys(("x", "NDC"), _context_stack),
}
