"""Reading a configuration file into plain dicts and lists: strict JSON, or hjson where the file says so.

Every way a file can be unreadable (not UTF-8, bad syntax, duplicate keys, absurd nesting) is a
``ConfigError`` naming the file and, where there is one, the line and column.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import select
import stat
from typing import Any

import hjson

from ..errors import ConfigError
from ..regular import FileTooLargeError, NotRegularFileError, read_regular
from .rules import raise_if, show

__all__ = ["CONFIG_LIMIT", "HJSON_SUFFIX", "read_config_bytes", "read_document"]

HJSON_SUFFIX = ".hjson"  # files read as hjson; every other file is strict JSON
# The most bytes a configuration file holds (ds_config.json, a sweep's result, a Hugging Face config.json):
# anything larger is not one, and is refused before it is read.
CONFIG_LIMIT = 64 << 20

_SHOWN_LINE = 100  # characters of the offending line quoted in a syntax error


# NOTE: a file is strict JSON unless its name ends in .hjson. DeepSpeed parses ds_config.json with hjson
# (runtime/config.py), which also takes //, /* */ and # comments, trailing commas, members separated by
# newlines alone and unquoted keys and strings; but that also means a missing comma or a stray word is read
# as something else, silently (a path swallowed into the previous value). A .json file is held to JSON, and
# its error says so when hjson would have read it; a file named .hjson is read as DeepSpeed reads it. Numbers
# are read the same way in both (a whole number with a fraction or exponent below 1e10, 8.0 or 1e8, is an
# integer, as hjson reads it), so the same settings mean the same in either. hjson 3.1 and json have a few
# ways to fail that are not their decode errors (an IndexError for a /* comment never closed, OverflowError
# for 1e999, ValueError from chr() for a bad escape, RecursionError for deep nesting); each becomes a
# ConfigError here.
def read_document(path: str) -> dict:
    """Parse the file at ``path`` into a dict of JSON values: strict JSON, or hjson for a ``.hjson`` file.

    Raises:
        ConfigError: the file is not UTF-8, is empty, is not valid JSON (hjson for ``.hjson``; with line and
            column), has a duplicate key (with its JSON path), nests too deeply, or is not an object at the
            top level.
        OSError: the file cannot be read.
    """
    data = read_config_bytes(path, pipe=True)
    text = _decode(data, path)
    hjson_file = str(path).lower().endswith(HJSON_SUFFIX)
    try:
        doc = _parse(text, hjson_file)
    except (hjson.HjsonDecodeError, json.JSONDecodeError) as err:
        message = err.msg + ("" if hjson_file else _hjson_hint(text))
        if not hjson_file and not text.strip():
            message = "the file holds no JSON value (it is empty); write {} for all defaults"
        raise ConfigError(_syntax_error(path, text, err.lineno, err.colno, message)) from None
    except _NumberOutOfRangeError as err:
        where = text.find(err.literal)
        line, column = _line_and_column(text, max(where, 0))
        raise ConfigError(_syntax_error(path, text, line, column, f"the number {_clip(err.literal)} is out of "
                                        "range (a float holds at most about 1.8e308)")) from None  # fmt: skip
    except RecursionError:
        raise ConfigError(
            f"{path}: objects or lists are nested too deeply to read; a configuration needs only a few "
            "levels (is this the right file?)"
        ) from None
    except IndexError:
        raise ConfigError(_end_of_file_error(path, text)) from None
    except (OverflowError, ValueError) as err:
        raise ConfigError(f"{path}: invalid JSON: {err}") from None
    if type(doc) is dict:
        # Objects in the text come back as _Object; a plain dict is hjson's answer for a file holding
        # only blanks and comments, which is more likely a truncated file than a wish for defaults.
        raise ConfigError(
            f"{path}: invalid JSON at line 1, column 1: the file holds no JSON value (it is empty or only "
            "comments); write {} for all defaults"
        )
    problems: list[tuple[str, str]] = []
    _find_duplicates(doc, problems)
    raise_if(problems, f"invalid configuration in {path}")
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object {{...}}, got {show(doc)}")
    return doc


def _parse(text: str, hjson_file: bool) -> Any:
    if hjson_file:
        return hjson.loads(text, object_pairs_hook=_Object.from_pairs, parse_float=_float, parse_int=_int)
    return json.loads(text, object_pairs_hook=_Object.from_pairs, parse_float=_json_float, parse_int=_int,
                      parse_constant=_constant)


def _hjson_hint(text: str) -> str:
    """What to say after a JSON syntax error when the text is valid hjson (comments, trailing commas, unquoted
    strings, or a missing comma that hjson reads past)."""
    try:
        hjson.loads(text)
    except Exception:  # not hjson either: the JSON error is the whole story
        return ""
    return (f" (this is strict JSON; the file would read as hjson, which DeepSpeed also accepts, with its comments, "
            f"trailing commas and unquoted strings: fix the JSON, or rename the file to *{HJSON_SUFFIX} to have "
            "it read as hjson)")


def read_config_bytes(path: str, *, pipe: bool = False) -> bytes:
    """The bytes of the configuration file ``path``: a regular file of at most :data:`CONFIG_LIMIT` bytes (a
    device, a socket or a link to one is never read).

    Args:
        path: the file.
        pipe: also read a pipe (``--config <(jq ... ds_config.json)``, a named pipe with a writer) to its end, up to
            the same bound. A pipe quiet for :data:`PIPE_QUIET_S` seconds (no writer came, or it stopped writing
            without closing) is refused rather than waited on for ever. Only for a configuration the user names:
            files found inside a checkpoint are regular files or refused.

    Raises:
        ConfigError: not a regular file (or pipe), too large, or a pipe that gave nothing; the message names it.
        OSError: it cannot be opened or read.
    """
    try:
        if pipe:
            data = _read_pipe(path)
            if data is not None:
                return data
        return read_regular(path, limit=CONFIG_LIMIT)
    except (NotRegularFileError, FileTooLargeError) as err:
        raise ConfigError(f"{path} is {err.strerror}; give a JSON configuration file") from None


# NOTE: open(2) of a FIFO with O_NONBLOCK returns at once, whether or not a writer has it open, and a named pipe's
# writer may open it only after we do (its open waits for a reader). read(2) of a pipe that no one holds for
# writing returns end of file, so a read is made only once poll(2) says there are bytes or the writer hung up
# (Linux reports a hang-up only for a writer that came after our open); a pipe quiet for PIPE_QUIET_S seconds is
# refused instead of waited on for ever. The read stops one byte past the bound.
PIPE_QUIET_S = 60.0


def _read_pipe(path: str) -> bytes | None:
    """The bytes of ``path`` if it is a pipe (read to its end, at most CONFIG_LIMIT), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # read_regular opens it again and says why it cannot be read
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        out = _drain_pipe(fd, path)
    finally:
        os.close(fd)
    if not out:
        raise NotRegularFileError(errno.ENODATA, "a FIFO (named pipe) whose writer wrote nothing", path)
    return out


