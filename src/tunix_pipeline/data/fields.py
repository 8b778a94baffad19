"""Where a record's field is in a source row, as `ingest.sources[].columns` says it: a column (`problem`), a
nested field (`meta.problem`: the column `meta` holds an object with a `problem`), or a template over several
(`"{Body} {Question}"`, SVAMP's question). Values are text; numbers are accepted too and written as people
write them (`51.0` -> `51`) in answer columns and templates, so a numeric answer compares equal to a `51`."""

from __future__ import annotations

import numbers
import re

_PLACEHOLDER = re.compile(r"\{([^{}]+)\}")
_ZERO_FRACTION = re.compile(r"-?\d+\.0+")
_NOT_UTF8 = re.compile("[\ud800-\udfff]")  # undecodable bytes (surrogateescape) or lone surrogates from JSON escapes
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


class BadRow(ValueError):
    """One row that cannot be mapped: `reason` is a stable slug (a metric name), the message a sentence."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def json_type(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def paths(spec: str) -> list[str]:
    """The fields a spec reads: a template's placeholders, else the spec itself."""
    return _PLACEHOLDER.findall(spec) or [spec]


def top_column(path: str, columns) -> str:
    """The column of a schema a path reads: itself when a column has that name (dots included), else the part
    before its first dot."""
    return path if path in columns or "." not in path else path.split(".", 1)[0]


def lookup(row: dict, path: str):
    """The value at `path`: a column of that exact name, else nested objects walked along the dots."""
    if path in row:
        return row[path]
    value = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            # a top-level column: name the row's own, one of which the source's `columns:` can map to it
            named = "" if "." in path else (f" (the row has {', '.join(map(repr, list(row)[:12]))}; where one of them "
                                            "holds it, name that column in this source's `columns:`)")
            raise BadRow(f"missing_column:{path}", f"missing column '{path}'{named}")
        value = value[key]
    return value


def text(row: dict, spec: str, required: bool, numeric: bool = False) -> str:
    """The field as stripped text ("" when optional and absent or null); a template joins its parts. Numbers are
    text in a template, and where `numeric` (an answer column); elsewhere a number is a mistake of mapping."""
    found = _PLACEHOLDER.findall(spec)
    if found:
        parts = {path: _value_text(lookup(row, path), path, False, True) for path in found}
        value = _PLACEHOLDER.sub(lambda m: parts[m.group(1)], spec).strip()
    else:
        try:
            raw = lookup(row, spec)
        except BadRow:
            if required:
                raise
            return ""
        value = _value_text(raw, spec, required, numeric)
    if required and not value:
        raise BadRow(f"empty_field:{spec}", f"'{spec}' is empty")
    return value


def _value_text(value, path: str, required: bool, numeric: bool) -> str:
    if value is None or (isinstance(value, float) and value != value):  # None or NaN
        if required:
            raise BadRow(f"null_field:{path}", f"'{path}' is null")
        return ""
    if numeric and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return number_text(value)
    if not isinstance(value, str):
        raise BadRow(f"wrong_type:{path}", f"'{path}' is {json_type(value)}, expected text")
    if _NOT_UTF8.search(value):
        raise BadRow(f"not_utf8:{path}", f"'{path}' holds bytes that are not UTF-8 text")
    return value.strip()


def plain_number(answer: str) -> str:
    """An answer written as a whole number with a zero fraction (`51.0`, a CSV's float column) as `51`."""
    return answer.split(".", 1)[0] if _ZERO_FRACTION.fullmatch(answer) else answer


def number_text(value: numbers.Real) -> str:
    """A number as people write it: 51.0 -> 51, 0.5 -> 0.5, 1e21 -> 1e+21."""
    value = float(value) if not isinstance(value, int) else value
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)
