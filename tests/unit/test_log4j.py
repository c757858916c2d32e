r"""TorchServe's ``--log-config`` (log4j2 XML) mapped onto Python logging: TorchServe's own
default file (from its wheel) and the SageMaker toolkit's, read as they ship; the loggers,
appenders, lookups and layouts that map; a file that is not log4j2's refused clearly."""

from __future__ import annotations

import io
import logging
import re
import time
import zipfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from frontend import cli
from frontend.errors import ConfigError
from frontend.observe import log4j
from frontend.observe.log4j_pattern import Untranslatable, translate
from frontend.observe.logs import SERVER_PATTERN, AccessLog, EscapingLogRecord
from frontend.observe.metric_log import MetricLog
from tests.torchserve_sources import torchserve_file

ROOT = Path(__file__).resolve().parent.parent.parent
MIB = 1024 * 1024
#: TorchServe's PatternLayout for its server log: "%d{ISO8601} [%-5p] %t %c - %m%n".
TS_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{3} \[(\w+) *\] (\S+) (\S+) - (.*)")
FORGED = "hi\r\n2024-01-01T00:00:00,000 [INFO ] main FORGED - \x1b[2J"
ESCAPED = "hi\\r\\n2024-01-01T00:00:00,000 [INFO ] main FORGED - \\x1b[2J"


def torchserve_default() -> bytes | None:
    """TorchServe 0.12's own log4j2.xml: in its wheel's model-server.jar (``make test``
    installs the wheel in .venv-torchserve-archiver), else in its sources."""
    for jar in sorted(ROOT.glob(".venv-torchserve-archiver/lib/python*/site-packages/ts/"
                                "frontend/model-server.jar")):
        with zipfile.ZipFile(jar) as archive:
            return archive.read("log4j2.xml")
    return torchserve_file("frontend/server/src/main/resources/log4j2.xml")


def sagemaker_toolkit_file() -> Path | None:
    """The log4j2.xml the SageMaker PyTorch toolkit passes to ``torchserve``, from the side
    venv ``make test`` installs the toolkit in."""
    found = sorted(ROOT.glob(".venv-*/lib/python*/site-packages/"
                             "sagemaker_pytorch_serving_container/etc/log4j2.xml"))
    return found[0] if found else None


@pytest.fixture
def clean_logging() -> Iterator[None]:
    """Python's logging as it was before the test: its loggers' handlers, levels and
    propagation, the record factory; handlers the test made are closed."""
    manager = logging.root.manager
    before = {name: (list(lg.handlers), lg.level, lg.propagate)
              for name, lg in [("", logging.root), *manager.loggerDict.items()]
              if isinstance(lg, logging.Logger)}
    factory = logging.getLogRecordFactory()
    logging.setLogRecordFactory(EscapingLogRecord)
    yield
    logging.setLogRecordFactory(factory)
    kept = {id(handler) for handlers, _, _ in before.values() for handler in handlers}
    for name, lg in [("", logging.root), *manager.loggerDict.items()]:
        if not isinstance(lg, logging.Logger):
            continue
        for handler in lg.handlers:
            if id(handler) not in kept:
                handler.close()
        lg.handlers[:], lg.level, lg.propagate = before.get(name, ([], logging.NOTSET, True))


def _configure(path: Path, stdout: io.StringIO, stderr: io.StringIO | None = None) -> None:
    log4j.configure(log4j.read(path), stdout, stderr or io.StringIO(),
                    translate(SERVER_PATTERN).formatter)


def _flush() -> None:
    for lg in [logging.root, *logging.root.manager.loggerDict.values()]:
        for handler in getattr(lg, "handlers", []):
            handler.flush()


# ---- TorchServe's own file --------------------------------------------------------------