def _drain_pipe(fd: int, path: str) -> bytes:
    """Everything the writer of the non-blocking pipe ``fd`` writes before it closes it, up to the bound."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    out = bytearray()
    while len(out) <= CONFIG_LIMIT:
        if not poller.poll(PIPE_QUIET_S * 1000):
            raise NotRegularFileError(errno.ETIMEDOUT, f"a FIFO (named pipe) that no process wrote to or closed "
                                      f"within {PIPE_QUIET_S:g} s", path)
        try:
            chunk = os.read(fd, CONFIG_LIMIT + 1 - len(out))
        except BlockingIOError:
            continue
        if not chunk:
            return bytes(out)
        out += chunk
    raise FileTooLargeError(errno.EFBIG, f"a pipe that gave more than the {CONFIG_LIMIT} bytes a configuration "
                            "holds", path)


class _Object(dict):
    """A JSON object that remembers the keys it was given more than once."""

    duplicates: list

    @classmethod
    def from_pairs(cls, pairs: list[tuple[str, Any]]) -> _Object:
        obj = cls()
        obj.duplicates = []
        for key, value in pairs:
            if key in obj:
                obj.duplicates.append(key)
            obj[key] = value
        return obj


class _NumberOutOfRangeError(Exception):
    def __init__(self, literal: str):
        super().__init__(literal)
        self.literal = literal


def _float(literal: str) -> float:
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        raise _NumberOutOfRangeError(literal)
    return value


def _json_float(literal: str) -> float | int:
    """A JSON number with a fraction or exponent, read as hjson reads it: a whole number below 1e10 is an int."""
    value = _float(literal)
    if value.is_integer() and abs(value) < 1e10:
        return int(value)
    return value


def _constant(literal: str) -> float:
    raise ValueError(f"{literal} is not a JSON number; write a number")


def _int(literal: str) -> int:
    try:
        return int(literal)
    except ValueError:  # more digits than Python converts (4300 by default)
        raise _NumberOutOfRangeError(literal) from None


def _decode(data: bytes, path: str) -> str:
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as err:
        at = bom + err.start
        line = data.count(b"\n", 0, at) + 1
        column = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise ConfigError(
            f"{path}: not UTF-8 text: byte 0x{data[at]:02x} at line {line}, column {column} (byte offset {at}) "
            f"{err.reason}; save the file as UTF-8"
        ) from None


def _find_duplicates(doc: Any, problems: list) -> None:
    """Append a problem for each duplicated key, with its JSON path (depth-first, in file order)."""
    stack = [(doc, "")]
    while stack:
        value, path = stack.pop()
        children = []
        if isinstance(value, _Object):
            for key in dict.fromkeys(value.duplicates):
                where = f"{path}.{key}" if path else key
                problems.append((where, "duplicate key (DeepSpeed rejects these too); keep one"))
            children = [(item, f"{path}.{key}" if path else key) for key, item in value.items()]
        elif isinstance(value, list):
            children = [(item, f"{path}[{i}]") for i, item in enumerate(value)]
        stack.extend(reversed(children))


def _syntax_error(path: str, text: str, line: int, column: int, message: str) -> str:
    return f"{path}: invalid JSON at line {line}, column {column}: {message}{_quote(text, line, column)}"


def _quote(text: str, line: int, column: int) -> str:
    """The line, and a caret under the column, for a message."""
    lines = text.split("\n")
    quoted = lines[line - 1].rstrip("\r") if 0 < line <= len(lines) else ""
    caret = column - 1
    if len(quoted) > _SHOWN_LINE:  # a minified or hostile file: quote the part around the column
        start = max(0, min(caret - _SHOWN_LINE // 2, len(quoted) - _SHOWN_LINE))
        quoted = quoted[start:start + _SHOWN_LINE]
        caret -= start
    return f"\n    {quoted}\n    {' ' * caret}^"


def _end_of_file_error(path: str, text: str) -> str:
    # hjson raises IndexError when the text ends inside a /* comment or a ''' string. A "/*" after the
    # last "*/" is where an unclosed comment starts (unless it sits inside a string: good enough to point).
    last_close = text.rfind("*/")
    opening = text.find("/*", last_close + 2 if last_close >= 0 else 0)
    if opening >= 0:
        line, column = _line_and_column(text, opening)
        return (f"{path}: unterminated /* comment at line {line}, column {column}: the file ends before "
                f"its */{_quote(text, line, column)}")  # fmt: skip
    line, column = _line_and_column(text, len(text))
    return _syntax_error(path, text, line, column, "the file ends inside a multiline ''' string")


def _line_and_column(text: str, at: int) -> tuple[int, int]:
    return text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1) + 1


def _clip(literal: str) -> str:
    return literal if len(literal) <= 40 else f"{literal[:20]}...{literal[-10:]} ({len(literal)} characters)"
