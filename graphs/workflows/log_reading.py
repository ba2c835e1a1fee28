"""Reading pasted logs: each line's level, emitting service and message, and the signals of an excerpt.

This is code, not a model, because counting and quoting are what rules do right: an on-call engineer
pastes a mix of formats (JSON lines, logfmt, Spring Boot, log4j, zap, glog, nginx, syslog, gunicorn,
celery, Rails, Airflow, Laravel, MySQL, CoreDNS, ...), often wrapped in ``kubectl logs --prefix`` or
docker-compose prefixes. Every format is recognised by its shape (where the level token sits and what
surrounds it), never by the words of a particular incident, so unseen logs of the same formats parse
the same way. The message is always a verbatim substring of the line, so the top error can be quoted
back to the engineer exactly as they will grep for it.

Parsing a line goes outside in:

1. *wrappers* that name the emitting container: ``[pod/<pod>/<container>] ``, ``<service>-1  | ``
   and the CRI ``<time> stdout F `` prefix;
2. *structured* lines: a JSON object or logfmt ``key=value`` pairs, read by their fields;
3. *text* lines: formats whose header carries its own timestamp (glog, Rails, celery, Serilog) first,
   then timestamps, syslog ``host ident[pid]:`` and postgres ``[n-n]`` are stripped and the level is
   found where each format puts it (``[LEVEL]``, ``LEVEL``, ``env.LEVEL:``, ``name:LEVEL``, ``E!``,
   ``{file.py:NN} LEVEL -``, tab-separated zap fields), and the format's logger/thread/pid decoration
   after it is peeled off (Spring's ``--- [app] [thread] logger :``, log4j's ``[thread] c.e.Cls -``,
   nginx's ``pid#tid: *conn``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any, NamedTuple

__all__ = ["LogLine", "error_kind", "log_signals", "parse_line"]


class LogLine(NamedTuple):
    """One parsed line. ``level`` is FATAL, ERROR, WARN or INFO; ``service`` is None where the line does
    not name its emitter; ``message`` is a verbatim substring of the line."""

    level: str
    service: str | None
    message: str


# Level words, normalised to the four levels the signals count. Abbreviations are the ones real
# loggers print (logrus ERRO/FATA, log15 EROR, Serilog ERR/FTL, zap DPANIC, java.util.logging SEVERE).
_LEVEL_WORDS: dict[str, str] = {
    **dict.fromkeys(("fatal", "fata", "ftl", "critical", "crit", "crt", "panic", "pani", "dpanic",
                     "emerg", "emergency", "alert"), "FATAL"),
    **dict.fromkeys(("error", "erro", "eror", "err", "severe"), "ERROR"),
    **dict.fromkeys(("warn", "warning", "wrn"), "WARN"),
    **dict.fromkeys(("info", "inf", "notice", "debug", "debu", "dbg", "trace", "trac", "verbose", "vrb",
                     "log", "note", "system", "fine", "finer", "finest", "config"), "INFO"),
}
_LETTER_LEVELS = {"F": "FATAL", "E": "ERROR", "W": "WARN", "I": "INFO", "D": "INFO"}
_LEVEL_ALT = "|".join(sorted(_LEVEL_WORDS, key=len, reverse=True))
_LVL = rf"(?:(?i:{_LEVEL_ALT}))"  # any case; bare tokens are checked for UPPER/lower case in code

# -- wrappers -------------------------------------------------------------------------------------
_KUBECTL = re.compile(r"\[pod/([^/\]\s]+)(?:/([^\]\s]+))?\] ?")
_COMPOSE = re.compile(r"([A-Za-z][\w.-]*?)(?:[-_]\d+)?\s+\|(?: |$)")
_CRI = re.compile(r"\d{4}-\d{2}-\d{2}T\S+\s+(?:stdout|stderr)\s+[FP] ")
_POD_HASH = re.compile(r"(?:-[a-z0-9]{6,10})?-[a-z0-9]{5}$|-\d+$")

# -- timestamps and syslog ----------------------------------------------------------------------------
_TS = re.compile(
    r"\[?(?:"
    r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2})?(?:[.,]\d+)?(?:\s?(?:Z|[+-]\d{2}:?\d{2}|UTC|GMT)\b)?"
    r"|\d{4}/\d{2}/\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?"
    r"|\d{2}-[A-Z][a-z]{2}-\d{4} \d{2}:\d{2}:\d{2}(?:[.,]\d+)?"
    r"|[A-Z][a-z]{2}\s+\d{1,2}\s+\d{2}:\d{2}:\d{2}(?:\.\d+)?"
    r"|\d{2}:\d{2}:\d{2}(?:[.,]\d+)?"
    r")\]?(?:\s+[|-](?=\s))?(?:\s+|$|(?<=\])(?=\[))"
)
_BSD_SYSLOG_TS = re.compile(r"[A-Z][a-z]{2}\s+\d{1,2}\s+\d{2}:\d{2}:\d{2}\s+")
_SYSLOG_IDENT = re.compile(r"(?:\S+\s+)?([A-Za-z][\w./-]*?)(?:\[\d+\])?:\s+")
_ISO_SYSLOG_IDENT = re.compile(r"\S+\s+([A-Za-z][\w./-]*)\[\d+\]:\s+")  # rsyslog: <iso> host app[pid]:
_PG_LINE = re.compile(r"\[\d+-\d+\]\s+")  # postgres via syslog: "[7-1] ERROR:  ..."

# -- formats whose header holds the timestamp -------------------------------------------------------
_GLOG = re.compile(r"([IWEF])\d{4}\s+\d{2}:\d{2}:\d{2}(?:\.\d+)?\s+\d+\s+[^\s\]]+:\d+\]\s?(.*)")
_KLOG_MSG = re.compile(r'"((?:[^"\\]|\\.)*)"(?:\s+[\w.-]+=.*)?$')  # structured klog: "msg" k=v
_RAILS = re.compile(rf"[DIWEFAU], \[[^\]]*\]\s+({_LVL}|ANY)\s+-- ([^:]*?): ?(.*)")
_CELERY = re.compile(rf"\[[^\]]*?:\s*({_LVL})/[\w.-]+\]\s+(.*)")
_SERILOG = re.compile(r"\[\d{2}:\d{2}:\d{2}(?:\.\d+)?\s+(FTL|ERR|WRN|INF|DBG|VRB)\]\s+(.*)")

# -- the level where each text format puts it ---------------------------------------------------------
# gunicorn "[1] [CRITICAL]", mysql "4112 [ERROR]", postgres "[2201] ERROR:" and "[2201] user@db ERROR:"
_PID = r"(?:\[\d+\]\s*(?:[\w.-]*@[\w.-]*\s+)?|\d+\s+)?"
_BRACKET_LEVEL = re.compile(rf"{_PID}\[(\s*)({_LVL})(\s*)\]\s*")
_PY_BASIC = re.compile(rf"({_LVL}):([\w.<>-]+):(.*)")  # logging.basicConfig: "ERROR:root:msg"
_NAME_LEVEL = re.compile(rf"([A-Za-z][\w.-]*):({_LVL})\s+(.*)")  # thumbor: "thumbor:ERROR msg"
_TELEGRAF = re.compile(r"([EWID])!\s+(.*)")
_LOGRUS_TTY = re.compile(r"(ERRO|FATA|PANI|WARN|INFO|DEBU|TRAC)\[\d+\]\s+(.*)")
_LARAVEL = re.compile(rf"[A-Za-z]\w*\.({_LVL}):\s?(.*)")
_AIRFLOW = re.compile(rf"\{{[^}}]*\}}\s+({_LVL})\s+-\s(.*)")
_NAME_DASH_LEVEL = re.compile(rf"([A-Za-z][\w.-]*)\s+-\s+({_LVL})\s+-\s(.*)")  # "%(name)s - %(levelname)s -"
_TAG_THEN_LEVEL = re.compile(rf"\[([A-Za-z][^\]\s]*)\]\s+(?:\[\s*({_LVL})\s*\]|({_LVL})\b:?)\s+(.*)")
_BARE_LEVEL = re.compile(rf"{_PID}({_LVL})(?=[\s:|]|$)(\s*:\s*|\s*\|\s*|\s+-\s+|\s+|$)(.*)")

# -- what follows the level --------------------------------------------------------------------------
# Spring Boot: "pid --- [app] [thread] logger : msg" (3.x) or, with Sleuth, "[app,trace,span] pid --- ..."
_SPRING = re.compile(r"(?:\[([\w.-]+),[^\]]*\]\s+)?\d+\s+---\s+((?:\[[^\]]*\]\s*)+)(\S+)\s+:\s(.*)")
_JAVA_LOGGER = r"(?:[\w$]+(?:\.[\w$]+)+|[A-Z][a-z]\w*[A-Z]\w*)"  # c.e.oh.OrderController, OrderService
_LOG4J = re.compile(rf"((?:\[[^\]]*\]\s+)*){_JAVA_LOGGER}\s+-\s(.*)")
_BRACKETS = re.compile(r"\[([^\]]*)\]")
_LOGURU = re.compile(r"[\w.]+:[\w<>.]+:\d+\s+-\s(.*)")
_FLASK = re.compile(r"in\s+[\w.]+:\s(.*)")
_SERVICE_TAG = re.compile(r"\[([a-z][\w.-]*)\]\s+(.*)")
_SERVICE_COLON = re.compile(r"([a-z][\w.-]*):\s+(.*)")  # "CRITICAL worker: out of memory"
_NGINX = re.compile(r"\d+#\d+:\s+(?:\*\d+\s+)?(.*?)(?:, client: .*)?$")
_HAPROXY = re.compile(r"(?:\d+/\d+\s+)?\(\d+\)\s*:\s*(.*)")
_ES_LOGGER = re.compile(r"\[[^\]]*\]\s*(?:\[[^\]]*\]\s+)?(.*)")  # "[ERROR][o.e.Logger] [node] msg"
_THREAD_LIKE = re.compile(r"(?i)^\s|\s$|^main$|thread|exec|nio|pool|-\d+$")

# -- message tails that are fields, not message -------------------------------------------------------
_KV = r'[\w.@-]+=(?:"(?:[^"\\]|\\.)*"|\S*)'
_KV_TAIL_WIDE = re.compile(rf"\s{{2,}}({_KV}(?:\s+{_KV})*)\s*$")  # logrus/gitlab-runner: "msg    k=v k=v"
_KV_TAIL = re.compile(rf"\s+({_KV}(?:\s+{_KV})*)\s*$")  # structlog pads the event, then k=v fields
_JSON_TAIL = re.compile(r"(?:\s+|\t)(\{.*\}|\[\])(?:\s+\[\])?$")  # laravel/zap/monolog context objects
_LOGFMT = re.compile(r'([\w.@-]+)=("(?:[^"\\]|\\.)*"|\S*)')

# -- structured fields ------------------------------------------------------------------------------
_LEVEL_KEYS = ("level", "lvl", "severity", "loglevel", "log.level", "levelname", "level_name", "severitytext",
               "severity_text", "@l")
_MESSAGE_KEYS = ("msg", "message", "@m", "@mt", "body", "short_message", "event", "log")
_ERROR_KEYS = ("error", "err", "error.message", "err.message", "exception")
_SERVICE_KEYS = ("service", "service.name", "service_name", "servicename", "svc", "app", "app_name",
                 "application", "container", "container_name", "kubernetes.container_name")
_NAME_KEYS = ("name", "logger", "logger_name")  # bunyan/pino name, zap logger: services when they read so
_SERVICE_LIKE = re.compile(r"[A-Za-z][\w-]*(?:\.[a-z][\w-]*)?")  # not a Java class, not a sentence

# -- stack traces ---------------------------------------------------------------------------------
_CONTINUATION = re.compile(
    r"\s+at\s|\s*\.\.\.\s*\d+\s+(?:more|common frames omitted)|\s*Caused by:|\s*Suppressed:"
    r"|\s+File \"|\s+/\S+\.go:\d+|goroutine \d+ \[|\s*During handling of the above exception"
    r"|\s*The above exception was the direct cause"
)
_TRACEBACK = "Traceback (most recent call last)"

_HTTP_5XX = re.compile(r'"\s(5\d\d)\s|\b(?:HTTP|status|code)[=: /]*\s*(5\d\d)\b|\b(5\d\d)\s+(?:Bad Gateway|'
                       r"Service Unavailable|Gateway Time-?out|Internal Server Error)", re.IGNORECASE)
_UUID_OR_HEX = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|\b0x[0-9a-f]+\b",
                          re.IGNORECASE)
_HAS_DIGIT = re.compile(r"\S*\d\S*")


def _level_of(token: str, *, bare: bool = False) -> str | None:
    """The normalised level of a level word, or None. A bare (unbracketed) word counts only in UPPER
    or lower case: ``Error:`` at a line start is a Node/Java exception header, not a level."""
    if bare and not (token.isupper() or token.islower()):
        return None
    return _LEVEL_WORDS.get(token.strip().lower())


def _unwrap(line: str) -> tuple[str | None, str]:
    """The container named by ``kubectl logs --prefix``/docker-compose/CRI wrappers, and the line they
    wrap (indentation kept, so stack-trace continuations stay recognisable)."""
    service: str | None = None
    body = line.rstrip()
    for _ in range(3):
        if m := _KUBECTL.match(body):
            pod, container = m.group(1), m.group(2)
            service, body = container or _POD_HASH.sub("", pod), body[m.end():]
        elif (m := _COMPOSE.match(body)) and not _TS.match(body):
            service, body = m.group(1), body[m.end():]
        elif m := _CRI.match(body):
            body = body[m.end():]
        else:
            break
    return service, body


def parse_line(line: str) -> LogLine:
    """Level, emitting service and message of one log line, whatever format it was pasted in. A
    service named inside the line (a ``[tag]``, a ``service`` field, Spring's app, the syslog ident)
    wins over the container a wrapper names, because it is the application's own name for itself."""
    outer, body = _unwrap(line)
    body = body.strip()
    parsed = _parse_json(body) or _parse_logfmt(body) or _parse_text(body)
    return LogLine(parsed.level, parsed.service or outer, parsed.message)


# -- structured lines ---------------------------------------------------------------------------------


def _flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted lower-case keys for nested objects (``{"log": {"level": ...}}`` -> ``log.level``), so
    ECS/OpenTelemetry-style nesting reads like flat fields."""
    flat: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{str(key).lower()}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        flat.setdefault(name, value)
    return flat


def _field_level(value: Any) -> str | None:
    """A level field's value: a word (any case), a pino/bunyan number (10..60) or a syslog number
    (0..7, as GELF sends)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        n = int(value)
        if n >= 10:
            return "FATAL" if n >= 60 else "ERROR" if n >= 50 else "WARN" if n >= 40 else "INFO"
        return "FATAL" if n <= 2 else "ERROR" if n == 3 else "WARN" if n == 4 else "INFO"
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            return _field_level(int(text))
        if len(text) == 1:
            return _LETTER_LEVELS.get(text.upper())
        return _LEVEL_WORDS.get(text.lower())
    return None


def _service_field(fields: dict[str, Any]) -> str | None:
    """The emitting service named by a structured line's fields; a logger name only when it reads like
    a service (``payments-api``), not a module or class path (``com.example.Foo``)."""
    for key in _SERVICE_KEYS:
        value = fields.get(key)
        if isinstance(value, str) and value.strip() and " " not in value.strip():
            return value.strip()
    for key in _NAME_KEYS:
        value = fields.get(key)
        if isinstance(value, str) and (service := _name_service(value)):
            return service
    for key, value in fields.items():
        if key.endswith((".service", ".service.name", ".service_name")) and isinstance(value, str) and value:
            return value
    return None


def _raw_string(text: str, key: str, value: str) -> str:
    """The value as written in the line (escapes kept), so the quoted message is a substring of it."""
    for m in re.finditer(r'"' + re.escape(key) + r'"\s*:\s*"((?:[^"\\]|\\.)*)"', text):
        try:
            if json.loads(f'"{m.group(1)}"') == value:
                return m.group(1)
        except json.JSONDecodeError:
            continue
    return value


def _parse_json(body: str) -> LogLine | None:
    """JSON lines: the level, service and message fields (pino/bunyan numbers, mongod ``"s"``,
    nested ECS/OTel fields); a docker ``{"log": "..."}`` envelope is parsed as the line it wraps."""
    if not body.startswith("{"):
        return None
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    fields = _flatten(obj)
    level = next((lv for k in _LEVEL_KEYS if k in fields and (lv := _field_level(fields[k]))), None)
    if level is None and isinstance(fields.get("s"), str) and ("c" in fields or "ctx" in fields):
        level = _LETTER_LEVELS.get(fields["s"][:1].upper())  # mongod: {"s":"E","c":"STORAGE",...}
    if level is None and isinstance(fields.get("log"), str):
        inner = parse_line(fields["log"])
        return LogLine(inner.level, inner.service or _service_field(fields), inner.message)
    service = _service_field(fields)
    message = ""
    for key in (*_MESSAGE_KEYS, *_ERROR_KEYS):
        value = fields.get(key)
        if isinstance(value, str) and value.strip():
            original = next((str(k) for k in obj if str(k).lower() == key), key)
            message = _raw_string(body, original, value)
            break
    return LogLine(level or "INFO", service, message or body)


def _parse_logfmt(body: str) -> LogLine | None:
    """logfmt/logrus ``key=value`` lines (possibly after a timestamp) that carry a level field."""
    stamp = None if re.match(r"[\w.@-]+=", body) else _TS.match(body)
    text = body[stamp.end():] if stamp else body
    if not re.match(r"[\w.@-]+=", text):
        return None
    pairs: dict[str, str] = {}
    for key, value in _LOGFMT.findall(text):
        pairs.setdefault(key.lower(), value[1:-1] if value.startswith('"') and len(value) > 1 else value)
    level_key = next((k for k in _LEVEL_KEYS if k in pairs), None)
    if level_key is None or len(pairs) < 2:
        return None
    level = _field_level(pairs[level_key]) or "INFO"
    message = next((pairs[k] for k in (*_MESSAGE_KEYS, *_ERROR_KEYS) if pairs.get(k)), "")
    return LogLine(level, _service_field(pairs), message or text)


# -- text lines -------------------------------------------------------------------------------------


def _parse_text(body: str) -> LogLine:
    """Text formats, by where their level token sits."""
    if parsed := _parse_own_header(body):
        return parsed
    rest, service = _strip_header(body)
    if "\t" in body and (parsed := _parse_zap(body)):
        return parsed
    level, tag, message = _find_level(rest, stamped=rest != body)
    return LogLine(level, tag or service, _trim_fields(message))


def _parse_own_header(body: str) -> LogLine | None:
    """glog, Rails, celery and Serilog print the timestamp inside their own header."""
    if m := _GLOG.match(body):
        text = m.group(2)
        quoted = _KLOG_MSG.match(text)
        return LogLine(_LETTER_LEVELS[m.group(1)], None, quoted.group(1) if quoted else text.strip())
    if m := _RAILS.match(body):
        progname = m.group(2).strip()
        service = progname if progname and _SERVICE_LIKE.fullmatch(progname) else None
        return LogLine(_level_of(m.group(1)) or "INFO", service, m.group(3).strip())
    if m := _CELERY.match(body):
        return LogLine(_level_of(m.group(1)) or "INFO", None, m.group(2).strip())
    if m := _SERILOG.match(body):
        return LogLine(_level_of(m.group(1)) or "INFO", None, _trim_fields(m.group(2)))
    return None


def _strip_header(body: str) -> tuple[str, str | None]:
    """Drop timestamps, the syslog ``host ident[pid]:`` (the ident is the service) and the postgres
    ``[n-n]`` line counter; a second timestamp can follow the syslog header (telegraf, patroni)."""
    service = None
    rest = body
    if m := _BSD_SYSLOG_TS.match(rest):
        after = rest[m.end():]
        ident = _SYSLOG_IDENT.match(after)
        if ident and not _level_of(ident.group(1), bare=True):
            service, rest = ident.group(1), after[ident.end():]
        else:
            rest = after
    elif m := _TS.match(rest):
        rest = rest[m.end():]
        if ident := _ISO_SYSLOG_IDENT.match(rest):
            service, rest = ident.group(1), rest[ident.end():]
    if m := _TS.match(rest):
        rest = rest[m.end():]
    if m := _PG_LINE.match(rest):
        rest = rest[m.end():]
    return rest, service


def _parse_zap(body: str) -> LogLine | None:
    """zap's console encoder: ``time<TAB>LEVEL<TAB>[logger<TAB>][caller<TAB>]message[<TAB>{json}]``;
    the logger name is the service."""
    fields = body.split("\t")
    start = 1 if len(fields) > 1 and _TS.fullmatch(fields[0] + " ") else 0
    if len(fields) - start < 2 or not (level := _level_of(fields[start], bare=True)):
        return None
    rest = fields[start + 1:]
    if rest and rest[-1].lstrip().startswith("{"):
        rest = rest[:-1]
    caller = next((i for i, f in enumerate(rest) if re.fullmatch(r"[\w./-]+:\d+", f)), None)
    if caller is not None:
        names, message = rest[:caller], "\t".join(rest[caller + 1:])
    else:
        names, message = rest[:-1], rest[-1] if rest else ""
    service = names[0] if names and _SERVICE_LIKE.fullmatch(names[0]) else None
    return LogLine(level, service, message.strip())


def _find_level(rest: str, *, stamped: bool) -> tuple[str, str | None, str]:
    """The level, a service tag and the message of a text line whose header is stripped. A lower-case
    bare level counts only after a timestamp or before a colon (``error: ...``), so a message that
    merely starts with the word "alert" or "error" is not read as a level."""
    if m := _PY_BASIC.match(rest):
        if level := _level_of(m.group(1), bare=True):
            return level, _name_service(m.group(2)), m.group(3)
    if m := _NAME_LEVEL.match(rest):
        if level := _level_of(m.group(2), bare=True):
            return level, _name_service(m.group(1)), m.group(3)
    if m := _TELEGRAF.match(rest):
        return _LETTER_LEVELS[m.group(1)], None, m.group(2)
    if m := _LOGRUS_TTY.match(rest):
        return _level_of(m.group(1)) or "INFO", None, _cut_kv(m.group(2), wide=False)[0]
    if m := _LARAVEL.match(rest):
        if level := _level_of(m.group(1), bare=True):
            return level, None, m.group(2)
    if m := _AIRFLOW.match(rest):
        return _level_of(m.group(1)) or "INFO", None, m.group(2)
    if m := _NAME_DASH_LEVEL.match(rest):
        if level := _level_of(m.group(2), bare=True):
            return level, _name_service(m.group(1)), m.group(3)
    if m := _BRACKET_LEVEL.match(rest):
        if level := _level_of(m.group(2)):
            return (level, *_after_bracket_level(m, rest[m.end():]))
    if m := _TAG_THEN_LEVEL.match(rest):
        level = _level_of(m.group(2)) if m.group(2) else _level_of(m.group(3), bare=True)
        if level:
            if log4j := _LOG4J.match(m.group(4)):  # log4j "[thread] LEVEL logger - msg": a thread
                return level, None, log4j.group(2)
            return level, m.group(1), m.group(4)
    if m := _BARE_LEVEL.match(rest):
        level = _level_of(m.group(1), bare=True)
        if level and (stamped or m.group(1).isupper() or ":" in m.group(2)):
            return (level, *_after_bare_level(level, m.group(2), m.group(3)))
    return "INFO", None, rest


def _name_service(name: str) -> str | None:
    """A logger name is the service when it reads like one (``thumbor``), not a module or class path."""
    return name if _SERVICE_LIKE.fullmatch(name) and name not in ("root", "__main__") else None


def _after_bracket_level(m: re.Match[str], after: str) -> tuple[str | None, str]:
    """What follows ``[LEVEL]``: nginx ``pid#tid: *conn``, Elasticsearch ``[logger] [node]``, haproxy
    ``(pid) :``, structlog's padded event with k=v fields; other bracketed codes (MySQL ``[MY-...]``,
    fluent-bit ``[output:...]``) are part of the message. Only an UPPER-case ``[LEVEL]`` can be
    followed by a service tag: nginx, fluent-bit and structlog put a module there."""
    token = m.group(2)
    if n := _NGINX.match(after):
        return None, n.group(1)
    if after.startswith("[") and m.group(0).endswith("]") and (n := _ES_LOGGER.match(after)):
        return None, n.group(1)
    if n := _HAPROXY.match(after):
        return None, n.group(1)
    if m.group(3) and token.islower():  # structlog "[error    ] event   key=value"
        message, fields = _cut_kv(after, wide=False)
        return _service_field(fields), message
    if token.isupper() and (n := _SERVICE_TAG.match(after)):
        return n.group(1), n.group(2)
    return None, after


def _after_bare_level(level: str, separator: str, after: str) -> tuple[str | None, str]:
    """What follows a bare ``LEVEL``: Spring's ``pid --- [app] [thread] logger :``, log4j's
    ``[svc] [thread] logger -``, loguru's ``| module:function:line -``, Flask's ``in app:``, Node's
    ``FATAL ERROR:``, a ``[service]`` tag or a ``service:`` name."""
    if n := _SPRING.match(after):
        brackets = _BRACKETS.findall(n.group(2))
        app = brackets[0] if len(brackets) >= 2 and not _THREAD_LIKE.search(brackets[0]) else n.group(1)
        return app, n.group(4)
    if n := _LOG4J.match(after):
        brackets = _BRACKETS.findall(n.group(1))
        service = brackets[0] if brackets and (len(brackets) >= 2 or not _THREAD_LIKE.search(brackets[0])) \
            else None
        return service, n.group(2)
    if n := _LOGURU.match(after):
        return None, n.group(1)
    if n := _FLASK.match(after):
        return None, n.group(1)
    if level == "FATAL" and (n := re.match(r"ERROR:\s+(.*)", after)):  # Node: "FATAL ERROR: ..."
        return None, n.group(1)
    if n := _SERVICE_TAG.match(after):
        return n.group(1), n.group(2)
    if separator.strip() == "" and (n := _SERVICE_COLON.match(after)):
        return n.group(1), n.group(2)
    return None, after


def _cut_kv(message: str, *, wide: bool) -> tuple[str, dict[str, str]]:
    """Split trailing ``key=value`` fields off a message; ``wide`` wants them set apart by 2+ spaces
    (logrus/gitlab-runner padding), so ``GET /x 200 dur=3ms`` keeps its fields as message."""
    m = (_KV_TAIL_WIDE if wide else _KV_TAIL).search(message)
    if not m or m.start() == 0:
        return message, {}
    fields = {k.lower(): v.strip('"') for k, v in _LOGFMT.findall(m.group(1))}
    return message[:m.start()].rstrip(), fields


def _trim_fields(message: str) -> str:
    """The message without trailing context a logger appends to it: a JSON object (Laravel, Monolog,
    zap) or padded ``key=value`` fields (logrus text, gitlab-runner)."""
    message = message.strip()
    if (m := _JSON_TAIL.search(message)) and m.start() > 0:
        blob = m.group(1)
        try:
            json.loads(blob)
            ok = True
        except json.JSONDecodeError:
            ok = blob.startswith('{"')
        if ok:
            message = message[:m.start()].rstrip()
    return _cut_kv(message, wide=True)[0]


# -- signals --------------------------------------------------------------------------------------


def error_kind(message: str) -> str:
    """Messages that differ only in numbers, ids, durations and timestamps are one kind of error: any
    token holding a digit (and uuids, 0x addresses) is blanked, letters must match."""
    kind = _HAS_DIGIT.sub("#", _UUID_OR_HEX.sub("#", message))
    return " ".join(kind.split()).strip(" .:;-").lower()


def _stack_lines(lines: list[str]) -> list[bool]:
    """Which lines continue a stack trace: Java ``at``/``Caused by:``/``... N more``, Go frames and
    Python tracebacks (their frames and the exception line that closes them). They belong to the
    error above them and must not count as errors of their own. Tracebacks are followed per wrapper
    source, so interleaved pods do not end each other's traces."""
    open_traceback: set[str] = set()
    flags = []
    for line in lines:
        outer, body = _unwrap(line)
        source, stripped = outer or "", body.strip()
        if stripped.startswith(_TRACEBACK):
            open_traceback.add(source)
            flags.append(True)
        elif source in open_traceback and (body[:1].isspace() or not stripped):
            flags.append(True)  # a frame
        elif source in open_traceback:
            open_traceback.discard(source)
            # the exception line closes the traceback; a timestamped line means it was cut short
            flags.append(not (_TS.match(stripped) or _BSD_SYSLOG_TS.match(stripped)))
        else:
            flags.append(bool(_CONTINUATION.match(body)))
    return flags


def log_signals(logs: str) -> dict[str, Any]:
    """Counts by level, 5xx responses, the most frequent kind of error (quoted as it appears in its
    first line) and the service that emits the most errors."""
    levels: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    first: dict[str, str] = {}
    emitters: Counter[str] = Counter()
    status_5xx = 0
    lines = [line for line in logs.splitlines() if line.strip()]
    for line, continuation in zip(lines, _stack_lines(lines)):
        if continuation:
            continue
        parsed = parse_line(line)
        levels[parsed.level] += 1
        status_5xx += sum(1 for _ in _HTTP_5XX.finditer(line))
        if parsed.level in ("ERROR", "FATAL") and parsed.message:
            kind = error_kind(parsed.message)
            kinds[kind] += 1
            first.setdefault(kind, parsed.message)
            if parsed.service:
                emitters[parsed.service] += 1
    top = kinds.most_common(1)[0] if kinds else None
    return {
        "lines": len(lines),
        "fatal": levels["FATAL"],
        "error": levels["ERROR"],
        "warn": levels["WARN"],
        "status_5xx": status_5xx,
        "top_error": first[top[0]] if top else "",
        "top_error_count": top[1] if top else 0,
        "emitter": emitters.most_common(1)[0][0] if emitters else "",
    }