def test_torchserve_default_log4j2_maps_its_loggers_and_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_logging: None) -> None:
    text = torchserve_default()
    if text is None:
        pytest.skip("TorchServe's log4j2.xml is not here: `make test` installs torchserve=="
                    "0.12.0 (its model-server.jar holds it) into .venv-torchserve-archiver")
    source = tmp_path / "log4j2.xml"
    source.write_bytes(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOG_LOCATION", raising=False)
    monkeypatch.setenv("METRICS_LOCATION", "metrics")

    config = log4j.read(source)
    appenders = config.appenders
    assert {name: (a.kind, a.path) for name, a in appenders.items()} == {
        "STDOUT": ("console", None),
        "access_log": ("file", Path("logs/access_log.log")),
        "model_log": ("file", Path("logs/model_log.log")),
        "ts_log": ("file", Path("logs/ts_log.log")),
        # ${env:METRICS_LOCATION:-logs}
        "ts_metrics": ("file", Path("metrics/ts_metrics.log")),
        "model_metrics": ("file", Path("metrics/model_metrics.log")),
    }
    # SizeBasedTriggeringPolicy 100 MB, DefaultRolloverStrategy max 5.
    assert {(a.max_bytes, a.backup_count) for a in appenders.values() if a.kind == "file"} \
        == {(100 * MIB, 5)}
    loggers = {spec.name: spec for spec in config.loggers}
    assert loggers[""].level == logging.INFO
    assert [ref for ref, _ in loggers[""].refs] == ["STDOUT", "ts_log"]
    assert loggers["org.pytorch.serve"].level == logging.DEBUG
    assert loggers["org.apache"].level == log4j.OFF
    assert loggers["MODEL_LOG"].level == 1  # all
    # What does not map is said: rolling by time, filePattern's names and .gz.
    notes = " | ".join(config.notes)
    assert "rolling by time is not done" in notes and "filePattern" in notes

    stdout = io.StringIO()
    log4j.configure(config, stdout, io.StringIO(), translate(SERVER_PATTERN).formatter)
    # Every file is made at start, as log4j2 makes them.
    for path in ("logs/access_log.log", "logs/model_log.log", "logs/ts_log.log",
                 "metrics/ts_metrics.log", "metrics/model_metrics.log"):
        assert (tmp_path / path).is_file(), path
    logging.getLogger("frontend.server").debug("debug line")  # org.pytorch.serve: debug
    logging.getLogger("batchserve").info("client sent %s", FORGED)
    logging.getLogger("ACCESS_LOG").info("/127.0.0.1:5 \"GET /ping HTTP/1.1\" 200 1.0ms")
    logging.getLogger("MODEL_LOG").info("[W-9000-m_1.0] printed")
    logging.getLogger("TS_METRICS").info("Requests2XX.Count:1.0|#Level:Host")
    logging.getLogger("uvicorn.error").debug("not shown: the root logger is at info")
    _flush()

    console = stdout.getvalue().splitlines()
    server_lines = [TS_LINE.fullmatch(line) for line in console]
    assert all(server_lines), console  # one entry per line: the client's CR/LF escaped
    by_logger = {(m.group(3), m.group(4)) for m in server_lines if m}
    assert ("batchserve", f"client sent {ESCAPED}") in by_logger
    assert ("frontend.server", "debug line") in by_logger
    assert ("MODEL_LOG", "[W-9000-m_1.0] printed") in by_logger  # additive: to Root's too
    assert {m.group(1) for m in server_lines if m} >= {"INFO", "DEBUG"}
    assert not any("not shown" in line for line in console)
    # ts_log: as log4j2 writes it, org.pytorch.serve's own appender, then Root's again.
    ts_log = (tmp_path / "logs/ts_log.log").read_text().splitlines()
    assert sum(line.endswith(f"batchserve - client sent {ESCAPED}") for line in ts_log) == 2
    assert sum(line.endswith("MODEL_LOG - [W-9000-m_1.0] printed") for line in ts_log) == 1
    access = (tmp_path / "logs/access_log.log").read_text()
    assert re.fullmatch(r"\S+T\S+,\d{3} - /127.0.0.1:5 \"GET /ping HTTP/1.1\" 200 1.0ms\n",
                        access)
    assert "Requests2XX.Count:1.0" in (tmp_path / "metrics/ts_metrics.log").read_text()
    assert (tmp_path / "logs/model_log.log").read_text().endswith(
        "[INFO ] MainThread MODEL_LOG - [W-9000-m_1.0] printed\n")


def test_log_location_from_the_environment_as_torchserve_sets_it(tmp_path: Path) -> None:
    source = tmp_path / "log4j2.xml"
    source.write_text(
        '<Configuration><Appenders>'
        '<File name="a" fileName="${env:LOG_LOCATION:-logs}/a.log"/>'
        '<File name="b" fileName="${sys:LOG_LOCATION}/b.log"/>'
        '<File name="c" fileName="${sys:METRICS_LOCATION}/c.log"/>'
        '</Appenders><Loggers><Root level="info"/></Loggers></Configuration>')
    paths = {name: a.path for name, a in log4j.read(
        source, {"LOG_LOCATION": "/var/log/ts"}).appenders.items()}
    assert paths == {"a": Path("/var/log/ts/a.log"), "b": Path("/var/log/ts/b.log"),
                     "c": Path("logs/c.log")}


# ---- the SageMaker toolkit's file -------------------------------------------------------

#: A file of the SageMaker toolkit's shape (its own is read below where installed): a
#: console first, files by LOG_LOCATION/METRICS_LOCATION, a Null appender, a Routing
#: appender with a File inside, and a logger writing only there.
SAGEMAKER_SHAPE = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration>
  <Appenders>
    <Console name="out" target="SYSTEM_OUT">
      <PatternLayout pattern="%d{ISO8601} [%-5p] %t %c - %m%n"/>
    </Console>
    <RollingFile name="models" fileName="${env:LOG_LOCATION:-logs}/model_log.log"
                 filePattern="${env:LOG_LOCATION:-logs}/model_log.%d{dd-MMM}.log.gz">
      <PatternLayout pattern="%d{ISO8601} [%-5p] %c - %m%n"/>
      <Policies><SizeBasedTriggeringPolicy size="10 MB"/><TimeBasedTriggeringPolicy/></Policies>
      <DefaultRolloverStrategy max="5"/>
    </RollingFile>
    <Null name="nowhere"/>
    <Routing name="telemetry">
      <Routes pattern="${env:TELEMETRY:-OPT_OUT}">
        <Route ref="nowhere" key="OPT_OUT"/>
        <Route key="${env:TELEMETRY}"><File name="remote" fileName="${env:TELEMETRY}">
          <PatternLayout pattern="%m%n"/></File></Route>
      </Routes>
    </Routing>
  </Appenders>
  <Loggers>
    <Logger name="MODEL_LOG" level="info"><AppenderRef ref="models"/></Logger>
    <Logger name="TELEMETRY" level="all"><AppenderRef ref="telemetry"/></Logger>
    <Root level="info"><AppenderRef ref="out"/></Root>
  </Loggers>
</Configuration>
"""


def _check_sagemaker_shape(config: log4j.Log4jConfig) -> None:
    assert "telemetry_metrics" not in config.appenders and "telemetry" not in config.appenders
    notes = " | ".join(config.notes)
    assert re.search(r"appenders not supported here, skipped.*\((Routing)\)", notes)
    model = next(a for a in config.appenders.values()
                 if a.path is not None and a.path.name == "model_log.log")
    assert (model.max_bytes, model.backup_count) == (10 * MIB, 5)
    assert any(a.kind == "null" for a in config.appenders.values())


def test_a_file_of_the_sagemaker_toolkits_shape(tmp_path: Path, clean_logging: None) -> None:
    source = tmp_path / "sagemaker.xml"
    source.write_text(SAGEMAKER_SHAPE)
    config = log4j.read(source, {"LOG_LOCATION": str(tmp_path / "logs")})
    _check_sagemaker_shape(config)
    stdout = io.StringIO()
    log4j.configure(config, stdout, io.StringIO(), translate(SERVER_PATTERN).formatter)
    logging.getLogger("TELEMETRY").info("goes nowhere")  # its appender is skipped
    logging.getLogger("MODEL_LOG").info("worker said %s", FORGED)
    _flush()
    # The Routing appender's inner File is not made; the skip is logged once.
    assert not list(tmp_path.glob("**/remote*"))
    assert re.search(r"not mapped: appenders not supported here.*telemetry \(Routing\)",
                     stdout.getvalue())
    assert "goes nowhere" in stdout.getvalue()  # to Root's console, additive
    model_log = (tmp_path / "logs" / "model_log.log").read_text()
    assert re.fullmatch(rf"\S+ \[INFO \] MODEL_LOG - worker said {re.escape(ESCAPED)}\n",
                        model_log)


def test_the_sagemaker_toolkits_own_file(tmp_path: Path, clean_logging: None) -> None:
    source = sagemaker_toolkit_file()
    if source is None:
        pytest.skip("the SageMaker toolkit is not installed in a side venv here (.venv-*): "
                    "`make test` installs it")
    config = log4j.read(source, {"LOG_LOCATION": str(tmp_path / "logs"),
                                 "METRICS_LOCATION": str(tmp_path / "logs")})
    _check_sagemaker_shape(config)
    loggers = {spec.name: spec for spec in config.loggers}
    assert loggers["MODEL_LOG"].level == logging.INFO
    assert [ref for ref, _ in loggers[""].refs] == ["STDOUT", "ts_log"]
    stdout = io.StringIO()
    log4j.configure(config, stdout, io.StringIO(), translate(SERVER_PATTERN).formatter)
    logging.getLogger("frontend.server").info("serving")
    _flush()
    assert TS_LINE.fullmatch(stdout.getvalue().splitlines()[-1])
    assert (tmp_path / "logs" / "ts_log.log").read_text().count("frontend.server - serving") \
        == 2


# ---- loggers and appenders --------------------------------------------------------------


def _write(tmp_path: Path, appenders: str, loggers: str) -> Path:
    source = tmp_path / "log4j2.xml"
    source.write_text(f"<Configuration><Appenders>{appenders}</Appenders>"
                      f"<Loggers>{loggers}</Loggers></Configuration>")
    return source


def test_levels_off_additivity_ref_levels_and_thresholds(tmp_path: Path,
                                                         clean_logging: None) -> None:
    source = _write(
        tmp_path,
        '<Console name="out"><PatternLayout pattern="%p %c %m%n"/></Console>'
        '<Console name="err" target="SYSTEM_ERR"><PatternLayout pattern="%p %m%n"/>'
        '<ThresholdFilter level="error"/></Console>'
        f'<File name="f" fileName="{tmp_path}/f.log"><PatternLayout pattern="%m%n"/></File>',
        '<Logger name="ACCESS_LOG" level="off"><AppenderRef ref="f"/></Logger>'
        '<Logger name="MODEL_LOG" level="info" additivity="false">'
        '  <AppenderRef ref="f" level="warn"/></Logger>'
        '<Logger name="org.pytorch.serve" level="warn"/>'
        '<Root level="debug"><AppenderRef ref="out"/><AppenderRef ref="err"/></Root>')
    stdout, stderr = io.StringIO(), io.StringIO()
    _configure(source, stdout, stderr)
    logging.getLogger("ACCESS_LOG").error("off: never written")
    logging.getLogger("MODEL_LOG").info("info: below its reference's level")
    logging.getLogger("MODEL_LOG").warning("warned")
    logging.getLogger("frontend.x").info("below org.pytorch.serve's level")
    logging.getLogger("batchserve").error("failed")
    logging.getLogger("someone.else").debug("root's level")
    _flush()
    assert stdout.getvalue().splitlines()[-2:] == ["ERROR batchserve failed",
                                                  "DEBUG someone.else root's level"]
    assert "warned" not in stdout.getvalue()  # additivity false
    assert "below" not in stdout.getvalue()
    assert stderr.getvalue() == "ERROR failed\n"  # its ThresholdFilter: error and above
    assert (tmp_path / "f.log").read_text() == "warned\n"


def test_no_root_is_log4js_default_and_empty_root_writes_nothing(
        tmp_path: Path, clean_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    source = _write(tmp_path, "", "")
    config = log4j.read(source)
    root = next(spec for spec in config.loggers if spec.name == "")
    assert root.level == logging.ERROR
    assert config.appenders[root.refs[0][0]].kind == "console"
    assert any("no <Root> logger" in note for note in config.notes)

    quiet = _write(tmp_path, "", '<Root level="info"/>')
    _configure(quiet, io.StringIO())
    logging.getLogger("frontend.x").warning("nowhere to go")
    assert "nowhere to go" not in capsys.readouterr().err  # not Python's last resort


def test_rolling_file_rolls_by_size_and_keeps_max(tmp_path: Path, clean_logging: None) -> None:
    source = _write(
        tmp_path,
        f'<RollingFile name="r" fileName="{tmp_path}/roll/r.log" filePattern="r-%i.log.gz">'
        '<PatternLayout pattern="%m%n"/><SizeBasedTriggeringPolicy size="1 KB"/>'
        '<DefaultRolloverStrategy max="2"/></RollingFile>',
        '<Root level="info"><AppenderRef ref="r"/></Root>')
    _configure(source, io.StringIO())
    for count in range(40):
        logging.getLogger("frontend.x").info("%02d %s", count, "x" * 100)
    names = sorted(path.name for path in (tmp_path / "roll").iterdir())
    assert names == ["r.log", "r.log.1", "r.log.2"]
    assert all(path.stat().st_size <= 1024 for path in (tmp_path / "roll").iterdir())
    assert (tmp_path / "roll" / "r.log").read_text().splitlines()[-1].startswith("39 ")


def test_properties_lookups_and_strict_format(tmp_path: Path) -> None:
    source = tmp_path / "log4j2.xml"
    source.write_text(
        '<Configuration xmlns="http://logging.apache.org/log4j/2.0/config" strict="true">'
        '<Properties><Property name="dir">${env:BASE:-/base}/sub</Property>'
        '<Property name="name">app</Property></Properties>'
        '<Appenders><Appender type="File" name="f" fileName="${dir}/${name}.log">'
        '<Layout type="PatternLayout" pattern="$${literal} %m%n"/></Appender>'
        '<File name="g" fileName="${env:NONE:-${env:ALSO_NONE:-nested}}/${ctx:user}.log"/>'
        '</Appenders><Loggers><Root level="INFO"><AppenderRef ref="f"/></Root></Loggers>'
        '</Configuration>')
    config = log4j.read(source, {})
    assert config.appenders["f"].path == Path("/base/sub/app.log")
    # Another lookup (ctx) stays as written, as log4j2 leaves what it cannot resolve.
    assert config.appenders["g"].path == Path("nested/${ctx:user}.log")
    layout = config.appenders["f"].layout
    assert layout is not None
    assert layout.formatter.format(_record("m")) == "${literal} m"


def test_a_variables_value_is_never_looked_up_again(tmp_path: Path) -> None:
    """``${env:NAME}`` is the variable's text: a lookup in it stays as it is (no second
    substitution), in a file name as in a property."""
    source = tmp_path / "log4j2.xml"
    source.write_text(
        '<Configuration><Properties><Property name="p">${env:DIR}</Property></Properties>'
        '<Appenders><File name="f" fileName="${env:DIR}/a.log"/>'
        '<File name="g" fileName="${p}/b.log"/></Appenders>'
        '<Loggers><Root level="INFO"><AppenderRef ref="f"/></Root></Loggers></Configuration>')
    config = log4j.read(source, {"DIR": "${env:SECRET}", "SECRET": "/etc"})
    assert config.appenders["f"].path == Path("${env:SECRET}/a.log")
    assert config.appenders["g"].path == Path("${env:SECRET}/b.log")


@pytest.mark.parametrize(("text", "expected"), [
    ("<Configuration><Appenders>", "not well-formed XML"),
    ("<log4j:configuration xmlns:log4j='x'/>", "not a log4j2 configuration"),
    ('<Configuration><Loggers><Root level="loud"/></Loggers></Configuration>',
     "level 'loud'"),
    ('<Configuration><Appenders><RollingFile name="r" fileName="f.log">'
     '<SizeBasedTriggeringPolicy size="big"/></RollingFile></Appenders></Configuration>',
     "size 'big'"),
    ('<Configuration><Appenders><File name="f"/></Appenders></Configuration>',
     "has no fileName"),
])
def test_a_file_that_is_not_usable_log4j2_is_a_config_error(tmp_path: Path, text: str,
                                                            expected: str) -> None:
    source = tmp_path / "bad.xml"
    source.write_text(text)
    with pytest.raises(ConfigError) as error:
        log4j.read(source)
    assert str(source) in str(error.value) and expected in str(error.value)


def test_torchserve_start_refuses_a_bad_log4j2_file_before_starting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("BATCHSERVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "store").mkdir()
    (tmp_path / "bad.xml").write_text("<Configuration><Loggers></Configuration>")
    code = cli.main(["--start", "--model-store", "store", "--log-config", "bad.xml"])
    assert code == 2
    err = capsys.readouterr().err
    assert "bad.xml" in err and "not well-formed XML" in err
    assert not (tmp_path / "state" / "server.json").exists()


def test_setup_logging_maps_log4j2_and_refuses_an_unreadable_ini(
        tmp_path: Path, clean_logging: None) -> None:
    xml = tmp_path / "log4j2.xml"
    xml.write_text('<?xml version="1.0"?>\n<Configuration><Appenders><Console name="c">'
                   '<PatternLayout pattern="%c %m%n"/></Console></Appenders>'
                   '<Loggers><Root level="info"><AppenderRef ref="c"/></Root></Loggers>'
                   '</Configuration>\n')
    stream = io.StringIO()
    assert cli.setup_logging(xml, stream) is True
    assert "frontend.observe.log4j --log-config" in stream.getvalue()
    logging.getLogger("batchserve").info("line %s", "\x1b")
    assert stream.getvalue().endswith("batchserve line \\x1b\n")

    properties = tmp_path / "log4j.properties"
    properties.write_text("log4j.rootLogger=INFO, console\n")
    assert cli.setup_logging(properties, io.StringIO()) is False  # said, not read
    not_ini = tmp_path / "logging.conf"
    not_ini.write_text("[loggers]\nkeys=root\n")
    with pytest.raises(ConfigError, match=r"logging\.conf"):
        cli.setup_logging(not_ini, io.StringIO())
    with pytest.raises(ConfigError, match="not found"):
        cli.setup_logging(tmp_path / "missing.xml", io.StringIO())


# ---- the buffered logs through loggers --------------------------------------------------


def test_access_and_metric_logs_go_through_the_named_loggers(clean_logging: None) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(translate("%d{UNIX} %c %m%n").formatter)
    for name in ("ACCESS_LOG", "TS_METRICS"):
        logging.getLogger(name).handlers[:] = [handler]
        logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger(name).propagate = False
    access = AccessLog(None, logging.getLogger("ACCESS_LOG"))
    access.open()
    metrics = MetricLog(None, logging.getLogger("TS_METRICS"))
    metrics.open()
    access.write("/127.0.0.1:1", "GET", f"/p{FORGED}", "HTTP/1.1", 404, 0.001, "-", "-", 0, 0)
    metrics.write("Requests4XX.Count:1.0|#Level:Host")
    access.flush()
    metrics.flush()
    lines = stream.getvalue().splitlines()
    now = int(time.time())
    assert len(lines) == 2
    stamp, name, message = lines[0].split(" ", 2)
    assert abs(int(stamp) - now) <= 2 and name == "ACCESS_LOG"
    # TorchServe's message (its Session): client, request line, status, milliseconds.
    assert message == f'/127.0.0.1:1 "GET /p{ESCAPED} HTTP/1.1" 404 1'
    assert lines[1].endswith("TS_METRICS Requests4XX.Count:1.0|#Level:Host")

    logging.getLogger("ACCESS_LOG").setLevel(log4j.OFF)
    off = AccessLog(None, logging.getLogger("ACCESS_LOG"))
    off.open()
    assert not off.enabled  # a logger turned off: nothing is even collected
    access.close()
    metrics.close()


# ---- PatternLayout ----------------------------------------------------------------------

MOMENT = 1_717_105_307.123456  # 2024-05-30T21:41:47.123456 UTC


def _record(message: str, name: str = "frontend.serving.workers",
            level: int = logging.INFO) -> logging.LogRecord:
    record = logging.LogRecord(name, level, "/x/workers.py", 42, message, (), None, "spawn")
    record.created = MOMENT
    return record


@pytest.mark.parametrize(("pattern", "expected"), [
    ("%d{ISO8601}{UTC} [%-5p] %t %c - %m%n",
     "2024-05-30T21:41:47,123 [INFO ] MainThread frontend.serving.workers - hello"),
    ("%d{yyyy-MM-dd HH:mm:ss.SSS}{UTC} %level %logger{1} %msg",
     "2024-05-30 21:41:47.123 INFO workers hello"),
    ("%d{DEFAULT}{GMT} %5p|%-3.3c{-1}|", "2024-05-30 21:41:47,123  INFO|ers|"),
    ("%d{ABSOLUTE}{UTC} %c{1.} %%%n", "21:41:47,123 f.s.workers %"),
    ("%d{dd MMM yyyy EEE a hh 'o''clock' XXX}{UTC}", "30 May 2024 Thu PM 09 o'clock Z"),
    ("%d{UNIX_MILLIS} %d{UNIX} %.-4c %M:%L %F", "1717105307123 1717105307 fron spawn:42 "
     "workers.py"),
    ("%d{HH:mm:ss,SSS}{+02:00} %X{user}%x %thread", "23:41:47,123 [] MainThread"),
])
def test_patterns_translate(pattern: str, expected: str) -> None:
    translation = translate(pattern)
    assert translation.formatter.format(_record("hello")) == expected
    assert translation.terminator == ("\n" if pattern.endswith("%n") else "")


def test_date_default_is_local_time_and_levels_are_log4js_names() -> None:
    formatter = translate("%d %p").formatter
    local = datetime.fromtimestamp(MOMENT).strftime("%Y-%m-%d %H:%M:%S")
    assert formatter.format(_record("m", level=logging.WARNING)) == f"{local},123 WARN"
    assert formatter.format(_record("m", level=logging.CRITICAL)).endswith(" FATAL")


def test_a_traceback_follows_the_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        record = _record("failed")
        record.exc_info = sys.exc_info()
    text = translate("%p %m%n%ex").formatter.format(record)
    assert text.startswith("INFO failed\nTraceback")
    assert text.endswith("RuntimeError: boom")


@pytest.mark.parametrize("pattern", ["%highlight{%m}", "%p{WARN=W}", "%c{1.1.~}",
                                     "%d{yyyy Q}", "%m %", "%d{HH}{Mars/Olympus}"])
def test_what_is_not_translated_is_named(pattern: str) -> None:
    with pytest.raises(Untranslatable):
        translate(pattern)


def test_an_untranslated_layout_falls_back_with_one_note(tmp_path: Path,
                                                         clean_logging: None) -> None:
    source = _write(
        tmp_path,
        '<Console name="a"><PatternLayout pattern="%highlight{%m}%n"/></Console>'
        '<Console name="b"><JsonLayout/></Console>',
        '<Root level="info"><AppenderRef ref="a"/><AppenderRef ref="b"/></Root>')
    config = log4j.read(source)
    assert config.appenders["a"].layout is None and config.appenders["b"].layout is None
    assert [note for note in config.notes if "PatternLayout conversions" in note] == [
        "PatternLayout conversions not translated: these appenders write the server's own "
        "format: a (%highlight)"]
    assert any(note.endswith("b (JsonLayout)") for note in config.notes)
    stdout = io.StringIO()
    log4j.configure(config, stdout, io.StringIO(), translate(SERVER_PATTERN).formatter)
    logging.getLogger("batchserve").warning("fallback")
    # The server's own format: TorchServe's server-log layout.
    assert stdout.getvalue().splitlines()[-1].endswith("[WARN ] MainThread batchserve - fallback")
